//! Resuming a run by name (R23): after a host killed with SIGKILL, with
//! leftovers of interrupted uploads, with a damaged newest checkpoint.

use serde_json::json;
use trainhost::{Checkpoint, RunConfig};

use crate::util::*;

/// The CLI running the example as 2 ranks under `name` in `dir`.
fn start_example(dir: &std::path::Path, name: &str, config: &str) -> HostProcess {
    HostProcess::spawn(
        &[
            "run",
            LINEAR_REGRESSION,
            "--workers",
            "2",
            "--name",
            name,
            "--config",
            config,
            "--num-to-keep",
            "3",
        ],
        dir,
    )
}

fn epoch_of(line: &str) -> Option<u64> {
    line.strip_prefix("[rank 0] epoch ")?
        .split(':')
        .next()?
        .parse()
        .ok()
}

#[test]
fn a_host_killed_with_sigkill_resumes_from_its_last_committed_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let config = r#"{"num_epochs": 400}"#;
    let mut host = start_example(tmp.path(), "killed", config);
    host.wait_for(|l| epoch_of(l).is_some_and(|e| e >= 60));
    host.child.kill().unwrap(); // SIGKILL: no chance to clean up
    host.child.wait().unwrap();

    let run_dir = tmp.path().join("trainhost_results/killed");
    let before = trainhost::committed_checkpoints(run_dir.to_str().unwrap()).unwrap();
    let last_before = before
        .iter()
        .map(Checkpoint::index)
        .max()
        .expect("checkpoints were committed");
    let resumed_epoch = before
        .iter()
        .find(|c| c.index() == last_before)
        .unwrap()
        .metrics()
        .get("epoch")
        .cloned();

    let mut host = start_example(tmp.path(), "killed", config);
    let line = host.wait_for(|l| l.contains("resuming from"));
    let resumed_epoch = serde_json::to_value(resumed_epoch.unwrap()).unwrap();
    assert!(
        line.ends_with(&format!("after epoch {resumed_epoch}")),
        "resumed from the wrong checkpoint: {line} (latest committed was epoch {resumed_epoch})"
    );
    let status = host.child.wait().unwrap();
    assert!(status.success());

    // Numbering went on; every retained checkpoint verifies.
    let after = trainhost::committed_checkpoints(run_dir.to_str().unwrap()).unwrap();
    assert!(
        after.iter().all(|c| c.index() > last_before),
        "numbering continued"
    );
    assert!(after.len() <= 3, "retention applies across the restart");
    for c in &after {
        c.verify().unwrap();
    }
    let history = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let indexes: Vec<u64> = history
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["report_index"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert!(
        indexes.windows(2).all(|w| w[1] == w[0] + 1),
        "report numbering is continuous"
    );
    let last: serde_json::Value = serde_json::from_str(history.lines().last().unwrap()).unwrap();
    assert_eq!(last["metrics"]["epoch"], 399);
}

/// The script of the runs below: print the checkpoint received, then
/// commit two, holding `w` = "zero" and "one".
fn script() -> serde_json::Value {
    json!([
        {"print_checkpoint": true},
        {"write": "ckpt/w", "text": "zero"},
        {"report": {"i": 0}, "checkpoint": "ckpt"},
        {"write": "ckpt/w", "text": "one"},
        {"report": {"i": 1}, "checkpoint": "ckpt"},
    ])
}

/// Run the script again under run "t" in `first`'s storage.
fn rerun(first: &Run, fresh: bool, steps: serde_json::Value) -> Run {
    let (builder, scratch, lines) = scripted(1, steps);
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: first.storage.path().display().to_string(),
        fresh,
        ..Default::default()
    });
    finish(builder, scratch, lines)
}

/// Run `steps` under run "t" in `first`'s storage: continuing must be
/// refused with an error holding every one of `refusal` and touch nothing;
/// starting fresh must then delete the old run's checkpoints and history.
fn refused_then_started_fresh(first: &Run, steps: serde_json::Value, refusal: &[&str]) {
    let (builder, _scratch, _lines) = scripted(1, steps.clone());
    let err = builder
        .run_config(RunConfig {
            name: Some("t".into()),
            storage_path: first.storage.path().display().to_string(),
            ..Default::default()
        })
        .build()
        .unwrap()
        .fit()
        .unwrap_err();
    let message = err.to_string();
    assert!(
        refusal.iter().all(|part| message.contains(part)),
        "{message}"
    );
    assert!(
        first.dir().join("checkpoint_000001").exists(),
        "refusing touches nothing"
    );

    let fresh = rerun(first, true, steps);
    fresh.assert_ok();
    assert_eq!(fresh.stdout(0), ["checkpoint: none", "report ok"]);
    assert_eq!(
        checkpoint_dirs(&first.dir()),
        Vec::<String>::new(),
        "the old run's checkpoints were deleted"
    );
    assert_eq!(
        fresh.result.metrics_history.len(),
        1,
        "no history line of the old run"
    );
}

#[test]
fn leftovers_of_interrupted_uploads_are_removed_and_never_restored() {
    let first = run(1, script());
    first.assert_ok();
    let dir = first.dir();
    // An upload killed before its manifest, and an orphan far ahead.
    std::fs::create_dir_all(dir.join("checkpoint_000002/sub")).unwrap();
    std::fs::write(dir.join("checkpoint_000002/sub/w"), "partial").unwrap();
    std::fs::create_dir_all(dir.join("checkpoint_000009")).unwrap();
    std::fs::write(dir.join("checkpoint_000009/w"), "junk").unwrap();

    let second = rerun(&first, false, script());
    second.assert_ok();
    assert_eq!(
        second.stdout(0)[0],
        "checkpoint: /checkpoints/checkpoint_000001"
    );
    // checkpoint_000002 is now the resumed run's own, with the new bytes.
    assert_eq!(
        checkpoint_dirs(&dir),
        [
            "checkpoint_000000",
            "checkpoint_000001",
            "checkpoint_000002",
            "checkpoint_000003"
        ]
    );
    assert_eq!(files(&dir.join("checkpoint_000002")), ["w"]);
    assert_eq!(
        std::fs::read(dir.join("checkpoint_000002/w")).unwrap(),
        b"zero"
    );
    let indexes: Vec<u64> = second
        .result
        .metrics_history
        .iter()
        .map(|r| r.report_index)
        .collect();
    assert_eq!(indexes, [0, 1, 2, 3]);
}

#[test]
fn a_checkpoint_committed_after_the_last_state_write_is_adopted() {
    let first = run(1, script());
    first.assert_ok();
    let dir = first.dir();
    // A host killed between the manifest and the state write: the state
    // does not know checkpoint 1, but its manifest commits it.
    let state_path = dir.join("trainhost-run.json");
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    state["checkpoints"].as_array_mut().unwrap().truncate(1);
    state["next_checkpoint_index"] = json!(1);
    state["reports"] = json!(1);
    std::fs::write(&state_path, serde_json::to_vec(&state).unwrap()).unwrap();

    let second = rerun(&first, false, script());
    second.assert_ok();
    assert_eq!(
        second.stdout(0)[0],
        "checkpoint: /checkpoints/checkpoint_000001"
    );
    assert_eq!(checkpoint_dirs(&dir).len(), 4);
}

#[test]
fn a_damaged_newest_checkpoint_falls_back_to_the_previous_one() {
    let first = run(1, script());
    first.assert_ok();
    std::fs::write(first.dir().join("checkpoint_000001/w"), "bit rot").unwrap();
    let second = rerun(&first, false, script());
    second.assert_ok();
    let out = second.stdout(0);
    assert_eq!(
        out[0], "checkpoint: /checkpoints/checkpoint_000000",
        "{out:?}"
    );
    assert!(out[1].starts_with("file: w 4 "), "{out:?}");
}

#[test]
fn when_no_committed_checkpoint_verifies_the_run_fails_instead_of_starting_over() {
    let first = run(1, script());
    first.assert_ok();
    for dir in ["checkpoint_000000", "checkpoint_000001"] {
        std::fs::write(first.dir().join(dir).join("w"), "bit rot").unwrap();
    }
    let second = rerun(&first, false, script());
    let e = second.result.error.clone().expect("must fail");
    assert_eq!(e.kind, trainhost::FailureKind::Restore);
    assert!(
        e.message
            .contains("none of the run's 2 committed checkpoints verifies"),
        "{e}"
    );
}

#[test]
fn a_changed_config_is_refused_unless_starting_fresh() {
    let first = run(1, script());
    first.assert_ok();
    let changed = json!([{"print_checkpoint": true}, {"report": {"other": 1}}]);
    refused_then_started_fresh(
        &first,
        changed,
        &["exists with a different config", "--resume-from", "--fresh"],
    );
}

#[test]
fn leftovers_of_an_interrupted_start_fresh_are_refused_then_deleted_by_fresh() {
    let first = run(1, script());
    first.assert_ok();
    // Starting fresh deletes the run state first, then the rest: a host
    // killed in between leaves committed checkpoints and a history with
    // no state.
    std::fs::remove_file(first.dir().join("trainhost-run.json")).unwrap();
    std::fs::remove_dir_all(first.dir().join("checkpoint_000000")).unwrap();

    let steps = json!([{"print_checkpoint": true}, {"report": {"new": 1}}]);
    refused_then_started_fresh(
        &first,
        steps,
        &[
            "holds checkpoint_000001, metrics.jsonl, events.out.tfevents.trainhost but no trainhost-run.json",
            "start fresh with --fresh",
        ],
    );
}

#[test]
fn a_history_line_lost_to_a_kill_is_restored_from_the_committed_checkpoint() {
    let first = run(1, script());
    first.assert_ok();
    // A host killed between the state write and the history append: the
    // last committed report is missing from metrics.jsonl.
    let history = first.dir().join("metrics.jsonl");
    let text = std::fs::read_to_string(&history).unwrap();
    let kept: Vec<&str> = text.lines().take(1).collect();
    std::fs::write(&history, format!("{}\n", kept.join("\n"))).unwrap();

    let second = rerun(&first, false, script());
    second.assert_ok();
    let indexes: Vec<u64> = second
        .result
        .metrics_history
        .iter()
        .map(|r| r.report_index)
        .collect();
    assert_eq!(indexes, [0, 1, 2, 3]);
    assert_eq!(second.result.metrics_history[1].checkpoint, Some(1));
}
