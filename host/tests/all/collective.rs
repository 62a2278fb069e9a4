//! Collectives between ranks (R29–R33): every operation and type against a
//! reference computed here, mismatches, a rank failing while others wait,
//! one rank, and the memory limit.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use trainhost::{FailureConfig, FailureKind, Interruption, MaxFailures, RunConfig};

use crate::util::*;

/// Element `i` of `rank`'s input, as the test guest computes it.
pub(crate) fn value(rank: u32, i: usize) -> i64 {
    ((i * 7919 + rank as usize * 104_729) % 1000) as i64
}

pub(crate) fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Combine in rank order, as R29 promises.
fn reduce<T: Copy>(
    ranks: u32,
    len: usize,
    of: impl Fn(u32, usize) -> T,
    f: impl Fn(T, T) -> T,
) -> Vec<T> {
    (0..len)
        .map(|i| (1..ranks).fold(of(0, i), |acc, r| f(acc, of(r, i))))
        .collect()
}

/// The line the guest prints for an all-reduce of `dtype` with `op`.
pub(crate) fn expected(ranks: u32, dtype: &str, op: &str, len: usize) -> String {
    let bytes: Vec<u8> = match dtype {
        "f32" => {
            let of = |r, i| value(r, i) as f32 / 7.0 - 60.0;
            let v = match op {
                "sum" => reduce(ranks, len, of, |a, b| a + b),
                "mean" => reduce(ranks, len, of, |a, b| a + b)
                    .into_iter()
                    .map(|x| x / ranks as f32)
                    .collect(),
                "min" => reduce(ranks, len, of, f32::min),
                _ => reduce(ranks, len, of, f32::max),
            };
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        }
        "f64" => {
            let of = |r, i| value(r, i) as f64 / 7.0 - 60.0;
            let v = match op {
                "sum" => reduce(ranks, len, of, |a, b| a + b),
                "mean" => reduce(ranks, len, of, |a, b| a + b)
                    .into_iter()
                    .map(|x| x / f64::from(ranks))
                    .collect(),
                "min" => reduce(ranks, len, of, f64::min),
                _ => reduce(ranks, len, of, f64::max),
            };
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        }
        _ => {
            let of = |r, i| (value(r, i) - 500) * (i64::MAX / 600);
            let v = match op {
                "sum" => reduce(ranks, len, of, i64::wrapping_add),
                "min" => reduce(ranks, len, of, i64::min),
                _ => reduce(ranks, len, of, i64::max),
            };
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        }
    };
    format!("all_reduce: {len} {:016x}", fnv(&bytes))
}

fn cases() -> Vec<(&'static str, &'static str, usize)> {
    let mut cases = Vec::new();
    for dtype in ["f32", "f64", "s64"] {
        for op in ["sum", "mean", "min", "max"] {
            if dtype == "s64" && op == "mean" {
                continue;
            }
            // Done by one thread, and split across the ranks.
            cases.push((dtype, op, 1001));
            cases.push((dtype, op, 100_003));
        }
    }
    cases
}

#[test]
fn every_operation_and_type_gives_every_rank_the_reference_result() {
    for ranks in [1, 3] {
        let mut steps: Vec<Value> = cases()
            .iter()
            .map(|(dtype, op, len)| json!({"all_reduce": dtype, "op": op, "len": len}))
            .collect();
        steps.extend([
            json!({"barrier": true}),
            json!({"broadcast": "from {rank}", "root": ranks - 1}),
            json!({"all_gather": "r{rank}"}),
            // Collectives and reports interleave.
            json!({"report": {"i": 0}}),
            json!({"all_gather": "after report {rank}"}),
        ]);
        let run = run(ranks, Value::Array(steps));
        run.assert_ok();
        let mut want: Vec<String> = cases()
            .iter()
            .map(|(dtype, op, len)| expected(ranks, dtype, op, *len))
            .collect();
        let names: Vec<String> = (0..ranks).map(|r| format!("r{r}")).collect();
        let after: Vec<String> = (0..ranks).map(|r| format!("after report {r}")).collect();
        want.extend([
            "barrier ok".to_owned(),
            format!("broadcast: from {}", ranks - 1),
            format!("all_gather: {}", names.join("|")),
            "report ok".to_owned(),
            format!("all_gather: {}", after.join("|")),
        ]);
        for r in 0..ranks {
            assert_eq!(run.stdout(r), want, "rank {r} of {ranks}");
        }
        assert_eq!(run.result.metrics_history.len(), 1);
    }
}

/// A rank whose f32 list the host copies (`collective.all-reduce-f32`, as
/// a Python guest and the Rust SDK below 1 MiB call it) meets ranks
/// whose lists it reads where they lie (`collective-bits`, the Rust SDK's
/// call from 1 MiB): every rank gets the reference result, combined
/// by one thread and split across the ranks.
#[test]
fn ranks_lending_their_values_and_ranks_copying_them_get_the_same_result() {
    let ranks = 3;
    let mut cases = Vec::new();
    for op in ["sum", "mean", "min", "max"] {
        for len in [1001, 100_003] {
            cases.push((op, len));
        }
    }
    let steps: Vec<Value> = cases
        .iter()
        .flat_map(|(op, len)| {
            [
                json!({"all_reduce": "f32", "op": op, "len": len, "into": "list", "ranks": [0]}),
                json!({"all_reduce": "f32", "op": op, "len": len, "into": "bits", "ranks": [1, 2]}),
            ]
        })
        .collect();
    let run = run(ranks, Value::Array(steps));
    run.assert_ok();
    let want: Vec<String> = cases
        .iter()
        .map(|(op, len)| expected(ranks, "f32", op, *len))
        .collect();
    for r in 0..ranks {
        assert_eq!(run.stdout(r), want, "rank {r}");
    }
}

/// The SDK takes a `Vec` (replaced by the host's list), a slice or an array
/// (the result copied in): the same result either way, whether the host
/// copies the values (f32 below 1 MiB) or reads them where they lie
/// (from 1 MiB), and on an error the values stay as they were (the
/// guest checks that).
#[test]
fn a_vec_a_slice_and_an_array_get_the_same_result() {
    let ranks = 3;
    let cases = [
        ("f32", "sum", 100_003, "vec"),
        ("f32", "sum", 100_003, "slice"),
        ("f32", "mean", 300_007, "vec"),
        ("f32", "max", 300_007, "slice"),
        ("f64", "mean", 1001, "slice"),
        ("s64", "max", 4, "vec"),
        ("s64", "max", 4, "slice"),
        ("s64", "max", 4, "array"),
        ("f32", "min", 4, "array"),
    ];
    let mut steps: Vec<Value> = cases
        .iter()
        .map(|(dtype, op, len, into)| {
            json!({"all_reduce": dtype, "op": op, "len": len, "into": into})
        })
        .collect();
    for into in ["vec", "slice", "array"] {
        steps.push(json!({"all_reduce": "s64", "op": "mean", "len": 4, "into": into}));
    }
    let run = run(ranks, Value::Array(steps));
    run.assert_ok();
    let mut want: Vec<String> = cases
        .iter()
        .map(|(dtype, op, len, _)| expected(ranks, dtype, op, *len))
        .collect();
    want.extend(
        ["vec", "slice", "array"]
            .map(|_| "collective error: invalid collective call: the mean of s64".to_owned()),
    );
    for r in 0..ranks {
        let out = run.stdout(r);
        assert_eq!(out.len(), want.len(), "rank {r}: {out:?}");
        for (line, want) in out.iter().zip(&want) {
            assert!(
                line.starts_with(want.as_str()),
                "rank {r}: {line:?}, want {want:?}"
            );
        }
    }
}

#[test]
fn the_mean_of_integers_is_refused_on_every_rank_and_the_run_goes_on() {
    let run = run(
        2,
        json!([
            {"all_reduce": "s64", "op": "mean", "len": 3},
            {"barrier": true},
        ]),
    );
    run.assert_ok();
    for r in 0..2 {
        let out = run.stdout(r);
        assert!(
            out[0].starts_with("collective error: invalid collective call: the mean of s64"),
            "{out:?}"
        );
        assert_eq!(out[1], "barrier ok");
    }
}

/// Run `steps` on two ranks; the run must fail with a protocol error, fast.
fn mismatch(steps: Value) -> (Run, String) {
    // Interrupted only in host calls, so that each guest surely prints the
    // error it got before the stop reaches it.
    let (builder, storage, lines) = scripted(2, steps);
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        report_timeout: Duration::from_secs(60),
        interruption: Interruption::AtHostCalls,
        ..Default::default()
    });
    let started = Instant::now();
    let run = finish(builder, storage, lines);
    let e = run.result.error.clone().expect("the run must fail");
    assert_eq!(e.kind, FailureKind::Protocol, "{e}");
    // Not after the 60 s report timeout.
    assert!(started.elapsed() < Duration::from_secs(30));
    let msg = e.to_string();
    (run, msg)
}

#[test]
fn calls_that_do_not_match_fail_the_run_naming_each_rank_and_call() {
    let (run, msg) = mismatch(json!([
        {"broadcast": "x", "root": 0, "ranks": [0]},
        {"all_reduce": "f32", "len": 10, "ranks": [1]},
    ]));
    assert!(
        msg.contains("the 1st collective call does not match: rank 0 called broadcast from rank 0, rank 1 called all-reduce (sum) of 10 f32"),
        "{msg}"
    );
    // Each rank's guest was told, with the same message.
    for r in 0..2 {
        assert!(
            run.stdout(r)
                .iter()
                .any(|l| l.starts_with("collective error: collective protocol violation: the 1st collective call does not match")),
            "{:?}",
            run.stdout(r)
        );
    }

    let (_, msg) = mismatch(json!([
        {"all_reduce": "f64", "len": 10, "ranks": [0]},
        {"all_reduce": "f64", "len": 11, "ranks": [1]},
    ]));
    assert!(
        msg.contains("of 10 f64, rank 1 called all-reduce (sum) of 11 f64"),
        "{msg}"
    );

    let (_, msg) = mismatch(json!([
        {"all_reduce": "f32", "len": 4, "op": "sum", "ranks": [0]},
        {"all_reduce": "f32", "len": 4, "op": "max", "ranks": [1]},
    ]));
    assert!(
        msg.contains(
            "rank 0 called all-reduce (sum) of 4 f32, rank 1 called all-reduce (max) of 4 f32"
        ),
        "{msg}"
    );

    let (_, msg) = mismatch(json!([
        {"broadcast": "x", "root": 0, "ranks": [0]},
        {"broadcast": "x", "root": 1, "ranks": [1]},
    ]));
    assert!(
        msg.contains("rank 0 called broadcast from rank 0, rank 1 called broadcast from rank 1"),
        "{msg}"
    );

    let (_, msg) = mismatch(json!([
        {"report": {"i": 0}, "ranks": [0]},
        {"barrier": true, "ranks": [1]},
    ]));
    assert!(
        msg.contains("rank 0 called report, rank 1 called barrier"),
        "{msg}"
    );
}

#[test]
fn a_collective_after_another_rank_returned_is_a_mismatch() {
    let (_, msg) = mismatch(json!([
        {"barrier": true},
        {"all_gather": "x", "ranks": [1]},
    ]));
    assert!(
        msg.contains("rank 0 returned from train after 1 collective calls"),
        "{msg}"
    );
    assert!(
        msg.contains("ranks [1] wait in their 2nd (all-gather of 1 bytes)")
            || msg.contains("rank 1 called all-gather of 1 bytes as its 2nd collective call"),
        "{msg}"
    );
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_it() {
    let (builder, storage, lines) = scripted(
        2,
        json!([
            {"barrier": true, "ranks": [0]},
            {"sleep_ms": 60_000, "ranks": [1]},
        ]),
    );
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        report_timeout: Duration::from_millis(300),
        ..Default::default()
    });
    let started = Instant::now();
    let run = finish(builder, storage, lines);
    let msg = run.error();
    assert!(
        msg.contains("ranks [0] waited 300ms in their 1st collective call (barrier) for ranks [1]"),
        "{msg}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_rank_trapping_while_others_wait_in_all_reduce_restarts_the_gang_from_its_checkpoint() {
    let (builder, storage, lines) = scripted(
        3,
        json!([
            {"write": "ck/attempt", "text": "{next_attempt}", "ranks": [0]},
            {"report": {"attempt": "{attempt}"}, "checkpoint": "ck", "ranks": [0]},
            {"report": {"attempt": "{attempt}"}, "ranks": [1, 2]},
            {"spin_ms": 100, "ranks": [1], "when_attempt": [0]},
            {"panic": "rank 1 breaks", "ranks": [1], "when_attempt": [0]},
            {"all_reduce": "f32", "len": 100_003, "op": "mean"},
            {"print": "done in attempt {attempt}"},
        ]),
    );
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        report_timeout: Duration::from_secs(60),
        failure_config: FailureConfig {
            max_failures: MaxFailures::Limited(1),
        },
        ..Default::default()
    });
    let started = Instant::now();
    let run = finish(builder, storage, lines);
    run.assert_ok();
    assert_eq!(run.result.failures, 1);
    // Released at once, not after the 60 s timeout.
    assert!(started.elapsed() < Duration::from_secs(30));
    let want = expected(3, "f32", "mean", 100_003);
    for r in 0..3 {
        let out = run.stdout(r);
        // Attempt 0 never got past the all-reduce; attempt 1 restored the
        // checkpoint and finished.
        assert!(!out.contains(&"done in attempt 0".to_owned()), "{out:?}");
        assert_eq!(out.last().unwrap(), "done in attempt 1", "{out:?}");
        assert!(out.contains(&want), "{out:?}");
    }
}

#[test]
fn a_rank_told_the_run_is_stopping_is_stopped_by_its_next_call() {
    // Interrupted only in host calls, so that the guest surely runs on
    // after the error and makes its next call.
    let (builder, storage, lines) = scripted(
        2,
        json!([
            {"collective_until_stopped": true, "ranks": [0]},
            {"spin_ms": 100, "ranks": [1]},
            {"fail": "rank 1 gives up", "ranks": [1]},
        ]),
    );
    let builder = builder.run_config(RunConfig {
        name: Some("t".into()),
        storage_path: storage.path().display().to_string(),
        interruption: Interruption::AtHostCalls,
        ..Default::default()
    });
    let run = finish(builder, storage, lines);
    assert_eq!(
        run.result.error.as_ref().unwrap().kind,
        FailureKind::GuestError
    );
    let out = run.stdout(0);
    assert!(
        out.iter()
            .any(|l| l.starts_with("collective error: collective call aborted")),
        "{out:?}"
    );
    assert!(
        !out.iter().any(|l| l.starts_with("called again")),
        "{out:?}"
    );
}

#[test]
fn a_lone_ranks_tensor_all_reduce_is_aborted_when_the_run_stops() {
    // With one rank a tensor's all-reduce makes no round (its values are
    // their own result), yet a stopping run still aborts it (R31).
    // Interrupted only in host calls, so that the guest surely runs on
    // after the error and makes its next call.
    let (builder, storage, lines) = scripted(1, json!([{"collective_until_stopped": "tensor"}]));
    let (builder, preemption) = preemptible_by(
        builder,
        &storage,
        Duration::from_millis(100),
        Interruption::AtHostCalls,
    );
    let asking = request_after(&preemption, Duration::from_millis(200));
    let run = finish(builder, storage, lines);
    asking.join().unwrap();
    assert!(run.result.preempted, "{:?}", run.result.error);
    let out = run.stdout(0);
    assert!(
        out.iter().any(
            |l| l.starts_with("collective error: collective call aborted")
                && l.contains("grace period ran out")
        ),
        "{out:?}"
    );
    assert!(
        !out.iter().any(|l| l.starts_with("called again")),
        "{out:?}"
    );
}

#[test]
fn one_rank_gets_its_own_data_back() {
    let run = run(
        1,
        json!([
            {"barrier": true},
            {"broadcast": "solo", "root": 0},
            {"all_gather": "solo"},
            {"all_reduce": "f64", "len": 5, "op": "mean"},
        ]),
    );
    run.assert_ok();
    assert_eq!(
        run.stdout(0),
        [
            "barrier ok".to_owned(),
            "broadcast: solo".to_owned(),
            "all_gather: solo".to_owned(),
            expected(1, "f64", "mean", 5),
        ]
    );
}

#[test]
fn a_result_over_the_memory_limit_is_refused_before_it_is_allocated() {
    let (builder, storage, lines) = scripted(
        2,
        json!([
            // 2 × 40 MiB gathered into every rank: over 64 MiB.
            {"all_gather": "", "bytes": 40 << 20},
            {"all_gather": "small {rank}"},
        ]),
    );
    let builder = with_max_memory(builder, &storage, 64 << 20);
    let run = finish(builder, storage, lines);
    run.assert_ok();
    for r in 0..2 {
        let out = run.stdout(r);
        assert!(
            out[0]
                .starts_with("collective error: invalid collective call: the result of all-gather")
                && out[0].contains("over the ranks' memory limit of 64 MiB (--max-memory)"),
            "{out:?}"
        );
        assert_eq!(out[1], "all_gather: small 0|small 1");
    }
}
