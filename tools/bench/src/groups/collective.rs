//! Collectives: all-reduce against the memory traffic it cannot avoid, a
//! small all-reduce against `report`, and data-parallel scaling of the
//! digits example.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use serde_json::{Value, json};
use trainhost::{MetricValue, ScalingConfig, Trainer};
use trainhost_bench_kernel::Loops;
use trainhost_test_artifacts::DIGITS_MLP;

use crate::common::{Lines, Paired, Row, Sampling, local_run, median, metric, run_guest};
use crate::goals;

const SIZES: [(usize, &str); 3] = [(4 << 10, "4 KiB"), (1 << 20, "1 MiB"), (64 << 20, "64 MiB")];

pub(crate) fn collective(quick: bool) -> Result<Vec<Row>> {
    // A pass of the group takes a few seconds, and the digits example's
    // scaling lies within a few percent of its goal: as many samples as
    // any row.
    let reps = Sampling::Standard.per_pass(quick);
    let storage = tempfile::tempdir()?;
    let mut rows = Vec::new();
    for ranks in [2u32, 4] {
        for (bytes, name) in SIZES {
            let floats = bytes / 4;
            let calls = match (bytes, quick) {
                (b, false) if b >= 64 << 20 => 7,
                (b, true) if b >= 64 << 20 => 3,
                (b, false) if b >= 1 << 20 => 200,
                (b, true) if b >= 1 << 20 => 30,
                (_, false) => 5_000,
                (_, true) => 500,
            };
            let (mut floor, mut report, mut exchange) =
                (Paired::default(), Paired::default(), Paired::default());
            for _ in 0..reps {
                let result = run_guest(
                    json!({"mode": "all_reduce", "floats": floats, "calls": calls}),
                    ranks,
                    local_run(storage.path()),
                    Arc::default(),
                )?;
                let ours = metric(&result, "all_reduce_ns")?;
                let floor_ns = copy_floor(ranks as usize, bytes, calls);
                floor.push(floor_ns, ours);
                report.push(metric(&result, "report_ns")?, ours);
                // Threads are started for each round here (the ranks'
                // threads exist already): only at 64 MiB is that noise.
                if bytes >= 64 << 20 {
                    let alone = trainhost::bench::all_reduce_exchange(
                        ranks as usize,
                        floats,
                        calls.min(21),
                    ) * 1e9;
                    exchange.push(floor_ns, alone);
                }
            }
            let judged = bytes == 64 << 20;
            rows.push(floor.row(
                "collective",
                format!("all-reduce of {name} f32 (sum), {ranks} ranks, as the guest calls it"),
                format!("{ranks} threads each copying its {name} to another buffer at once (the floor: every rank's buffer read, a result written to every rank)"),
                if judged {
                    format!("≤ {} × the copy", goals::ALL_REDUCE_VS_COPY)
                } else {
                    goals::comparison("the goal is stated for 64 MiB")
                },
                move |b, o| judged.then_some(o / b <= goals::ALL_REDUCE_VS_COPY),
            ));
            if bytes >= 64 << 20 {
                rows.push(exchange.row(
                    "collective",
                    format!("the exchange alone, {name}, {ranks} ranks (no guest, no canonical ABI copies)"),
                    "the same copy".into(),
                    goals::comparison("where the time of the row above goes"),
                    |_, _| None,
                ));
            }
            if bytes == 4 << 10 {
                rows.push(report.row(
                    "collective",
                    format!("all-reduce of 4 KiB f32, {ranks} ranks"),
                    "`report` without checkpoint, same ranks, same run".into(),
                    format!(
                        "same order as `report` (< {} ×)",
                        goals::SMALL_ALL_REDUCE_VS_REPORT
                    ),
                    |b, o| Some(o / b < goals::SMALL_ALL_REDUCE_VS_REPORT),
                ));
            }
        }
    }
    rows.extend(scaling(quick, reps)?);
    Ok(rows)
}

/// Nanoseconds per round of `ranks` threads each copying its own `bytes`
/// into a second buffer, all at once, `rounds` times: the memory traffic of
/// an all-reduce (each rank's data read once, a result written to each
/// rank) with nothing else. The slowest thread's time per round.
fn copy_floor(ranks: usize, bytes: usize, rounds: u32) -> f64 {
    let barrier = std::sync::Barrier::new(ranks);
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..ranks)
            .map(|r| {
                let barrier = &barrier;
                s.spawn(move || {
                    let src = vec![r as u8 + 1; bytes];
                    let mut dst = vec![0u8; bytes];
                    // Touch both before timing, as the guest's buffers are.
                    dst.copy_from_slice(&src);
                    barrier.wait();
                    let started = Instant::now();
                    for _ in 0..rounds {
                        dst.copy_from_slice(std::hint::black_box(&src));
                        std::hint::black_box(&mut dst);
                    }
                    started.elapsed().as_nanos() as f64 / f64::from(rounds)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a copying thread does not panic"))
            .fold(0.0, f64::max)
    })
}

/// Samples per second of the digits example's training steps, the median
/// over its epochs after the first.
fn samples_per_second(workers: u32, config: &Value) -> Result<f64> {
    let storage = tempfile::tempdir()?;
    let result = Trainer::builder(DIGITS_MLP)
        .train_loop_config(config.clone())
        .scaling_config(ScalingConfig {
            num_workers: workers,
        })
        .run_config(local_run(storage.path()))
        .output(Arc::new(Lines::default()))
        .build()?
        .fit()?;
    if let Some(e) = &result.error {
        bail!("the digits example failed: {e}");
    }
    let rates: Vec<f64> = result
        .metrics_history
        .iter()
        .skip(1)
        .filter_map(|r| {
            r.metrics
                .get("samples_per_second")
                .and_then(MetricValue::as_f64)
        })
        .collect();
    if rates.is_empty() {
        bail!("the digits example reported no samples_per_second");
    }
    Ok(median(rates))
}

/// Nanoseconds per million SGD steps (`tools/bench/kernel`, natively) of
/// `threads` threads each stepping its own model at the same time.
fn native_sgd(threads: u32) -> f64 {
    const STEPS: u32 = 100_000;
    let per_step = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| s.spawn(|| trainhost_bench_kernel::time_sgd(STEPS, 256, 64, Loops::Plain).0))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("the kernel does not panic"))
            .fold(0.0, f64::max)
    });
    per_step * 1e6 / f64::from(threads)
}

/// Data-parallel scaling: the digits example with 2 ranks against 1. The
/// rows show time per million samples (lower is better, as in every other
/// row); the goal is on samples per second, the inverse ratio.
fn scaling(quick: bool, reps: usize) -> Result<Vec<Row>> {
    // Epochs of the demo's model take a few milliseconds: enough of them
    // that a hiccup of the machine moves the median little.
    let (small, large) = if quick { (10, 4) } else { (100, 30) };
    let configs = [
        (
            json!({"num_epochs": small, "checkpoint_every": 1000}),
            "the demo's model (64 hidden units, global batch 32: 16 samples per rank and step)",
        ),
        (
            json!({"num_epochs": large, "hidden": 256, "batch_size": 256, "checkpoint_every": 1000}),
            "a larger step (256 hidden units, global batch 256)",
        ),
    ];
    let mut rows = Vec::new();
    // What this machine gives two threads that do not communicate at all,
    // measured beside the example: on a virtual machine two cores may be
    // one physical core's two hyperthreads, or busy with a neighbour.
    let mut native = Paired::default();
    for _ in 0..reps {
        native.push(native_sgd(1), native_sgd(2));
    }
    rows.push(native.row(
        "collective",
        "2 threads each running the SGD kernel natively, no communication: time per million steps".into(),
        "1 thread".into(),
        goals::comparison("the machine's own ceiling for 2 threads, for the rows below"),
        |_, _| None,
    ));
    for (config, what) in configs {
        let mut pairs = Paired::default();
        for _ in 0..reps {
            // Time per million samples, so that lower is better as in
            // every other row.
            let one = 1e15 / samples_per_second(1, &config)?;
            let two = 1e15 / samples_per_second(2, &config)?;
            pairs.push(one, two);
        }
        rows.push(pairs.row(
            "collective",
            format!("digits example, 2 ranks, time per million samples: {what}"),
            "1 rank".into(),
            format!(
                "≥ {} × the samples/s of 1 rank (ratio ≤ {:.3})",
                goals::SCALING_2_RANKS,
                1.0 / goals::SCALING_2_RANKS
            ),
            |b, o| Some(b / o >= goals::SCALING_2_RANKS),
        ));
    }
    Ok(rows)
}
