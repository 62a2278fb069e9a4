//! Loops written in Python (guest-sdk-python/, built by
//! scripts/build-python-guest.sh with componentize-py): ranks, config,
//! reports, host tensors and their all-reduce, a Python exception failing
//! the run with its traceback, and a crash resumed from a checkpoint. The
//! build installs componentize-py from PyPI on first use; without it the
//! tests are skipped, saying so, unless TRAINHOST_REQUIRE_PYTHON=1 (CI).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use serde_json::json;
use trainhost::{FailureConfig, FailureKind, MaxFailures, RunConfig, ScalingConfig, Trainer};

use crate::util::Lines;

/// tests/python/scripted.py as a component, built once per test run.
fn guest() -> Option<&'static str> {
    static BUILT: OnceLock<Option<String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let top = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("python-scripted.wasm");
            let built = Command::new(top.join("scripts/build-python-guest.sh"))
                .arg(top.join("tests/python/scripted.py"))
                .arg("-o")
                .arg(&out)
                .output()
                .unwrap();
            if built.status.success() {
                return Some(out.display().to_string());
            }
            let why = String::from_utf8_lossy(&built.stderr).into_owned();
            assert!(
                std::env::var("TRAINHOST_REQUIRE_PYTHON").as_deref() != Ok("1"),
                "the Python guest did not build and TRAINHOST_REQUIRE_PYTHON=1:\n{why}"
            );
            eprintln!("skipped: the Python guest did not build (no python3 or no PyPI?):\n{why}");
            None
        })
        .as_deref()
}

fn run(
    workers: u32,
    config: serde_json::Value,
    max_failures: u32,
) -> Option<(trainhost::TrainResult, std::sync::Arc<Lines>)> {
    let guest = guest()?;
    let storage = tempfile::tempdir().unwrap();
    let lines = std::sync::Arc::new(Lines::default());
    let result = Trainer::builder(guest)
        .train_loop_config(config)
        .scaling_config(ScalingConfig {
            num_workers: workers,
        })
        .run_config(RunConfig {
            name: Some("py".into()),
            storage_path: storage.path().display().to_string(),
            failure_config: FailureConfig {
                max_failures: MaxFailures::Limited(max_failures),
            },
            ..Default::default()
        })
        .output(lines.clone())
        .build()
        .unwrap()
        .fit()
        .unwrap();
    Some((result, lines))
}

#[test]
fn a_python_loop_reports_from_every_rank_and_all_reduces_host_tensors() {
    for workers in [1, 2] {
        let Some((result, _)) = run(workers, json!({"epochs": 3}), 0) else {
            return;
        };
        assert!(result.error.is_none(), "{:?}", result.error);
        assert_eq!(result.metrics_history.len(), 3);
        let last = result.metrics.as_ref().unwrap();
        assert_eq!(last.get("epoch").and_then(|v| v.as_f64()), Some(2.0));
        assert_eq!(
            last.get("ranks").and_then(|v| v.as_f64()),
            Some(f64::from(workers))
        );
        // The mean of the ranks' numbers 0..workers.
        let mean = f64::from(workers - 1) / 2.0;
        assert_eq!(last.get("mean_rank").and_then(|v| v.as_f64()), Some(mean));
    }
}

#[test]
fn a_python_exception_fails_the_run_with_its_traceback() {
    let Some((result, _)) = run(2, json!({"epochs": 3, "fail_at": 1}), 0) else {
        return;
    };
    let e = result.error.expect("the run fails");
    assert_eq!(e.kind, FailureKind::GuestError, "{e}");
    let message = e.to_string();
    for needed in [
        "Traceback (most recent call last)",
        "scripted.py",
        "ZeroDivisionError: division by zero",
    ] {
        assert!(
            message.contains(needed),
            "{needed:?} missing from {message}"
        );
    }
}

#[test]
fn a_crashed_python_loop_resumes_from_its_checkpoint() {
    let config = json!({"epochs": 4, "fail_at": 3, "checkpoint_every": 2});
    let Some((result, lines)) = run(2, config, 1) else {
        return;
    };
    assert!(result.error.is_none(), "{:?}", result.error);
    assert_eq!(result.failures, 1);
    let epochs: Vec<f64> = result
        .metrics_history
        .iter()
        .filter_map(|r| r.metrics.get("epoch").and_then(|v| v.as_f64()))
        .collect();
    // Epochs 0-2, then after the crash at 3 from the checkpoint of epoch 1.
    assert_eq!(epochs, [0.0, 1.0, 2.0, 2.0, 3.0]);
    let printed = lines.0.lock().unwrap();
    assert!(
        printed
            .iter()
            .any(|(_, _, l)| l == "rank 0 resumes at epoch 2")
    );
}
