//! The results as a Markdown table and BENCHMARKS.md.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::common::Row;
use crate::goals;

pub(crate) fn markdown(rows: &[Row]) -> String {
    let mut out = String::from(
        "| group | measure | baseline | baseline value | ours | ratio (ours / baseline), range over repetitions | goal | met |\n|---|---|---|---:|---:|---:|---|---|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.3}{} | {} | {} |\n",
            r.group,
            r.measure,
            r.baseline_name,
            r.unit.show(r.baseline),
            r.unit.show(r.ours),
            r.ours / r.baseline,
            r.spread
                .map_or(String::new(), |(lo, hi)| format!(" ({lo:.2}–{hi:.2})")),
            r.goal,
            met(r.met, r.met_in),
        ));
    }
    out
}

/// The met column: the medians' verdict, and how many repetitions agree
/// with it when not all do.
fn met(median: Option<bool>, met_in: Option<(usize, usize)>) -> String {
    let verdict = match median {
        Some(true) => "yes",
        Some(false) => "**no**",
        None => return String::new(),
    };
    match (median, met_in) {
        (Some(true), Some((k, n))) if k < n => {
            format!("{verdict}, not in {} of {n} repetitions", n - k)
        }
        (Some(false), Some((k, n))) if k > 0 => format!("{verdict}, met in {k} of {n} repetitions"),
        _ => verdict.to_owned(),
    }
}

pub(crate) fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or("?".into(), |kb| format!("{} GiB", kb >> 20));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cpu}, {cores} cores, {mem} RAM, Linux {}", kernel.trim())
}

pub(crate) fn write_results(
    path: &Path,
    table: &str,
    skipped: &[String],
    args: &str,
    took: Duration,
) -> Result<()> {
    let mut text = String::new();
    text.push_str(include_str!("header.md"));
    text.push('\n');
    text.push_str(&goals::describe());
    text.push_str(&format!(
        "\n## Results\n\nMachine: {}. Command: `scripts/bench.sh{}{}` ({} in all).\n\n",
        machine(),
        if args.is_empty() { "" } else { " " },
        args,
        humantime_secs(took)
    ));
    text.push_str(table);
    for s in skipped {
        text.push_str(&format!("\nSkipped: {s}\n"));
    }
    text.push_str(include_str!("notes.md"));
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

pub(crate) fn humantime_secs(d: Duration) -> String {
    format!("{:.0} s", d.as_secs_f64())
}
