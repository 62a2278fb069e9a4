//! Stopping early on request: SIGTERM to the CLI, or Preemption from a
//! library caller.

use std::time::{Duration, Instant};

use serde_json::json;
use trainhost::{Interruption, Preemption, RunConfig};

use crate::util::*;

fn preemptible(
    workers: u32,
    steps: serde_json::Value,
    grace: Duration,
) -> (Run, Preemption, Duration) {
    let (builder, storage, lines) = scripted(workers, steps);
    let (builder, preemption) = preemptible_by(builder, &storage, grace, Interruption::default());
    let requester = request_after(&preemption, Duration::from_millis(300));
    let run = finish(builder, storage, lines);
    let requested_at = requester.join().unwrap();
    (run, preemption, requested_at.elapsed())
}

#[test]
fn ranks_see_the_request_after_the_same_report_and_commit_a_final_checkpoint() {
    let (run, _, _) = preemptible(
        3,
        json!([{"until_preempted": true}]),
        Duration::from_secs(60),
    );
    run.assert_ok();
    assert!(run.result.preempted);
    let stops: Vec<String> = (0..3)
        .map(|r| run.stdout(r).last().cloned().unwrap())
        .collect();
    assert!(stops[0].starts_with("preempted at "), "{stops:?}");
    assert!(
        stops.iter().all(|s| *s == stops[0]),
        "ranks stopped at different reports: {stops:?}"
    );
    let latest = run.result.checkpoint.as_ref().expect("a final checkpoint");
    let at: String = stops[0].trim_start_matches("preempted at ").to_owned();
    assert_eq!(
        std::fs::read_to_string(std::path::Path::new(latest.location()).join("final")).unwrap(),
        at
    );
    assert_eq!(
        run.result.metrics.as_ref().unwrap().get("final"),
        Some(&trainhost::MetricValue::Boolean(true))
    );
}

#[test]
fn ranks_that_ignore_the_request_are_stopped_after_the_grace_period() {
    let (run, _, since_request) = preemptible(
        2,
        json!([
            {"write": "c/w", "text": "kept", "ranks": [0]},
            {"report": {}, "checkpoint": "c", "ranks": [0]},
            {"report": {}, "ranks": [1]},
            {"spin": true},
        ]),
        Duration::from_millis(200),
    );
    assert!(run.result.preempted);
    assert!(
        run.result.error.is_none(),
        "being stopped on request is not a failure: {:?}",
        run.result.error
    );
    assert_eq!(run.result.failures, 0);
    assert!(since_request < Duration::from_secs(20), "{since_request:?}");
    run.result.checkpoint.as_ref().unwrap().verify().unwrap();
}

#[test]
fn sigterm_yields_a_final_checkpoint_and_a_resumable_exit_and_the_rerun_continues() {
    let tmp = tempfile::tempdir().unwrap();
    let args = [
        "run",
        LINEAR_REGRESSION,
        "--workers",
        "2",
        "--name",
        "pre",
        // Checkpoints every 100000 epochs only: the final one comes from
        // the preemption path.
        "--config",
        r#"{"num_epochs": 100000000, "checkpoint_freq": 100000}"#,
    ];
    let host = HostProcess::spawn(&args, tmp.path());
    host.wait_for(|l| l.contains("epoch 300:"));
    host.sigterm();
    let stopped = host.wait_for(|l| l.contains("preempted after epoch"));
    let output = host.child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(75), "{stderr}");
    assert!(
        stderr.contains("stopped early on request; resume with"),
        "{stderr}"
    );
    let stopped_at: u64 = stopped
        .split("preempted after epoch ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .unwrap()
        .parse()
        .unwrap();

    let run_dir = tmp.path().join("trainhost_results/pre");
    let listed = trainhost::committed_checkpoints(run_dir.to_str().unwrap()).unwrap();
    let final_checkpoint = listed.iter().max_by_key(|c| c.index()).unwrap();
    final_checkpoint.verify().unwrap();
    assert_eq!(
        serde_json::to_value(final_checkpoint.metrics().get("epoch").unwrap()).unwrap(),
        json!(stopped_at)
    );

    let host = HostProcess::spawn(&args, tmp.path());
    let resumed = host.wait_for(|l| l.contains("resuming from"));
    assert!(
        resumed.ends_with(&format!("after epoch {stopped_at}")),
        "{resumed}"
    );
    host.wait_for(|l| l.contains(&format!("epoch {}:", stopped_at + 1)));
    host.sigterm();
    let output = host.child.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(75));
}

#[test]
fn a_forced_stop_does_not_wait_for_the_grace_period() {
    let preemption = Preemption::new();
    let (builder, storage, lines) = scripted(2, json!([{"spin": true}]));
    let builder = builder
        .run_config(RunConfig {
            name: Some("t".into()),
            storage_path: storage.path().display().to_string(),
            preemption_grace: Duration::from_secs(3600),
            ..Default::default()
        })
        .preemption(preemption.clone());
    let forcer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        preemption.request();
        std::thread::sleep(Duration::from_millis(200));
        preemption.force();
        Instant::now()
    });
    let run = finish(builder, storage, lines);
    let forced_at = forcer.join().unwrap();
    assert!(run.result.preempted);
    assert!(run.result.error.is_none());
    assert!(
        forced_at.elapsed() < Duration::from_secs(20),
        "{:?}",
        forced_at.elapsed()
    );
}

/// With `--interrupt host-calls` a rank that never calls the host again
/// cannot be stopped; the third signal exits the CLI anyway.
#[test]
fn a_third_signal_exits_even_when_a_rank_cannot_be_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let config = json!({"steps": [{"print": "spinning"}, {"spin": true}]}).to_string();
    let args = [
        "run",
        TEST_GUEST,
        "--interrupt",
        "host-calls",
        "--config",
        &config,
        "--name",
        "stuck",
    ];
    let mut host = HostProcess::spawn(&args, tmp.path());
    host.wait_for(|l| l.contains("spinning"));
    for _ in 0..3 {
        // Apart, so that the signals are not merged into one.
        std::thread::sleep(Duration::from_millis(300));
        host.sigterm();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = host.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the host did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = host.child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(status.code(), Some(128 + 15), "{stderr}");
    assert!(stderr.contains("third signal"), "{stderr}");
}

/// A request the ranks never hear of (they do not ask, and finish within
/// the grace period) does not make a finished run a preempted one.
#[test]
fn a_run_that_finishes_without_hearing_of_the_request_is_finished() {
    let (run, _, _) = preemptible(
        2,
        json!([{"sleep_ms": 1000}, {"report": {"done": true}}]),
        Duration::from_secs(60),
    );
    run.assert_ok();
    assert!(!run.result.preempted, "every rank finished its work");
    assert_eq!(run.result.metrics_history.len(), 1);
}

/// The same through the CLI: SIGTERM during a run whose guest does not ask
/// about preemption and finishes in time exits 0, not 75.
#[test]
fn sigterm_to_a_run_that_then_finishes_exits_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let config = json!({"steps": [{"print": "started"}, {"sleep_ms": 1500}, {"report": {}}]});
    let config = config.to_string();
    let args = ["run", TEST_GUEST, "--config", &config, "--name", "fin"];
    let host = HostProcess::spawn(&args, tmp.path());
    host.wait_for(|l| l.contains("started"));
    host.sigterm();
    let output = host.child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("stopped early"), "{stderr}");
}
