//! Per-rank limits: each hit fails the attempt, names the limit and the
//! rank, and counts toward max_failures.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use trainhost::{FailureConfig, FailureKind, MaxFailures, ResourceLimits, RunConfig, RunFailure};

use crate::util::*;

fn limited(workers: u32, steps: Value, limits: ResourceLimits, max_failures: u32) -> Run {
    let (builder, storage, lines) = scripted(workers, steps);
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        limits,
        failure_config: FailureConfig {
            max_failures: MaxFailures::Limited(max_failures),
        },
        ..Default::default()
    });
    finish(builder, storage, lines)
}

/// The failure `run` ended with, which must be a limit that `rank` hit
/// (`None`: the attempt's own, hit by no one rank).
fn limit_hit(run: &Run, rank: Option<u32>) -> RunFailure {
    let e = run.result.error.clone().expect("must fail");
    assert_eq!(e.kind, FailureKind::Limit, "{e}");
    assert_eq!(e.rank, rank, "{e}");
    e
}

#[test]
fn the_memory_limit_fails_the_rank_and_counts_toward_max_failures() {
    let limits = ResourceLimits {
        max_memory: Some(32 << 20),
        ..Default::default()
    };
    let run = limited(
        2,
        // The report orders the two: rank 0 has allocated (and said so)
        // before rank 1 goes over the limit and the attempt is stopped.
        json!([
            {"alloc_mb": 4, "ranks": [0]},
            {"report": {"step": 0}},
            {"alloc_mb": 100, "ranks": [1]},
        ]),
        limits,
        1,
    );
    let e = limit_hit(&run, Some(1));
    assert!(
        e.to_string()
            .starts_with("rank 1 hit a limit: exceeded the memory limit of 32 MiB"),
        "{e}"
    );
    assert_eq!(run.result.failures, 2, "restarted once, failed again");
    assert!(
        run.stdout(0).contains(&"allocated 4 MiB".to_owned()),
        "small allocations still work"
    );
}

#[test]
fn a_silent_rank_stalls_while_a_rank_waiting_in_report_does_not() {
    let limits = ResourceLimits {
        stall_timeout: Some(Duration::from_millis(400)),
        ..Default::default()
    };
    let started = Instant::now();
    let run = limited(
        2,
        json!([
            {"report": {}, "ranks": [0]},
            {"spin": true, "ranks": [1]},
        ]),
        limits,
        0,
    );
    let e = limit_hit(&run, Some(1));
    assert!(
        e.message
            .starts_with("stalled: no report and no output for"),
        "{e}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[test]
fn output_counts_as_progress() {
    let limits = ResourceLimits {
        stall_timeout: Some(Duration::from_millis(500)),
        ..Default::default()
    };
    let mut steps = Vec::new();
    for _ in 0..8 {
        steps.push(json!({"sleep_ms": 150}));
        steps.push(json!({"print": "still working"}));
    }
    limited(1, Value::Array(steps), limits, 0).assert_ok();
}

#[test]
fn the_attempt_wall_clock_limit_stops_every_rank() {
    let limits = ResourceLimits {
        attempt_timeout: Some(Duration::from_millis(500)),
        ..Default::default()
    };
    let run = limited(3, json!([{"spin": true}]), limits, 0);
    let e = limit_hit(&run, None);
    assert!(
        e.to_string()
            .contains("exceeded its wall-clock limit of 500ms"),
        "{e}"
    );
}

#[test]
fn an_output_flood_fails_the_rank() {
    let limits = ResourceLimits {
        max_output_rate: Some(64 << 10),
        ..Default::default()
    };
    let run = limited(2, json!([{"flood": 20_000_000, "ranks": [1]}]), limits, 0);
    let e = limit_hit(&run, Some(1));
    assert!(
        e.message.contains("exceeded the output limit of 64 KiB/s"),
        "{e}"
    );
}

#[test]
fn a_report_flood_fails_rank_0_and_keeps_the_history_bounded() {
    let limits = ResourceLimits {
        max_output_rate: Some(64 << 10),
        ..Default::default()
    };
    // About 1.1 KiB a report against a burst of 256 KiB: a few hundred
    // reports are recorded, not the 100000 the loop makes. Only rank 0's
    // metrics are kept, so it is the one that fails.
    let flood = json!([{"report_flood": 100_000, "text_bytes": 1000}]);
    let run = limited(2, flood, limits.clone(), 0);
    let e = limit_hit(&run, Some(0));
    assert!(
        e.message
            .contains("exceeded the output limit of 64 KiB/s (--max-output-rate), counting the metrics it reported"),
        "{e}"
    );
    let recorded = run.result.metrics_history.len();
    assert!(
        (100..400).contains(&recorded),
        "{recorded} reports recorded"
    );

    // Within the budget the same reports are all recorded.
    let run = limited(
        2,
        json!([{"report_flood": 100, "text_bytes": 1000}]),
        limits,
        0,
    );
    run.assert_ok();
    assert_eq!(run.result.metrics_history.len(), 100);
}

#[test]
fn a_loop_reporting_within_the_output_limit_goes_on_past_its_burst() {
    // 1000 B/s allow 4000 B at once; about 100 B a report, 8 a second,
    // for 8 s: twice the burst in all, at 0.8 of the rate.
    let limits = ResourceLimits {
        max_output_rate: Some(1000),
        ..Default::default()
    };
    let steady = json!([{"report_flood": 64, "text_bytes": 0, "every_ms": 125}]);
    let run = limited(1, steady, limits, 0);
    run.assert_ok();
    assert_eq!(run.result.metrics_history.len(), 64);
}

/// Run 2 ranks under a scratch limit of 4 MiB, rank 1 taking 8 MiB of
/// disk by its `filling` steps and then computing, rank 0 asleep: rank 1
/// must fail, computing or not, with a message naming the limit and its
/// flag, and rank 0 be stopped with it. Returns the failure.
fn over_the_scratch_limit(filling: Value) -> RunFailure {
    let limits = ResourceLimits {
        max_scratch_bytes: Some(4 << 20),
        // Should the limit not be seen: a failure, not a hung test.
        attempt_timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    let mut steps = filling.as_array().expect("a list of steps").clone();
    steps.push(json!({"spin": true, "ranks": [1]}));
    steps.push(json!({"sleep_ms": 600_000}));
    let run = limited(2, Value::Array(steps), limits, 0);
    let e = limit_hit(&run, Some(1));
    let prefix = "exceeded the scratch limit of 4 MiB (--max-scratch): its scratch directory held ";
    assert!(e.message.starts_with(prefix), "{e}");
    // A measurement may fall while the rank is still writing: the figure
    // is what the directory held then, over the limit and at most what
    // the rank writes in all.
    let held: f64 = e.message[prefix.len()..]
        .split(" MiB")
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no figure in MiB after \"held\": {e}"));
    assert!(held > 4.0 && held < 9.0, "{e}");
    e
}

#[test]
fn a_rank_holding_more_than_the_scratch_limit_fails() {
    let e = over_the_scratch_limit(json!([
        {"write": "big", "bytes": 8 << 20, "seed": 1, "ranks": [1]},
    ]));
    assert!(!e.message.contains("deleted"), "{e}");
}

/// A file the rank deleted but holds open, and writes on, still holds its
/// blocks: it counts against the limit, and the message says so.
#[test]
fn a_deleted_file_held_open_counts_against_the_scratch_limit() {
    let e = over_the_scratch_limit(json!([
        {"hold": "gone", "ranks": [1]},
        {"remove": "gone", "ranks": [1]},
        {"write_held": "gone", "text": "x".repeat(1024), "times": 8192, "ranks": [1]},
    ]));
    assert!(
        e.message
            .contains("MiB of it in files it deleted but holds open"),
        "{e}"
    );
}

/// The scratch limit is on what the directory holds, not on what the rank
/// writes in all: a rank replacing a file below the limit, measured each
/// time, goes on; a sparse file counts only the blocks it holds.
#[test]
fn a_rank_rewriting_within_the_scratch_limit_goes_on() {
    let limits = ResourceLimits {
        max_scratch_bytes: Some(4 << 20),
        ..Default::default()
    };
    let mut steps = vec![json!({"sparse": "sparse", "size": 1u64 << 40})];
    for seed in 0..3 {
        steps.push(json!({"write": "f", "bytes": 3 << 20, "seed": seed}));
        // Longer than the time between two measurements.
        steps.push(json!({"sleep_ms": 1500}));
        steps.push(json!({"remove": "f"}));
    }
    steps.push(json!({"report": {"i": 1}}));
    let run = limited(1, json!(steps), limits, 0);
    run.assert_ok();
}

#[test]
fn long_lines_are_cut_not_failed() {
    let limits = ResourceLimits {
        max_line_bytes: 100,
        ..Default::default()
    };
    let long = "y".repeat(5000);
    let run = limited(1, json!([{"print": long}, {"print": "after"}]), limits, 0);
    run.assert_ok();
    let out = run.stdout(0);
    assert_eq!(
        out[0],
        format!("{} [line cut at 100 bytes]", "y".repeat(100))
    );
    assert_eq!(out[1], "after");
}

#[test]
fn limits_that_stop_a_busy_rank_need_interruption_anywhere() {
    for limits in [
        ResourceLimits {
            stall_timeout: Some(Duration::from_secs(60)),
            ..ResourceLimits::default()
        },
        ResourceLimits {
            attempt_timeout: Some(Duration::from_secs(60)),
            ..ResourceLimits::default()
        },
        ResourceLimits {
            max_scratch_bytes: Some(1 << 30),
            ..ResourceLimits::default()
        },
    ] {
        let err = trainhost::Trainer::builder(TEST_GUEST)
            .run_config(RunConfig {
                limits,
                interruption: trainhost::Interruption::AtHostCalls,
                ..RunConfig::default()
            })
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, trainhost::Error::InvalidConfig(m) if m.contains("needs interruption Anywhere")),
            "{err}"
        );
    }
}

/// A rank that keeps files open is refused past its share of the
/// process's descriptors, with a warning naming the limit, and the host's
/// own opens go on: the checkpoint both ranks report is committed. The
/// process's limit is lowered to 512 here: a quarter stays the host's,
/// and each of 2 ranks may hold 128.
#[test]
fn a_rank_holding_files_open_is_refused_past_its_share_and_reports_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let config = json!({"steps": [
        {"write": "ck/a", "text": "x"},
        {"open_many": "f", "count": 1000, "ranks": [0]},
        {"report": {"i": 1}, "checkpoint": "ck"},
    ]});
    let (stdout, stderr) = run_with_512_open_files(dir.path(), 2, &config);
    assert!(
        stdout.contains("[rank 0] open failed after 128: Quota exceeded"),
        "{stdout}"
    );
    assert!(stdout.contains("[rank 0] opened 128\n"), "{stdout}");
    assert!(
        stderr.contains("rank 0 holds 128 open files, directories and directory listings")
            && stderr.contains("open-file limit, 512; raise it with `ulimit -n`"),
        "{stderr}"
    );
    let committed = dir.path().join("st/open/checkpoint_000000/a");
    assert_eq!(std::fs::read_to_string(&committed).unwrap(), "x");
}
