//! Runs over several hosts: one trainhost per node under a real `mpiexec`
//! (MPICH), the nodes on loopback, oversubscribed on this machine's cores.
//! Built only with the `mpi` feature (`scripts/test.sh` runs them so).
//!
//! Without `mpiexec` the tests are skipped, saying so, unless
//! `TRAINHOST_REQUIRE_MPI=1` (CI).

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{Value, json};

use crate::util::*;
use std::time::Duration;
use trainhost_test_artifacts::DIGITS_MLP;

mod rounds;

/// Seconds after which MPICH's mpiexec ends a job of these tests: a node
/// that waits forever (a protocol bug) fails its test instead of hanging
/// the test run.
const MPIEXEC_TIMEOUT: &str = "300";

/// Whether `mpiexec` can be run (else the test is skipped, or fails in CI).
pub(super) fn have_mpiexec() -> bool {
    if Command::new("mpiexec").arg("--version").output().is_ok() {
        return true;
    }
    assert!(
        std::env::var("TRAINHOST_REQUIRE_MPI").as_deref() != Ok("1"),
        "mpiexec is not installed and TRAINHOST_REQUIRE_MPI=1: install MPICH (apt-get install mpich)"
    );
    eprintln!("skipped: mpiexec is not installed (install MPICH: apt-get install mpich)");
    false
}

/// `RUST_LOG` for runs whose test reads trainhost's debug lines.
const DEBUG: &str = "warn,trainhost=debug";

/// What a node logs (at debug) when it sends its failure to the others.
const TOLD: &str = "telling the other nodes this node's failure";

/// `mpiexec` with `sections`, each `(processes, trainhost run arguments)`
/// (several sections give nodes different arguments), in `dir`.
pub(super) fn mpiexec(sections: &[(u32, Vec<String>)], dir: &Path) -> (bool, String, String) {
    mpiexec_logging(sections, dir, "warn")
}

/// [`mpiexec`], logging what `log` (`RUST_LOG`) lets through.
fn mpiexec_logging(
    sections: &[(u32, Vec<String>)],
    dir: &Path,
    log: &str,
) -> (bool, String, String) {
    let mut command = Command::new("mpiexec");
    for (i, (n, args)) in sections.iter().enumerate() {
        if i > 0 {
            command.arg(":");
        }
        command
            .args(["-n", &n.to_string()])
            .arg(env!("CARGO_BIN_EXE_trainhost"))
            .arg("run")
            .args(args);
    }
    let out: Output = command
        .current_dir(dir)
        .env("RUST_LOG", log)
        .env("TRAINHOST_CACHE_DIR", dir.join("compile-cache"))
        .env("MPIEXEC_TIMEOUT", MPIEXEC_TIMEOUT)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `trainhost run` arguments for the scripted test guest.
pub(super) fn scripted_args(workers: u32, steps: Value, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        TEST_GUEST,
        "--workers",
        &workers.to_string(),
        "--config",
        &json!({ "steps": steps }).to_string(),
        "--storage",
        "st",
        "--name",
        "t",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args
}

/// Lines a rank printed, from mpiexec's merged output.
pub(super) fn rank_lines(stdout: &str, rank: u32) -> Vec<&str> {
    let prefix = format!("[rank {rank}] ");
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .collect()
}

#[test]
fn every_rank_knows_its_place_over_two_nodes() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let args = scripted_args(
        4,
        json!([{"print_context": true}, {"report": {"i": 1}}]),
        &[],
    );
    let (ok, stdout, stderr) = mpiexec(&[(2, args)], dir.path());
    assert!(ok, "{stdout}\n{stderr}");
    for rank in 0..4 {
        let want = format!(
            "context: rank={rank} size=4 local_rank={} local_size=2 node={} run=t",
            rank % 2,
            rank / 2
        );
        assert!(
            rank_lines(&stdout, rank)
                .iter()
                .any(|l| l.starts_with(&want)),
            "{want}\n{stdout}"
        );
    }
    assert!(
        stderr.contains("1 reports, 0 checkpoints retained"),
        "{stderr}"
    );
    assert!(
        stderr.contains("node 1 of 2: its ranks are done"),
        "{stderr}"
    );
}

#[test]
fn nodes_on_one_host_split_its_cores() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let args = scripted_args(2, json!([{"report": {"i": 1}}]), &[]);
    let (ok, stdout, stderr) = mpiexec_logging(&[(2, args)], dir.path(), "info");
    assert!(ok, "{stdout}\n{stderr}");
    // As the test's process counts them: the same affinity and quota.
    let host = std::thread::available_parallelism().map_or(1, usize::from);
    let want = format!(
        "host_processes=2 cores={} host_cores={host}",
        (host / 2).max(1)
    );
    let shared = stderr
        .lines()
        .filter(|l| l.contains("share its cores") && l.contains(&want))
        .count();
    assert_eq!(shared, 2, "each node says so once: {want}\n{stderr}");
}

#[test]
fn a_trap_on_one_node_restarts_every_node_from_the_checkpoint() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let steps = json!([
        {"write": "ck/attempt", "text": "{next_attempt}", "ranks": [0]},
        {"report": {"attempt": "{attempt}"}, "checkpoint": "ck", "ranks": [0]},
        {"report": {"attempt": "{attempt}"}, "ranks": [1, 2, 3]},
        {"panic": "rank 3 breaks", "ranks": [3], "when_attempt": [0]},
        {"all_reduce": "s64", "len": 10, "op": "sum"},
        {"print": "done in attempt {attempt}"},
    ]);
    let args = scripted_args(4, steps, &["--max-failures", "1"]);
    let (ok, stdout, stderr) = mpiexec_logging(&[(2, args)], dir.path(), DEBUG);
    assert!(ok, "{stdout}\n{stderr}");
    // Node 1's trap reaches node 0 as its failure.
    assert!(stderr.contains(TOLD), "{stderr}");
    // Attempt 1 restored the checkpoint node 0 committed, on every node.
    let sum = crate::collective::expected(4, "s64", "sum", 10);
    for rank in 0..4 {
        let lines = rank_lines(&stdout, rank);
        assert!(
            lines.contains(&"done in attempt 1"),
            "rank {rank}\n{stdout}"
        );
        assert!(lines.contains(&sum.as_str()), "rank {rank}\n{stdout}");
    }
    assert!(stderr.contains("failures: 1"), "{stderr}");
    assert!(stderr.contains("rank 3 trapped"), "{stderr}");
}

/// Every rank writes its own shard, a file every rank writes alike, and
/// the attempt number; all report them; rank 3 (node 1) traps after the
/// first report. The next attempt prints what it restored.
fn sharded_steps() -> Value {
    json!([
        {"write": "ck/shard-{rank}.txt", "text": "shard of rank {rank}"},
        {"write": "ck/common.txt", "text": "the same on every rank"},
        {"write": "ck/attempt", "text": "{next_attempt}"},
        {"report": {"attempt": "{attempt}"}, "checkpoint": "ck"},
        {"panic": "rank 3 breaks", "ranks": [3], "when_attempt": [0]},
        {"print_checkpoint": true},
    ])
}

/// Every rank of the second attempt restored every node's files.
fn assert_restored_everywhere(stdout: &str) {
    for rank in 0..4 {
        let lines = rank_lines(stdout, rank);
        for shard in 0..4 {
            let name = format!("file: shard-{shard}.txt 15 ");
            assert!(
                lines.iter().any(|l| l.starts_with(&name)),
                "rank {rank} did not restore shard {shard}\n{stdout}"
            );
        }
        assert!(
            lines.iter().any(|l| l.starts_with("file: common.txt ")),
            "rank {rank}\n{stdout}"
        );
    }
}

#[test]
fn a_checkpoint_holds_every_nodes_files_in_one_manifest() {
    if !have_mpiexec() {
        return;
    }
    for mode in [&[][..], &["--wait-for-upload"][..]] {
        let dir = tempfile::tempdir().unwrap();
        let mut extra = vec!["--max-failures", "1"];
        extra.extend(mode);
        let args = scripted_args(4, sharded_steps(), &extra);
        let (ok, stdout, stderr) = mpiexec(&[(2, args)], dir.path());
        assert!(ok, "{mode:?}\n{stdout}\n{stderr}");
        assert_restored_everywhere(&stdout);
        let manifest: Value = serde_json::from_slice(
            &std::fs::read(
                dir.path()
                    .join("st/t/checkpoint_000000/.trainhost/manifest.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let files: Vec<(String, Value)> = manifest["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| (f["path"].as_str().unwrap().to_owned(), f["ranks"].clone()))
            .collect();
        let all = json!([0, 1, 2, 3]);
        let want: Vec<(String, Value)> = [
            ("attempt".to_owned(), all.clone()),
            ("common.txt".to_owned(), all.clone()),
        ]
        .into_iter()
        .chain((0..4).map(|r| (format!("shard-{r}.txt"), json!([r]))))
        .collect();
        assert_eq!(files, want, "{mode:?}");
        assert_eq!(manifest["ranks"], all, "{mode:?}");
        assert_eq!(manifest["world_size"], 4, "{mode:?}");
    }
}

#[test]
fn a_checkpoint_over_nodes_commits_on_s3() {
    if !have_mpiexec() {
        return;
    }
    let Some(moto) = crate::servers::moto() else {
        return;
    };
    let backend = crate::servers::s3(moto.port, moto.port, "nodes");
    let dir = tempfile::tempdir().unwrap();
    let mut args = scripted_args(4, sharded_steps(), &["--max-failures", "1"]);
    let at = args.iter().position(|a| a == "st").unwrap();
    args[at] = backend.url.clone();
    for (key, value) in &backend.options.options {
        args.extend(["--storage-option".to_owned(), format!("{key}={value}")]);
    }
    let (ok, stdout, stderr) = mpiexec(&[(2, args)], dir.path());
    assert!(ok, "{stdout}\n{stderr}");
    assert_restored_everywhere(&stdout);
}

#[test]
fn files_that_differ_across_nodes_are_refused_naming_the_ranks() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let steps = json!([
        // Same size on both nodes, different bytes: digests tell.
        {"write": "ck/model.bin", "text": "weights A", "ranks": [0, 1]},
        {"write": "ck/model.bin", "text": "weights B", "ranks": [2, 3]},
        {"report": {"i": 0}, "checkpoint": "ck"},
        // Different sizes: the lists tell.
        {"write": "ck/model.bin", "text": "longer weights", "ranks": [2, 3]},
        {"report": {"i": 1}, "checkpoint": "ck"},
        // Ranks of node 1 disagree: node 1 tells.
        {"write": "ck/model.bin", "text": "weights A", "ranks": [3]},
        {"report": {"i": 2}, "checkpoint": "ck"},
    ]);
    let (ok, stdout, stderr) = mpiexec(&[(2, scripted_args(4, steps, &[]))], dir.path());
    assert!(ok, "{stdout}\n{stderr}");
    for rank in 0..4 {
        let refused: Vec<&str> = rank_lines(&stdout, rank)
            .into_iter()
            .filter(|l| l.contains("report refused"))
            .collect();
        assert_eq!(refused.len(), 3, "rank {rank}\n{stdout}");
        assert!(
            refused[0].contains("\"model.bin\" differs between ranks")
                && refused[0].contains("ranks [0, 1] wrote sha256")
                && refused[0].contains("ranks [2, 3] wrote sha256"),
            "{}",
            refused[0]
        );
        assert!(
            refused[1].contains("ranks [0, 1] wrote 9 bytes")
                && refused[1].contains("ranks [2, 3] wrote 14 bytes"),
            "{}",
            refused[1]
        );
        assert!(
            refused[2].contains("ranks [2] wrote 14 bytes, ranks [3] wrote 9 bytes"),
            "{}",
            refused[2]
        );
    }
    assert!(
        !dir.path()
            .join("st/t/checkpoint_000000/.trainhost")
            .exists(),
        "nothing committed"
    );
}

#[test]
fn nodes_given_different_settings_refuse_to_start() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let steps = json!([{"report": {"i": 0}}]);
    let node0 = scripted_args(2, steps.clone(), &[]);
    let node1 = scripted_args(2, json!([{"report": {"i": 1}}]), &["--max-failures", "3"]);
    let (ok, stdout, stderr) = mpiexec(&[(1, node0), (1, node1)], dir.path());
    assert!(!ok, "{stdout}\n{stderr}");
    for what in ["node 1's config differs", "node 1's run settings differ"] {
        assert_eq!(stderr.matches(what).count(), 2, "{what}: {stderr}");
    }
    assert!(!dir.path().join("st/t").exists(), "nothing started");
}

#[test]
fn storage_that_is_not_shared_refuses_to_start() {
    if !have_mpiexec() {
        return;
    }
    // The same relative --storage, but each node in its own directory.
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let args = scripted_args(2, json!([{"report": {"i": 0}}]), &[]);
    let mut command = Command::new("mpiexec");
    for (i, wdir) in [&a, &b].iter().enumerate() {
        if i > 0 {
            command.arg(":");
        }
        command
            .args(["-n", "1", "-wdir"])
            .arg(wdir)
            .arg(env!("CARGO_BIN_EXE_trainhost"))
            .arg("run")
            .args(&args);
    }
    let out = command
        .env("TRAINHOST_CACHE_DIR", dir.path().join("compile-cache"))
        .env("MPIEXEC_TIMEOUT", MPIEXEC_TIMEOUT)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_eq!(
        stderr
            .matches("is not shared by every node: node 1 finds nothing at")
            .count(),
        2,
        "{stderr}"
    );
}

#[test]
fn the_digits_example_trains_over_two_nodes_as_on_one() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = |sections: &[(u32, Vec<String>)]| {
        let (ok, stdout, stderr) = mpiexec(sections, dir.path());
        assert!(ok, "{stdout}\n{stderr}");
        let json: Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("result.json")).unwrap())
                .unwrap();
        json["metrics"]["val_accuracy"].as_f64().unwrap()
    };
    let args = |name: &str| -> Vec<String> {
        [
            DIGITS_MLP,
            "--workers",
            "4",
            "--storage",
            "st",
            "--name",
            name,
            "--result-json",
            "result.json",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    };
    let two_nodes = run(&[(2, args("nodes"))]);
    let one_host = run(&[(1, args("host"))]);
    assert!(two_nodes >= 0.95, "{two_nodes}");
    assert!(
        (two_nodes - one_host).abs() <= 0.01,
        "{two_nodes} vs {one_host}"
    );
}

/// The process of node `node` among those running in `dir` (its working
/// directory), found through `/proc`.
fn node_process(dir: &Path, node: u32) -> Option<i32> {
    let want = format!("PMI_RANK={node}");
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let cwd = std::fs::read_link(entry.path().join("cwd")).ok()?;
            let environ = std::fs::read(entry.path().join("environ")).ok()?;
            let exe = std::fs::read_link(entry.path().join("exe")).ok()?;
            (cwd == dir
                && exe.file_name()? == "trainhost"
                && environ.split(|b| *b == 0).any(|v| v == want.as_bytes()))
            .then_some(pid)
        })
}

#[test]
fn a_stop_requested_on_one_node_reaches_every_rank_on_every_node() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dir_path = dir.path().canonicalize().unwrap();
    let args = scripted_args(4, json!([{"until_preempted": true}]), &[]);
    let child = Command::new("mpiexec")
        .args(["-n", "2"])
        .arg(env!("CARGO_BIN_EXE_trainhost"))
        .arg("run")
        .args(&args)
        .current_dir(&dir_path)
        .env("RUST_LOG", "warn")
        .env("TRAINHOST_CACHE_DIR", dir_path.join("compile-cache"))
        .env("MPIEXEC_TIMEOUT", MPIEXEC_TIMEOUT)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Once the ranks are reporting, signal node 1's process only.
    let history = dir_path.join("st/t/metrics.jsonl");
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&history).map_or(0, |h| h.lines().count()) < 3 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "no reports"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let pid = node_process(&dir_path, 1).expect("node 1's process");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Both nodes stop early and resumably (the launcher passes the code on).
    assert_eq!(out.status.code(), Some(75), "{stdout}\n{stderr}");
    assert_eq!(
        stderr
            .matches("stopped early on request; resume with")
            .count(),
        2,
        "{stderr}"
    );
    // Every rank saw the request after the same report.
    let at: Vec<&str> = (0..4)
        .map(|r| {
            rank_lines(&stdout, r)
                .into_iter()
                .find(|l| l.starts_with("preempted at "))
                .unwrap_or_else(|| panic!("rank {r}: {stdout}"))
        })
        .collect();
    assert!(at.iter().all(|a| *a == at[0]), "{at:?}");
}

/// `mpiexec -n 2 trainhost run` of the linear-regression example, every
/// rank saving its own shard, in `dir`.
fn sharded_example(dir: &Path) -> Command {
    let mut command = Command::new("mpiexec");
    command
        .args(["-n", "2"])
        .arg(env!("CARGO_BIN_EXE_trainhost"))
        .args(["run", LINEAR_REGRESSION, "--workers", "4"])
        .args(["--config", r#"{"num_epochs": 150, "sharded": true}"#])
        .args(["--storage", "st", "--name", "t", "--num-to-keep", "2"])
        .current_dir(dir)
        .env("RUST_LOG", "warn")
        .env("TRAINHOST_CACHE_DIR", dir.join("compile-cache"))
        .env("MPIEXEC_TIMEOUT", MPIEXEC_TIMEOUT);
    command
}

#[test]
fn a_node_killed_ends_the_job_everywhere_and_the_rerun_resumes() {
    if !have_mpiexec() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dir_path = dir.path().canonicalize().unwrap();
    let mut child = sharded_example(&dir_path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let history = dir_path.join("st/t/metrics.jsonl");
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&history).map_or(0, |h| h.lines().count()) < 3 {
        assert!(started.elapsed() < Duration::from_secs(60), "no reports");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid = node_process(&dir_path, 1).expect("node 1's process");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    // The job ends on every node, not just the killed one, and soon.
    let killed = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "the job still runs 30 s after node 1 was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success());
    assert_eq!(node_process(&dir_path, 0), None, "node 0 lives on");
    // What is committed verifies, and the rerun resumes from the newest.
    let committed =
        trainhost::committed_checkpoints(&dir_path.join("st/t").display().to_string()).unwrap();
    for c in &committed {
        c.verify().unwrap();
    }
    let newest = committed.iter().map(trainhost::Checkpoint::index).max();
    let out = sharded_example(&dir_path).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    if let Some(newest) = newest {
        let epoch = committed
            .iter()
            .find(|c| c.index() == newest)
            .and_then(|c| c.metrics().get("epoch").cloned());
        let Some(trainhost::MetricValue::Integer(epoch)) = epoch else {
            panic!("checkpoint {newest} has no epoch");
        };
        assert!(
            rank_lines(&stdout, 0)
                .iter()
                .any(|l| l.starts_with("resuming from")
                    && l.ends_with(&format!("after epoch {epoch}"))),
            "{stdout}"
        );
    }
    assert!(stdout.contains("epoch 149:"), "{stdout}");
}
