//! Loops written in Python (guest-sdk-python/, built by
//! scripts/build-python-guest.sh with componentize-py): ranks, config,
//! reports, host tensors and their all-reduce, a Python exception failing
//! the run with its traceback, and a crash resumed from a checkpoint; the
//! digits example in Python (examples/digits-python) reaching the Rust
//! example's parameters bit for bit (`python_hostile.rs`: the same guest
//! misbehaving). The
//! build installs componentize-py from PyPI on first use; without it the
//! tests are skipped, saying so, unless TRAINHOST_REQUIRE_PYTHON=1 (CI).

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, OnceLock};

use serde_json::json;
use tempfile::TempDir;
use trainhost::{
    FailureConfig, FailureKind, MaxFailures, ResourceLimits, RunConfig, ScalingConfig, TrainResult,
    Trainer,
};
use trainhost_test_artifacts::DIGITS_MLP;

use crate::util::{Lines, metric};

/// A Python loop built into a component, once per test run: `script`
/// (from the repository's top) with `paths` on its Python path.
fn build(
    cell: &'static OnceLock<Option<String>>,
    script: &str,
    paths: &[&str],
) -> Option<&'static str> {
    cell.get_or_init(|| {
        let top = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let name = script.replace(['/', '.'], "-");
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.wasm"));
        let mut command = Command::new(top.join("scripts/build-python-guest.sh"));
        command.arg(top.join(script)).arg("-o").arg(&out);
        for path in paths {
            command.arg("-p").arg(top.join(path));
        }
        let built = command.output().unwrap();
        if built.status.success() {
            return Some(out.display().to_string());
        }
        let why = String::from_utf8_lossy(&built.stderr).into_owned();
        assert!(
            std::env::var("TRAINHOST_REQUIRE_PYTHON").as_deref() != Ok("1"),
            "{script} did not build and TRAINHOST_REQUIRE_PYTHON=1:\n{why}"
        );
        eprintln!("skipped: {script} did not build (no python3 or no PyPI?):\n{why}");
        None
    })
    .as_deref()
}

/// tests/python/scripted.py: what it does comes from the config.
pub(crate) fn scripted() -> Option<&'static str> {
    static BUILT: OnceLock<Option<String>> = OnceLock::new();
    build(&BUILT, "tests/python/scripted.py", &[])
}

/// examples/digits-python, the data built in.
fn digits() -> Option<&'static str> {
    static BUILT: OnceLock<Option<String>> = OnceLock::new();
    build(
        &BUILT,
        "examples/digits-python/train.py",
        &["examples/digits-mlp/data"],
    )
}

/// A run of `guest` in a storage directory of its own, which the caller
/// keeps to read the checkpoints.
fn train(
    guest: &str,
    workers: u32,
    config: serde_json::Value,
    max_failures: u32,
) -> (TrainResult, Arc<Lines>, TempDir) {
    train_limited(
        guest,
        workers,
        config,
        max_failures,
        ResourceLimits::default(),
    )
}

pub(crate) fn train_limited(
    guest: &str,
    workers: u32,
    config: serde_json::Value,
    max_failures: u32,
    limits: ResourceLimits,
) -> (TrainResult, Arc<Lines>, TempDir) {
    let storage = tempfile::tempdir().unwrap();
    let lines = Arc::new(Lines::default());
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
            limits,
            ..Default::default()
        })
        .output(lines.clone())
        .build()
        .unwrap()
        .fit()
        .unwrap();
    (result, lines, storage)
}

pub(crate) fn run(
    workers: u32,
    config: serde_json::Value,
    max_failures: u32,
) -> Option<(TrainResult, Arc<Lines>)> {
    let (result, lines, _) = train(scripted()?, workers, config, max_failures);
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

/// A kernel the host refuses raises `TrainhostError` naming the kind of
/// refusal and what was wrong; a name the SDK does not know (an
/// activation, a reduction) raises `ValueError` listing the names it
/// does; the loop catches either and goes on.
#[test]
fn a_python_loop_catches_refused_kernel_calls() {
    let Some((result, lines)) = run(1, json!({"misuse": true, "epochs": 1}), 0) else {
        return;
    };
    assert!(result.error.is_none(), "{:?}", result.error);
    let printed = lines.texts();
    let expected = [
        ("gemm of mismatched shapes", "refused by the host: Shape: "),
        ("dense of mismatched shapes", "refused by the host: Shape: "),
        (
            "dense with an unknown activation",
            "refused by the SDK: unknown activation 'gelu'; use one of relu, tanh",
        ),
        ("gather of a row past the end", "refused by the host: "),
        ("labels past the classes", "refused by the host: "),
        (
            "all-reduce with an unknown op",
            "refused by the SDK: unknown reduction 'prod'; use one of sum",
        ),
        (
            "sgd over lists of different lengths",
            "refused by the host: Shape: sgd-momentum-list: 1 params, 2 velocities",
        ),
        (
            "program of mismatched shapes",
            "refused by the host: Shape: program.dense: x has 3 columns, so w must have 3 rows",
        ),
        (
            "program run of too few rows",
            "refused by the host: Shape: program.run: kernel 0 (gather-rows) takes 2 rows, \
             and the run was given 1",
        ),
    ];
    for (what, outcome) in expected {
        let line = printed
            .iter()
            .find(|l| l.starts_with(&format!("{what}: ")))
            .unwrap_or_else(|| panic!("no line for {what:?} in {printed:?}"));
        assert!(line.contains(outcome), "{line:?} should say {outcome:?}");
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

/// The bytes of `file` in the run's latest checkpoint.
fn latest(result: &TrainResult, file: &str) -> Vec<u8> {
    let checkpoint = result.checkpoint.as_ref().expect("a checkpoint");
    let dir = checkpoint.as_directory().unwrap();
    std::fs::read(dir.path().join(file)).unwrap()
}

/// The Python example follows the Rust one on kernels step for step: the
/// same data, initial weights, order and kernels give the same parameters
/// bit for bit, with 1 and with 2 ranks (between rank counts only up to
/// rounding: the gradient sums add in another order), and the same accuracy.
#[test]
fn the_python_digits_example_reaches_the_rust_examples_parameters() {
    let Some(python) = digits() else { return };
    let config = json!({"num_epochs": 12, "checkpoint_every": 4});
    for workers in [1, 2] {
        let rust = json!({"num_epochs": 12, "checkpoint_every": 4, "kernels": true});
        let (expected, _, _keep) = train(DIGITS_MLP, workers, rust, 0);
        assert!(expected.error.is_none(), "{:?}", expected.error);
        let accuracy = metric(&expected, "val_accuracy");
        assert!(accuracy >= 0.95, "the Rust example reached {accuracy}");
        let (result, lines, _keep) = train(python, workers, config.clone(), 0);
        assert!(result.error.is_none(), "{:?}", result.error);
        assert_eq!(result.metrics_history.len(), 12);
        assert_eq!(metric(&result, "val_accuracy"), accuracy, "{workers} ranks");
        for file in ["model.safetensors", "optimizer.safetensors"] {
            assert!(
                latest(&result, file) == latest(&expected, file),
                "{file} differs from the Rust example's with {workers} ranks"
            );
        }
        let printed = lines.0.lock().unwrap();
        assert!(
            printed
                .iter()
                .any(|(rank, _, l)| *rank == 0 && l.starts_with("epoch 11: train loss")),
            "{printed:?}"
        );
    }
}

/// A crash mid-run resumes from the last checkpoint and ends where an
/// uninterrupted run does; a checkpoint of the Rust example resumes in
/// Python too (the same files).
#[test]
fn the_python_digits_example_resumes_its_own_and_the_rust_examples_checkpoints() {
    let Some(python) = digits() else { return };
    let plain = json!({"num_epochs": 6, "checkpoint_every": 2});
    let (expected, _, _keep) = train(python, 2, plain, 0);
    assert!(expected.error.is_none(), "{:?}", expected.error);

    let crashing = json!({"num_epochs": 6, "checkpoint_every": 2, "fail_at_epoch": 3});
    let (result, lines, _keep) = train(python, 2, crashing, 1);
    assert!(result.error.is_none(), "{:?}", result.error);
    assert_eq!(result.failures, 1);
    let failure = &result.failure_history[0];
    assert!(
        failure.to_string().contains("injected failure at epoch 3"),
        "{failure}"
    );
    assert!(
        lines
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|(_, _, l)| l == "resuming after epoch 1")
    );
    assert_eq!(
        latest(&result, "model.safetensors"),
        latest(&expected, "model.safetensors")
    );

    // The Rust example trains 4 epochs; a Python run starts from its
    // checkpoint and trains the last 2.
    let (rust, _, _keep) = train(
        DIGITS_MLP,
        2,
        json!({"num_epochs": 4, "checkpoint_every": 2, "kernels": true}),
        0,
    );
    assert!(rust.error.is_none(), "{:?}", rust.error);
    let storage = tempfile::tempdir().unwrap();
    let resumed = Trainer::builder(python)
        .train_loop_config(json!({"num_epochs": 6, "checkpoint_every": 2}))
        .scaling_config(ScalingConfig { num_workers: 2 })
        .run_config(RunConfig {
            name: Some("from-rust".into()),
            storage_path: storage.path().display().to_string(),
            ..Default::default()
        })
        .resume_from_checkpoint(rust.checkpoint.as_ref().unwrap().location())
        .output(Arc::new(Lines::default()))
        .build()
        .unwrap()
        .fit()
        .unwrap();
    assert!(resumed.error.is_none(), "{:?}", resumed.error);
    assert_eq!(resumed.metrics_history.len(), 2);
    assert_eq!(
        latest(&resumed, "model.safetensors"),
        latest(&expected, "model.safetensors")
    );
}
