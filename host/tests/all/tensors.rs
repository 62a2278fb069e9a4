//! Host tensors and kernels (the `tensors` interface): what the guest gets
//! back is what it would compute itself, a bad call is an error the guest
//! sees, tensors count against the memory limit, each rank's tensors are
//! its own, and a stop request interrupts a long kernel.

use std::time::Instant;

use serde_json::json;
use trainhost::{FailureKind, ResourceLimits, RunConfig};

use crate::util::*;

#[test]
fn a_host_matmul_equals_the_guests_own_and_each_rank_has_its_own_tensors() {
    // Each rank draws its own matrices (seeded by its rank) and checks the
    // host's product against one it computes from their values.
    let run = run(
        2,
        json!([
            {"tensor_matmul": [37, 129, 65], "seed": 1, "ranks": [0]},
            {"tensor_matmul": [64, 64, 64], "seed": 2, "ranks": [1]},
        ]),
    );
    run.assert_ok();
    for r in 0..2 {
        let out = run.stdout(r);
        let error: f32 = out[0]
            .strip_prefix("tensor_matmul: max_error ")
            .unwrap_or_else(|| panic!("{out:?}"))
            .parse()
            .unwrap();
        // Sums of up to 129 products of values in [-1, 1), in f32.
        assert!(error <= 1e-4, "rank {r}: {error}");
    }
}

#[test]
fn a_bad_call_is_an_error_the_guest_sees_and_changes_nothing() {
    let run = run(
        1,
        json!([{"tensor_bad_shape": true}, {"report": {"after": 1}}]),
    );
    run.assert_ok();
    let out = run.stdout(0);
    assert_eq!(out[0], "tensor unchanged: true");
    assert!(
        out[1].starts_with("tensor error: gemm: op(a) is 2×3 and op(b) 2×3"),
        "{out:?}"
    );
    assert_eq!(run.result.metrics_history.len(), 1, "the loop went on");
}

#[test]
fn host_tensors_count_against_the_memory_limit_and_free_it_when_dropped() {
    let (builder, storage, lines) = scripted(
        1,
        json!([
            // 16 MiB each under a 64 MiB limit that the linear memory
            // shares: the fourth cannot fit.
            {"tensor_hold_mb": 16, "count": 4},
            // The step drops what it held first: the same fit again.
            {"tensor_hold_mb": 16, "count": 2},
        ]),
    );
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        limits: ResourceLimits {
            max_memory: Some(64 << 20),
            ..ResourceLimits::default()
        },
        ..Default::default()
    });
    let run = finish(builder, storage, lines);
    run.assert_ok();
    let out = run.stdout(0);
    let refused = out
        .iter()
        .position(|l| l.starts_with("tensor error: out of memory: a tensor of 16 MiB would take the rank past its memory limit of 64 MiB"))
        .unwrap_or_else(|| panic!("{out:?}"));
    assert!(refused <= 3, "{out:?}");
    assert_eq!(
        out[refused + 1..],
        ["tensor_hold: 0 made", "tensor_hold: 1 made"]
    );
}

#[test]
fn a_failing_rank_stops_another_inside_a_long_kernel() {
    // One GEMM of 2 × 4096 × 8192 × 4096 ≈ 275 GFLOP, seconds on any
    // machine: first alone, to know how long it takes here.
    let gemm = json!({"tensor_gemm": 4096, "ranks": [0]});
    let started = Instant::now();
    let alone = run(1, json!([gemm]));
    let whole = started.elapsed();
    alone.assert_ok();
    assert_eq!(alone.stdout(0), ["tensor_gemm: done"]);

    // Then rank 1 fails while rank 0 is in the same GEMM.
    let started = Instant::now();
    let failed = run(
        2,
        json!([gemm, {"sleep_ms": 300, "ranks": [1]}, {"panic": "rank 1 gives up", "ranks": [1]}]),
    );
    let stopped = started.elapsed();
    let e = failed.result.error.clone().expect("the run fails");
    assert_eq!(e.kind, FailureKind::Trap, "{e}");
    assert!(e.to_string().contains("rank 1 gives up"), "{e}");
    assert!(failed.stdout(0).is_empty(), "{:?}", failed.stdout(0));
    // Stopped between two blocks of the GEMM, not at its end.
    assert!(
        stopped < whole.mul_f64(0.6),
        "the GEMM alone took {whole:?}; the failed run {stopped:?}"
    );
}

#[test]
fn a_tensor_all_reduce_equals_the_list_all_reduce_and_matches_it() {
    for op in ["sum", "mean", "max"] {
        let run = run(3, json!([{"tensor_all_reduce": 1000, "op": op}]));
        run.assert_ok();
        let want = crate::collective::expected(3, "f32", op, 1000);
        for r in 0..3 {
            assert_eq!(run.stdout(r), std::slice::from_ref(&want), "rank {r}, {op}");
        }
    }
    // A tensor on one rank meets a list on the other: the same call.
    let run = run(
        2,
        json!([
            {"tensor_all_reduce": 10, "ranks": [0]},
            {"all_reduce": "f32", "len": 10, "ranks": [1]},
        ]),
    );
    run.assert_ok();
    assert_eq!(run.stdout(0), run.stdout(1));
}
