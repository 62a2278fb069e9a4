//! get-checkpoint and resume_from (R21, R22, R23 numbering, R26).

use serde_json::json;
use trainhost::{Checkpoint, Error, FailureKind};

use crate::util::*;

/// A committed checkpoint from a first run, holding `w` = `text`.
fn source_checkpoint(text: &str) -> Run {
    let run = run(
        1,
        json!([
            {"write": "ckpt/w", "text": text},
            {"write": "ckpt/sub/more.bin", "bytes": 70_000, "seed": 5},
            {"report": {"loss": 1}, "checkpoint": "ckpt"},
        ]),
    );
    run.assert_ok();
    run
}

#[test]
fn a_fresh_run_has_no_checkpoint() {
    let run = run(2, json!([{"print_checkpoint": true}]));
    run.assert_ok();
    assert_eq!(run.stdout(0), ["checkpoint: none"]);
    assert_eq!(run.stdout(1), ["checkpoint: none"]);
}

#[test]
fn resume_from_seeds_get_checkpoint_on_every_rank_until_the_run_commits() {
    let source = source_checkpoint("from another run");
    let location = source.dir().join("checkpoint_000000").display().to_string();
    let (builder, storage, lines) = scripted(
        2,
        json!([
            {"print_checkpoint": true},
            {"write": "ckpt/w", "text": "mine"},
            {"report": {"loss": 0.5}, "checkpoint": "ckpt", "ranks": [0]},
            {"report": {"loss": 0.5}, "ranks": [1]},
            {"print_checkpoint": true},
        ]),
    );
    let run = finish(builder.resume_from_checkpoint(location), storage, lines);
    run.assert_ok();
    let expected_sum = format!("{:016x}", fnv(b"from another run"));
    for rank in 0..2 {
        let out = run.stdout(rank);
        // Every rank sees the same read-only copy.
        assert_eq!(out[0], "checkpoint: /checkpoints/resume_from", "{out:?}");
        assert_eq!(
            out[1],
            format!(
                "file: sub/more.bin 70000 {:016x}",
                fnv(&pseudo_random(70_000, 5))
            )
        );
        assert_eq!(out[2], format!("file: w 16 {expected_sum}"));
        // After the run's own commit, the latest committed one wins.
        assert_eq!(
            out[4], "checkpoint: /checkpoints/checkpoint_000000",
            "{out:?}"
        );
        assert!(out[5].starts_with("file: w 4 "), "{out:?}");
    }
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[test]
fn a_corrupted_resume_from_checkpoint_fails_verification() {
    let source = source_checkpoint("original");
    let dir = source.dir().join("checkpoint_000000");
    std::fs::write(dir.join("w"), "tampered").unwrap();
    let err = Checkpoint::open(dir.to_str().unwrap())
        .unwrap()
        .verify()
        .unwrap_err();
    assert!(matches!(err, Error::Verification { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("w holds 8 bytes, the manifest says 8")
            || err.to_string().contains("SHA-256"),
        "{err}"
    );

    let (builder, storage, lines) = scripted(1, json!([{"print_checkpoint": true}]));
    let run = finish(
        builder.resume_from_checkpoint(dir.display().to_string()),
        storage,
        lines,
    );
    let e = run
        .result
        .error
        .clone()
        .expect("restoring a corrupted checkpoint fails the run");
    assert_eq!(e.kind, FailureKind::Restore);
    assert!(e.message.contains("failed verification"), "{e}");
    assert!(
        run.stdout(0).is_empty(),
        "the guest must not see a corrupted checkpoint"
    );
}

#[test]
fn resume_from_something_that_is_not_a_committed_checkpoint_is_refused_before_starting() {
    let empty = tempfile::tempdir().unwrap();
    let (builder, _storage, _lines) = scripted(1, json!([]));
    let err = builder
        .resume_from_checkpoint(empty.path().display().to_string())
        .build()
        .unwrap()
        .fit()
        .unwrap_err();
    assert!(matches!(err, Error::NotACheckpoint { .. }), "{err}");
    assert!(
        err.to_string().contains("no .trainhost/manifest.json"),
        "{err}"
    );
}

#[test]
fn a_directory_without_manifest_is_not_a_checkpoint() {
    let source = source_checkpoint("x");
    let partial = source.dir().join("checkpoint_000007");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("w"), "half uploaded").unwrap();
    let listed = trainhost::committed_checkpoints(source.dir().to_str().unwrap()).unwrap();
    let indexes: Vec<u64> = listed.iter().map(Checkpoint::index).collect();
    assert_eq!(indexes, [0]);
}

#[test]
fn running_again_under_the_same_name_continues_numbering_and_restores_the_latest() {
    let first = run(
        1,
        json!([
            {"write": "ckpt/w", "text": "epoch 0"},
            {"report": {"epoch": 0}, "checkpoint": "ckpt"},
        ]),
    );
    first.assert_ok();
    let storage = first.storage.path().display().to_string();
    let lines = std::sync::Arc::new(Lines::default());
    let second = trainhost::Trainer::builder(TEST_GUEST)
        .train_loop_config(json!({"steps": [
            {"write": "ckpt/w", "text": "epoch 0"},
            {"report": {"epoch": 0}, "checkpoint": "ckpt"},
        ]}))
        .run_config(trainhost::RunConfig {
            name: Some("t".into()),
            storage_path: storage.clone(),
            ..Default::default()
        })
        .output(lines)
        .build()
        .unwrap()
        .fit()
        .unwrap();
    assert!(second.error.is_none());
    assert_eq!(
        checkpoint_dirs(&first.dir()),
        ["checkpoint_000000", "checkpoint_000001"]
    );
    let indexes: Vec<u64> = second
        .metrics_history
        .iter()
        .map(|r| r.report_index)
        .collect();
    assert_eq!(indexes, [0, 1]);

    // A different config under the same name is refused.
    let err = trainhost::Trainer::builder(TEST_GUEST)
        .train_loop_config(json!({"steps": []}))
        .run_config(trainhost::RunConfig {
            name: Some("t".into()),
            storage_path: storage,
            ..Default::default()
        })
        .build()
        .unwrap()
        .fit()
        .unwrap_err();
    assert!(matches!(err, Error::RunConflict { .. }), "{err}");
    assert!(err.to_string().contains("different config"), "{err}");
}
