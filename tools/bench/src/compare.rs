//! Two results files side by side: which of a re-run's ratios fall outside
//! the range an earlier run stated, and which verdicts changed. This is how
//! a re-run is checked against BENCHMARKS.md:
//!
//! ```text
//! scripts/bench.sh --write mine.md
//! target/release/trainhost-bench --compare BENCHMARKS.md mine.md
//! ```

use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::results::{Stated, parse_table};

/// One line of the later run measured against the earlier one.
#[derive(Debug, PartialEq)]
pub(crate) enum Outcome {
    /// The later ratio lies inside the earlier range.
    Within,
    /// Outside it, by this factor beyond the nearer edge (1.10: 10% above
    /// the highest, or the lowest 10% above the later ratio).
    Outside(f64),
    /// The earlier run had one repetition: no range to fall in.
    NoRange,
}

/// How `later`'s ratio sits against `earlier`'s range.
pub(crate) fn outcome(earlier: &Stated, later: &Stated) -> Outcome {
    let Some((lo, hi)) = earlier.range else {
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

/// Compare the results file `later` with `earlier`, as a report for the
/// terminal.
pub(crate) fn compare(earlier: &Path, later: &Path) -> Result<String> {
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
    Ok(report(&read(earlier)?, &read(later)?, earlier, later))
}

fn report(earlier: &[Stated], later: &[Stated], earlier_path: &Path, later_path: &Path) -> String {
    let name = |s: &Stated| format!("{} | {} | against {}", s.group, s.measure, s.baseline);
    let mut outside = Vec::new();
    let mut no_range = 0;
    let mut changed = Vec::new();
    let mut shared = 0;
    for l in later {
        let Some(e) = earlier.iter().find(|e| e.same_line(l)) else {
            continue;
        };
        shared += 1;
        match outcome(e, l) {
            Outcome::Within => {}
            Outcome::NoRange => no_range += 1,
            Outcome::Outside(by) => outside.push((by, e, l)),
        }
        if verdict(&e.met) != verdict(&l.met) {
            changed.push((e, l));
        }
    }
    outside.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut out = format!(
        "{} against {}: {shared} rows in both ({} only in {}, {} only in {}).\n",
        later_path.display(),
        earlier_path.display(),
        later.len() - shared,
        later_path.display(),
        earlier.len() - shared,
        earlier_path.display(),
    );
    let near = outside.iter().filter(|(by, ..)| *by < 1.05).count();
    out.push_str(&format!(
        "{} ratios outside the earlier range ({near} of them by less than 5%){}.\n",
        outside.len(),
        if no_range > 0 {
            format!("; {no_range} earlier rows had one repetition and no range")
        } else {
            String::new()
        }
    ));
    out.push_str(
        "By sampling alone, a median of nine samples falls outside the range of nine others of \
         the same distribution about three times in a hundred, of six about one time in ten, of \
         three four times in ten: see BENCHMARKS.md's header.\n",
    );
    for (by, e, l) in &outside {
        out.push_str(&format!(
            "  {:>6.1}% beyond: {}: {} (earlier {})\n",
            (by - 1.0) * 100.0,
            name(l),
            l.ratio_text,
            e.ratio_text,
        ));
    }
    out.push_str(&format!("{} verdicts changed.\n", changed.len()));
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
        assert_eq!(outcome(&earlier[0], &later[0]), Outcome::Within);
        let Outcome::Outside(by) = outcome(&earlier[1], &later[1]) else {
            panic!("2.31 lies above 2.1");
        };
        assert!((by - 1.1).abs() < 1e-9, "{by}");
        assert_eq!(outcome(&earlier[2], &later[2]), Outcome::NoRange);
        // Below the range: by how much the lowest lies above.
        let low = parse_table(&table(&[("a", "0.800 (0.700–0.900)", "yes")]));
        let Outcome::Outside(by) = outcome(&earlier[0], &low[0]) else {
            panic!("0.8 lies below 0.9");
        };
        assert!((by - 1.125).abs() < 1e-9, "{by}");

        let text = report(&earlier, &later, Path::new("old.md"), Path::new("new.md"));
        assert!(
            text.starts_with(
                "new.md against old.md: 3 rows in both (1 only in new.md, 1 only in old.md)."
            ),
            "{text}"
        );
        assert!(text.contains("1 ratios outside the earlier range (0 of them by less than 5%); 1 earlier rows had one repetition and no range."), "{text}");
        assert!(text.contains("10.0% beyond: report | b | against a trivial host call: 2.310 (2.200–2.400) (earlier 2.000 (1.900–2.100))"), "{text}");
        assert!(text.contains("1 verdicts changed.\n  report | b | against a trivial host call: yes, not in 1 of 9 repetitions → **no**, met in 2 of 9 repetitions"), "{text}");
    }

    #[test]
    fn a_file_without_a_table_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("notes.md");
        std::fs::write(&empty, "# Benchmarks\n\nnothing measured\n").unwrap();
        let e = compare(&empty, &empty).unwrap_err().to_string();
        assert!(e.contains("notes.md holds no results table"), "{e}");
        let e = compare(&dir.path().join("missing.md"), &empty)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read the results file"), "{e}");
    }
}
