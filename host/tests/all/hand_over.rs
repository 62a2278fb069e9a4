//! `report-handing-over`: the guest gives its checkpoint directory to the
//! host, which moves it out of the sandbox instead of copying it.

use serde_json::json;
use trainhost::{Checkpoint, RunConfig};

use crate::util::*;

/// The directory is empty when `report` returns, the checkpoint holds the
/// files the guest wrote, and the guest may write the next checkpoint in
/// the same directory at once (R8), in both persisting modes.
#[test]
fn handed_over_files_are_committed_and_the_directory_left_empty() {
    for background in [true, false] {
        let steps = json!([
            {"write": "ck/a", "text": "first {rank}"},
            {"write": "ck/nested/b", "bytes": 3_000_000, "seed": 1},
            {"report": {"epoch": 0}, "checkpoint": "ck", "hand_over": true},
            {"count_entries": "ck"},
            {"write": "ck/a", "text": "second"},
            {"report": {"epoch": 1}, "checkpoint": "ck", "hand_over": true},
            {"count_entries": "ck"},
        ]);
        let run = run_persisting(1, steps, background);
        run.assert_ok();
        assert_eq!(
            run.stdout(0),
            ["report ok", "entries: 0", "report ok", "entries: 0"],
            "background={background}"
        );
        let dir = run.dir();
        let read = |p: &str| std::fs::read(dir.join(p)).unwrap();
        assert_eq!(read("checkpoint_000000/a"), b"first 0");
        assert_eq!(
            read("checkpoint_000000/nested/b"),
            pseudo_random(3_000_000, 1)
        );
        assert_eq!(files(&dir.join("checkpoint_000001")), ["a"]);
        assert_eq!(read("checkpoint_000001/a"), b"second");
        for c in ["checkpoint_000000", "checkpoint_000001"] {
            Checkpoint::open(dir.join(c).to_str().unwrap())
                .unwrap()
                .verify()
                .unwrap();
        }
    }
}

/// Ranks choose for themselves: one hands its directory over, the other
/// has its directory copied and keeps it; the checkpoint holds both.
#[test]
fn ranks_may_mix_handing_over_and_copying() {
    let steps = json!([
        {"write": "ck/rank-{rank}.bin", "bytes": 100_000, "seed": 2},
        {"ranks": [0], "report": {"epoch": 0}, "checkpoint": "ck", "hand_over": true},
        {"ranks": [1], "report": {"epoch": 0}, "checkpoint": "ck"},
        {"count_entries": "ck"},
    ]);
    let run = run(2, steps);
    run.assert_ok();
    assert_eq!(run.stdout(0), ["report ok", "entries: 0"]);
    assert_eq!(run.stdout(1), ["report ok", "entries: 1"]);
    assert_eq!(
        files(&run.dir().join("checkpoint_000000")),
        ["rank-0.bin", "rank-1.bin"]
    );
}

/// What cannot be handed over is refused before anything moves: the
/// scratch directory itself, a symbolic link, a restored checkpoint, a
/// directory holding a symbolic link. The files stay where they were, the
/// refused call does not count as a report, and the run goes on.
#[test]
fn what_cannot_be_handed_over_is_refused_and_left_in_place() {
    let steps = json!([
        {"write": "ck/a", "text": "x"},
        {"report": {"epoch": 0}, "checkpoint": "/scratch", "hand_over": true},
        {"symlink": "link", "target": "ck"},
        {"report": {"epoch": 0}, "checkpoint": "link", "hand_over": true},
        {"count_entries": "ck"},
        {"write": "bad/a", "text": "x"},
        {"symlink": "bad/l", "target": "a"},
        {"report": {"epoch": 0}, "checkpoint": "bad", "hand_over": true},
        {"count_entries": "bad"},
        {"report": {"epoch": 0}, "checkpoint": "ck", "hand_over": true},
        {"print_checkpoint": true},
        {"report": {"epoch": 1}, "checkpoint": "/checkpoints/checkpoint_000000", "hand_over": true},
    ]);
    let run = run(1, steps);
    run.assert_ok();
    let out = run.stdout(0);
    assert!(
        out[0].contains("is the scratch directory itself"),
        "{out:?}"
    );
    assert!(out[1].contains("is a symbolic link"), "{out:?}");
    assert_eq!(out[2], "entries: 1");
    assert!(out[3].contains("symbolic link"), "{out:?}");
    assert_eq!(out[4], "entries: 2");
    assert_eq!(out[5], "report ok");
    assert!(
        out.last().unwrap().contains("is a restored checkpoint"),
        "{out:?}"
    );
    let history: Vec<_> = run
        .result
        .metrics_history
        .iter()
        .map(|r| r.report_index)
        .collect();
    assert_eq!(history, [0], "refused calls are not reports");
}

/// A guest built against trainhost:train@0.1.0, before
/// `report-handing-over` existed, still loads and reports.
#[test]
fn a_guest_built_against_0_1_0_still_runs() {
    let storage = tempfile::tempdir().unwrap();
    let result = trainhost::Trainer::builder(trainhost_test_artifacts::WIT_0_1_0)
        .run_config(RunConfig {
            name: Some("old".into()),
            storage_path: storage.path().display().to_string(),
            ..RunConfig::default()
        })
        .output(std::sync::Arc::new(Lines::default()))
        .build()
        .unwrap()
        .fit()
        .unwrap();
    assert!(result.error.is_none(), "{:?}", result.error);
    assert_eq!(result.metrics_history.len(), 1);
}
