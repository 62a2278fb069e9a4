//! Loops written in Python: the digits example's training step on host
//! kernels (examples/digits-python) against the Rust example's same step
//! on the same kernels, and the start of a run, cold (compiling the
//! component) and from the compiled-guest cache, against the Rust guest's.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::json;
use trainhost_test_artifacts::DIGITS_MLP;

use crate::common::{Paired, Row, Sampling, step_ns, time_command};
use crate::goals;

/// The example's step and a larger one, with steps a sample (about a
/// second of the Python loop's time each).
const STEPS: [(u32, u32, &str, u32); 2] = [
    (64, 32, "the example's step: MLP 64→64→10, batch 32", 12_000),
    (512, 512, "a larger step: MLP 64→512→10, batch 512", 400),
];

pub(crate) fn python(bin: &Path, quick: bool) -> Result<Vec<Row>> {
    let work = tempfile::tempdir()?;
    let guest = build(&work.path().join("digits-python.wasm"))?;
    let guest = guest
        .to_str()
        .context("a temporary path that is not UTF-8")?;
    // About 17 s a sample of every row.
    let reps = Sampling::Standard.per_pass(quick);
    let mut rows = steps(guest, quick, reps)?;
    rows.extend(start(bin, guest, work.path(), reps)?);
    Ok(rows)
}

/// examples/digits-python built into a component, as its README says.
fn build(out: &Path) -> Result<PathBuf> {
    let top = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let built = Command::new(top.join("scripts/build-python-guest.sh"))
        .arg(top.join("examples/digits-python/train.py"))
        .arg("-o")
        .arg(out)
        .arg("-p")
        .arg(top.join("examples/digits-mlp/data"))
        .output()?;
    if !built.status.success() {
        bail!(
            "scripts/build-python-guest.sh failed (python3 with venv and PyPI are needed):\n{}",
            String::from_utf8_lossy(&built.stderr)
        );
    }
    Ok(out.to_owned())
}

fn steps(python: &str, quick: bool, reps: usize) -> Result<Vec<Row>> {
    let storage = tempfile::tempdir()?;
    let mut rows = Vec::new();
    for (hidden, batch, what, steps) in STEPS {
        let steps = if quick { steps / 20 } else { steps };
        let config = json!({"hidden": hidden, "batch_size": batch, "bench_steps": steps});
        let mut rust_config = config.clone();
        rust_config["kernels"] = json!(true);
        let mut pairs = Paired::default();
        for _ in 0..reps {
            let rust = step_ns(DIGITS_MLP, rust_config.clone(), storage.path())?;
            pairs.push(rust, step_ns(python, config.clone(), storage.path())?);
        }
        rows.push(pairs.row(
            "python",
            format!("training step of the Python example on host kernels, {what} (1 rank, default interruption; {steps} steps a sample)"),
            "the Rust example's same step on the same kernels (`kernels: true`)".into(),
            format!("≤ {} × the Rust guest", goals::PYTHON_STEP_VS_RUST),
            |rust, python| Some(python <= goals::PYTHON_STEP_VS_RUST * rust),
        ));
    }
    Ok(rows)
}

/// A whole CLI run of one step (process start to exit), cold and from the
/// cache, of the Python guest against the Rust one.
fn start(bin: &Path, python: &str, work: &Path, reps: usize) -> Result<Vec<Row>> {
    let run = |guest: &str, cache: &Path| -> Result<f64> {
        let (wall, _) = time_command(
            Command::new(bin)
                .args(["run", guest, "-q", "--fresh", "-n", "start", "-w", "1"])
                .args(["-c", r#"{"bench_steps": 1}"#, "-s"])
                .arg(work.join("storage"))
                .arg("--cache-dir")
                .arg(cache)
                .env("RUST_LOG", "error"),
        )?;
        Ok(wall.as_nanos() as f64)
    };
    let (mut cold, mut cached) = (Paired::default(), Paired::default());
    for _ in 0..reps {
        let (rust_cache, python_cache) = (work.join("cache-rust"), work.join("cache-python"));
        for c in [&rust_cache, &python_cache] {
            let _ = std::fs::remove_dir_all(c);
        }
        cold.push(run(DIGITS_MLP, &rust_cache)?, run(python, &python_cache)?);
        cached.push(run(DIGITS_MLP, &rust_cache)?, run(python, &python_cache)?);
    }
    let row = |pairs: Paired, how: &str| {
        pairs.row(
            "python",
            format!(
                "start of a run of the Python example, {how} (CLI, process start to exit, 1 rank, 1 step)"
            ),
            format!("the Rust example, {how}"),
            goals::comparison("what CPython in the component costs"),
            |_, _| None,
        )
    };
    Ok(vec![
        row(cold, "cold: compiling the component"),
        row(cached, "from the compiled-guest cache"),
    ])
}
