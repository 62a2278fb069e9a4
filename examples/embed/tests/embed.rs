//! The embedding example runs the real example guest end to end.

use std::process::Command;

#[test]
fn embeds_runs_and_restores() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_embed"))
        .args([
            trainhost_test_artifacts::LINEAR_REGRESSION,
            "runs",
            "restored",
        ])
        .current_dir(tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("guest[0:out] epoch 0: loss"), "{stdout}");
    assert!(stdout.contains("4 reports"), "{stdout}");
    // checkpoint_freq 2 over 4 epochs: epochs 0, 2 and the last, 3; newest first.
    let order: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("checkpoint "))
        .collect();
    assert_eq!(order.len(), 3, "{stdout}");
    assert!(order[0].starts_with("checkpoint 2 epoch=3"), "{stdout}");
    assert!(
        stdout.contains(
            "restored checkpoint 2 into restored: meta.json model.safetensors optimizer.safetensors"
        ),
        "{stdout}"
    );
    assert!(tmp.path().join("restored/model.safetensors").exists());
}
