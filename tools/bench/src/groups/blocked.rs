//! How long a guest waits in `report` with a checkpoint: handed over
//! (`report-handing-over`), lent (the default `report`), and with
//! `--wait-for-upload`, on local storage and on S3.

use std::sync::Arc;

use anyhow::Result;
use serde_json::json;
use trainhost::{CheckpointConfig, RunConfig};

use crate::common::{
    Paired, Row, Sampling, checkpoint_sizes, describe, layout, local_run, metric, run_guest,
    size_name, sync,
};
use crate::goals;

/// Where the checkpoints go: a name for the rows, and a fresh run config
/// for repetition `i` (its storage kept alive by the returned guard).
pub(crate) struct Target<'a> {
    pub name: &'a str,
    /// How the store shares a file unchanged since the previous checkpoint.
    pub shares: &'a str,
    pub run: &'a dyn Fn(usize) -> Result<(RunConfig, Box<dyn std::any::Any>)>,
}

/// The blocked time on local storage, for every checkpoint size.
pub(crate) fn blocked(quick: bool) -> Result<Vec<Row>> {
    let local = |_: usize| -> Result<(RunConfig, Box<dyn std::any::Any>)> {
        let storage = tempfile::tempdir()?;
        Ok((local_run(storage.path()), Box::new(storage)))
    };
    let target = Target {
        name: "local storage",
        shares: "linked",
        run: &local,
    };
    let mut rows = Vec::new();
    for &total in checkpoint_sizes(quick) {
        let reps = Sampling::of_checkpoint(total).per_pass(quick);
        rows.extend(measure(&target, total, reps)?);
    }
    Ok(rows)
}

/// One report's blocked times in one run: the first, the mean of the
/// changed ones, the unchanged one.
struct Times {
    first: f64,
    /// The guest's rewrite of its files right after the first report.
    rewrite: f64,
    changed: f64,
    unchanged: f64,
}

fn run_once(target: &Target<'_>, files: &[(u32, u64)], i: usize, mode: Mode) -> Result<Times> {
    let config = json!({
        "mode": "checkpoint",
        "files": files,
        "reports": 3,
        "hand_over": mode == Mode::HandedOver,
    });
    let (run, _storage) = (target.run)(i)?;
    sync();
    let result = run_guest(
        config,
        1,
        RunConfig {
            persist_in_background: mode != Mode::Waiting,
            checkpoint_config: CheckpointConfig {
                num_to_keep: Some(1),
                ..Default::default()
            },
            ..run
        },
        Arc::default(),
    )?;
    Ok(Times {
        first: metric(&result, "first_ns")?,
        rewrite: metric(&result, "rewrite_ns")?,
        changed: metric(&result, "changed_ns")?,
        unchanged: metric(&result, "unchanged_ns")?,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `--wait-for-upload`: the baseline.
    Waiting,
    /// The default `report`: the host links the files and lends them
    /// (copy-on-write).
    Lent,
    /// `report-handing-over`: the host moves the directory.
    HandedOver,
}

/// The rows of one checkpoint size on `target`.
pub(crate) fn measure(target: &Target<'_>, total: u64, reps: usize) -> Result<Vec<Row>> {
    let (mut handed_first, mut handed_changed) = (Paired::default(), Paired::default());
    let (mut lent_first, mut lent_changed) = (Paired::default(), Paired::default());
    let mut lent_rewrite = Paired::default();
    let mut unchanged = Paired::default();
    // The same bytes as a few large files (a model and its optimizer
    // state, say): linking costs per file, not per byte.
    let judged = total == 64 << 20;
    let few = [(4u32, total / 4)];
    let mut few_first = Paired::default();
    for i in 0..reps {
        let waiting = run_once(target, &layout(total), i, Mode::Waiting)?;
        let lent = run_once(target, &layout(total), i, Mode::Lent)?;
        let handed = run_once(target, &layout(total), i, Mode::HandedOver)?;
        if judged {
            let waiting = run_once(target, &few, i, Mode::Waiting)?;
            let lent = run_once(target, &few, i, Mode::Lent)?;
            few_first.push(waiting.first, lent.first);
        }
        handed_first.push(waiting.first, handed.first);
        handed_changed.push(waiting.changed, handed.changed);
        lent_first.push(waiting.first, lent.first);
        lent_changed.push(waiting.changed, lent.changed);
        lent_rewrite.push(waiting.rewrite, lent.rewrite);
        unchanged.push(waiting.first, waiting.unchanged);
    }
    let name = size_name(total);
    let on = target.name;
    let goal = blocked_goal(total);
    let row = |pairs: &Paired, measure, baseline_name: &str, goal: &str, judged: bool| {
        pairs.row(
            "blocked",
            measure,
            baseline_name.into(),
            goal.into(),
            move |_, o| judged.then_some(o <= goals::BLOCKED_64MIB_NS),
        )
    };
    // A guest that checkpoints faster than storage takes checkpoints waits
    // for the one before: bounded memory and disk cost that wait.
    let back_pressure = goals::comparison(
        "back-pressure, not the goal's case: the 5 ms goal is for a report while nothing is still being persisted",
    );
    let files = describe(&layout(total));
    let mut rows = vec![
        row(
            &handed_first,
            format!("guest blocked in `report`, new {name} checkpoint handed over, {on}"),
            "--wait-for-upload",
            &goal,
            judged,
        ),
        row(
            &handed_changed,
            format!(
                "guest blocked in `report`, {name} checkpoint handed over again as soon as rewritten (waits while the previous one is persisted: one in flight), {on}"
            ),
            "--wait-for-upload",
            &back_pressure,
            false,
        ),
        row(
            &lent_first,
            format!(
                "guest blocked in `report`, new {name} checkpoint ({files}) lent (default: linked, copy-on-write), {on}"
            ),
            "--wait-for-upload",
            &goal,
            judged,
        ),
        row(
            &lent_changed,
            format!(
                "guest blocked in `report`, {name} checkpoint lent (default) again as soon as rewritten (one in flight), {on}"
            ),
            "--wait-for-upload",
            &back_pressure,
            false,
        ),
        row(
            &lent_rewrite,
            format!(
                "guest rewriting its {name} checkpoint ({files}) right after a lent `report` (waits for the links, copies on write, while the host persists the checkpoint beside it), {on}"
            ),
            "the same rewrite after `report` with --wait-for-upload",
            &goals::comparison("what lending costs the guest after `report` returns"),
            false,
        ),
        row(
            &unchanged,
            format!(
                "persist an unchanged {name} checkpoint (incremental: {}), {on}",
                target.shares
            ),
            "persisting it new (--wait-for-upload)",
            &goals::comparison("every file is still read and hashed"),
            false,
        ),
    ];
    if judged {
        rows.push(row(
            &few_first,
            format!(
                "guest blocked in `report`, new {name} checkpoint as {} lent (default), {on}",
                describe(&few)
            ),
            "--wait-for-upload",
            &goal,
            true,
        ));
    }
    Ok(rows)
}

/// The goal of a blocked-in-report row: stated for 64 MiB only.
fn blocked_goal(total: u64) -> String {
    if total == 64 << 20 {
        format!("≤ {} ms blocked", goals::BLOCKED_64MIB_NS / 1e6)
    } else {
        goals::comparison("the 5 ms goal is for 64 MiB")
    }
}
