//! Every way out of the sandbox through `report` is refused with an error
//! the guest sees, and nothing is persisted (R2, R5).

use serde_json::{Value, json};

use crate::util::*;

/// Run `setup` then report `path` on one rank; return what the guest was
/// told, after checking that nothing was committed.
fn refused(setup: Value, path: &str) -> String {
    let mut steps = setup.as_array().unwrap().clone();
    steps.push(json!({"report": {"loss": 1}, "checkpoint": path}));
    let run = run(1, Value::Array(steps));
    run.assert_ok();
    assert!(
        checkpoint_dirs(&run.dir()).is_empty(),
        "{path}: something was committed"
    );
    assert!(
        run.result.metrics_history.is_empty(),
        "{path}: the refused call counted as a report"
    );
    let out = run.stdout(0);
    assert_eq!(out.len(), 1, "{out:?}");
    assert!(
        out[0].starts_with("report refused: checkpoint refused:"),
        "{path}: {out:?}"
    );
    out[0].clone()
}

#[test]
fn dot_dot_is_refused() {
    let setup = json!([{"write": "ckpt/f", "text": "x"}]);
    assert!(refused(setup.clone(), "../ckpt").contains("'..'"));
    assert!(refused(setup.clone(), "/scratch/../scratch/ckpt").contains("'..'"));
    assert!(refused(setup, "ckpt/../../etc").contains("'..'"));
}

#[test]
fn absolute_paths_outside_the_preopens_are_refused() {
    for path in ["/etc", "/", "/tmp", "/scratchy", "/proc/self"] {
        let msg = refused(json!([]), path);
        assert!(msg.contains("outside the sandbox"), "{path}: {msg}");
    }
}

#[test]
fn a_symlink_leading_outside_is_refused() {
    for (target, name) in [
        ("../../../../../../..", "up"),
        ("../..", "parent"),
        ("..", "one-up"),
    ] {
        let msg = refused(json!([{"symlink": name, "target": target}]), name);
        assert!(msg.contains("outside the sandbox"), "{name}: {msg}");
    }
}

#[test]
fn a_guest_cannot_even_create_a_symlink_to_an_absolute_host_path() {
    let host_dir = tempfile::tempdir().unwrap();
    let target = host_dir.path().display().to_string();
    let run = run(
        1,
        json!([
            {"symlink": "abs", "target": target},
            {"report": {}, "checkpoint": "abs"},
        ]),
    );
    run.assert_ok();
    let out = run.stdout(0);
    assert!(
        out[0].starts_with("symlink refused") && out[0].contains("not-permitted"),
        "{out:?}"
    );
    assert!(out[1].contains("does not exist"), "{out:?}");
    assert!(checkpoint_dirs(&run.dir()).is_empty());
}

#[test]
fn a_symlink_inside_the_checkpoint_directory_is_refused() {
    // Pointing inside or outside, a link in a checkpoint is refused: it
    // would restore as something else, or leak host files.
    for target in ["real", "../other", "../../.."] {
        let msg = refused(
            json!([
                {"write": "ckpt/real", "text": "x"},
                {"mkdir": "other"},
                {"symlink": "ckpt/link", "target": target},
            ]),
            "ckpt",
        );
        assert!(
            msg.contains("ckpt/link is a symbolic link"),
            "{target}: {msg}"
        );
    }
    let msg = refused(
        json!([
            {"write": "ckpt/sub/real", "text": "x"},
            {"symlink": "ckpt/sub/deep-link", "target": "real"},
        ]),
        "ckpt",
    );
    assert!(
        msg.contains("ckpt/sub/deep-link is a symbolic link"),
        "{msg}"
    );
}

#[test]
fn a_file_or_a_missing_path_is_refused() {
    let msg = refused(json!([{"write": "file", "text": "x"}]), "file");
    assert!(msg.contains("not a directory"), "{msg}");
    let msg = refused(json!([]), "missing");
    assert!(msg.contains("does not exist"), "{msg}");
    let msg = refused(json!([]), "");
    assert!(msg.contains("empty"), "{msg}");
}

#[test]
fn the_reserved_manifest_directory_is_refused() {
    let msg = refused(
        json!([{"write": "ckpt/.trainhost/manifest.json", "text": "{}"}]),
        "ckpt",
    );
    assert!(msg.contains("reserved"), "{msg}");
}

#[test]
fn the_restored_checkpoint_is_read_only_but_can_be_reported_again() {
    let first = run(
        1,
        json!([
            {"write": "ckpt/w", "text": "weights"},
            {"report": {"i": 0}, "checkpoint": "ckpt"},
            // The latest committed checkpoint is now restorable; writing
            // into it fails, reporting it again works.
            {"print_checkpoint": true},
            {"write": "/checkpoints/checkpoint_000000/w", "text": "tampered"},
        ]),
    );
    let err = first.error();
    assert!(err.contains("rank 0 returned an error"), "{err}");
    assert!(
        err.to_lowercase().contains("read-only")
            || err.contains("ermission")
            || err.contains("not permitted"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(first.dir().join("checkpoint_000000/w")).unwrap(),
        b"weights"
    );

    let again = run(
        1,
        json!([
            {"write": "ckpt/w", "text": "weights"},
            {"report": {"i": 0}, "checkpoint": "ckpt"},
            {"print_checkpoint": true},
            {"report": {"i": 1}, "checkpoint": "/checkpoints/checkpoint_000000"},
        ]),
    );
    again.assert_ok();
    assert_eq!(
        std::fs::read(again.dir().join("checkpoint_000001/w")).unwrap(),
        b"weights"
    );
}

#[test]
fn odd_but_valid_file_names_round_trip_exactly() {
    let names = [
        "a b",
        "ünïcødé",
        "x#1",
        "100%",
        "back\\slash",
        "q?x",
        "star*",
        "dots..",
        "-dash",
        "tab\there",
        "new\nline",
    ];
    let mut steps = Vec::new();
    for (i, n) in names.iter().enumerate() {
        steps.push(json!({"write": format!("ckpt/{n}"), "text": format!("file {i}")}));
    }
    steps.push(json!({"report": {}, "checkpoint": "ckpt"}));
    steps.push(json!({"print_checkpoint": true}));
    let run = run(1, Value::Array(steps));
    run.assert_ok();
    let latest = run.result.checkpoint.as_ref().unwrap();
    let mut listed: Vec<String> = latest
        .manifest()
        .files
        .iter()
        .map(|f| f.path.clone())
        .collect();
    listed.sort();
    let mut expected: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    expected.sort();
    assert_eq!(listed, expected);
    // Restored under the same names with the same bytes.
    let dest = run.storage.path().join("restored");
    latest.to_directory(&dest).unwrap();
    for (i, n) in names.iter().enumerate() {
        assert_eq!(
            std::fs::read_to_string(dest.join(n)).unwrap(),
            format!("file {i}"),
            "{n:?}"
        );
    }
    // And the guest sees them the same way after a restore.
    let out = run.stdout(0);
    assert!(
        out.iter().any(|l| l.starts_with("file: ünïcødé 6 ")),
        "{out:?}"
    );
}

#[test]
fn deep_nesting_is_refused_past_the_limit_and_fine_below_it() {
    let ok = run(
        1,
        json!([{"nest": "ckpt", "depth": 40}, {"report": {}, "checkpoint": "ckpt"}]),
    );
    ok.assert_ok();
    assert_eq!(
        files(&ok.dir().join("checkpoint_000000")),
        [format!("{}bottom", "d/".repeat(40))]
    );
    let msg = refused(json!([{"nest": "ckpt", "depth": 70}]), "ckpt");
    assert!(
        msg.contains("nested more than 64 directories deep"),
        "{msg}"
    );
}

#[test]
fn a_huge_sparse_file_is_refused_over_the_checkpoint_limit() {
    let (builder, storage, lines) = scripted(
        1,
        json!([
            {"sparse": "ckpt/huge.bin", "size": 1u64 << 40},
            {"report": {}, "checkpoint": "ckpt"},
        ]),
    );
    let builder = builder.run_config(trainhost::RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        limits: trainhost::ResourceLimits {
            max_checkpoint_bytes: Some(1 << 30),
            ..Default::default()
        },
        ..Default::default()
    });
    let run = finish(builder, storage, lines);
    run.assert_ok();
    let out = run.stdout(0);
    assert!(
        out[0].contains("ckpt holds 1 TiB in 1 files, over the checkpoint limit of 1 GiB"),
        "{out:?}"
    );
    assert!(checkpoint_dirs(&run.dir()).is_empty());
}

#[test]
fn a_hundred_thousand_tiny_files_make_a_correct_checkpoint() {
    let run = run(
        1,
        json!([
            {"many": "ckpt", "count": 100_000},
            {"report": {}, "checkpoint": "ckpt"},
        ]),
    );
    run.assert_ok();
    let latest = run.result.checkpoint.as_ref().unwrap();
    assert_eq!(latest.manifest().files.len(), 100_000);
    let dir = run.dir().join("checkpoint_000000");
    assert_eq!(
        std::fs::read_to_string(dir.join("042/f99942")).unwrap(),
        "99942"
    );
    latest.verify().unwrap();
}

#[test]
fn huge_metric_maps_and_names_are_refused_and_non_finite_values_kept() {
    let many: serde_json::Map<String, Value> =
        (0..2000).map(|i| (format!("m{i}"), json!(i))).collect();
    let run = run(
        1,
        json!([
            {"report": many},
            {"report": {"x".repeat(300): 1}},
            {"report": {"loss": "NaN", "gain": "inf"}},
        ]),
    );
    run.assert_ok();
    let out = run.stdout(0);
    assert!(out[0].contains("at most 1024 metrics"), "{out:?}");
    assert!(out[1].contains("names may be at most 256 bytes"), "{out:?}");
    assert_eq!(out[2], "report ok");
    let stored = std::fs::read_to_string(run.dir().join("metrics.jsonl")).unwrap();
    assert!(
        stored.contains(r#""loss":{"float":"NaN"}"#)
            && stored.contains(r#""gain":{"float":"inf"}"#),
        "{stored}"
    );
}

#[test]
fn a_restored_file_cannot_be_hard_linked_into_the_writable_scratch() {
    let run = run(
        1,
        json!([
            {"write": "ckpt/w", "text": "restored bytes"},
            {"report": {}, "checkpoint": "ckpt"},
            {"print_checkpoint": true},
            {"hardlink": "stolen", "target": "/checkpoints/checkpoint_000000/w"},
            {"write": "mine", "text": "x"},
            {"hardlink": "ckpt/also-mine", "target": "mine"},
        ]),
    );
    run.assert_ok();
    let out = run.stdout(0);
    assert!(
        out.iter().any(|l| l.starts_with("hardlink refused")),
        "{out:?}"
    );
    assert_eq!(
        out.last().unwrap(),
        "hardlink made",
        "links inside the scratch directory are fine"
    );
}

/// The restore directory itself is no checkpoint (before a restore it is
/// empty, and a report of it committed an empty checkpoint).
#[test]
fn the_restore_directory_itself_is_refused() {
    for path in ["/checkpoints", "/checkpoints/"] {
        let msg = refused(json!([]), path);
        assert!(
            msg.contains("where restored checkpoints appear"),
            "{path}: {msg}"
        );
    }
}
