//! Retention: num_to_keep, score attribute and order, keep_every (R13-R18).

use serde_json::{Value, json};
use trainhost::{CheckpointConfig, Error, MetricValue, RunConfig, ScoreOrder};

use crate::util::*;

/// Report one checkpoint per value of `metrics`, with `checkpoint` config.
fn run_with(checkpoint: CheckpointConfig, metrics: &[Value]) -> Run {
    let mut steps = Vec::new();
    for (i, m) in metrics.iter().enumerate() {
        steps.push(json!({"write": "ckpt/i", "text": i.to_string()}));
        steps.push(json!({"report": m, "checkpoint": "ckpt"}));
    }
    let (builder, storage, lines) = scripted(1, Value::Array(steps));
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        checkpoint_config: checkpoint,
        ..Default::default()
    });
    let run = finish(builder, storage, lines);
    run.assert_ok();
    run
}

fn best(run: &Run) -> Vec<u64> {
    run.result
        .best_checkpoints
        .iter()
        .map(|(c, _)| c.index())
        .collect()
}

fn keep(n: usize, attr: Option<&str>, order: Option<ScoreOrder>) -> CheckpointConfig {
    CheckpointConfig {
        num_to_keep: Some(n),
        checkpoint_score_attribute: attr.map(str::to_owned),
        checkpoint_score_order: order,
        keep_every: None,
    }
}

#[test]
fn keeps_the_two_lowest_losses_plus_the_latest() {
    let losses = [2, 4, 1, 3].map(|l| json!({"loss": l}));
    let run = run_with(keep(2, Some("loss"), Some(ScoreOrder::Min)), &losses);
    assert_eq!(
        checkpoint_dirs(&run.dir()),
        [
            "checkpoint_000000",
            "checkpoint_000002",
            "checkpoint_000003"
        ]
    );
    assert_eq!(best(&run), [2, 0, 3]);
    assert_eq!(run.result.checkpoint.as_ref().unwrap().index(), 3, "latest");
    // Deleted checkpoints leave nothing behind.
    assert!(!run.dir().join("checkpoint_000001").exists());
    // The listing ranks the same way.
    let listed: Vec<u64> = trainhost::committed_checkpoints(run.dir().to_str().unwrap())
        .unwrap()
        .iter()
        .map(trainhost::Checkpoint::index)
        .collect();
    assert_eq!(listed, [2, 0, 3]);
}

#[test]
fn tune_shorthand_sets_the_order() {
    let losses = [2, 4, 1, 3].map(|l| json!({"loss": l}));
    let run = run_with(keep(2, Some("min-loss"), None), &losses);
    assert_eq!(best(&run), [2, 0, 3]);
    let accs = [0.5, 0.9, 0.7].map(|a| json!({"auc": a}));
    let run = run_with(keep(1, Some("max-auc"), None), &accs);
    assert_eq!(best(&run), [1, 2]);
}

#[test]
fn without_a_score_the_most_recent_are_kept() {
    let run = run_with(
        keep(2, None, None),
        &[json!({}), json!({}), json!({}), json!({})],
    );
    assert_eq!(
        checkpoint_dirs(&run.dir()),
        ["checkpoint_000002", "checkpoint_000003"]
    );
    assert_eq!(best(&run), [3, 2]);
}

#[test]
fn ties_go_to_the_newer_checkpoint() {
    let run = run_with(
        keep(1, Some("loss"), Some(ScoreOrder::Min)),
        &[json!({"loss": 1}), json!({"loss": 1}), json!({"loss": 5})],
    );
    assert_eq!(best(&run), [1, 2]);
}

#[test]
fn a_missing_score_ranks_worst_under_min_and_max() {
    for order in [ScoreOrder::Min, ScoreOrder::Max] {
        let metrics = [
            json!({"other": 1}),
            json!({"loss": 3}),
            json!({"loss": 2}),
            json!({"other": 2}),
        ];
        let run = run_with(keep(1, Some("loss"), Some(order)), &metrics);
        let expected_best = if order == ScoreOrder::Min { 2 } else { 1 };
        assert_eq!(
            best(&run),
            [expected_best, 3],
            "{order:?}: the unscored latest is kept but ranks last"
        );
        assert!(
            !run.dir().join("checkpoint_000000").exists(),
            "{order:?}: the unscored first one is deleted"
        );
    }
}

#[test]
fn nan_ranks_worst() {
    let run = run_with(
        keep(1, Some("loss"), Some(ScoreOrder::Min)),
        &[
            json!({"loss": 1}),
            json!({"loss": "NaN"}),
            json!({"loss": 2}),
        ],
    );
    assert_eq!(best(&run), [0, 2]);
    let history = &run.result.metrics_history;
    assert!(matches!(history[1].metrics.get("loss"), Some(MetricValue::Float(f)) if f.is_nan()));
}

#[test]
fn a_non_numeric_score_is_a_report_error_the_guest_sees() {
    let (builder, storage, lines) = scripted(
        1,
        json!([
            {"write": "ckpt/f", "text": "x"},
            {"report": {"loss": "low"}, "checkpoint": "ckpt"},
            {"report": {"loss": 0.5}, "checkpoint": "ckpt"},
        ]),
    );
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        checkpoint_config: keep(2, Some("loss"), None),
        ..Default::default()
    });
    let run = finish(builder, storage, lines);
    run.assert_ok();
    let out = run.stdout(0);
    assert!(
        out[0].starts_with(
            "report refused: metrics refused: the score attribute \"loss\" must be a number"
        ),
        "{out:?}"
    );
    assert_eq!(out[1], "report ok");
    assert_eq!(checkpoint_dirs(&run.dir()), ["checkpoint_000000"]);
}

#[test]
fn nested_metric_names_work_as_score_attributes() {
    let metrics = [0.3, 0.1, 0.2].map(|l| json!({"eval": {"loss": l}}));
    let run = run_with(keep(1, Some("eval/loss"), Some(ScoreOrder::Min)), &metrics);
    assert_eq!(best(&run), [1, 2]);
}

#[test]
fn keep_every_keeps_every_nth_whatever_its_score() {
    let config = CheckpointConfig {
        keep_every: Some(2),
        ..keep(1, None, None)
    };
    let run = run_with(
        config,
        &[
            json!({}),
            json!({}),
            json!({}),
            json!({}),
            json!({}),
            json!({}),
        ],
    );
    assert_eq!(
        checkpoint_dirs(&run.dir()),
        [
            "checkpoint_000000",
            "checkpoint_000002",
            "checkpoint_000004",
            "checkpoint_000005"
        ]
    );
}

#[test]
fn bad_retention_settings_are_refused_before_anything_runs() {
    let cases = [
        (keep(0, None, None), "num_to_keep must be at least 1, got 0"),
        (
            CheckpointConfig {
                keep_every: Some(0),
                ..Default::default()
            },
            "keep_every is 0",
        ),
        (
            keep(1, Some("max-auc"), Some(ScoreOrder::Min)),
            "implies order Max",
        ),
    ];
    for (config, expected) in cases {
        let (builder, storage, _) = scripted(1, json!([]));
        let err = builder
            .run_config(RunConfig {
                storage_path: storage.path().display().to_string(),
                checkpoint_config: config,
                ..Default::default()
            })
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
        assert!(err.to_string().contains(expected), "{err}");
    }
}
