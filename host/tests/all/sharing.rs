//! Ranks that outnumber the cores share threads (R34): a computing rank
//! yields its thread to the others at every epoch tick, and a rank waiting
//! holds no thread.

use std::time::Duration;

use serde_json::json;
use trainhost::{FailureConfig, FailureKind, MaxFailures, ResourceLimits, RunConfig};

use crate::util::*;

/// The cores the host sees, so that one more rank than this shares a
/// thread with rank 0.
fn cores() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
}

#[test]
fn a_computing_rank_yields_its_thread_to_the_ranks_sharing_it() {
    // Every rank but the last computes forever; the last shares rank 0's
    // thread, sleeps a moment and fails. Its failure can only be the run's
    // if rank 0 lets it run: otherwise the wall-clock limit ends the run.
    let last = cores();
    let (builder, storage, lines) = scripted(
        last + 1,
        json!([
            {"sleep_ms": 100, "ranks": [last]},
            {"fail": "rank {rank} got its turn", "ranks": [last]},
            {"spin": true},
        ]),
    );
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        limits: ResourceLimits {
            attempt_timeout: Some(Duration::from_secs(120)),
            ..Default::default()
        },
        failure_config: FailureConfig {
            max_failures: MaxFailures::Limited(0),
        },
        ..Default::default()
    });
    let run = finish(builder, storage, lines);
    let e = run.result.error.clone().expect("must fail");
    assert_eq!(e.kind, FailureKind::GuestError, "{e}");
    assert_eq!(e.rank, Some(last), "{e}");
    assert!(
        e.to_string().contains(&format!("rank {last} got its turn")),
        "{e}"
    );
}

#[test]
fn many_ranks_on_few_threads_meet_in_every_round() {
    // Four ranks per core: every round is met by ranks that take turns on
    // a thread, with reports, a barrier and an all-reduce split between
    // the ranks.
    let ranks = 4 * cores();
    // 100 000 s64 (800 KB) is over the size from which ranks split it.
    let len = 100_000;
    let steps: Vec<_> = (0..20)
        .flat_map(|i| {
            [
                json!({"report": {"step": i}}),
                json!({"barrier": true}),
                json!({"all_reduce": "s64", "len": len, "op": "sum"}),
            ]
        })
        .collect();
    let (builder, storage, lines) = scripted(ranks, json!(steps));
    let run = finish(builder, storage, lines);
    run.assert_ok();
    assert_eq!(run.result.metrics_history.len(), 20);
    let want = crate::collective::expected(ranks, "s64", "sum", len);
    for rank in 0..ranks {
        let out = run.stdout(rank);
        assert_eq!(out.iter().filter(|l| *l == "barrier ok").count(), 20);
        assert_eq!(
            out.iter().filter(|l| **l == want).count(),
            20,
            "rank {rank}"
        );
    }
}
