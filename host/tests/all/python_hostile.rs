//! A hostile loop written in Python (tests/python/scripted.py) under a
//! representative subset of the sandbox and limit tests Rust guests pass
//! (escape.rs, limits.rs): CPython inside the component changes nothing
//! about what the host enforces.

use std::time::{Duration, Instant};

use serde_json::json;
use trainhost::{FailureKind, ResourceLimits};

use crate::python::{run, scripted, train_limited};

/// The ways out a Python loop can try end in the sandbox: no host file
/// is seen, no link out is made, and `report` refuses paths outside it
/// with a `TrainhostError` the loop can catch.
#[test]
fn a_python_loop_cannot_leave_its_sandbox() {
    let Some((result, lines)) = run(1, json!({"escape": true, "epochs": 1}), 0) else {
        return;
    };
    assert!(result.error.is_none(), "{:?}", result.error);
    assert!(result.checkpoint.is_none(), "nothing may be committed");
    assert_eq!(result.metrics_history.len(), 1, "only the epoch's report");
    let printed = lines.texts();
    let attempts = [
        "read /etc/passwd",
        "list /",
        "read ../..",
        "symlink out",
        "report /scratch/ckpt/../../etc",
        "report /etc",
        "report /",
    ];
    for what in attempts {
        let line = printed
            .iter()
            .find(|l| l.starts_with(&format!("{what}: ")))
            .unwrap_or_else(|| panic!("no line for {what:?} in {printed:?}"));
        assert!(line.contains(": refused"), "{line}");
    }
    assert!(
        printed.iter().any(|l| l
            .starts_with("report /etc: refused by the host: InvalidCheckpoint")
            && l.contains("outside the sandbox")),
        "{printed:?}"
    );
}

/// Every limit stops a Python loop that misbehaves, names itself and the
/// rank, and returns control promptly: memory, a spinning and a sleeping
/// rank (wall clock), a silent one (stall), an output flood.
#[test]
fn limits_stop_a_hostile_python_loop() {
    let Some(guest) = scripted() else { return };
    let cases = [
        (
            json!({"alloc_mb": 200, "ranks": [1]}),
            ResourceLimits {
                max_memory: Some(64 << 20),
                ..Default::default()
            },
            Some(1),
            "exceeded the memory limit of 64 MiB",
        ),
        (
            json!({"spin": true}),
            ResourceLimits {
                attempt_timeout: Some(Duration::from_secs(2)),
                ..Default::default()
            },
            None,
            "exceeded its wall-clock limit of 2s",
        ),
        (
            json!({"sleep_s": 3600}),
            ResourceLimits {
                attempt_timeout: Some(Duration::from_secs(2)),
                ..Default::default()
            },
            None,
            "exceeded its wall-clock limit of 2s",
        ),
        (
            json!({"spin": true, "ranks": [1]}),
            ResourceLimits {
                stall_timeout: Some(Duration::from_secs(1)),
                ..Default::default()
            },
            Some(1),
            "stalled: no report and no output for",
        ),
        (
            json!({"flood": 20_000_000, "ranks": [0]}),
            ResourceLimits {
                max_output_rate: Some(64 << 10),
                ..Default::default()
            },
            Some(0),
            "exceeded the output limit of 64 KiB/s",
        ),
    ];
    for (config, limits, rank, expected) in cases {
        let started = Instant::now();
        let (result, _, _keep) = train_limited(guest, 2, config.clone(), 0, limits);
        let e = result.error.expect("the run fails");
        assert_eq!(e.kind, FailureKind::Limit, "{config}: {e}");
        if rank.is_some() {
            assert_eq!(e.rank, rank, "{config}: {e}");
        }
        assert!(e.to_string().contains(expected), "{config}: {e}");
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{config}: control came back after {:?}",
            started.elapsed()
        );
    }
}
