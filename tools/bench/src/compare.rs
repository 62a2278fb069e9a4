//! A re-run's results against earlier ones: which of its ratios fall
//! outside the range the earlier runs stated, and which verdicts changed.
//! This is how a re-run is checked against BENCHMARKS.md:
//!
//! ```text
//! scripts/bench.sh --write mine.md
//! target/release/trainhost-bench --compare BENCHMARKS.md mine.md
//! ```
//!
//! Against several earlier runs (earlier versions of BENCHMARKS.md, from
//! git), a row's range is the union of theirs: how far that row has moved
//! over those runs, which one run's repetitions understate.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::results::{Stated, parse_table};

/// One line of the later run measured against the earlier ones.
#[derive(Debug, PartialEq)]
pub(crate) enum Outcome {
    /// The later ratio lies inside the earlier range.
    Within,
    /// Outside it, by this factor beyond the nearer edge (1.10: 10% above
    /// the highest, or the lowest 10% above the later ratio).
    Outside(f64),
    /// The earlier runs had one repetition: no range to fall in.
    NoRange,
}

/// A row's range over several runs: the union of the ranges they state
/// (`None` if none states one).
fn union(rows: &[&Stated]) -> Option<(f64, f64)> {
    rows.iter()
        .filter_map(|r| r.range)
        .reduce(|(lo, hi), (l, h)| (lo.min(l), hi.max(h)))
}

/// How `later`'s ratio sits in `range`, an earlier range.
pub(crate) fn outcome(range: Option<(f64, f64)>, later: &Stated) -> Outcome {
    let Some((lo, hi)) = range else {
        return Outcome::NoRange;
    };
    let r = later.ratio;
    if r > hi {
        Outcome::Outside(r / hi)
    } else if r < lo {
        Outcome::Outside(lo / r)
    } else {
        Outcome::Within
    }
}

/// The verdict word of a met column ("yes", "no"), without the count of
/// disagreeing repetitions; empty for a row without a goal.
fn verdict(met: &str) -> &str {
    met.split(',').next().unwrap_or("").trim().trim_matches('*')
}

/// Compare the results file `later` with the files `earlier` (oldest
/// first), as a report for the terminal.
pub(crate) fn compare(earlier: &[PathBuf], later: &Path) -> Result<String> {
    let read = |path: &Path| -> Result<Vec<Stated>> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the results file {}", path.display()))?;
        let rows = parse_table(&text);
        if rows.is_empty() {
            bail!(
                "{} holds no results table (expected a file written by --write, such as BENCHMARKS.md)",
                path.display()
            );
        }
        Ok(rows)
    };
    let runs = earlier
        .iter()
        .map(|path| Ok((path.as_path(), read(path)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(report(&runs, &read(later)?, later))
}

/// `later` against `runs` (each a file's name and rows, oldest first):
/// ranges from all of them, verdicts against the last.
fn report(runs: &[(&Path, Vec<Stated>)], later: &[Stated], later_path: &Path) -> String {
    let name = |s: &Stated| format!("{} | {} | against {}", s.group, s.measure, s.baseline);
    let Some((last_path, last)) = runs.last() else {
        return String::new();
    };
    let mut outside = Vec::new();
    let mut no_range = 0;
    let mut changed = Vec::new();
    let mut shared = 0;
    for l in later {
        let earlier: Vec<&Stated> = runs
            .iter()
            .filter_map(|(_, rows)| rows.iter().find(|e| e.same_line(l)))
            .collect();
        if earlier.is_empty() {
            continue;
        }
        shared += 1;
        let range = union(&earlier);
        match outcome(range, l) {
            Outcome::Within => {}
            Outcome::NoRange => no_range += 1,
            Outcome::Outside(by) => {
                let (lo, hi) = range.unwrap_or_default();
                let was = match &earlier[..] {
                    [one] => one.ratio_text.clone(),
                    several => format!("{lo:.3}–{hi:.3} over {} runs", several.len()),
                };
                outside.push((by, was, l));
            }
        }
        if let Some(e) = last.iter().find(|e| e.same_line(l))
            && verdict(&e.met) != verdict(&l.met)
        {
            changed.push((e, l));
        }
    }
    outside.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut out = match runs {
        [(path, rows)] => format!(
            "{} against {}: {shared} rows in both ({} only in {}, {} only in {}).\n",
            later_path.display(),
            path.display(),
            later.len() - shared,
            later_path.display(),
            rows.len() - shared,
            path.display(),
        ),
        _ => format!(
            "{} against the union of the ranges of {} runs ({}): {shared} of its {} rows in at least one of them.\n",
            later_path.display(),
            runs.len(),
            runs.iter()
                .map(|(path, _)| path.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            later.len(),
        ),
    };
    let near = outside.iter().filter(|(by, ..)| *by < 1.05).count();
    out.push_str(&format!(
        "{} ratios outside the earlier range ({near} of them by less than 5%){}.\n",
        outside.len(),
        if no_range > 0 {
            format!("; {no_range} rows had one repetition and no range in the earlier runs")
        } else {
            String::new()
        }
    ));
    out.push_str(
        "By sampling alone, a median of nine samples falls outside the range of nine others of \
         the same distribution about three times in a hundred, of six about one time in ten, of \
         three four times in ten: see BENCHMARKS.md's header.\n",
    );
    for (by, was, l) in &outside {
        out.push_str(&format!(
            "  {:>6.1}% beyond: {}: {} (earlier {was})\n",
            (by - 1.0) * 100.0,
            name(l),
            l.ratio_text,
        ));
    }
    out.push_str(&format!(
        "{} verdicts changed against {}.\n",
        changed.len(),
        last_path.display()
    ));
    for (e, l) in &changed {
        out.push_str(&format!(
            "  {}: {} → {} (ratio {} → {})\n",
            name(l),
            e.met,
            l.met,
            e.ratio_text,
            l.ratio_text
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(rows: &[(&str, &str, &str)]) -> String {
        let mut t = String::from(
            "# Benchmarks\n\n| group | measure | baseline | baseline value | ours | ratio (ours / baseline), range over repetitions | goal | met |\n|---|---|---|---:|---:|---:|---|---|\n",
        );
        for (measure, ratio, met) in rows {
            t.push_str(&format!(
                "| report | {measure} | a trivial host call | 38 ns | 1.1 µs | {ratio} | ≤ 20 µs | {met} |\n"
            ));
        }
        t.push_str("\n## Reading the results\n\n- a note | with a bar\n");
        t
    }

    #[test]
    fn a_rerun_is_measured_against_the_earlier_range() {
        let earlier = parse_table(&table(&[
            ("a", "1.000 (0.900–1.100)", "yes"),
            ("b", "2.000 (1.900–2.100)", "yes, not in 1 of 9 repetitions"),
            ("c", "3.000", "**no**"),
            ("gone", "1.000 (0.900–1.100)", ""),
        ]));
        let later = parse_table(&table(&[
            ("a", "1.050 (1.000–1.200)", "yes"),
            (
                "b",
                "2.310 (2.200–2.400)",
                "**no**, met in 2 of 9 repetitions",
            ),
            ("c", "3.100 (3.000–3.200)", "**no**"),
            ("new", "1.000 (0.900–1.100)", ""),
        ]));
        assert_eq!(earlier.len(), 4);
        assert_eq!(earlier[1].range, Some((1.9, 2.1)));
        assert_eq!(earlier[2].range, None);
        assert_eq!(outcome(earlier[0].range, &later[0]), Outcome::Within);
        let Outcome::Outside(by) = outcome(earlier[1].range, &later[1]) else {
            panic!("2.31 lies above 2.1");
        };
        assert!((by - 1.1).abs() < 1e-9, "{by}");
        assert_eq!(outcome(earlier[2].range, &later[2]), Outcome::NoRange);
        // Below the range: by how much the lowest lies above.
        let low = parse_table(&table(&[("a", "0.800 (0.700–0.900)", "yes")]));
        let Outcome::Outside(by) = outcome(earlier[0].range, &low[0]) else {
            panic!("0.8 lies below 0.9");
        };
        assert!((by - 1.125).abs() < 1e-9, "{by}");

        let text = report(
            &[(Path::new("old.md"), earlier)],
            &later,
            Path::new("new.md"),
        );
        assert!(
            text.starts_with(
                "new.md against old.md: 3 rows in both (1 only in new.md, 1 only in old.md)."
            ),
            "{text}"
        );
        assert!(text.contains("1 ratios outside the earlier range (0 of them by less than 5%); 1 rows had one repetition and no range in the earlier runs."), "{text}");
        assert!(text.contains("10.0% beyond: report | b | against a trivial host call: 2.310 (2.200–2.400) (earlier 2.000 (1.900–2.100))"), "{text}");
        assert!(text.contains("1 verdicts changed against old.md.\n  report | b | against a trivial host call: yes, not in 1 of 9 repetitions → **no**, met in 2 of 9 repetitions"), "{text}");
    }

    #[test]
    fn against_several_runs_a_row_falls_in_the_union_of_their_ranges() {
        let older = parse_table(&table(&[
            ("a", "1.000 (0.900–1.100)", "yes"),
            ("b", "2.000 (1.900–2.100)", "yes"),
        ]));
        let newer = parse_table(&table(&[
            ("a", "1.250 (1.200–1.300)", "**no**"),
            ("b", "2.000 (1.950–2.050)", "yes"),
            ("only later", "1.000 (0.900–1.100)", ""),
        ]));
        let rerun = parse_table(&table(&[
            // Outside the last run's range, inside the union.
            ("a", "1.150 (1.100–1.200)", "yes"),
            // Outside both.
            ("b", "2.420 (2.400–2.500)", "yes"),
            ("only later", "1.000 (0.950–1.050)", ""),
            ("new", "1.000 (0.900–1.100)", ""),
        ]));
        let runs = [(Path::new("AI.md"), older), (Path::new("AJ.md"), newer)];
        let text = report(&runs, &rerun, Path::new("mine.md"));
        assert!(
            text.starts_with("mine.md against the union of the ranges of 2 runs (AI.md, AJ.md): 3 of its 4 rows in at least one of them."),
            "{text}"
        );
        assert!(
            text.contains("1 ratios outside the earlier range"),
            "{text}"
        );
        assert!(
            text.contains("15.2% beyond: report | b | against a trivial host call: 2.420 (2.400–2.500) (earlier 1.900–2.100 over 2 runs)"),
            "{text}"
        );
        // Verdicts against the last run only.
        assert!(
            text.contains("1 verdicts changed against AJ.md.\n  report | a"),
            "{text}"
        );
    }

    #[test]
    fn a_file_without_a_table_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("notes.md");
        std::fs::write(&empty, "# Benchmarks\n\nnothing measured\n").unwrap();
        let e = compare(std::slice::from_ref(&empty), &empty)
            .unwrap_err()
            .to_string();
        assert!(e.contains("notes.md holds no results table"), "{e}");
        let e = compare(&[dir.path().join("missing.md")], &empty)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read the results file"), "{e}");
    }
}
