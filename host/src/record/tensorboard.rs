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
#[derive(Debug, Default)]
pub(crate) struct EventFile {
    bytes: Vec<u8>,
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
        let mut event = Vec::new();
        if self.bytes.is_empty() {
            double_field(&mut event, 1, wall_time(&r.time));
            bytes_field(&mut event, 3, FILE_VERSION.as_bytes());
            frame(&mut self.bytes, &event);
            event.clear();
        }
        let mut summary = Vec::new();
        for (name, value) in r.metrics.iter() {
            // Booleans are flags and text is text: not curves.
            let number = match value {
                crate::metrics::MetricValue::Integer(i) => *i as f64,
                crate::metrics::MetricValue::Float(f) => *f,
                _ => continue,
            };
            let mut v = Vec::new();
            bytes_field(&mut v, 1, name.as_bytes());
            // simple_value is a float: what TensorBoard plots.
            key(&mut v, 2, 5);
            v.extend_from_slice(&(number as f32).to_le_bytes());
            bytes_field(&mut summary, 1, &v);
        }
        double_field(&mut event, 1, wall_time(&r.time));
        key(&mut event, 2, 0);
        varint(&mut event, r.report_index);
        bytes_field(&mut event, 5, &summary);
        frame(&mut self.bytes, &event);
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> bytes::Bytes {
        bytes::Bytes::from(self.bytes.clone())
    }
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

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit per
/// byte through a table built once.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, entry) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0x82f6_3b78 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *entry = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
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
