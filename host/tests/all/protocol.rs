//! Ranks that break the collective protocol or fail: the run fails with
//! an error naming the ranks, all ranks stop, nothing hangs (R6, R19).

use std::time::{Duration, Instant};

use serde_json::json;
use trainhost::FailureKind;

use crate::util::*;

#[test]
fn a_rank_reporting_more_often_fails_the_run_naming_both_ranks() {
    let started = Instant::now();
    let run = run(
        2,
        json!([
            {"report": {"i": 0}},
            {"report": {"i": 1}, "ranks": [1]},
        ]),
    );
    let e = run.result.error.clone().expect("the run must fail");
    assert_eq!(e.kind, FailureKind::Protocol);
    let msg = e.to_string();
    assert!(
        msg.contains("rank 0 returned from train after 1 collective calls"),
        "{msg}"
    );
    // Which of the two notices first depends on timing; either way both
    // ranks are named.
    assert!(
        msg.contains("ranks [1] wait in their 2nd (report)")
            || msg.contains("rank 1 called report as its 2nd collective call"),
        "{msg}"
    );
    assert!(msg.starts_with("collective protocol violation"), "{msg}");
    // Detected when rank 0 returns, not after the 60 s report timeout.
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    // The report all ranks made is recorded.
    assert_eq!(run.result.metrics_history.len(), 1);
}

#[test]
fn a_rank_that_never_reports_times_out_naming_it() {
    let (builder, storage, lines) = scripted(
        3,
        json!([
            {"report": {"i": 0}, "ranks": [0, 2]},
            // Rank 1 computes forever instead of reporting.
            {"spin": true, "ranks": [1]},
        ]),
    );
    let builder = builder.run_config(trainhost::RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        report_timeout: Duration::from_millis(500),
        ..Default::default()
    });
    let started = Instant::now();
    let run = finish(builder, storage, lines);
    let e = run.result.error.clone().expect("the run must fail");
    assert_eq!(e.kind, FailureKind::Protocol);
    let msg = e.to_string();
    assert!(msg.contains("ranks [0, 2] waited"), "{msg}");
    assert!(msg.contains("for ranks [1]"), "{msg}");
    // The spinning rank was interrupted too: fit returned.
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_trapping_rank_fails_the_run_with_its_rank_and_message_and_stops_the_others() {
    let started = Instant::now();
    let run = run(
        3,
        json!([
            {"report": {"i": 0}},
            {"panic": "injected panic on rank {rank}", "ranks": [1]},
            // Rank 0 waits in report, rank 2 computes: both must stop.
            {"report": {"i": 1}, "ranks": [0]},
            {"spin": true, "ranks": [2]},
        ]),
    );
    let e = run.result.error.clone().expect("the run must fail");
    assert_eq!(e.kind, FailureKind::Trap);
    assert_eq!(e.rank, Some(1));
    let msg = e.to_string();
    assert!(msg.starts_with("rank 1 trapped"), "{msg}");
    assert!(msg.contains("unreachable"), "{msg}");
    assert!(
        msg.contains("injected panic on rank 1"),
        "the guest's panic message is shown: {msg}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(run.result.metrics_history.len(), 1);
}

#[test]
fn a_guest_error_fails_the_run_with_its_message() {
    let run = run(
        2,
        json!([{"fail": "loss diverged on rank {rank}", "ranks": [0]}, {"report": {}, "ranks": [1]}]),
    );
    let e = run.result.error.clone().unwrap();
    assert_eq!(e.kind, FailureKind::GuestError);
    assert_eq!(e.rank, Some(0));
    assert_eq!(
        e.to_string(),
        "rank 0 returned an error: loss diverged on rank 0"
    );
}

#[test]
fn committed_checkpoints_survive_a_failure_and_are_in_the_result() {
    let run = run(
        2,
        json!([
            {"write": "c/w", "text": "good", "ranks": [0]},
            {"report": {"loss": 1}, "checkpoint": "c", "ranks": [0]},
            {"report": {"loss": 1}, "ranks": [1]},
            {"panic": "boom", "ranks": [0]},
            {"report": {"loss": 0}, "ranks": [1]},
        ]),
    );
    assert!(run.result.error.is_some());
    let latest = run
        .result
        .checkpoint
        .as_ref()
        .expect("the committed checkpoint is kept");
    latest.verify().unwrap();
    assert_eq!(
        std::fs::read(run.dir().join("checkpoint_000000/w")).unwrap(),
        b"good"
    );
}
