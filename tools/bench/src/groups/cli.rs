//! A whole CLI run, cold and warm.

use std::path::Path;
use std::process::Command;

use anyhow::Result;
use trainhost_test_artifacts::LINEAR_REGRESSION;

use crate::common::{Paired, Row, Sampling, time_command};
use crate::goals;

pub(crate) fn cli(bin: &Path, quick: bool) -> Result<Vec<Row>> {
    let work = tempfile::tempdir()?;
    let cache = work.path().join("cache");
    let run = |cache: &Path| -> Result<f64> {
        let (wall, _) = time_command(
            Command::new(bin)
                .args([
                    "run",
                    LINEAR_REGRESSION,
                    "-q",
                    "--fresh",
                    "-n",
                    "cli",
                    "-w",
                    "2",
                ])
                .args(["-c", r#"{"num_epochs": 5}"#, "-s"])
                .arg(work.path().join("storage"))
                .arg("--cache-dir")
                .arg(cache)
                .env("RUST_LOG", "error"),
        )?;
        Ok(wall.as_nanos() as f64)
    };
    let mut pairs = Paired::default();
    // A pair of runs takes well under a second.
    for _ in 0..Sampling::Standard.per_pass(quick) {
        let _ = std::fs::remove_dir_all(&cache);
        let cold = run(&cache)?;
        pairs.push(cold, run(&cache)?);
    }
    Ok(vec![pairs.row(
        "cli",
        "whole CLI run of the example, 2 ranks, 5 epochs (process start to exit)".into(),
        "cold: compiling the guest".into(),
        format!(
            "≤ {} s warm with 2 ranks (Ray: 18.6 s)",
            goals::CLI_WARM_NS / 1e9
        ),
        |_, o| Some(o <= goals::CLI_WARM_NS),
    )])
}
