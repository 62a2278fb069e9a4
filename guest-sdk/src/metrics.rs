//! Metrics as the guest builds them: a flat map from name to value, with
//! nested structures flattened into `/`-separated names.

use crate::wit::trainhost::train::session;

/// The value of one metric.
#[derive(Debug, Clone, PartialEq)]
pub enum MetricValue {
    /// A whole number.
    Integer(i64),
    /// A floating-point number. NaN and infinities are recorded as such.
    Float(f64),
    /// Text.
    Text(String),
    /// A flag.
    Boolean(bool),
}

macro_rules! from_int {
    ($($t:ty),*) => {$(
        impl From<$t> for MetricValue {
            fn from(v: $t) -> Self {
                MetricValue::Integer(i64::from(v))
            }
        }
    )*};
}
from_int!(i8, i16, i32, i64, u8, u16, u32);

impl From<f64> for MetricValue {
    fn from(v: f64) -> Self {
        MetricValue::Float(v)
    }
}

impl From<f32> for MetricValue {
    fn from(v: f32) -> Self {
        MetricValue::Float(f64::from(v))
    }
}

impl From<bool> for MetricValue {
    fn from(v: bool) -> Self {
        MetricValue::Boolean(v)
    }
}

impl From<&str> for MetricValue {
    fn from(v: &str) -> Self {
        MetricValue::Text(v.to_owned())
    }
}

impl From<String> for MetricValue {
    fn from(v: String) -> Self {
        MetricValue::Text(v)
    }
}

/// Metrics for one report: names mapped to values.
///
/// ```
/// use trainhost_guest::Metrics;
/// let m = Metrics::new().with("loss", 0.25).with("epoch", 3);
/// assert_eq!(m.len(), 2);
///
/// // Nested structures flatten with `/`.
/// let nested = Metrics::from_serialize(&serde_json::json!({
///     "train": {"loss": 0.5},
///     "epoch": 1,
/// })).unwrap();
/// assert!(nested.get("train/loss").is_some());
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    /// Sorted by name, each name once: one small allocation per report,
    /// where a `BTreeMap` node takes over 600 bytes, and handed to the
    /// host in place.
    values: Vec<(String, MetricValue)>,
}

impl Metrics {
    /// No metrics.
    pub fn new() -> Self {
        Self::default()
    }

    fn find(&self, name: &str) -> Result<usize, usize> {
        self.values.binary_search_by(|(k, _)| k.as_str().cmp(name))
    }

    /// Set `name` to `value`, replacing an earlier value of that name.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<MetricValue>) {
        let (name, value) = (name.into(), value.into());
        match self.find(&name) {
            Ok(i) => self.values[i].1 = value,
            Err(i) => self.values.insert(i, (name, value)),
        }
    }

    /// Builder form of [`Metrics::insert`].
    pub fn with(mut self, name: impl Into<String>, value: impl Into<MetricValue>) -> Self {
        self.insert(name, value);
        self
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&MetricValue> {
        self.find(name).ok().map(|i| &self.values[i].1)
    }

    /// How many metrics there are.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Metrics from any serializable value whose top level is a map or a
    /// struct. Nested maps and structs are flattened into `outer/inner`
    /// names; `null` fields are left out. Arrays are not metrics and are
    /// refused.
    pub fn from_serialize<T: serde::Serialize>(value: &T) -> Result<Self, crate::Error> {
        let json =
            serde_json::to_value(value).map_err(|e| crate::Error::InvalidMetrics(e.to_string()))?;
        let serde_json::Value::Object(map) = json else {
            return Err(crate::Error::InvalidMetrics(
                "metrics must be a map or a struct".into(),
            ));
        };
        let mut out = Metrics::new();
        flatten("", map, &mut out)?;
        Ok(out)
    }

    /// The metrics as the host takes them; the names and texts move
    /// instead of being copied.
    pub(crate) fn into_wit(self) -> Vec<session::Metric> {
        self.values
            .into_iter()
            .map(|(name, value)| session::Metric {
                name,
                value: match value {
                    MetricValue::Integer(v) => session::MetricValue::Integer(v),
                    MetricValue::Float(v) => session::MetricValue::Float(v),
                    MetricValue::Text(v) => session::MetricValue::Text(v),
                    MetricValue::Boolean(v) => session::MetricValue::Boolean(v),
                },
            })
            .collect()
    }
}

fn flatten(
    prefix: &str,
    map: serde_json::Map<String, serde_json::Value>,
    out: &mut Metrics,
) -> Result<(), crate::Error> {
    use serde_json::Value;
    for (key, value) in map {
        let name = if prefix.is_empty() {
            key
        } else {
            format!("{prefix}/{key}")
        };
        match value {
            Value::Null => {}
            Value::Bool(b) => out.insert(name, b),
            Value::Number(n) => match n.as_i64() {
                Some(i) => out.insert(name, i),
                None => out.insert(name, n.as_f64().unwrap_or(f64::NAN)),
            },
            Value::String(s) => out.insert(name, s),
            Value::Object(inner) => flatten(&name, inner, out)?,
            Value::Array(_) => {
                return Err(crate::Error::InvalidMetrics(format!(
                    "metric {name:?} is an array; report one metric per element"
                )));
            }
        }
    }
    Ok(())
}

impl<K: Into<String>, V: Into<MetricValue>, const N: usize> From<[(K, V); N]> for Metrics {
    fn from(items: [(K, V); N]) -> Self {
        items.into_iter().collect()
    }
}

/// A later value of a name replaces an earlier one, as with
/// [`Metrics::insert`].
impl<K: Into<String>, V: Into<MetricValue>> FromIterator<(K, V)> for Metrics {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let map: std::collections::BTreeMap<String, MetricValue> = iter
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        Metrics {
            values: map.into_iter().collect(),
        }
    }
}

/// The metrics in name order.
impl IntoIterator for Metrics {
    type Item = (String, MetricValue);
    type IntoIter = std::vec::IntoIter<(String, MetricValue)>;
    fn into_iter(self) -> Self::IntoIter {
        self.values.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_kept_in_name_order_with_a_names_last_value() {
        let mut m = Metrics::new().with("loss", 0.5).with("epoch", 1);
        m.insert("acc", true);
        m.insert("loss", 0.25);
        assert_eq!(m.len(), 3);
        assert_eq!(m.get("loss"), Some(&MetricValue::Float(0.25)));
        assert_eq!(m.get("lr"), None);
        let names: Vec<String> = m.clone().into_iter().map(|(k, _)| k).collect();
        assert_eq!(names, ["acc", "epoch", "loss"]);
        let wit: Vec<String> = m.into_wit().into_iter().map(|m| m.name).collect();
        assert_eq!(wit, ["acc", "epoch", "loss"]);

        let collected: Metrics = [("b", 1), ("a", 2), ("b", 3), ("a", 4), ("c", 5)]
            .into_iter()
            .collect();
        let pairs: Vec<(String, MetricValue)> = collected.into_iter().collect();
        assert_eq!(
            pairs,
            [
                ("a".to_owned(), MetricValue::Integer(4)),
                ("b".to_owned(), MetricValue::Integer(3)),
                ("c".to_owned(), MetricValue::Integer(5)),
            ]
        );
    }
}
