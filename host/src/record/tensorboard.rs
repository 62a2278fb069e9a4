//! The metrics history as a TensorBoard event file (R49), so that
//! `tensorboard --logdir <storage>` shows every run's curves.
//!
//! An event file is a sequence of records (TFRecord framing: the length,
//! its masked CRC-32C, the bytes, their masked CRC-32C), each holding one
//! `Event` protocol buffer: first the file version, then one event per
//! report whose summary holds a `simple_value` for every numeric metric,
//! with the report's index as the step. The file is made from the whole
//! history each time the history is stored, so it never holds a report
//! twice, a resumed run continues the same series, and a reader that
//! follows the file as it grows finds the bytes it has read unchanged.
//! The few protocol-buffer fields are encoded here by hand: they are
//! stable since TensorFlow 1.0, and a protobuf stack would be most of the
//! code it took to write them.

use super::history::ReportRecord;

/// What TensorBoard expects as the first event of a file.
const FILE_VERSION: &str = "brain.Event:2";

/// An event file kept in memory and extended report by report: the same
/// bytes as made from the whole history at once.
///
/// A report is recorded while the ranks wait in their `report` call, so
/// an event costs no allocation: it is encoded in a buffer kept between
/// reports, each length computed before the bytes it counts, and a
/// report's time is read once per second (reports of the same second
/// share it). Encoding an event with a vector per field, its time parsed
/// each time and its CRC taken a byte at a time was about a fifth of a
/// `report`'s time with one rank.
#[derive(Debug, Default)]
pub(crate) struct EventFile {
    bytes: Vec<u8>,
    /// One event's encoding, reused.
    event: Vec<u8>,
    /// The last report's time and what [`wall_time`] made of it.
    last_time: Option<(String, f64)>,
}

impl EventFile {
    /// The event file of `records`.
    pub fn of(records: &[ReportRecord]) -> Self {
        let mut file = Self::default();
        records.iter().for_each(|r| file.push(r));
        file
    }

    /// Add one report; the first also writes the file's version, stamped
    /// with its time.
    pub fn push(&mut self, r: &ReportRecord) {
        let wall = self.wall_time(&r.time);
        let mut event = std::mem::take(&mut self.event);
        event.clear();
        if self.bytes.is_empty() {
            double_field(&mut event, 1, wall);
            bytes_field(&mut event, 3, FILE_VERSION.as_bytes());
            frame(&mut self.bytes, &event);
            event.clear();
        }
        double_field(&mut event, 1, wall);
        key(&mut event, 2, 0);
        varint(&mut event, r.report_index);
        // The summary (field 5): a `value` (field 1) per numeric metric.
        let summary: usize = plotted(r)
            .map(|(name, _)| {
                let value = value_len(name);
                1 + varint_len(value as u64) + value
            })
            .sum();
        key(&mut event, 5, 2);
        varint(&mut event, summary as u64);
        for (name, number) in plotted(r) {
            key(&mut event, 1, 2);
            varint(&mut event, value_len(name) as u64);
            bytes_field(&mut event, 1, name.as_bytes());
            // simple_value is a float: what TensorBoard plots.
            key(&mut event, 2, 5);
            event.extend_from_slice(&number.to_le_bytes());
        }
        frame(&mut self.bytes, &event);
        self.event = event;
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> bytes::Bytes {
        bytes::Bytes::from(self.bytes.clone())
    }

    /// [`wall_time`] of `time`, parsed only when it differs from the last.
    fn wall_time(&mut self, time: &str) -> f64 {
        match &self.last_time {
            Some((last, wall)) if last == time => *wall,
            _ => {
                let wall = wall_time(time);
                self.last_time = Some((time.to_owned(), wall));
                wall
            }
        }
    }
}

/// The metrics a report's event plots, as TensorBoard's floats: booleans
/// are flags and text is text, not curves.
fn plotted(r: &ReportRecord) -> impl Iterator<Item = (&str, f32)> {
    r.metrics.iter().filter_map(|(name, value)| match value {
        // Through f64, as the files written so far rounded an integer:
        // the file is made again from the whole history, and a reader
        // following it must find the bytes it read unchanged.
        crate::metrics::MetricValue::Integer(i) => Some((name, *i as f64 as f32)),
        crate::metrics::MetricValue::Float(f) => Some((name, *f as f32)),
        _ => None,
    })
}

/// The length of a summary `value` holding `name` (field 1) and a float
/// (field 2).
fn value_len(name: &str) -> usize {
    1 + varint_len(name.len() as u64) + name.len() + 1 + 4
}

/// Seconds since the epoch of an RFC 3339 time; 0 if it is not one.
fn wall_time(time: &str) -> f64 {
    humantime::parse_rfc3339_weak(time)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0.0, |d| d.as_secs_f64())
}

fn key(out: &mut Vec<u8>, field: u64, wire_type: u64) {
    varint(out, field << 3 | wire_type);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// How many bytes [`varint`] writes for `v`.
fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn double_field(out: &mut Vec<u8>, field: u64, v: f64) {
    key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    key(out, field, 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// One TFRecord: length, masked CRC of the length, data, masked CRC of the
/// data.
fn frame(out: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
}

/// TFRecord's masking of a CRC, so that a CRC of data holding CRCs stays
/// strong.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// CRC-32C (Castagnoli), with the CPU's CRC instructions where it has them.
fn crc32c(data: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MetricValue, Metrics};

    #[test]
    fn crc32c_matches_its_check_value() {
        // The standard check value of CRC-32C, and RFC 3720's zeros.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
    }

    fn record(index: u64, loss: f64) -> ReportRecord {
        ReportRecord {
            report_index: index,
            metrics: Metrics::from_iter([
                ("loss", MetricValue::Float(loss)),
                ("epoch", MetricValue::Integer(index as i64)),
                ("phase", MetricValue::Text("train".into())),
            ]),
            checkpoint: None,
            time: "2026-11-24T10:00:00Z".into(),
        }
    }

    /// The data of each record, its CRCs checked.
    fn records(mut bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            assert_eq!(
                u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
                masked_crc(&bytes[..8])
            );
            let data = &bytes[12..12 + len];
            assert_eq!(
                u32::from_le_bytes(bytes[12 + len..16 + len].try_into().unwrap()),
                masked_crc(data)
            );
            out.push(data.to_vec());
            bytes = &bytes[16 + len..];
        }
        out
    }

    /// An event encoded field by field, each in a vector of its own: what
    /// [`EventFile::push`] must write without them.
    fn event_of(r: &ReportRecord) -> Vec<u8> {
        let mut summary = Vec::new();
        for (name, value) in r.metrics.iter() {
            let number = match value {
                MetricValue::Integer(i) => *i as f64,
                MetricValue::Float(f) => *f,
                _ => continue,
            };
            let mut v = Vec::new();
            bytes_field(&mut v, 1, name.as_bytes());
            key(&mut v, 2, 5);
            v.extend_from_slice(&(number as f32).to_le_bytes());
            bytes_field(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        double_field(&mut event, 1, wall_time(&r.time));
        key(&mut event, 2, 0);
        varint(&mut event, r.report_index);
        bytes_field(&mut event, 5, &summary);
        event
    }

    #[test]
    fn events_are_encoded_as_field_by_field_whatever_their_lengths() {
        // Names and summaries past 127 bytes take two-byte lengths.
        let long = "n".repeat(200);
        let many: Vec<(String, MetricValue)> = (0..40)
            .map(|i| {
                (
                    format!("metric_{i}"),
                    MetricValue::Float(f64::from(i) / 3.0),
                )
            })
            .chain([
                (long, MetricValue::Integer(i64::MAX)),
                ("flag".into(), MetricValue::Boolean(true)),
                ("odd".into(), MetricValue::Integer(-(1 << 53) - 1)),
            ])
            .collect();
        let reports = [
            record(0, 1.5),
            ReportRecord {
                report_index: 1 << 40,
                metrics: Metrics::from_iter(many),
                checkpoint: Some(3),
                time: "2026-11-24T10:00:01Z".into(),
            },
            ReportRecord {
                report_index: 2,
                metrics: Metrics::new(),
                checkpoint: None,
                time: "not a time".into(),
            },
        ];
        let file = EventFile::of(&reports);
        let events = records(&file.bytes);
        assert_eq!(events.len(), reports.len() + 1);
        for (event, r) in events[1..].iter().zip(&reports) {
            assert_eq!(event, &event_of(r), "report {}", r.report_index);
        }
        for v in [0, 1, 127, 128, 16_383, 16_384, u64::MAX] {
            let mut out = Vec::new();
            varint(&mut out, v);
            assert_eq!(out.len(), varint_len(v), "{v}");
        }
    }

    #[test]
    fn one_event_per_report_after_the_version_and_a_longer_history_extends_the_file() {
        let two = EventFile::of(&[record(0, 1.5), record(1, 0.5)]).bytes;
        let events = records(&two);
        assert_eq!(events.len(), 3);
        assert!(
            events[0]
                .windows(FILE_VERSION.len())
                .any(|w| w == FILE_VERSION.as_bytes())
        );
        // Step 1 (field 2, varint), and the float 0.5 after the tag "loss".
        let second = &events[2];
        assert!(second.windows(2).any(|w| w == [0x10, 0x01]));
        let loss = [&[0x0a, 4][..], b"loss", &[0x15], &0.5f32.to_le_bytes()].concat();
        assert!(second.windows(loss.len()).any(|w| w == loss));
        assert!(
            !second.windows(5).any(|w| w == b"train"),
            "text is left out"
        );
        let mut three = EventFile::of(&[record(0, 1.5), record(1, 0.5)]);
        three.push(&record(2, 0.25));
        assert!(three.bytes.starts_with(&two));
        let whole = EventFile::of(&[record(0, 1.5), record(1, 0.5), record(2, 0.25)]);
        assert_eq!(
            three.bytes, whole.bytes,
            "extended or made at once: the same"
        );
        assert!(EventFile::default().to_bytes().is_empty());
    }
}
