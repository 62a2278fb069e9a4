//! The digits classifier written with burn (`examples/digits-burn`, on
//! `trainhost-burn`): the accuracy a user expects on 1 and 2 ranks with
//! their parameters kept identical, checkpoints at the chosen frequency
//! through burn's recorder, and a crash mid-epoch resumed with the model
//! and Adam's state intact.

use std::sync::Arc;

use serde_json::json;
use trainhost::{
    FailureConfig, MaxFailures, MetricValue, Preemption, RunConfig, ScalingConfig, TrainResult,
    Trainer,
};
use trainhost_test_artifacts::DIGITS_BURN;

use crate::util::Lines;

fn train(workers: u32, config: serde_json::Value, max_failures: u32) -> TrainResult {
    let storage = tempfile::tempdir().unwrap();
    let result = run(&storage, workers, config, max_failures, Preemption::new());
    assert!(result.error.is_none(), "{:?}", result.error);
    result
}

fn run(
    storage: &tempfile::TempDir,
    workers: u32,
    config: serde_json::Value,
    max_failures: u32,
    preemption: Preemption,
) -> TrainResult {
    Trainer::builder(DIGITS_BURN)
        .train_loop_config(config)
        .scaling_config(ScalingConfig {
            num_workers: workers,
        })
        .run_config(RunConfig {
            name: Some("digits-burn".into()),
            storage_path: storage.path().display().to_string(),
            failure_config: FailureConfig {
                max_failures: MaxFailures::Limited(max_failures),
            },
            ..Default::default()
        })
        .output(Arc::new(Lines::default()))
        .preemption(preemption)
        .build()
        .unwrap()
        .fit()
        .unwrap()
}

fn number(metrics: &trainhost::Metrics, name: &str) -> f64 {
    metrics
        .get(name)
        .and_then(MetricValue::as_f64)
        .unwrap_or_else(|| panic!("no {name} in {metrics:?}"))
}

/// `name` of every report, in order.
fn series(result: &TrainResult, name: &str) -> Vec<f64> {
    result
        .metrics_history
        .iter()
        .map(|r| number(&r.metrics, name))
        .collect()
}

#[test]
fn one_and_two_ranks_reach_95_percent_with_identical_parameters() {
    // Each epoch ends with an all-gather of the ranks' parameter digests:
    // the run fails if the two ranks ever differ.
    let accuracies: Vec<f64> = [1, 2]
        .into_iter()
        .map(|workers| {
            let result = train(workers, json!({}), 0);
            assert_eq!(result.metrics_history.len(), 15);
            number(result.metrics.as_ref().unwrap(), "val_accuracy")
        })
        .collect();
    for a in &accuracies {
        assert!(*a >= 0.95, "validation accuracy {accuracies:?}");
    }
    assert!(
        (accuracies[0] - accuracies[1]).abs() <= 0.02,
        "1 and 2 ranks take the same path up to rounding: {accuracies:?}"
    );
}

#[test]
fn checkpoints_fall_every_nth_epoch_and_after_the_last_in_burns_format() {
    let result = train(2, json!({"num_epochs": 7, "checkpoint_every": 3}), 0);
    let with_checkpoint: Vec<f64> = result
        .metrics_history
        .iter()
        .filter(|r| r.checkpoint.is_some())
        .map(|r| number(&r.metrics, "epoch"))
        .collect();
    assert_eq!(with_checkpoint, [2.0, 5.0, 6.0]);
    let latest = result.checkpoint.expect("a checkpoint");
    let mut files: Vec<String> = latest
        .manifest()
        .files
        .iter()
        .map(|f| f.path.clone())
        .collect();
    files.sort();
    assert_eq!(
        files,
        ["model.mpk", "optimizer.mpk", "trainhost-burn.json"],
        "burn's named MessagePack records and the epoch"
    );
}

#[test]
fn a_crash_mid_epoch_resumes_the_model_and_adams_state() {
    let whole = train(2, json!({"num_epochs": 10}), 0);
    let crashed = train(2, json!({"num_epochs": 10, "fail_at_epoch": 7}), 1);
    assert_eq!(crashed.failures, 1);
    // Rank 1 panicked halfway through epoch 7; the ranks resumed from the
    // checkpoint after epoch 4, so epochs 5 and 6 are reported twice.
    let epochs = series(&crashed, "epoch");
    let want = [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9].map(f64::from);
    assert_eq!(epochs, want);
    // After the restart the loss curve continues as if nothing happened:
    // the same steps from the same model and optimizer state, the same
    // bits. Had Adam's moments been lost, epoch 5 would differ.
    let losses = series(&crashed, "train_loss");
    let (before, after) = losses.split_at(7);
    let uninterrupted = series(&whole, "train_loss");
    assert_eq!(before, &uninterrupted[..7]);
    assert_eq!(after, &uninterrupted[5..]);
    assert_eq!(
        series(&crashed, "val_loss")[7..],
        series(&whole, "val_loss")[5..]
    );
}

#[test]
fn a_preempted_run_saves_the_epoch_it_ended_and_the_rerun_continues_from_it() {
    let storage = tempfile::tempdir().unwrap();
    let config = json!({"num_epochs": 6, "checkpoint_every": 5});
    // Requested before the start: the ranks see it after their first report.
    let preemption = Preemption::new();
    preemption.request();
    let stopped = run(&storage, 2, config.clone(), 0, preemption);
    assert!(stopped.error.is_none(), "{:?}", stopped.error);
    assert!(stopped.preempted);
    // Epoch 0 was not due a checkpoint: a second report carries one.
    let checkpoints: Vec<Option<u64>> = stopped
        .metrics_history
        .iter()
        .map(|r| r.checkpoint)
        .collect();
    assert_eq!(checkpoints, [None, Some(0)]);

    let rerun = run(&storage, 2, config, 0, Preemption::new());
    assert!(rerun.error.is_none(), "{:?}", rerun.error);
    let epochs: Vec<f64> = series(&rerun, "epoch");
    assert_eq!(
        epochs,
        [0, 0, 1, 2, 3, 4, 5].map(f64::from),
        "continued after epoch 0"
    );
}
