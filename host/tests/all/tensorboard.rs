//! The TensorBoard event file (R49), read back by TensorBoard's own
//! reader: every numeric metric of rank 0 against the report index, a
//! resumed run continuing the series without repeating a step, and no
//! file when it is turned off.

use std::process::Command;

use serde_json::{Value, json};
use trainhost::{FailureConfig, MaxFailures, RunConfig};

use crate::util::*;

/// The scalars TensorBoard's `EventAccumulator` finds in `dir`: tag →
/// [(step, value)]; `None` when there is no Python with TensorBoard.
fn scalars(dir: &std::path::Path) -> Option<Value> {
    let python = venv_python("TensorBoard")?;
    let out = Command::new(python)
        .args([
            "-c",
            "import json, sys\n\
             from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
             acc = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0})\n\
             acc.Reload()\n\
             print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()['scalars']}))",
        ])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

#[test]
fn tensorboard_reads_every_numeric_metric_and_a_resumed_run_repeats_no_step() {
    // Attempt 0 reports twice (the second with a checkpoint) and a third
    // time, then dies; attempt 1 restarts from the checkpoint and reports
    // twice more: the history, and the event file, hold five reports.
    let (builder, storage, lines) = scripted(
        2,
        json!([
            {"write": "c/attempt", "text": "{next_attempt}", "when_attempt": [0]},
            {"report": {"loss": 1.5, "epoch": 0, "phase": "warm-up", "done": false}, "when_attempt": [0]},
            {"report": {"loss": 1.0, "epoch": 1}, "checkpoint": "c", "when_attempt": [0]},
            {"report": {"loss": 0.9, "epoch": 2}, "when_attempt": [0]},
            {"panic": "attempt 0 dies", "ranks": [1], "when_attempt": [0]},
            {"report": {"loss": 0.8, "epoch": 2}, "when_attempt": [1]},
            {"report": {"loss": 0.7, "epoch": 3, "lr": 0.01}, "when_attempt": [1]},
        ]),
    );
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
    assert_eq!(run.result.failures, 1);
    assert!(run.dir().join("events.out.tfevents.trainhost").exists());
    let Some(found) = scalars(&run.dir()) else {
        return;
    };
    let series = |tag: &str| -> Vec<(u64, f64)> {
        found[tag]
            .as_array()
            .unwrap_or_else(|| panic!("no {tag} in {found}"))
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
            .collect()
    };
    let loss = series("loss");
    let steps: Vec<u64> = loss.iter().map(|p| p.0).collect();
    assert_eq!(steps, [0, 1, 2, 3, 4], "{found}");
    let want = [1.5, 1.0, 0.9, 0.8, 0.7];
    for ((_, got), want) in loss.iter().zip(want) {
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
    assert_eq!(
        series("epoch").iter().map(|p| p.1).collect::<Vec<_>>(),
        [0.0, 1.0, 2.0, 2.0, 3.0]
    );
    assert_eq!(series("lr").len(), 1);
    // Text and flags are not curves.
    let mut tags: Vec<&String> = found.as_object().unwrap().keys().collect();
    tags.sort();
    assert_eq!(tags, ["epoch", "loss", "lr"]);
}

#[test]
fn the_event_file_can_be_turned_off() {
    let (builder, storage, lines) = scripted(1, json!([{"report": {"loss": 1.0}}]));
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        tensorboard: false,
        ..Default::default()
    });
    let run = finish(builder, storage, lines);
    run.assert_ok();
    assert!(run.dir().join("metrics.jsonl").exists());
    assert!(!run.dir().join("events.out.tfevents.trainhost").exists());
}
