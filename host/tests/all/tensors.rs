//! Host tensors and kernels (the `tensors` interface): what the guest gets
//! back is what it would compute itself, a bad call is an error the guest
//! sees, tensors count against the memory limit, each rank's tensors are
//! its own, and a stop request interrupts a long kernel.

use std::time::Instant;

use serde_json::json;
use trainhost::{FailureKind, RunConfig};

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
    let builder = with_max_memory(builder, &storage, 64 << 20);
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
fn empty_tensors_count_against_the_memory_limit() {
    // Each tensor costs the host its table entry and shape besides its
    // values: a guest cannot hold host memory without bound in tensors of
    // no values. Under 8 MiB (shared with the linear memory) about 50 000
    // fit, at 128 B each: below the 100 000 handles wasmtime lets a store
    // hold, which would stop the rank instead.
    let (builder, storage, lines) = scripted(
        1,
        json!([{"tensor_empty": 200_000}, {"tensor_empty": 200_000}]),
    );
    let builder = with_max_memory(builder, &storage, 8 << 20);
    let run = finish(builder, storage, lines);
    run.assert_ok();
    let out = run.stdout(0);
    assert_eq!(out.len(), 4, "{out:?}");
    let made = |line: &str| -> u64 {
        line.strip_prefix("tensor_empty: ")
            .and_then(|l| l.strip_suffix(" made"))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{out:?}"))
    };
    let (first, again) = (made(&out[0]), made(&out[2]));
    assert!((40_000..60_000).contains(&first), "{out:?}");
    // Dropped with the first step's tensors, the memory is there again.
    assert!(again.abs_diff(first) < 1000, "{out:?}");
    for refused in [&out[1], &out[3]] {
        assert!(
            refused.starts_with("tensor error: out of memory: a tensor of 128 B would take the rank past its memory limit of 8 MiB"),
            "{out:?}"
        );
    }
}

#[test]
fn a_rank_holds_a_bounded_number_of_tensors() {
    // Below wasmtime's 100 000 handles a store may hold, whose trap would
    // say nothing of tensors.
    let run = run(1, json!([{"tensor_empty": 95_000}, {"tensor_empty": 10}]));
    run.assert_ok();
    let out = run.stdout(0);
    assert_eq!(out[0], "tensor_empty: 90000 made", "{out:?}");
    assert_eq!(
        out[1],
        "tensor error: out of memory: a tensor would make the rank hold more than 90000 tensors and programs at once (it holds 90000); drop those it no longer uses"
    );
    // Dropped, they make room again.
    assert_eq!(out[2..], ["tensor_empty: 10 made"], "{out:?}");
}

#[test]
fn a_failing_rank_stops_another_inside_a_long_kernel() {
    stops_inside_a_long_gemm("tensor_gemm");
}

/// One GEMM of 2 × 4096 × 8192 × 4096 ≈ 275 GFLOP, seconds on any
/// machine, made by the step `step` (printing `STEP: done`): first alone,
/// to know how long it takes here, then while rank 1 fails. Rank 0 is
/// stopped between two blocks of the GEMM, not at its end.
pub(crate) fn stops_inside_a_long_gemm(step: &str) {
    let gemm = json!({step: 4096, "ranks": [0]});
    let started = Instant::now();
    let alone = run(1, json!([gemm]));
    let whole = started.elapsed();
    alone.assert_ok();
    assert_eq!(alone.stdout(0), [format!("{step}: done")]);

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

#[test]
fn an_all_reduce_of_a_list_of_tensors_is_one_all_reduce_of_their_values() {
    // One rank's values stay in its tensors, unchanged (the mean too).
    for (ranks, op) in [(3, "sum"), (3, "max"), (1, "mean"), (1, "min")] {
        let run = run(
            ranks,
            json!([{"tensor_all_reduce_list": [300, 1, 699], "op": op}]),
        );
        run.assert_ok();
        let want = crate::collective::expected(ranks, "f32", op, 1000);
        for r in 0..ranks {
            assert_eq!(run.stdout(r), std::slice::from_ref(&want), "rank {r}, {op}");
        }
    }
    // Matched with a list all-reduce and a single tensor of the same count.
    let run = run(
        3,
        json!([
            {"tensor_all_reduce_list": [4, 6], "ranks": [0]},
            {"tensor_all_reduce": 10, "ranks": [1]},
            {"all_reduce": "f32", "len": 10, "ranks": [2]},
        ]),
    );
    run.assert_ok();
    assert_eq!(run.stdout(0), run.stdout(1));
    assert_eq!(run.stdout(0), run.stdout(2));
}

#[test]
fn a_tensor_listed_twice_stops_the_run_instead_of_leaving_the_others_waiting() {
    let run = run(
        2,
        json!([{"tensor_all_reduce_twice": true, "ranks": [0]}, {"barrier": true}]),
    );
    let e = run.result.error.clone().expect("the run fails");
    assert_eq!(e.kind, FailureKind::Trap, "{e}");
    assert!(
        e.to_string()
            .contains("the same tensor is in the list twice"),
        "{e}"
    );
}

#[test]
fn a_tensor_broadcast_gives_every_rank_the_roots_values() {
    let done = run(3, json!([{"tensor_broadcast": 100, "root": 1}]));
    done.assert_ok();
    let root = done.stdout(1);
    assert!(root[0].starts_with("tensor_broadcast: "), "{root:?}");
    assert_eq!(done.stdout(0), root);
    assert_eq!(done.stdout(2), root);
    // Its values are rank 1's.
    let ones: Vec<u8> = (0..100)
        .flat_map(|i| (crate::collective::value(1, i) as f32).to_le_bytes())
        .collect();
    assert_eq!(
        root[0],
        format!("tensor_broadcast: {:016x}", crate::collective::fnv(&ones))
    );

    // A list broadcast meets it; a rank whose tensor is of another size
    // fails the run.
    let failed = run(
        3,
        json!([
            {"broadcast": "", "root": 0, "ranks": [0]},
            {"tensor_broadcast": 0, "root": 0, "ranks": [1]},
            {"tensor_broadcast": 3, "root": 0, "ranks": [2]},
        ]),
    );
    let e = failed.result.error.clone().expect("the run fails");
    assert!(
        e.to_string()
            .contains("rank 0 sent 0 values, but this rank's tensor of shape [3] holds 3"),
        "{e}"
    );
}

#[test]
fn adam_steps_in_the_host_and_refuses_aliased_tensors() {
    let run = run(1, json!([{"tensor_adam": true}]));
    run.assert_ok();
    assert_eq!(
        run.stdout(0),
        [
            "tensor_adam: [0.9900, 1.0100, 0.9900]",
            "tensor error: adam: each tensor it writes must be a tensor of its own, passed once and not also as one it reads"
        ]
    );
}

/// The kernels treat subnormal values as zero on x86-64 (R46), and the
/// guest's own maths after a kernel call, on the thread that ran it, still
/// computes them as WebAssembly says.
#[test]
fn kernels_flush_subnormals_and_the_guests_own_maths_keeps_them() {
    let run = run(2, json!([{"tensor_subnormal": true}]));
    run.assert_ok();
    // m / 2 and m (f32's smallest normal value) halved, and 0.5.
    let host = match cfg!(target_arch = "x86_64") {
        true => "00000000,00000000,3f000000",
        false => "00200000,00400000,3f000000",
    };
    for rank in 0..2 {
        assert_eq!(
            run.stdout(rank),
            [format!(
                "tensor_subnormal: host {host} guest 00200000,00400000,3f000000"
            )]
        );
    }
}

/// The fused kernels give a step the values of the separate ones, with
/// biases and without, and refuse a tensor written twice or written and
/// read by one call, and lists of different lengths.
#[test]
fn fused_kernels_step_like_the_separate_ones_and_refuse_aliases() {
    let run = run(1, json!([{"tensor_fused": true}]));
    run.assert_ok();
    let own = "each tensor it writes must be a tensor of its own, passed once and not also as one it reads";
    assert_eq!(
        run.stdout(0),
        [
            "tensor_fused: same true (bias true)".to_string(),
            "tensor_fused: same true (bias false)".to_string(),
            format!("tensor error: dense-backward: {own}"),
            format!("tensor error: sgd-momentum-list: {own}"),
            format!("tensor error: dense: {own}"),
            "tensor error: sgd-momentum-list: 1 params, 2 velocities and 1 gradients; \
             the lists must be as long"
                .to_string(),
        ]
    );
}

#[test]
fn tensors_saved_by_the_host_are_committed_and_load_back_after_a_restart() {
    // The first attempt saves and reports; a run again by name restores
    // the checkpoint (its `attempt` file says 1) and loads from it.
    let steps = json!([
        {"mkdir": "ckpt", "when_attempt": [0]},
        {"tensor_save": "ckpt/model.safetensors", "seed": 5, "when_attempt": [0]},
        {"write": "ckpt/attempt", "text": "{next_attempt}", "when_attempt": [0]},
        {"report": {"step": 0}, "checkpoint": "ckpt", "when_attempt": [0]},
        {"tensor_load": "ckpt/model.safetensors", "when_attempt": [0]},
        {"tensor_load": "model.safetensors", "from_checkpoint": true, "when_attempt": [1]},
    ]);
    let first = run(1, steps.clone());
    first.assert_ok();
    let out = first.stdout(0);
    assert_eq!(out[..2], ["tensor_save: ok", "report ok"]);
    let loaded = out[2..].to_vec();
    assert!(
        loaded.len() == 2
            && loaded[0].starts_with("tensor_load: b [5] ")
            && loaded[1].starts_with("tensor_load: w [3, 5] "),
        "{loaded:?}"
    );
    // The committed file is a safetensors file as the crate reads it, and
    // nothing was left beside it.
    let dirs = checkpoint_dirs(&first.dir());
    let ckpt = first.dir().join(&dirs[0]);
    assert_eq!(files(&ckpt), ["attempt", "model.safetensors"]);
    let bytes = std::fs::read(ckpt.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(file.tensor("w").unwrap().shape(), [3, 5]);

    // The run again, by name: the restored file gives the same tensors.
    let (builder, unused, lines) = scripted(1, steps);
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: first.storage.path().display().to_string(),
        ..Default::default()
    });
    let second = finish(builder, unused, lines);
    second.assert_ok();
    assert_eq!(second.stdout(0), loaded);
}

#[test]
fn tensor_files_stay_in_the_sandbox_and_other_files_are_refused() {
    let run = run(
        1,
        json!([
            {"tensor_save": "/etc/model.safetensors"},
            {"tensor_save": "../model.safetensors"},
            {"tensor_save": "missing/model.safetensors"},
            {"tensor_save": "/checkpoints/model.safetensors"},
            {"tensor_load": "nothing.safetensors"},
            {"write": "text.safetensors", "text": "no tensors here"},
            {"tensor_load": "text.safetensors"},
        ]),
    );
    run.assert_ok();
    let out = run.stdout(0);
    let expected = [
        "outside the sandbox",
        "contains '..'",
        "\"missing/model.safetensors\" does not exist",
        "is in a restored checkpoint, which is read-only",
        "\"nothing.safetensors\" does not exist",
        "\"text.safetensors\": not a safetensors file",
    ];
    assert_eq!(out.len(), expected.len(), "{out:?}");
    for (line, fragment) in out.iter().zip(expected) {
        assert!(
            line.starts_with("tensor error: ") && line.contains(fragment),
            "{line:?} should say {fragment:?}"
        );
    }
}

#[test]
fn a_forged_or_stale_handle_stops_the_rank_and_another_ranks_handles_name_nothing() {
    let stale = run(1, json!([{"tensor_stale_handle": true}]));
    // Rank 0 holds tensors; rank 1, holding none, names the number of one:
    // in rank 1's own table it is another resource, or nothing.
    let foreign = run(
        2,
        json!([
            {"tensor_hold_mb": 1, "count": 3, "ranks": [0]},
            {"barrier": true},
            {"tensor_forged_handle": 2, "ranks": [1]},
            {"barrier": true},
        ]),
    );
    for run in [stale, foreign] {
        let e = run.result.error.clone().expect("the run fails");
        assert_eq!(e.kind, FailureKind::Trap, "{e}");
        let message = e.to_string();
        assert!(
            message.contains("unknown handle index")
                || message.contains("used with the wrong type"),
            "{e}"
        );
    }
}
