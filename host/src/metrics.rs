//! Reported metrics: a flat map from name to value.
//!
//! Stored as JSON. Finite floats and integers are JSON numbers; NaN and
//! infinities, which JSON cannot hold, are written `{"float": "NaN"}` (or
//! `"inf"`, `"-inf"`) so they survive a round trip without being confused
//! with text.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The value of one metric.
///
/// ```
/// use trainhost::MetricValue;
/// assert_eq!(MetricValue::Integer(3).as_f64(), Some(3.0));
/// assert_eq!(MetricValue::Text("adam".into()).as_f64(), None);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum MetricValue {
    /// A whole number.
    Integer(i64),
    /// A floating-point number, possibly NaN or infinite.
    Float(f64),
    /// Text.
    Text(String),
    /// A flag.
    Boolean(bool),
}

impl MetricValue {
    /// The value as a number, if it is one (integers widen to `f64`).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            MetricValue::Integer(i) => Some(*i as f64),
            MetricValue::Float(f) => Some(*f),
            MetricValue::Text(_) | MetricValue::Boolean(_) => None,
        }
    }
}

impl fmt::Display for MetricValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricValue::Integer(v) => write!(f, "{v}"),
            MetricValue::Float(v) => write!(f, "{v}"),
            MetricValue::Text(v) => write!(f, "{v:?}"),
            MetricValue::Boolean(v) => write!(f, "{v}"),
        }
    }
}

impl Serialize for MetricValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            MetricValue::Integer(v) => s.serialize_i64(*v),
            MetricValue::Float(v) if v.is_finite() => s.serialize_f64(*v),
            MetricValue::Float(v) => {
                let text = if v.is_nan() {
                    "NaN"
                } else if *v > 0.0 {
                    "inf"
                } else {
                    "-inf"
                };
                let mut map = BTreeMap::new();
                map.insert("float", text);
                map.serialize(s)
            }
            MetricValue::Text(v) => s.serialize_str(v),
            MetricValue::Boolean(v) => s.serialize_bool(*v),
        }
    }
}

impl<'de> Deserialize<'de> for MetricValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde_json::Value;
        match Value::deserialize(d)? {
            Value::Bool(b) => Ok(MetricValue::Boolean(b)),
            Value::String(s) => Ok(MetricValue::Text(s)),
            Value::Number(n) => match n.as_i64() {
                Some(i) if !n.is_f64() => Ok(MetricValue::Integer(i)),
                _ => n
                    .as_f64()
                    .map(MetricValue::Float)
                    .ok_or_else(|| D::Error::custom(format!("metric value {n} is out of range"))),
            },
            Value::Object(map) => match map.get("float").and_then(Value::as_str) {
                Some("NaN") if map.len() == 1 => Ok(MetricValue::Float(f64::NAN)),
                Some("inf") if map.len() == 1 => Ok(MetricValue::Float(f64::INFINITY)),
                Some("-inf") if map.len() == 1 => Ok(MetricValue::Float(f64::NEG_INFINITY)),
                _ => Err(D::Error::custom(
                    "a metric value object must be {\"float\": \"NaN\" | \"inf\" | \"-inf\"}",
                )),
            },
            other => Err(D::Error::custom(format!(
                "a metric value must be a number, string or bool, not {other}"
            ))),
        }
    }
}

/// The most metrics one report may carry.
pub const MAX_METRICS: usize = 1024;
/// The longest metric name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// The longest text metric value, in bytes.
pub const MAX_TEXT_BYTES: usize = 4096;

/// Why metrics were refused by [`Metrics::from_pairs`]; a guest sees the
/// message.
///
/// ```
/// use trainhost::{InvalidMetrics, MetricValue, Metrics};
/// let twice = [("loss".to_owned(), MetricValue::Float(1.0)), ("loss".to_owned(), MetricValue::Float(2.0))];
/// assert!(matches!(Metrics::from_pairs(twice), Err(InvalidMetrics::Repeated { .. })));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMetrics {
    /// More metrics than one report may carry.
    #[error("a report may carry at most {MAX_METRICS} metrics; keep large data in the checkpoint")]
    TooMany,
    /// A name longer than a metric name may be.
    #[error(
        "metric name {start:?}... is {bytes} bytes long; names may be at most {MAX_NAME_BYTES} bytes"
    )]
    NameTooLong {
        /// The name's first 32 characters.
        start: String,
        /// Its length.
        bytes: usize,
    },
    /// A text value longer than a metric text may be.
    #[error(
        "metric {name:?} is a text of {bytes} bytes; texts may be at most {MAX_TEXT_BYTES} bytes"
    )]
    TextTooLong {
        /// The metric.
        name: String,
        /// The text's length.
        bytes: usize,
    },
    /// An empty name.
    #[error("a metric has an empty name")]
    EmptyName,
    /// A name with an empty part between `/` separators.
    #[error("metric name {name:?} has an empty part between '/' separators")]
    EmptyPart {
        /// The name.
        name: String,
    },
    /// A name given twice.
    #[error("metric {name:?} is given twice")]
    Repeated {
        /// The name.
        name: String,
    },
}

/// Metrics of one report, by name. Nested names use `/` (`eval/loss`).
///
/// ```
/// use trainhost::{MetricValue, Metrics};
/// let m: Metrics = [("loss", MetricValue::Float(0.5)), ("epoch", MetricValue::Integer(2))]
///     .into_iter()
///     .collect();
/// assert_eq!(m.to_string(), "epoch=2 loss=0.5");
/// assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"epoch":2,"loss":0.5}"#);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics(
    /// Sorted by name, each name once. A report usually carries a few
    /// metrics, and every rank's report builds its own: a vector is one
    /// small allocation where a `BTreeMap` node takes over 600 bytes.
    Vec<(String, MetricValue)>,
);

impl Metrics {
    /// No metrics.
    pub fn new() -> Self {
        Self::default()
    }

    /// About how many bytes these metrics take as a JSON object, as the
    /// run's history stores them: a number is counted as its longest
    /// form, a text as its bytes (escapes can make it longer).
    pub(crate) fn json_bytes(&self) -> usize {
        let value = |v: &MetricValue| match v {
            MetricValue::Text(t) => t.len() + 2,
            _ => 24,
        };
        2 + self
            .0
            .iter()
            .map(|(name, v)| name.len() + 4 + value(v))
            .sum::<usize>()
    }

    fn find(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(name))
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&MetricValue> {
        self.find(name).ok().map(|i| &self.0[i].1)
    }

    /// Set `name` to `value`.
    pub fn insert(&mut self, name: impl Into<String>, value: MetricValue) {
        let name = name.into();
        match self.find(&name) {
            Ok(i) => self.0[i].1 = value,
            Err(i) => self.0.insert(i, (name, value)),
        }
    }

    /// The metrics in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &MetricValue)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// How many metrics there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Build metrics from `(name, value)` pairs as a guest sends them,
    /// refusing empty, repeated and oversized names, oversized text and too
    /// many metrics (they would bloat every manifest and history line).
    /// Too many metrics are found first, a repeated name last.
    pub fn from_pairs(
        pairs: impl IntoIterator<Item = (String, MetricValue)>,
    ) -> Result<Self, InvalidMetrics> {
        // Collected first: from a guest's vector of the same layout the
        // pairs stay in its allocation.
        let mut out: Vec<(String, MetricValue)> = pairs.into_iter().take(MAX_METRICS + 1).collect();
        if out.len() > MAX_METRICS {
            return Err(InvalidMetrics::TooMany);
        }
        for (name, value) in &mut out {
            if name.len() > MAX_NAME_BYTES {
                return Err(InvalidMetrics::NameTooLong {
                    start: name.chars().take(32).collect(),
                    bytes: name.len(),
                });
            }
            if let MetricValue::Text(text) = value
                && text.len() > MAX_TEXT_BYTES
            {
                return Err(InvalidMetrics::TextTooLong {
                    bytes: text.len(),
                    name: std::mem::take(name),
                });
            }
            if name.is_empty() {
                return Err(InvalidMetrics::EmptyName);
            }
            if name.split('/').any(str::is_empty) {
                return Err(InvalidMetrics::EmptyPart {
                    name: std::mem::take(name),
                });
            }
        }
        out.sort_unstable_by(|(a, _), (b, _)| a.cmp(b));
        if let Some(i) = (1..out.len()).find(|&i| out[i - 1].0 == out[i].0) {
            let name = std::mem::take(&mut out[i].0);
            return Err(InvalidMetrics::Repeated { name });
        }
        Ok(Metrics(out))
    }
}

impl fmt::Display for Metrics {
    /// `name=value` pairs separated by spaces.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{k}={v}")?;
        }
        Ok(())
    }
}

/// A later value of a name replaces an earlier one.
impl<K: Into<String>> FromIterator<(K, MetricValue)> for Metrics {
    fn from_iter<I: IntoIterator<Item = (K, MetricValue)>>(iter: I) -> Self {
        let map: BTreeMap<String, MetricValue> =
            iter.into_iter().map(|(k, v)| (k.into(), v)).collect();
        Metrics(map.into_iter().collect())
    }
}

/// A JSON object, in name order.
impl Serialize for Metrics {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

impl<'de> Deserialize<'de> for Metrics {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map = BTreeMap::<String, MetricValue>::deserialize(d)?;
        Ok(Metrics(map.into_iter().collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_json_including_non_finite_floats() {
        let m: Metrics = [
            ("loss", MetricValue::Float(0.5)),
            ("nan", MetricValue::Float(f64::NAN)),
            ("inf", MetricValue::Float(f64::NEG_INFINITY)),
            ("epoch", MetricValue::Integer(3)),
            ("whole_float", MetricValue::Float(2.0)),
            ("text", MetricValue::Text("NaN".into())),
            ("flag", MetricValue::Boolean(true)),
        ]
        .into_iter()
        .collect();
        let json = serde_json::to_string(&m).unwrap();
        let back: Metrics = serde_json::from_str(&json).unwrap();
        assert!(matches!(back.get("nan"), Some(MetricValue::Float(f)) if f.is_nan()));
        assert_eq!(
            back.get("inf"),
            Some(&MetricValue::Float(f64::NEG_INFINITY))
        );
        assert_eq!(back.get("epoch"), Some(&MetricValue::Integer(3)));
        assert_eq!(back.get("whole_float"), Some(&MetricValue::Float(2.0)));
        assert_eq!(back.get("text"), Some(&MetricValue::Text("NaN".into())));
        assert_eq!(back.get("flag"), Some(&MetricValue::Boolean(true)));
    }

    #[test]
    fn floats_round_trip_bit_for_bit() {
        // Found by the metrics fuzz target: without serde_json's
        // float_roundtrip this came back one ulp off.
        for v in [
            -1.718380660761236e-93,
            f64::MIN_POSITIVE,
            5e-324,
            0.1 + 0.2,
            f64::MAX,
        ] {
            let m: Metrics = [("x", MetricValue::Float(v))].into_iter().collect();
            let back: Metrics = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
            assert_eq!(back.get("x"), Some(&MetricValue::Float(v)), "{v:e}");
        }
    }

    #[test]
    fn refuses_empty_repeated_and_malformed_names() {
        let v = || MetricValue::Integer(1);
        assert!(Metrics::from_pairs([("".into(), v())]).is_err());
        assert!(Metrics::from_pairs([("a//b".into(), v())]).is_err());
        assert!(Metrics::from_pairs([("a".into(), v()), ("a".into(), v())]).is_err());
        assert!(Metrics::from_pairs([("eval/loss".into(), v())]).is_ok());
    }

    #[test]
    fn metrics_are_kept_in_name_order_and_a_name_once() {
        let v = MetricValue::Integer;
        let mut m = Metrics::from_pairs([("loss".into(), v(3)), ("epoch".into(), v(1))]).unwrap();
        m.insert("acc", v(2));
        m.insert("loss", v(4));
        let names: Vec<&str> = m.iter().map(|(k, _)| k).collect();
        assert_eq!(names, ["acc", "epoch", "loss"]);
        assert_eq!(m.get("loss"), Some(&v(4)));
        assert_eq!(m.get("lr"), None);
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"acc":2,"epoch":1,"loss":4}"#
        );
        let repeated =
            Metrics::from_pairs([("b".into(), v(1)), ("a".into(), v(1)), ("b".into(), v(2))]);
        assert!(
            matches!(&repeated, Err(InvalidMetrics::Repeated { name }) if name == "b"),
            "{repeated:?}"
        );
        let collected: Metrics = [("x", v(1)), ("x", v(2))].into_iter().collect();
        assert_eq!(collected.len(), 1);
        assert_eq!(collected.get("x"), Some(&v(2)));
    }

    #[test]
    fn refuses_huge_maps_names_and_texts() {
        let many = (0..=MAX_METRICS).map(|i| (format!("m{i}"), MetricValue::Integer(1)));
        assert!(
            Metrics::from_pairs(many)
                .unwrap_err()
                .to_string()
                .contains("at most 1024 metrics")
        );
        let long = "n".repeat(MAX_NAME_BYTES + 1);
        assert!(
            Metrics::from_pairs([(long, MetricValue::Integer(1))])
                .unwrap_err()
                .to_string()
                .contains("at most 256 bytes")
        );
        let text = MetricValue::Text("t".repeat(MAX_TEXT_BYTES + 1));
        assert!(
            Metrics::from_pairs([("t".into(), text)])
                .unwrap_err()
                .to_string()
                .contains("texts may be at most")
        );
    }
}
