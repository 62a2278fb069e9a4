//! `report` without a checkpoint: per round, quiet and under load.

use std::sync::Arc;

use anyhow::Result;
use serde_json::json;
use trainhost::RunConfig;

use crate::common::{Paired, Row, Sampling, local_run, metric, run_guest};
use crate::goals;
use crate::load::Load;

pub(crate) fn report(quick: bool) -> Result<Vec<Row>> {
    let reports = if quick { 2_000 } else { 20_000 };
    let storage = tempfile::tempdir()?;
    // One run of `workers` ranks: per round, and per trivial host call.
    let measure = |workers: u32, background: bool| -> Result<(f64, f64)> {
        let result = run_guest(
            json!({"mode": "report", "reports": reports}),
            workers,
            RunConfig {
                persist_in_background: background,
                ..local_run(storage.path())
            },
            Arc::default(),
        )?;
        Ok((metric(&result, "report_ns")?, metric(&result, "call_ns")?))
    };
    let row = |pairs: &Paired, measure, baseline_name, goal, judged: bool| {
        pairs.row("report", measure, baseline_name, goal, move |_, o| {
            judged.then_some(o <= goals::REPORT_NS)
        })
    };
    let goal = format!(
        "≤ {} µs a round (Ray: 2 s default, 4 ms tuned)",
        goals::REPORT_NS / 1e3
    );
    // A run takes a second or less: as many samples as any row, so that the
    // goal's verdict and the range rest on more than three rounds of the
    // scheduler's dice (with every core busy a run lands in one of two
    // states, see BENCHMARKS.md).
    let reps = Sampling::Standard.per_pass(quick);
    let mut rows = Vec::new();
    let mut waiting = Paired::default();
    for _ in 0..reps {
        let (blocking_ns, _) = measure(1, false)?;
        let (report_ns, _) = measure(1, true)?;
        waiting.push(blocking_ns, report_ns);
    }
    for workers in [1, 2, 4, 16] {
        let (mut quiet, mut barrier, mut loaded) =
            (Paired::default(), Paired::default(), Paired::default());
        for _ in 0..reps {
            let (report_ns, call_ns) = measure(workers, true)?;
            quiet.push(call_ns, report_ns);
            if workers > 1 {
                barrier.push(barrier_round(workers, reports), report_ns);
                // The same with every core busy with other work, as on a
                // shared training machine: a waiting rank must not take
                // the core the rank it waits for needs.
                let load = Load::start(true, false)?;
                let (loaded_ns, call_ns) = measure(workers, true)?;
                drop(load);
                loaded.push(call_ns, loaded_ns);
            }
        }
        rows.push(row(
            &quiet,
            format!("`report` without checkpoint, {workers} rank(s)"),
            "a trivial host call (`world-rank`)".into(),
            goal.clone(),
            true,
        ));
        if workers == 1 {
            rows.push(row(
                &waiting,
                "`report` without checkpoint, 1 rank: background vs --wait-for-upload".into(),
                "--wait-for-upload (history stored per report)".into(),
                goals::comparison("what waiting for storage costs"),
                false,
            ));
            continue;
        }
        rows.push(row(
            &barrier,
            format!("`report` without checkpoint, {workers} ranks, as above"),
            format!(
                "{workers} threads meeting at a `std::sync::Barrier` (the same meeting, no guest)"
            ),
            goals::comparison("what the OS's own meeting of as many threads costs"),
            false,
        ));
        rows.push(row(
            &loaded,
            format!("`report` without checkpoint, {workers} rank(s), a busy thread on every core"),
            "a trivial host call (`world-rank`), same load".into(),
            format!("≤ {} µs a round", goals::REPORT_NS / 1e3),
            true,
        ));
    }
    Ok(rows)
}

/// Nanoseconds per round of `threads` threads meeting `rounds` times at a
/// `std::sync::Barrier`: what meeting that many OS threads costs on this
/// machine, without a guest.
fn barrier_round(threads: u32, rounds: u32) -> f64 {
    let barrier = Arc::new(std::sync::Barrier::new(threads as usize));
    let started = std::time::Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    barrier.wait();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a barrier thread does not panic");
    }
    started.elapsed().as_nanos() as f64 / f64::from(rounds)
}
