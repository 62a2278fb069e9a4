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
