//! A trainhost started as one of several processes (by `mpiexec` or
//! `srun`) refuses to run instead of training the run once per process.
//!
//! The `mpiexec` test runs MPICH's real launcher. Where `mpiexec` is not
//! installed it is skipped, saying so, unless `TRAINHOST_REQUIRE_MPI=1`
//! (CI), which makes it a failure.

use std::path::Path;
use std::process::{Command, Output};

use crate::util::*;

const REQUIRE: &str = "TRAINHOST_REQUIRE_MPI";

fn run(launcher: Option<&str>, env: &[(&str, &str)], storage: &Path) -> Output {
    let exe = env!("CARGO_BIN_EXE_trainhost");
    let args = [
        "run",
        TEST_GUEST,
        "--workers",
        "1",
        "--config",
        r#"{"steps": [{"report": {"step": 0}}]}"#,
        "--storage",
        storage.to_str().unwrap(),
    ];
    let mut command = match launcher {
        Some(launcher) => {
            let mut c = Command::new(launcher);
            c.args(["-n", "2", exe]).args(args);
            c
        }
        None => {
            let mut c = Command::new(exe);
            c.args(args);
            c
        }
    };
    command
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn assert_refused(out: &Output, storage: &Path, expected: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    for text in expected {
        assert!(stderr.contains(text), "{text:?} missing from: {stderr}");
    }
    assert!(
        stderr.contains("start trainhost once, not under"),
        "{stderr}"
    );
    // Nothing of a run was written.
    assert_eq!(std::fs::read_dir(storage).unwrap().count(), 0);
}

#[test]
fn every_process_mpiexec_started_refuses_to_run() {
    let found = Command::new("mpiexec").arg("--version").output();
    if found.is_err() {
        assert!(
            std::env::var(REQUIRE).as_deref() != Ok("1"),
            "mpiexec is not installed and {REQUIRE}=1: install MPICH (apt-get install mpich)"
        );
        eprintln!("skipped: mpiexec is not installed (install MPICH: apt-get install mpich)");
        return;
    }
    let storage = tempfile::tempdir().unwrap();
    let out = run(Some("mpiexec"), &[], storage.path());
    assert_refused(
        &out,
        storage.path(),
        &[
            "process 0 of 2 started by mpiexec",
            "process 1 of 2 started by mpiexec",
        ],
    );
}

#[test]
fn a_task_of_an_srun_step_refuses_to_run_but_a_batch_script_runs() {
    let storage = tempfile::tempdir().unwrap();
    let step = [("SLURM_STEP_NUM_TASKS", "4"), ("SLURM_PROCID", "3")];
    let out = run(None, &step, storage.path());
    assert_refused(&out, storage.path(), &["process 3 of 4 started by srun"]);

    // The batch script itself is one process, whatever the allocation.
    let batch = [("SLURM_NTASKS", "4"), ("SLURM_PROCID", "0")];
    let out = run(None, &batch, storage.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
