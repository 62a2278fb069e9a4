//! The metrics history (R9): every report of the run, one JSON object a
//! line, appended in report order.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::layout::{HISTORY, rfc3339};
use crate::metrics::Metrics;

/// One entry of the metrics history: one report (see
/// [`crate::TrainResult::metrics_history`]).
///
/// ```no_run
/// let result = trainhost::Trainer::builder("loop.wasm").build()?.fit()?;
/// for r in &result.metrics_history {
///     println!("report {}: {} (checkpoint {:?})", r.report_index, r.metrics, r.checkpoint);
/// }
/// # Ok::<(), trainhost::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportRecord {
    /// The report's index in the run, from 0.
    pub report_index: u64,
    /// Rank 0's metrics.
    pub metrics: Metrics,
    /// The checkpoint the report committed, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<u64>,
    /// When the report was recorded (RFC 3339, UTC).
    pub time: String,
}

/// A line of a stored history that is not a report, before the last line.
#[derive(Debug, thiserror::Error)]
#[error(
    "{HISTORY} line {line} is unreadable ({source}); choose another run name or repair the file"
)]
pub(crate) struct HistoryError {
    line: usize,
    #[source]
    source: serde_json::Error,
}

/// The history in memory, with the file's bytes kept beside the records
/// so that each report appends one line instead of re-serializing all of
/// them.
#[derive(Debug, Default)]
pub(crate) struct History {
    records: Vec<ReportRecord>,
    jsonl: Vec<u8>,
    /// The second of the last report's time stamp, and the stamp: reports
    /// of the same second share it instead of formatting it again (a
    /// report is recorded while its ranks wait).
    stamp: Option<(u64, String)>,
}

impl History {
    /// The history stored as `bytes`.
    pub fn parse(mut bytes: Vec<u8>) -> Result<Self, HistoryError> {
        let (records, whole) = parse_lines(&bytes)?;
        bytes.truncate(whole);
        if bytes.last().is_some_and(|b| *b != b'\n') {
            bytes.push(b'\n');
        }
        Ok(Self {
            records,
            jsonl: bytes,
            stamp: None,
        })
    }

    /// Add one report, time-stamped now.
    pub fn append(&mut self, report_index: u64, metrics: Metrics, checkpoint: Option<u64>) {
        let record = ReportRecord {
            report_index,
            metrics,
            checkpoint,
            time: self.now(),
        };
        serde_json::to_writer(&mut self.jsonl, &record).expect("reports serialize");
        self.jsonl.push(b'\n');
        self.records.push(record);
    }

    /// The time now, as a report's time stamp.
    fn now(&mut self) -> String {
        let now = SystemTime::now();
        let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        match &self.stamp {
            Some((last, stamp)) if *last == second => stamp.clone(),
            _ => {
                let stamp = rfc3339(now);
                self.stamp = Some((second, stamp.clone()));
                stamp
            }
        }
    }

    /// Every report, oldest first.
    pub fn records(&self) -> &[ReportRecord] {
        &self.records
    }

    /// The index the report after the last one gets.
    pub fn next_report_index(&self) -> u64 {
        self.records.last().map_or(0, |r| r.report_index + 1)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> bytes::Bytes {
        bytes::Bytes::from(self.jsonl.clone())
    }
}

/// The records of a stored history. A host killed while writing may leave
/// a torn last line (stores that write whole objects never do); it is
/// dropped. Any other unreadable line is an error.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn parse_history(bytes: &[u8]) -> Result<Vec<ReportRecord>, HistoryError> {
    parse_lines(bytes).map(|(records, _)| records)
}

/// The records, and how many bytes of `bytes` hold whole records.
fn parse_lines(bytes: &[u8]) -> Result<(Vec<ReportRecord>, usize), HistoryError> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut number = 0;
    while start < bytes.len() {
        number += 1;
        let end = bytes[start..]
            .iter()
            .position(|b| *b == b'\n')
            .map_or(bytes.len(), |i| start + i + 1);
        let line = &bytes[start..end];
        if !line.iter().all(u8::is_ascii_whitespace) {
            match serde_json::from_slice(line) {
                Ok(record) => out.push(record),
                Err(_) if end == bytes.len() => return Ok((out, start)),
                Err(source) => {
                    return Err(HistoryError {
                        line: number,
                        source,
                    });
                }
            }
        }
        start = end;
    }
    Ok((out, bytes.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_last_line_is_dropped_and_not_appended_after() {
        let mut history = History::default();
        history.append(0, Metrics::new(), None);
        history.append(1, Metrics::new(), Some(0));
        let mut stored = history.to_bytes().to_vec();
        stored.extend_from_slice(br#"{"report_index":2,"met"#);
        let mut read = History::parse(stored).unwrap();
        assert_eq!(read.records().len(), 2);
        read.append(2, Metrics::new(), None);
        let again = History::parse(read.to_bytes().to_vec()).unwrap();
        assert_eq!(again.next_report_index(), 3);
    }

    #[test]
    fn an_unreadable_line_before_the_last_is_an_error() {
        let err = parse_history(b"{}\n{\"report_index\":1}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 1 is unreadable"), "{err}");
    }
}
