//! Nothing is left behind on the machine: the working directories of hosts
//! killed with SIGKILL (scratch, snapshots, restored checkpoints) are
//! removed by the next run, never those of a live run.

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::util::*;

/// A test directory, and a temporary directory inside it for the hosts
/// the test starts (their `TMPDIR`), so that other tests' hosts never
/// share it.
fn private_tmp() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    (dir, tmp)
}

/// Every entry of `tmp` whose name starts with `trainhost`, with what it
/// holds below it (one level).
fn trainhost_entries(tmp: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(tmp).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("trainhost") {
            continue;
        }
        match std::fs::read_dir(entry.path()) {
            Ok(inner) => {
                for e in inner {
                    out.push(format!(
                        "{name}/{}",
                        e.unwrap().file_name().to_string_lossy()
                    ));
                }
            }
            Err(_) => out.push(name),
        }
    }
    out.sort();
    out
}

#[test]
fn the_working_directories_of_killed_hosts_are_removed_by_the_next_run() {
    let (dir, tmp) = private_tmp();
    let env = [("TMPDIR", tmp.as_path())];
    let config = json!({"steps": [
        {"write": "scratch-data", "bytes": 4_000_000, "seed": 1},
        {"print": "ready"},
        {"sleep_ms": 300_000},
    ]})
    .to_string();
    for round in 0..4 {
        let name = format!("k{round}");
        let args = ["run", TEST_GUEST, "--config", &config, "--name", &name];
        let mut host = HostProcess::spawn_with_env(&args, dir.path(), &env);
        host.wait_for(|l| l.contains("ready"));
        // This run's directory, and none of the runs killed before.
        let live = trainhost_entries(&tmp);
        assert_eq!(live.len(), 1, "round {round}: {live:?}");
        host.child.kill().unwrap(); // SIGKILL: no chance to clean up
        host.child.wait().unwrap();
    }
    assert_eq!(
        trainhost_entries(&tmp).len(),
        1,
        "each start removed the leftovers of the kill before it"
    );
    let done = json!({"steps": [{"report": {}}]}).to_string();
    let host = HostProcess::spawn_with_env(
        &["run", TEST_GUEST, "--config", &done, "--name", "done"],
        dir.path(),
        &env,
    );
    let status = host.child.wait_with_output().unwrap().status;
    assert!(status.success());
    assert_eq!(trainhost_entries(&tmp), Vec::<String>::new());
}

#[test]
fn a_live_runs_working_directory_is_left_alone() {
    let (dir, tmp) = private_tmp();
    let env = [("TMPDIR", tmp.as_path())];
    // The live run keeps state in its scratch directory across a sleep,
    // then commits it.
    let live = json!({"steps": [
        {"write": "ckpt/state", "text": "kept"},
        {"print": "ready"},
        {"sleep_ms": 8000},
        {"report": {}, "checkpoint": "ckpt"},
    ]})
    .to_string();
    let host = HostProcess::spawn_with_env(
        &["run", TEST_GUEST, "--config", &live, "--name", "live"],
        dir.path(),
        &env,
    );
    host.wait_for(|l| l.contains("ready"));
    let other = json!({"steps": [{"report": {}}]}).to_string();
    let short = HostProcess::spawn_with_env(
        &["run", TEST_GUEST, "--config", &other, "--name", "other"],
        dir.path(),
        &env,
    );
    assert!(short.child.wait_with_output().unwrap().status.success());
    let out = host.child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let committed = dir
        .path()
        .join("trainhost_results/live/checkpoint_000000/state");
    assert_eq!(std::fs::read_to_string(committed).unwrap(), "kept");
}

/// A restart's ranks start in scratch directories of their own; the
/// failed attempt's are removed while the next attempt runs (not before it
/// starts, where a busy disk would delay the restart).
#[test]
fn a_failed_attempts_scratch_directories_are_removed_while_the_next_one_runs() {
    let (dir, tmp) = private_tmp();
    let env = [("TMPDIR", tmp.as_path())];
    let config = json!({"steps": [
        {"write": "scratch-data", "bytes": 4_000_000, "seed": 1, "when_attempt": [0]},
        {"write": "ckpt/attempt", "text": "{next_attempt}", "when_attempt": [0]},
        {"report": {}, "checkpoint": "ckpt", "when_attempt": [0]},
        {"panic": "planned failure", "when_attempt": [0]},
        {"print": "ready"},
        {"sleep_ms": 300_000},
    ]})
    .to_string();
    let args = [
        "run",
        TEST_GUEST,
        "--config",
        &config,
        "--name",
        "r",
        "--max-failures",
        "1",
    ];
    let mut host = HostProcess::spawn_with_env(&args, dir.path(), &env);
    host.wait_for(|l| l.contains("ready"));
    let live = trainhost_entries(&tmp);
    assert_eq!(live.len(), 1, "{live:?}");
    let work = tmp.join(&live[0]);
    let attempts = || names_starting_with(&work, "attempt-");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while attempts() != ["attempt-1"] {
        assert!(
            std::time::Instant::now() < deadline,
            "the failed attempt's scratch directories are still there: {:?}",
            attempts()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(work.join("attempt-1/rank-0").is_dir());
    host.child.kill().unwrap();
    host.child.wait().unwrap();
}
