//! The linear-regression example: Ray's checkpointing loop, ported.

use std::sync::Arc;

use serde_json::json;
use trainhost::{MetricValue, RunConfig, ScalingConfig, Trainer};

use crate::util::*;

fn train(
    workers: u32,
    config: serde_json::Value,
    storage: &str,
    name: &str,
    resume: Option<String>,
) -> (trainhost::TrainResult, Arc<Lines>) {
    let lines = Arc::new(Lines::default());
    let mut b = Trainer::builder(LINEAR_REGRESSION)
        .train_loop_config(config)
        .scaling_config(ScalingConfig {
            num_workers: workers,
        })
        .run_config(RunConfig {
            name: Some(name.into()),
            storage_path: storage.into(),
            ..Default::default()
        })
        .output(lines.clone());
    if let Some(r) = resume {
        b = b.resume_from_checkpoint(r);
    }
    let result = b.build().unwrap().fit().unwrap();
    assert!(result.error.is_none(), "{:?}", result.error);
    (result, lines)
}

fn losses(result: &trainhost::TrainResult) -> Vec<f64> {
    result
        .metrics_history
        .iter()
        .map(|r| r.metrics.get("loss").and_then(MetricValue::as_f64).unwrap())
        .collect()
}

#[test]
fn ddp_style_rank_zero_checkpoints_every_epoch_and_the_loss_decreases() {
    let storage = tempfile::tempdir().unwrap();
    let (result, _) = train(
        2,
        json!({"num_epochs": 5}),
        storage.path().to_str().unwrap(),
        "ddp",
        None,
    );
    let l = losses(&result);
    assert_eq!(l.len(), 5);
    assert!(
        l.windows(2).all(|w| w[1] < w[0]),
        "loss must decrease: {l:?}"
    );
    assert_eq!(result.best_checkpoints.len(), 5);
    let latest = result.checkpoint.unwrap();
    let dir = std::path::PathBuf::from(latest.location());
    assert_eq!(
        files(&dir),
        ["meta.json", "model.safetensors", "optimizer.safetensors"]
    );
    assert_eq!(latest.manifest().ranks, [0]);
    assert_eq!(
        latest.metrics().get("epoch"),
        Some(&MetricValue::Integer(4))
    );
}

#[test]
fn checkpoint_freq_skips_epochs_but_keeps_the_last() {
    let storage = tempfile::tempdir().unwrap();
    let (result, _) = train(
        1,
        json!({"num_epochs": 5, "checkpoint_freq": 2}),
        storage.path().to_str().unwrap(),
        "freq",
        None,
    );
    let epochs: Vec<MetricValue> = result
        .best_checkpoints
        .iter()
        .map(|(_, m)| m.get("epoch").unwrap().clone())
        .collect();
    assert_eq!(
        epochs,
        [
            MetricValue::Integer(4),
            MetricValue::Integer(2),
            MetricValue::Integer(0)
        ]
    );
}

#[test]
fn sharded_checkpoints_merge_and_resume_onto_the_same_trajectory() {
    let storage = tempfile::tempdir().unwrap();
    let s = storage.path().to_str().unwrap();
    // Reference: 6 uninterrupted epochs.
    let (full, _) = train(1, json!({"num_epochs": 6}), s, "full", None);
    // Sharded over 3 ranks for 3 epochs, then resumed by 2 ranks for 3 more.
    let (sharded, _) = train(
        3,
        json!({"num_epochs": 3, "sharded": true}),
        s,
        "sharded",
        None,
    );
    let latest = sharded.checkpoint.clone().unwrap();
    assert_eq!(
        files(std::path::Path::new(latest.location())),
        [
            "meta.json",
            "model-rank=0.safetensors",
            "model-rank=1.safetensors",
            "model-rank=2.safetensors"
        ]
    );
    assert_eq!(latest.manifest().ranks, [0, 1, 2]);
    let (resumed, lines) = train(
        2,
        json!({"num_epochs": 6}),
        s,
        "resumed",
        Some(latest.location().to_owned()),
    );
    assert!(
        lines
            .texts()
            .iter()
            .any(|l| l.contains("resuming from /checkpoints/resume_from after epoch 2"))
    );
    let mut joined = losses(&sharded);
    joined.extend(losses(&resumed));
    let reference = losses(&full);
    assert_eq!(joined.len(), reference.len());
    for (a, b) in joined.iter().zip(&reference) {
        assert!(
            (a - b).abs() < 1e-6,
            "resumed trajectory {joined:?} differs from {reference:?}"
        );
    }
}
