//! `report` without a checkpoint: per round, quiet and under load.

use std::sync::Arc;

use anyhow::Result;
use serde_json::json;
use trainhost::RunConfig;

use crate::common::{Row, Unit, local_run, metric, run_guest};
use crate::goals;
use crate::load::Load;

pub(crate) fn report(quick: bool) -> Result<Vec<Row>> {
    let reports = if quick { 2_000 } else { 20_000 };
    let mut rows = Vec::new();
    let storage = tempfile::tempdir()?;
    let mut blocking_ns = 0.0;
    for (workers, background) in [(1, false), (1, true), (2, true), (4, true), (16, true)] {
        let result = run_guest(
            json!({"mode": "report", "reports": reports}),
            workers,
            RunConfig {
                persist_in_background: background,
                ..local_run(storage.path())
            },
            Arc::default(),
        )?;
        let (report_ns, call_ns) = (metric(&result, "report_ns")?, metric(&result, "call_ns")?);
        if !background {
            blocking_ns = report_ns;
            continue;
        }
        rows.push(Row {
            group: "report",
            measure: format!("`report` without checkpoint, {workers} rank(s)"),
            baseline_name: "a trivial host call (`world-rank`)".into(),
            baseline: call_ns,
            ours: report_ns,
            unit: Unit::Nanos,
            goal: format!(
                "≤ {} µs a round (Ray: 2 s default, 4 ms tuned)",
                goals::REPORT_NS / 1e3
            ),
            met: Some(report_ns <= goals::REPORT_NS),
            spread: None,
        });
        if workers > 1 {
            let barrier_ns = barrier_round(workers, reports);
            rows.push(Row {
                group: "report",
                measure: format!("`report` without checkpoint, {workers} ranks, as above"),
                baseline_name: format!(
                    "{workers} threads meeting at a `std::sync::Barrier` (the same meeting, no guest)"
                ),
                baseline: barrier_ns,
                ours: report_ns,
                unit: Unit::Nanos,
                goal: goals::comparison("what the OS's own meeting of as many threads costs"),
                met: None,
                spread: None,
            });
            // The same with every core busy with other work, as on a shared
            // training machine: a waiting rank must not take the core the
            // rank it waits for needs.
            let load = Load::start(true, false);
            let result = run_guest(
                json!({"mode": "report", "reports": reports}),
                workers,
                local_run(storage.path()),
                Arc::default(),
            )?;
            drop(load);
            let (loaded_ns, call_ns) = (metric(&result, "report_ns")?, metric(&result, "call_ns")?);
            rows.push(Row {
                group: "report",
                measure: format!(
                    "`report` without checkpoint, {workers} rank(s), a busy thread on every core"
                ),
                baseline_name: "a trivial host call (`world-rank`), same load".into(),
                baseline: call_ns,
                ours: loaded_ns,
                unit: Unit::Nanos,
                goal: format!("≤ {} µs a round", goals::REPORT_NS / 1e3),
                met: Some(loaded_ns <= goals::REPORT_NS),
                spread: None,
            });
        }
        if workers == 1 {
            rows.push(Row {
                group: "report",
                measure: "`report` without checkpoint, 1 rank: background vs --wait-for-upload"
                    .into(),
                baseline_name: "--wait-for-upload (history stored per report)".into(),
                baseline: blocking_ns,
                ours: report_ns,
                unit: Unit::Nanos,
                goal: goals::comparison("what waiting for storage costs"),
                met: None,
                spread: None,
            });
        }
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
