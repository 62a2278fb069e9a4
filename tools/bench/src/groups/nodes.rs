//! Runs over several hosts: the all-reduce of ranks on two nodes (MPI
//! processes on this machine) against a bare `MPI_Allreduce` of the same
//! bytes between as many processes, the in-process all-reduce of 4 ranks
//! against `MPI_Allreduce` among 4 processes, and `report` across nodes.
//! Each all-reduce is timed twice in the same run: of a list in the
//! guest's memory (crossing the canonical ABI both ways) and of a host
//! tensor of the same values (combined in place).
//!
//! Ours is `mpiexec -n P trainhost run` of the bench guest (trainhost built
//! with `--features mpi`); the baseline is `mpiexec -n P mpi-allreduce`
//! (this suite's `src/bin/mpi_allreduce.rs`), run alternately in the same
//! invocation. Both time each call on its own and take the median.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use trainhost_test_artifacts::BENCH_GUEST;

use crate::common::{Paired, Row, Sampling, local_run, metric, run_guest};
use crate::goals;

const SIZES: [(usize, &str); 3] = [(4 << 10, "4 KiB"), (1 << 20, "1 MiB"), (64 << 20, "64 MiB")];

/// The programs the group runs.
pub(crate) struct Programs<'a> {
    /// `trainhost`, built with `--features mpi`.
    pub trainhost: &'a Path,
    /// `mpi-allreduce`.
    pub baseline: &'a Path,
}

fn calls(bytes: usize, quick: bool) -> u32 {
    match (bytes >= 64 << 20, bytes >= 1 << 20, quick) {
        (true, _, false) => 7,
        (true, _, true) => 3,
        (_, true, false) => 200,
        (_, true, true) => 30,
        (_, _, false) => 5_000,
        (_, _, true) => 500,
    }
}

/// Median ns per bare `MPI_Allreduce` of `floats` f32 among `processes`.
fn bare(programs: &Programs, processes: u32, floats: usize, calls: u32) -> Result<f64> {
    let out = Command::new("mpiexec")
        .args(["-n", &processes.to_string()])
        .arg(programs.baseline)
        .args([floats.to_string(), calls.to_string()])
        .output()
        .context("cannot run mpiexec (install MPICH)")?;
    if !out.status.success() {
        bail!(
            "mpi-allreduce failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

/// The bench guest's metrics over `nodes` trainhost processes of `per_node`
/// ranks each.
fn across(
    programs: &Programs,
    nodes: u32,
    per_node: u32,
    config: Value,
    dir: &Path,
) -> Result<Value> {
    let result = dir.join("result.json");
    let _ = std::fs::remove_file(&result);
    let out = Command::new("mpiexec")
        .args(["-n", &nodes.to_string()])
        .arg(programs.trainhost)
        .args([
            "run",
            BENCH_GUEST,
            "--workers",
            &(nodes * per_node).to_string(),
        ])
        .args([
            "--config",
            &config.to_string(),
            "--storage",
            "st",
            "--name",
            "bench",
            "--fresh",
        ])
        .arg("--result-json")
        .arg(&result)
        .current_dir(dir)
        .env("RUST_LOG", "error")
        .env("TRAINHOST_CACHE_DIR", dir.join("cache"))
        .output()
        .context("cannot run mpiexec (install MPICH)")?;
    if !out.status.success() {
        bail!(
            "trainhost over {nodes} nodes failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let json: Value = serde_json::from_slice(&std::fs::read(&result)?)?;
    Ok(json["metrics"].clone())
}

fn number(metrics: &Value, name: &str) -> Result<f64> {
    metrics[name]
        .as_f64()
        .with_context(|| format!("no metric {name} in {metrics}"))
}

pub(crate) fn nodes(programs: &Programs, quick: bool) -> Result<Vec<Row>> {
    let dir = tempfile::tempdir()?;
    let storage = tempfile::tempdir()?;
    let mut rows = Vec::new();
    let mut report = Paired::default();
    // Fewer samples than most rows: a pass of this group takes about a
    // minute.
    let reps = Sampling::Processes.per_pass(quick);
    for per_node in [1u32, 2] {
        for (bytes, name) in SIZES {
            let floats = bytes / 4;
            let calls = calls(bytes, quick);
            let config = json!({"mode": "all_reduce", "floats": floats, "calls": calls});
            let (mut pairs, mut tensors) = (Paired::default(), Paired::default());
            for _ in 0..reps {
                let metrics = across(programs, 2, per_node, config.clone(), dir.path())?;
                let baseline = bare(programs, 2, floats, calls)?;
                pairs.push(baseline, number(&metrics, "all_reduce_ns")?);
                tensors.push(baseline, number(&metrics, "tensor_all_reduce_ns")?);
                if per_node == 1 && bytes == 4 << 10 {
                    let one_host =
                        run_guest(config.clone(), 2, local_run(storage.path()), Arc::default())?;
                    report.push(
                        metric(&one_host, "report_ns")?,
                        number(&metrics, "report_ns")?,
                    );
                }
            }
            for (pairs, what) in [
                (&pairs, "a list in guest memory"),
                (&tensors, "a host tensor"),
            ] {
                rows.push(pairs.row(
                    "nodes",
                    format!("all-reduce of {name} f32 (sum), {what}, across 2 nodes (MPI processes on this machine), {per_node} rank(s) each"),
                    "a bare MPI_Allreduce of the same bytes between the same 2 processes (MPICH)".into(),
                    format!("≥ {} × its bandwidth (≤ {:.2} × its time)", 1.0 / goals::NODES_VS_MPI, goals::NODES_VS_MPI),
                    |b, o| Some(o / b <= goals::NODES_VS_MPI),
                ));
            }
        }
    }
    for (bytes, name) in SIZES {
        let floats = bytes / 4;
        let calls = calls(bytes, quick);
        let config = json!({"mode": "all_reduce", "floats": floats, "calls": calls});
        let (mut pairs, mut tensors) = (Paired::default(), Paired::default());
        for _ in 0..reps {
            let one_host = run_guest(config.clone(), 4, local_run(storage.path()), Arc::default())?;
            let baseline = bare(programs, 4, floats, calls)?;
            pairs.push(baseline, metric(&one_host, "all_reduce_ns")?);
            tensors.push(baseline, metric(&one_host, "tensor_all_reduce_ns")?);
        }
        for (pairs, what) in [
            (&pairs, "a list in guest memory"),
            (&tensors, "a host tensor"),
        ] {
            rows.push(pairs.row(
                "nodes",
                format!("all-reduce of {name} f32 (sum), {what}, 4 ranks in one trainhost"),
                "a bare MPI_Allreduce of the same bytes among 4 MPI processes on this machine (MPICH)".into(),
                format!("≤ {} × its time", goals::IN_PROCESS_VS_MPI),
                |b, o| Some(o / b <= goals::IN_PROCESS_VS_MPI),
            ));
        }
    }
    rows.push(report.row(
        "nodes",
        "`report` without checkpoint, 2 nodes of 1 rank".into(),
        "the same 2 ranks in one trainhost".into(),
        goals::comparison("what crossing nodes costs a report round"),
        |_, _| None,
    ));
    Ok(rows)
}
