//! How reported checkpoints reach storage: in the background or before
//! `report` returns, and without sending unchanged files twice.

use std::os::unix::fs::MetadataExt;

use serde_json::json;
use trainhost::{Checkpoint, RunConfig};

use crate::util::*;

/// Report a checkpoint, then at once rewrite one file in place, delete one
/// and add one, and report again: each checkpoint holds exactly what its
/// report saw (R8), whether the upload runs in the background or not.
#[test]
fn the_guest_may_change_its_directory_as_soon_as_report_returns() {
    for background in [true, false] {
        let steps = json!([
            {"write": "ck/a", "text": "first"},
            {"write": "ck/b", "bytes": 3_000_000, "seed": 1},
            {"report": {"epoch": 0}, "checkpoint": "ck"},
            // In place: same inode, truncated and rewritten.
            {"write": "ck/a", "text": "second"},
            {"remove": "ck/b"},
            {"write": "ck/c", "text": "new"},
            {"report": {"epoch": 1}, "checkpoint": "ck"},
            {"remove": "ck"},
            {"report": {"epoch": 2}},
        ]);
        let run = run_persisting(2, steps, background);
        run.assert_ok();
        let dir = run.dir();
        let read = |p: &str| std::fs::read(dir.join(p)).unwrap();
        assert_eq!(
            read("checkpoint_000000/a"),
            b"first",
            "background={background}"
        );
        assert_eq!(read("checkpoint_000000/b"), pseudo_random(3_000_000, 1));
        assert!(!dir.join("checkpoint_000000/c").exists());
        assert_eq!(read("checkpoint_000001/a"), b"second");
        assert_eq!(read("checkpoint_000001/c"), b"new");
        assert!(!dir.join("checkpoint_000001/b").exists());
        for c in ["checkpoint_000000", "checkpoint_000001"] {
            Checkpoint::open(dir.join(c).to_str().unwrap())
                .unwrap()
                .verify()
                .unwrap();
        }
        let history: Vec<_> = run
            .result
            .metrics_history
            .iter()
            .map(|r| (r.report_index, r.checkpoint))
            .collect();
        assert_eq!(history, [(0, Some(0)), (1, Some(1)), (2, None)]);
        let stored = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        assert_eq!(stored.lines().count(), 3, "every report is in storage");
    }
}

/// The background mode takes the files without copying them (hard links
/// lent to the host, `persist::lend`): whatever way the guest writes them
/// afterwards (in place, appending, truncating, through a handle it held
/// open across `report`, through another hard link of its own), the
/// checkpoint holds what `report` saw (R8), and the guest sees its writes.
#[test]
fn a_checkpoint_keeps_its_bytes_however_the_guest_writes_them_after_report() {
    for background in [true, false] {
        let steps = json!([
            {"write": "ck/a", "text": "first-a"},
            {"write": "ck/b", "text": "first-b"},
            {"write": "ck/c", "text": "first-c"},
            {"write": "ck/d", "text": "first-d"},
            {"write": "ck/sub/n", "text": "first-n"},
            {"write": "ck/big", "bytes": 3_000_000, "seed": 7},
            {"hold": "ck/e"},
            {"write_held": "ck/e", "text": "e1"},
            {"report": {"epoch": 0}, "checkpoint": "ck"},
            {"patch": "ck/a", "text": "XX"},
            {"append": "ck/b", "text": "+more"},
            {"write": "ck/c", "text": "second"},
            {"write_held": "ck/e", "text": "e2"},
            {"hardlink": "other", "target": "ck/d"},
            {"patch": "other", "text": "ZZ"},
            {"patch": "ck/big", "text": "overwritten"},
            {"patch": "ck/sub/n", "text": "YY"},
            {"report": {"epoch": 1}, "checkpoint": "ck"},
            {"release": "ck/e"},
        ]);
        let run = run_persisting(1, steps, background);
        run.assert_ok();
        assert!(run.stdout(0).iter().any(|l| l == "hardlink made"));
        let dir = run.dir();
        let read =
            |p: &str| String::from_utf8_lossy(&std::fs::read(dir.join(p)).unwrap()).into_owned();
        let first = [
            ("a", "first-a"),
            ("b", "first-b"),
            ("c", "first-c"),
            ("d", "first-d"),
            ("e", "e1"),
            ("sub/n", "first-n"),
        ];
        for (name, want) in first {
            assert_eq!(
                read(&format!("checkpoint_000000/{name}")),
                want,
                "{name}, background={background}"
            );
        }
        assert_eq!(
            std::fs::read(dir.join("checkpoint_000000/big")).unwrap(),
            pseudo_random(3_000_000, 7)
        );
        let second = [
            ("a", "XXrst-a"),
            ("b", "first-b+more"),
            ("c", "second"),
            ("e", "e1e2"),
            ("sub/n", "YYrst-n"),
        ];
        for (name, want) in second {
            assert_eq!(
                read(&format!("checkpoint_000001/{name}")),
                want,
                "{name}, background={background}"
            );
        }
        assert!(read("checkpoint_000001/big").starts_with("overwritten"));
        for c in ["checkpoint_000000", "checkpoint_000001"] {
            Checkpoint::open(dir.join(c).to_str().unwrap())
                .unwrap()
                .verify()
                .unwrap();
        }
    }
}

/// The default `report` returns before the checkpoint's files are linked
/// into the host's snapshot (`persist::lend`): a guest that at once
/// writes one in place, renames, deletes and rewrites them, while the host is still linking
/// hundreds of them, waits for the links, and the checkpoint holds every
/// file as `report` saw it (R8).
#[test]
fn a_checkpoint_is_whole_however_soon_the_guest_changes_its_files() {
    let steps = json!([
        {"many": "ck", "count": 3000},
        {"write": "ck/zz/last", "text": "first-last"},
        {"write": "ck/zz/moved", "text": "first-moved"},
        {"write": "ck/zz/patched", "text": "first-patched"},
        {"report": {"epoch": 0}, "checkpoint": "ck"},
        {"patch": "ck/zz/patched", "text": "XX"},
        {"rename": "ck/zz/moved", "to": "ck/zz/last"},
        {"remove": "ck"},
        {"write": "ck/zz/last", "text": "second"},
        {"report": {"epoch": 1}, "checkpoint": "ck"},
    ]);
    let run = run_persisting(1, steps, true);
    run.assert_ok();
    let dir = run.dir();
    let first = dir.join("checkpoint_000000");
    let read = |p: &str| std::fs::read_to_string(first.join(p)).unwrap();
    assert_eq!(read("zz/last"), "first-last");
    assert_eq!(read("zz/moved"), "first-moved");
    assert_eq!(read("zz/patched"), "first-patched");
    for i in [0, 1234, 2999] {
        assert_eq!(read(&format!("{:03}/f{i}", i % 100)), i.to_string());
    }
    let listed = Checkpoint::open(first.to_str().unwrap()).unwrap();
    assert_eq!(listed.manifest().files.len(), 3003);
    listed.verify().unwrap();
    let second = dir.join("checkpoint_000001");
    assert_eq!(
        std::fs::read_to_string(second.join("zz/last")).unwrap(),
        "second"
    );
    assert!(!second.join("000").exists());
}

/// Many reports without a checkpoint in a row: every one is recorded, in
/// order, although the history file is written fewer times.
#[test]
fn a_burst_of_reports_is_recorded_in_order() {
    let steps: Vec<_> = (0..2000).map(|i| json!({"report": {"i": i}})).collect();
    let run = run(2, json!(steps));
    run.assert_ok();
    let indices: Vec<u64> = stored_history(&run.dir()).iter().map(|l| l.0).collect();
    assert_eq!(indices, (0..2000).collect::<Vec<_>>());
}

/// Reports without a checkpoint go straight into the history unless a
/// report before them is still being written; mixing both keeps the order,
/// and each checkpoint's line names it.
#[test]
fn reports_with_and_without_checkpoints_keep_their_order() {
    let mut steps = Vec::new();
    for i in 0..600 {
        if i % 50 == 7 {
            steps.push(json!({"write": "ck/i", "text": i.to_string()}));
            steps.push(json!({"report": {"i": i}, "checkpoint": "ck"}));
        } else {
            steps.push(json!({"report": {"i": i}}));
        }
    }
    let run = run(2, json!(steps));
    run.assert_ok();
    let lines = stored_history(&run.dir());
    let expected: Vec<(u64, Option<u64>)> = (0..600)
        .map(|i| (i, (i % 50 == 7).then_some(i / 50)))
        .collect();
    assert_eq!(lines, expected);
}

/// A file unchanged since the previous checkpoint is linked there on local
/// storage instead of written again; changed files are written. Retention
/// deleting the older checkpoint leaves the newer one whole.
#[test]
fn unchanged_files_are_linked_to_the_previous_checkpoint() {
    let steps = json!([
        {"write": "ck/frozen.bin", "bytes": 2_000_000, "seed": 7},
        {"write": "ck/same-size.bin", "bytes": 1000, "seed": 1},
        {"write": "ck/step", "text": "0"},
        {"report": {"epoch": 0}, "checkpoint": "ck"},
        // Same size, other bytes: must not be taken for the old one.
        {"write": "ck/same-size.bin", "bytes": 1000, "seed": 2},
        {"write": "ck/step", "text": "1"},
        // An unchanged file under a new name is shared as well.
        {"write": "ck/renamed.bin", "bytes": 2_000_000, "seed": 7},
        {"report": {"epoch": 1}, "checkpoint": "ck"},
    ]);
    let (builder, storage, lines) = scripted(1, steps);
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        checkpoint_config: trainhost::CheckpointConfig {
            num_to_keep: Some(1),
            ..Default::default()
        },
        ..RunConfig::default()
    });
    // Keep the first checkpoint's inodes: retention deletes it at the end.
    let run = finish(builder, storage, lines);
    run.assert_ok();
    let dir = run.dir();
    assert_eq!(checkpoint_dirs(&dir), ["checkpoint_000001"]);
    let meta = |p: &str| std::fs::metadata(dir.join("checkpoint_000001").join(p)).unwrap();
    // Linked, then the first checkpoint's link was deleted by retention.
    assert_eq!(
        meta("frozen.bin").nlink(),
        2,
        "frozen.bin and renamed.bin share one file"
    );
    assert_eq!(meta("frozen.bin").ino(), meta("renamed.bin").ino());
    assert_eq!(meta("same-size.bin").nlink(), 1);
    let checkpoint = Checkpoint::open(dir.join("checkpoint_000001").to_str().unwrap()).unwrap();
    checkpoint.verify().unwrap();
    assert_eq!(
        std::fs::read(dir.join("checkpoint_000001/same-size.bin")).unwrap(),
        pseudo_random(1000, 2)
    );
}
