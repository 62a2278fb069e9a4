//! Many ranks: start-up time and host memory per rank.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::json;
use trainhost::{ScalingConfig, Trainer};
use trainhost_test_artifacts::BENCH_GUEST;

use crate::common::{Lines, Paired, Row, Sampling, Unit, local_run};
use crate::goals;

pub(crate) fn child_ranks(n: u32, cache: Option<&Path>) -> Result<()> {
    let storage = tempfile::tempdir()?;
    let started = Instant::now();
    let mut builder = Trainer::builder(BENCH_GUEST)
        .train_loop_config(json!({"mode": "start"}))
        .scaling_config(ScalingConfig { num_workers: n })
        .run_config(local_run(storage.path()))
        .output(Arc::new(Lines::default()));
    if let Some(cache) = cache {
        builder = builder.compile_cache(cache);
    }
    let result = builder.build()?.fit()?;
    if let Some(e) = result.error {
        bail!("{e}");
    }
    let wall = started.elapsed();
    let status = std::fs::read_to_string("/proc/self/status")?;
    let hwm_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/self/status")?;
    println!("{} {}", wall.as_nanos(), hwm_kb * 1024);
    Ok(())
}

pub(crate) fn ranks(quick: bool, cache: &Path) -> Result<Vec<Row>> {
    trainhost::bench::compile(&std::fs::read(BENCH_GUEST)?, Some(cache))?;
    let counts: &[u32] = if quick {
        &[1, 8]
    } else {
        &[1, 2, 4, 8, 16, 32, 64]
    };
    // All the counts take under a second a sample.
    let samples = Sampling::Standard.per_pass(quick);
    let extras = counts.len() - 1;
    let mut walls: Vec<Paired> = (0..extras).map(|_| Paired::default()).collect();
    let mut peaks: Vec<Paired> = (0..extras).map(|_| Paired::default()).collect();
    for _ in 0..samples {
        let measured = counts
            .iter()
            .map(|&n| child(n, cache))
            .collect::<Result<Vec<_>>>()?;
        let (wall1, rss1) = measured[0];
        for (i, &(wall, rss)) in measured[1..].iter().enumerate() {
            walls[i].push(wall1, wall);
            peaks[i].push(rss1, rss);
        }
    }
    let mut rows = Vec::new();
    for ((&n, wall), rss) in counts[1..].iter().zip(walls).zip(peaks) {
        let extra = f64::from(n - 1);
        rows.push(
            wall.row(
                "ranks",
                format!("{n} ranks: start, one report, end (whole fit)"),
                "1 rank".into(),
                "informational".into(),
                |_, _| None,
            )
            .with_detail(move |b, o| format!("{:.2} ms per extra rank", (o - b) / 1e6 / extra)),
        );
        let per_rank_mib = move |b: f64, o: f64| (o - b) / (1024.0 * 1024.0) / extra;
        rows.push(
            rss.row(
                "ranks",
                format!("{n} ranks: peak host memory"),
                "1 rank".into(),
                format!("≤ {} MiB per rank", goals::RANK_MIB),
                move |b, o| Some(per_rank_mib(b, o) <= goals::RANK_MIB),
            )
            .in_unit(Unit::Bytes)
            .with_detail(move |b, o| format!("{:.2} MiB per extra rank", per_rank_mib(b, o))),
        );
    }
    Ok(rows)
}

/// The wall time (ns) and peak memory (bytes) of a process running `n`
/// ranks through start, one report and end.
fn child(n: u32, cache: &Path) -> Result<(f64, f64)> {
    let out = Command::new(std::env::current_exe()?)
        .arg("--child-ranks")
        .arg(n.to_string())
        .arg("--child-cache")
        .arg(cache)
        .output()?;
    if !out.status.success() {
        bail!("{n} ranks failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8(out.stdout)?;
    let mut parts = text.split_whitespace().map(str::parse::<f64>);
    let (Some(Ok(wall)), Some(Ok(rss))) = (parts.next(), parts.next()) else {
        bail!("unexpected output from the child: {text}");
    };
    Ok((wall, rss))
}
