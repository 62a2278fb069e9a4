//! `trainhost metrics`: a run's metrics history as a table, JSON or CSV.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use trainhost::{MetricValue, ReportRecord};

use crate::args::{StorageFlags, run_location};

#[derive(Args, Debug)]
pub struct MetricsArgs {
    /// The run: its name under --storage, or its directory or URL.
    run: String,

    /// Where runs are stored, when RUN is a name: a directory,
    /// file:///abs/path, or an object store (s3://BUCKET/PREFIX,
    /// gs://BUCKET/PREFIX, az://CONTAINER/PREFIX).
    #[arg(short, long, value_name = "URL|DIR", default_value = trainhost::DEFAULT_STORAGE)]
    storage: String,

    /// Only these metrics (repeatable, or comma-separated). Default: every
    /// metric any report has, in the order they first appear.
    #[arg(short, long = "metric", value_name = "NAME", value_delimiter = ',')]
    metrics: Vec<String>,

    /// Print the history as JSON: the records of metrics.jsonl as an array.
    #[arg(long, conflicts_with = "csv")]
    json: bool,

    /// Print the history as CSV (RFC 4180): report, checkpoint, time, then
    /// a column per metric, empty where a report lacks it.
    #[arg(long)]
    csv: bool,

    /// Draw the metrics (--metric, default: every numeric one) against
    /// the report index into this .png or .svg file: a panel and a line
    /// per metric, reports that committed a checkpoint marked with a dot.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,

    #[command(flatten)]
    storage_flags: StorageFlags,
}

pub fn metrics(args: MetricsArgs) -> anyhow::Result<ExitCode> {
    let location = run_location(&args.run, &args.storage)?;
    let history = trainhost::stored_history(&location, &args.storage_flags.options(false))?;
    let columns = match args.metrics.is_empty() {
        true => every_metric(&history),
        false => {
            if let Some(missing) = args
                .metrics
                .iter()
                .find(|m| history.iter().all(|r| r.metrics.get(m).is_none()))
            {
                anyhow::bail!(
                    "no report of {location} has a metric {missing:?}; it has: {}",
                    every_metric(&history).join(", ")
                );
            }
            args.metrics.clone()
        }
    };
    if let Some(path) = &args.plot {
        let numeric: Vec<String> = match args.metrics.is_empty() {
            true => columns
                .into_iter()
                .filter(|c| {
                    history
                        .iter()
                        .any(|r| r.metrics.get(c).is_some_and(|v| v.as_f64().is_some()))
                })
                .collect(),
            false => columns,
        };
        crate::plot::plot(path, &location, &history, &numeric)?;
        show!("wrote {}", path.display());
        return Ok(ExitCode::SUCCESS);
    }
    if args.json {
        let records: Vec<serde_json::Value> = history
            .iter()
            .map(|r| {
                let mut v = serde_json::to_value(r).expect("records serialize");
                if !args.metrics.is_empty() {
                    v["metrics"] = columns
                        .iter()
                        .filter_map(|c| {
                            Some((c.clone(), serde_json::to_value(r.metrics.get(c)?).ok()?))
                        })
                        .collect::<serde_json::Map<_, _>>()
                        .into();
                }
                v
            })
            .collect();
        show!("{}", serde_json::to_string_pretty(&records)?);
        return Ok(ExitCode::SUCCESS);
    }
    let cells = |r: &ReportRecord| -> Vec<String> {
        let mut row = vec![
            r.report_index.to_string(),
            r.checkpoint.map_or(String::new(), |c| c.to_string()),
            r.time.clone(),
        ];
        row.extend(
            columns
                .iter()
                .map(|c| r.metrics.get(c).map_or(String::new(), show_value)),
        );
        row
    };
    let mut header = vec!["report".to_owned(), "checkpoint".into(), "time".into()];
    header.extend(columns.iter().cloned());
    if args.csv {
        show!("{}", csv_line(&header));
        for r in &history {
            show!("{}", csv_line(&cells(r)));
        }
        return Ok(ExitCode::SUCCESS);
    }
    if history.is_empty() {
        show!("{location}: no reports");
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = history.iter().map(cells).collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([header[i].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[String]| -> String {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            // Numbers right-aligned, the time and text left-aligned.
            .map(|(i, (c, w))| match i {
                2 => format!("{c:<w$}"),
                _ => format!("{c:>w$}"),
            })
            .collect();
        padded.join("  ").trim_end().to_owned()
    };
    show!("{}", line(&header));
    for r in &rows {
        show!("{}", line(r));
    }
    Ok(ExitCode::SUCCESS)
}

/// Every metric name of `history`, in the order they first appear.
fn every_metric(history: &[ReportRecord]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for r in history {
        for (name, _) in r.metrics.iter() {
            if !names.iter().any(|n| n == name) {
                names.push(name.to_owned());
            }
        }
    }
    names
}

fn show_value(v: &MetricValue) -> String {
    match v {
        MetricValue::Integer(i) => i.to_string(),
        // Shortest text that reads back as the same f64.
        MetricValue::Float(f) => f.to_string(),
        MetricValue::Text(t) => t.clone(),
        MetricValue::Boolean(b) => b.to_string(),
    }
}

/// One CSV line: fields with a comma, quote or line break quoted, quotes
/// doubled.
fn csv_line(fields: &[String]) -> String {
    fields
        .iter()
        .map(|f| {
            if f.contains([',', '"', '\n', '\r']) {
                format!("\"{}\"", f.replace('"', "\"\""))
            } else {
                f.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}
