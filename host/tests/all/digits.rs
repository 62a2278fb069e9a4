//! The data-parallel digits example: real data, gradients all-reduced every
//! step, the accuracy a user expects, and recovery after a crash.

use std::sync::Arc;

use serde_json::json;
use trainhost::{
    FailureConfig, MaxFailures, MetricValue, RunConfig, ScalingConfig, TrainResult, Trainer,
};
use trainhost_test_artifacts::DIGITS_MLP;

use crate::util::{Lines, metric};

fn train(workers: u32, config: serde_json::Value, max_failures: u32) -> TrainResult {
    let storage = tempfile::tempdir().unwrap();
    let result = Trainer::builder(DIGITS_MLP)
        .train_loop_config(config)
        .scaling_config(ScalingConfig {
            num_workers: workers,
        })
        .run_config(RunConfig {
            name: Some("digits".into()),
            storage_path: storage.path().display().to_string(),
            failure_config: FailureConfig {
                max_failures: MaxFailures::Limited(max_failures),
            },
            ..Default::default()
        })
        .output(Arc::new(Lines::default()))
        .build()
        .unwrap()
        .fit()
        .unwrap();
    assert!(result.error.is_none(), "{:?}", result.error);
    result
}

#[test]
fn one_two_and_four_ranks_reach_the_same_accuracy_above_95_percent() {
    let accuracies: Vec<f64> = [1, 2, 4]
        .into_iter()
        .map(|workers| {
            let result = train(workers, json!({}), 0);
            // Every epoch reported, a checkpoint every 5 of 30 epochs.
            assert_eq!(result.metrics_history.len(), 30);
            metric(&result, "val_accuracy")
        })
        .collect();
    for a in &accuracies {
        assert!(*a >= 0.95, "validation accuracy {accuracies:?}");
        assert!(
            (a - accuracies[0]).abs() <= 0.01,
            "1, 2 and 4 ranks within one point: {accuracies:?}"
        );
    }
}

#[test]
fn after_a_crash_the_gang_resumes_and_ends_where_an_uninterrupted_run_does() {
    let whole = train(2, json!({"num_epochs": 12}), 0);
    let crashed = train(2, json!({"num_epochs": 12, "fail_at_epoch": 7}), 1);
    assert_eq!(crashed.failures, 1);
    // Resumed from the checkpoint after epoch 4 (epochs 5 and 6 are done
    // twice): the same steps on the same data, the same bits.
    for name in ["train_loss", "val_loss", "val_accuracy"] {
        assert_eq!(metric(&whole, name), metric(&crashed, name), "{name}");
    }
    let epochs: Vec<f64> = crashed
        .metrics_history
        .iter()
        .map(|r| {
            r.metrics
                .get("epoch")
                .and_then(MetricValue::as_f64)
                .unwrap()
        })
        .collect();
    let want = [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11].map(f64::from);
    assert_eq!(epochs, want);
}

#[test]
fn on_host_kernels_the_same_model_reaches_the_same_accuracy_and_resumes() {
    for workers in [1, 2] {
        let in_guest = metric(&train(workers, json!({}), 0), "val_accuracy");
        let on_host = metric(&train(workers, json!({"kernels": true}), 0), "val_accuracy");
        assert!(on_host >= 0.95, "{workers} ranks: {on_host}");
        assert!(
            (on_host - in_guest).abs() <= 0.01,
            "{workers} ranks: kernels {on_host}, guest {in_guest}"
        );
    }
    // The host writes the model's checkpoints from its tensors and reads
    // them back into tensors after a crash: the same steps, the same bits.
    let config =
        |fail: Option<u32>| json!({"num_epochs": 12, "kernels": true, "fail_at_epoch": fail});
    let whole = train(2, config(None), 0);
    let crashed = train(2, config(Some(7)), 1);
    assert_eq!(crashed.failures, 1);
    for name in ["train_loss", "val_loss", "val_accuracy"] {
        assert_eq!(metric(&whole, name), metric(&crashed, name), "{name}");
    }
}
