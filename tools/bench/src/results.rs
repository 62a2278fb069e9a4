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
        let (baseline, ours) = r.medians();
        let ratio = ours / baseline;
        let decimals = decimals(ratio);
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {ratio:.decimals$}{} | {} | {} |\n",
            r.group,
            r.measure,
            r.baseline_name,
            r.unit.show(baseline),
            r.unit.show(ours),
            r.spread().map_or(String::new(), |(lo, hi)| format!(
                " ({lo:.decimals$}–{hi:.decimals$})"
            )),
            r.goal_text(),
            met(r.met(), r.met_in()),
        ));
    }
    out
}

/// A row as a results file states it: what [`markdown`] wrote, read back
/// to compare runs (`--compare`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stated {
    pub group: String,
    pub measure: String,
    pub baseline: String,
    /// The medians' ratio.
    pub ratio: f64,
    /// The lowest and highest ratio of single repetitions, if more than
    /// one.
    pub range: Option<(f64, f64)>,
    /// The ratio column as written.
    pub ratio_text: String,
    /// The met column as written.
    pub met: String,
}

impl Stated {
    /// Whether both state the same measure against the same baseline.
    pub(crate) fn same_line(&self, other: &Stated) -> bool {
        self.group == other.group
            && self.measure == other.measure
            && self.baseline == other.baseline
    }
}

/// The rows of the first results table in `text` (a file written by
/// `--write`); lines that do not parse as a row are skipped.
pub(crate) fn parse_table(text: &str) -> Vec<Stated> {
    let mut lines = text
        .lines()
        .skip_while(|l| !l.starts_with("| group | measure |"));
    // The header, then its alignment line.
    lines.next();
    lines.next();
    lines
        .take_while(|l| l.starts_with("| "))
        .filter_map(parse_row)
        .collect()
}

fn parse_row(line: &str) -> Option<Stated> {
    let cells: Vec<&str> = line
        .trim()
        .strip_prefix('|')?
        .strip_suffix('|')?
        .split('|')
        .map(str::trim)
        .collect();
    let [group, measure, baseline, _, _, ratio_text, _, met] = cells[..] else {
        return None;
    };
    let (ratio, range) = match ratio_text.split_once(" (") {
        Some((ratio, range)) => {
            let (lo, hi) = range.strip_suffix(')')?.split_once('–')?;
            (ratio, Some((lo.parse().ok()?, hi.parse().ok()?)))
        }
        None => (ratio_text, None),
    };
    Some(Stated {
        group: group.to_owned(),
        measure: measure.to_owned(),
        baseline: baseline.to_owned(),
        ratio: ratio.parse().ok()?,
        range,
        ratio_text: ratio_text.to_owned(),
        met: met.to_owned(),
    })
}

/// Decimals for a ratio and its range: at least three, and at least two
/// significant digits, so that a small ratio's range is not rounded to
/// figures that leave the ratio outside it.
fn decimals(ratio: f64) -> usize {
    if ratio > 0.0 && ratio < 0.1 {
        (-ratio.log10()).floor() as usize + 2
    } else {
        3
    }
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
    round_trips: &[f64],
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
    if let Some(line) = round_trip_line(round_trips) {
        text.push_str(&line);
        text.push_str("\n\n");
    }
    text.push_str(table);
    for s in skipped {
        text.push_str(&format!("\nSkipped: {s}\n"));
    }
    text.push_str(include_str!("notes.md"));
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// The sentence naming the cores' round trips measured before each pass
/// and after the last (see `load::core_round_trip_ns`).
pub(crate) fn round_trip_line(ns: &[f64]) -> Option<String> {
    let (last, before) = ns.split_last()?;
    let before: Vec<String> = before.iter().map(|n| format!("{n:.0}")).collect();
    Some(format!(
        "A cache line's round trip between two cores (two threads handing a flag back and forth; rounds of ranks on more than one thread wait for such handovers): {} ns before the passes, {last:.0} ns after the last.",
        before.join(", ")
    ))
}

pub(crate) fn humantime_secs(d: Duration) -> String {
    format!("{:.0} s", d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::Paired;

    #[test]
    fn a_verdict_names_the_repetitions_that_disagree_with_it() {
        let goal = |b: f64, o: f64| Some(o <= 1.2 * b);
        // Medians 1.15×: met, though the second repetition (1.9×) is not.
        let mut pairs = Paired::default();
        for (b, o) in [(100.0, 112.0), (100.0, 190.0), (100.0, 115.0)] {
            pairs.push(b, o);
        }
        let row = pairs.row("g", "m".into(), "b".into(), "goal".into(), goal);
        assert_eq!(row.met_in(), Some((2, 3)));
        assert_eq!(
            met(row.met(), row.met_in()),
            "yes, not in 1 of 3 repetitions"
        );
        // Every repetition agrees: the verdict alone.
        assert_eq!(met(Some(true), Some((3, 3))), "yes");
        assert_eq!(met(Some(false), Some((0, 3))), "**no**");
        assert_eq!(
            met(Some(false), Some((5, 9))),
            "**no**, met in 5 of 9 repetitions"
        );
        // One repetition, or no goal: nothing to compare.
        let mut single = Paired::default();
        single.push(100.0, 190.0);
        assert_eq!(single.met_in(goal), None);
        assert_eq!(pairs.met_in(|_, _| None), None);
        assert_eq!(met(None, None), "");
    }

    #[test]
    fn the_passes_of_a_line_make_one_row_and_its_range_spans_them() {
        let goal = |b: f64, o: f64| Some(o <= 1.2 * b);
        let pass = |b: f64, o: f64| {
            let mut pairs = Paired::default();
            pairs.push(b, o);
            pairs.row("g", "m".into(), "b".into(), "goal".into(), goal)
        };
        // Alone, a pass has no range; together, the three passes' samples
        // give the range, the medians and the verdicts.
        let mut row = pass(100.0, 110.0);
        assert_eq!(row.spread(), None);
        for other in [pass(100.0, 150.0), pass(200.0, 220.0)] {
            assert!(row.same_line(&other));
            row.absorb(other);
        }
        assert_eq!(row.spread(), Some((1.1, 1.5)));
        assert_eq!(row.medians(), (100.0, 150.0));
        assert_eq!(row.met(), Some(false));
        assert_eq!(row.met_in(), Some((2, 3)));
        let another = Paired::default().row("g", "m".into(), "other".into(), "goal".into(), goal);
        assert!(!row.same_line(&another));
    }

    #[test]
    fn a_written_table_reads_back() {
        let mut pairs = Paired::default();
        for (b, o) in [(100.0, 112.0), (100.0, 190.0), (100.0, 115.0)] {
            pairs.push(b, o);
        }
        let row = pairs.row("g", "m `x`".into(), "b".into(), "goal".into(), |b, o| {
            Some(o <= 1.2 * b)
        });
        let mut single = Paired::default();
        single.push(100.0, 50.0);
        let other = single.row("g", "n".into(), "b".into(), "goal".into(), |_, _| None);
        let text = format!(
            "# Title\n\n{}\nA line after.\n| not | a row |\n",
            markdown(&[row, other])
        );
        let stated = parse_table(&text);
        assert_eq!(stated.len(), 2, "{stated:?}");
        assert_eq!(stated[0].measure, "m `x`");
        assert_eq!(stated[0].ratio, 1.15);
        assert_eq!(stated[0].range, Some((1.12, 1.9)));
        assert_eq!(stated[0].ratio_text, "1.150 (1.120–1.900)");
        assert_eq!(stated[0].met, "yes, not in 1 of 3 repetitions");
        assert_eq!(stated[1].range, None);
        assert_eq!(stated[1].met, "");
        assert!(!stated[0].same_line(&stated[1]));
    }

    #[test]
    fn a_small_ratio_and_its_range_keep_two_significant_digits() {
        let mut pairs = Paired::default();
        for (b, o) in [(1000.0, 6.0), (1000.0, 4.0), (1000.0, 11.0)] {
            pairs.push(b, o);
        }
        let table = markdown(&[pairs.row("g", "m".into(), "b".into(), "goal".into(), |_, _| None)]);
        // Rounded to two decimals the range read (0.00–0.01), which a
        // ratio of 0.006 seemed to fall outside.
        assert!(table.contains("| 0.0060 (0.0040–0.0110) |"), "{table}");
        assert_eq!(decimals(1.234), 3);
        assert_eq!(decimals(0.5), 3);
        assert_eq!(decimals(0.05), 3);
        assert_eq!(decimals(0.0012), 4);
    }
}
