//! Failures and gang restarts (R19-R21), and the example's documented
//! restoration scenario.

use std::sync::Arc;

use serde_json::{Value, json};
use trainhost::{
    FailureConfig, FailureKind, Interruption, MaxFailures, MetricValue, RunConfig, ScalingConfig,
    Trainer,
};

use crate::util::*;

/// Each attempt commits a checkpoint holding the next attempt's number,
/// then panics while its attempt is in `crash_on`.
fn crashing(workers: u32, crash_on: &[u64], max_failures: MaxFailures) -> Run {
    let steps = json!([
        {"print_checkpoint": true},
        {"write": "ckpt/attempt", "text": "{next_attempt}", "ranks": [0]},
        {"report": {"attempt": 1}, "checkpoint": "ckpt", "ranks": [0]},
        {"report": {"attempt": 1}, "ranks": [1, 2, 3]},
        {"panic": "crash in attempt {attempt}", "when_attempt": crash_on, "ranks": [workers - 1]},
        {"report": {"done": true}},
    ]);
    let (builder, storage, lines) = scripted(workers, steps);
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        failure_config: FailureConfig { max_failures },
        ..Default::default()
    });
    finish(builder, storage, lines)
}

#[test]
fn max_failures_zero_fails_at_the_first_failure() {
    let run = crashing(1, &[0], MaxFailures::Limited(0));
    let e = run.result.error.clone().expect("fails");
    assert_eq!(e.kind, FailureKind::Trap);
    assert!(e.message.contains("crash in attempt 0"), "{e}");
    assert_eq!(run.result.failures, 1);
    assert_eq!(
        run.stdout(0)
            .iter()
            .filter(|l| l.starts_with("checkpoint:"))
            .count(),
        1,
        "no restart"
    );
}

#[test]
fn max_failures_one_survives_one_crash_and_fails_on_the_second() {
    let survived = crashing(1, &[0], MaxFailures::Limited(1));
    survived.assert_ok();
    assert_eq!(survived.result.failures, 1);
    assert_eq!(survived.result.failure_history.len(), 1);
    assert!(
        survived.result.failure_history[0]
            .message
            .contains("crash in attempt 0")
    );

    let failed = crashing(1, &[0, 1], MaxFailures::Limited(1));
    let e = failed
        .result
        .error
        .clone()
        .expect("the second crash fails the run");
    assert!(e.message.contains("crash in attempt 1"), "{e}");
    assert_eq!(failed.result.failures, 2);
}

#[test]
fn unlimited_failures_survive_three_crashes() {
    let run = crashing(1, &[0, 1, 2], MaxFailures::Unlimited);
    run.assert_ok();
    assert_eq!(run.result.failures, 3);
    assert_eq!(
        run.result.metrics.as_ref().unwrap().get("done"),
        Some(&MetricValue::Boolean(true))
    );
    // Each failure's record and the history were stored beside the next
    // attempt's start (R53), and all of them landed before the run
    // returned: storage holds every failure and every report.
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.dir().join("trainhost-run.json")).unwrap())
            .unwrap();
    assert_eq!(
        state["failures"].as_array().map(Vec::len),
        Some(3),
        "{state}"
    );
    let stored = std::fs::read_to_string(run.dir().join("metrics.jsonl")).unwrap();
    assert_eq!(stored.lines().count(), run.result.metrics_history.len());
}

#[test]
fn one_rank_trapping_restarts_every_rank_from_the_same_checkpoint() {
    let run = crashing(2, &[0], MaxFailures::Limited(1));
    run.assert_ok();
    for rank in 0..2 {
        let seen: Vec<String> = run
            .stdout(rank)
            .into_iter()
            .filter(|l| l.starts_with("checkpoint:"))
            .collect();
        assert_eq!(
            seen,
            [
                "checkpoint: none",
                "checkpoint: /checkpoints/checkpoint_000000"
            ],
            "rank {rank}"
        );
    }
    assert_eq!(run.result.failure_history[0].rank, Some(1));
}

/// Rank 1 dies while rank 0 computes for a while without calling the
/// host; returns how often rank 0 finished that computation (the run
/// restarts once, and the second attempt does not die).
fn computations_finished_by_a_peer_of_a_dying_rank(interruption: Interruption) -> usize {
    let steps = json!([
        {"write": "ckpt/attempt", "text": "{next_attempt}", "ranks": [0]},
        {"report": {}, "checkpoint": "ckpt", "ranks": [0]},
        {"report": {}, "ranks": [1]},
        {"panic": "dies", "when_attempt": [0], "ranks": [1]},
        {"spin_ms": 1500, "ranks": [0]},
        {"print": "computed", "ranks": [0]},
        {"report": {"done": true}},
    ]);
    let (builder, storage, lines) = scripted(2, steps);
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        failure_config: FailureConfig {
            max_failures: MaxFailures::Limited(1),
        },
        interruption,
        ..Default::default()
    });
    let run = finish(builder, storage, lines);
    run.assert_ok();
    assert_eq!(run.result.failures, 1);
    run.stdout(0).iter().filter(|l| *l == "computed").count()
}

#[test]
fn by_default_a_computing_rank_is_stopped_where_it_is() {
    assert_eq!(
        computations_finished_by_a_peer_of_a_dying_rank(Interruption::Anywhere),
        1,
        "stopped mid-computation in the first attempt"
    );
}

#[test]
fn interrupting_at_host_calls_stops_a_computing_rank_at_its_next_report() {
    assert_eq!(
        computations_finished_by_a_peer_of_a_dying_rank(Interruption::AtHostCalls),
        2,
        "ran on to its report in the first attempt"
    );
}

#[test]
fn the_checkpoint_reported_just_before_the_crash_is_restored() {
    let steps = json!([
        {"print_checkpoint": true},
        {"write": "ckpt/attempt", "text": "{next_attempt}"},
        {"write": "ckpt/which", "text": "first"},
        {"report": {}, "checkpoint": "ckpt"},
        {"write": "ckpt/which", "text": "just before the crash"},
        {"report": {}, "checkpoint": "ckpt"},
        {"panic": "crash", "when_attempt": [0]},
    ]);
    let (builder, storage, lines) = scripted(1, steps);
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        failure_config: FailureConfig {
            max_failures: MaxFailures::Limited(1),
        },
        ..Default::default()
    });
    let run = finish(builder, storage, lines);
    run.assert_ok();
    let out = run.stdout(0);
    let restored = out
        .iter()
        .position(|l| l == "checkpoint: /checkpoints/checkpoint_000001")
        .expect("restored");
    assert!(out[restored + 2].starts_with("file: which 21 "), "{out:?}");
}

#[test]
fn the_example_crashes_once_at_epoch_one_and_finishes_from_the_epoch_zero_checkpoint() {
    let storage = tempfile::tempdir().unwrap();
    let lines = Arc::new(Lines::default());
    let result = Trainer::builder(LINEAR_REGRESSION)
        .train_loop_config(json!({"num_epochs": 5, "fail_at_epoch": 1}))
        .scaling_config(ScalingConfig { num_workers: 2 })
        .run_config(RunConfig {
            name: Some("ray-scenario".into()),
            storage_path: storage.path().display().to_string(),
            failure_config: FailureConfig {
                max_failures: MaxFailures::Limited(1),
            },
            ..Default::default()
        })
        .output(lines.clone())
        .build()
        .unwrap()
        .fit()
        .unwrap();
    assert!(result.error.is_none(), "{:?}", result.error);
    assert_eq!(result.failures, 1);
    assert!(
        result.failure_history[0]
            .message
            .contains("injected failure at epoch 1")
    );
    let printed = lines.texts();
    assert!(
        printed
            .iter()
            .any(|l| l == "resuming from /checkpoints/checkpoint_000000 after epoch 0"),
        "{printed:?}"
    );
    let epochs: Vec<Value> = result
        .metrics_history
        .iter()
        .map(|r| serde_json::to_value(r.metrics.get("epoch").unwrap()).unwrap())
        .collect();
    assert_eq!(epochs, [0, 1, 2, 3, 4].map(Value::from));
    let losses: Vec<f64> = result
        .metrics_history
        .iter()
        .map(|r| r.metrics.get("loss").unwrap().as_f64().unwrap())
        .collect();
    assert!(losses.windows(2).all(|w| w[1] < w[0]), "{losses:?}");
}
