//! A short campaign, as CI runs it: a real host process killed with
//! SIGKILL ten times, while the guest also fails every 5 epochs and the
//! run restarts, so that kills land in restarts too.

#[test]
fn ten_kills_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_crash-campaign"))
        .args([
            "run",
            "--guest",
            trainhost_test_artifacts::LINEAR_REGRESSION,
            "--kills",
            "10",
            "--epochs",
            "150",
            "--fail-every",
            "5",
        ])
        .arg("--dir")
        .arg(dir.path().join("store"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("campaign passed: 10 kills over"),
        "{stdout}"
    );
    assert!(stdout.contains("the complete runs restarted"), "{stdout}");
}
