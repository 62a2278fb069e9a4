//! Every limit stops a rank blocked in the host, not only a computing one
//! (R28): a rank asleep in WASI for minutes is stopped within seconds of the
//! limit, by whatever stops the attempt, with either interruption mode.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use trainhost::{FailureKind, Interruption, ResourceLimits, RunConfig, TrainResult};

use crate::util::*;

/// A step far longer than any test may take: a rank still asleep when the
/// limit hits is only stopped if the host wakes it.
fn asleep() -> Value {
    json!({"sleep_ms": 300_000})
}

/// Bound on how long a stopped run may take; the limits below hit within
/// a few seconds, the sleep would take five minutes.
const PROMPT: Duration = Duration::from_secs(30);

fn run(workers: u32, steps: Value, configure: impl FnOnce(&mut RunConfig)) -> (Run, Duration) {
    let (builder, storage, lines) = scripted(workers, steps);
    let mut config = RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        ..RunConfig::default()
    };
    configure(&mut config);
    let started = Instant::now();
    let run = finish(builder.run_config(config), storage, lines);
    (run, started.elapsed())
}

fn failure(result: &TrainResult) -> &trainhost::RunFailure {
    result.error.as_ref().expect("the run must fail")
}

#[test]
fn the_wall_clock_limit_stops_a_sleeping_rank() {
    let (run, took) = run(1, json!([asleep()]), |c| {
        c.limits = ResourceLimits {
            attempt_timeout: Some(Duration::from_secs(1)),
            ..ResourceLimits::default()
        };
    });
    let e = failure(&run.result);
    assert_eq!(e.kind, FailureKind::Limit);
    assert!(e.message.contains("wall-clock limit of 1s"), "{e}");
    assert!(took < PROMPT, "took {took:?}");
}

#[test]
fn the_stall_timeout_stops_a_sleeping_rank() {
    let (run, took) = run(1, json!([asleep()]), |c| {
        c.limits = ResourceLimits {
            stall_timeout: Some(Duration::from_secs(1)),
            ..ResourceLimits::default()
        };
    });
    let e = failure(&run.result);
    assert_eq!((e.kind, e.rank), (FailureKind::Limit, Some(0)), "{e}");
    assert!(took < PROMPT, "took {took:?}");
}

#[test]
fn the_report_timeout_stops_a_rank_asleep_instead_of_reporting() {
    let steps = json!([{"report": {}, "ranks": [0]}, {"sleep_ms": 300_000, "ranks": [1]}]);
    let (run, took) = run(2, steps, |c| c.report_timeout = Duration::from_secs(1));
    let e = failure(&run.result);
    assert_eq!(e.kind, FailureKind::Protocol, "{e}");
    assert!(took < PROMPT, "took {took:?}");
}

#[test]
fn another_ranks_failure_stops_a_sleeping_rank_in_both_interruption_modes() {
    for interruption in [Interruption::Anywhere, Interruption::AtHostCalls] {
        let steps = json!([
            {"sleep_ms": 300, "ranks": [0]},
            {"panic": "rank 0 gives up", "ranks": [0]},
            {"sleep_ms": 300_000, "ranks": [1]},
        ]);
        let (run, took) = run(2, steps, |c| c.interruption = interruption);
        let e = failure(&run.result);
        assert_eq!((e.kind, e.rank), (FailureKind::Trap, Some(0)), "{e}");
        assert!(took < PROMPT, "{interruption:?}: took {took:?}");
    }
}

#[test]
fn preemptions_grace_period_stops_a_sleeping_rank() {
    for interruption in [Interruption::Anywhere, Interruption::AtHostCalls] {
        let (builder, storage, lines) = scripted(1, json!([asleep()]));
        let (builder, preemption) =
            preemptible_by(builder, &storage, Duration::from_secs(1), interruption);
        let started = Instant::now();
        let asking = request_after(&preemption, Duration::from_millis(500));
        let run = finish(builder, storage, lines);
        asking.join().unwrap();
        let took = started.elapsed();
        assert!(run.result.preempted, "{:?}", run.result.error);
        assert!(took < PROMPT, "{interruption:?}: took {took:?}");
    }
}

#[test]
fn the_cli_exits_when_the_wall_clock_limit_stops_a_sleeping_rank() {
    let dir = tempfile::tempdir().unwrap();
    let config = json!({"steps": [asleep()]}).to_string();
    let args = [
        "run",
        TEST_GUEST,
        "--attempt-timeout",
        "1s",
        "--config",
        &config,
    ];
    let out = run_bounded(&args, dir.path(), PROMPT);
    assert_eq!(out.status, Some(1), "{out:?}");
    assert!(out.stderr.contains("wall-clock limit of 1s"), "{out:?}");
}
