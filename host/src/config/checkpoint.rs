//! Which checkpoints to keep: Ray's `CheckpointConfig` as the user writes
//! it, and the validated [`Retention`] policy a run applies (R13-R17).

use crate::error::Error;
use crate::metrics::{MetricValue, Metrics};

/// Which checkpoints to keep (Ray's `CheckpointConfig`).
///
/// ```
/// use trainhost::{CheckpointConfig, ScoreOrder};
/// // Keep the 3 checkpoints with the lowest loss (plus always the latest),
/// // and every 10th whatever its loss.
/// let keep = CheckpointConfig {
///     num_to_keep: Some(3),
///     checkpoint_score_attribute: Some("loss".into()),
///     checkpoint_score_order: Some(ScoreOrder::Min),
///     keep_every: Some(10),
/// };
/// // Tune's shorthand says the same about the order:
/// let same = CheckpointConfig {
///     num_to_keep: Some(3),
///     checkpoint_score_attribute: Some("min-loss".into()),
///     ..CheckpointConfig::default()
/// };
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointConfig {
    /// How many of the best checkpoints to keep; `None` (default) keeps
    /// all. The latest checkpoint is kept in addition, so storage may hold
    /// one more.
    pub num_to_keep: Option<usize>,
    /// The metric that ranks checkpoints; `None` ranks by recency. Tune's
    /// shorthand `max-<metric>` / `min-<metric>` sets the order too.
    pub checkpoint_score_attribute: Option<String>,
    /// Whether a higher or lower score is better (default `Max`, as in
    /// Ray).
    pub checkpoint_score_order: Option<ScoreOrder>,
    /// Keep every N-th checkpoint (index divisible by N) whatever its score.
    pub keep_every: Option<u64>,
}

impl CheckpointConfig {
    /// Read a `num_to_keep` as people write it (a command-line flag, a
    /// config file): a whole number of at least 1. Negative numbers are
    /// refused with the same message as 0, as Ray refuses them.
    ///
    /// ```
    /// use trainhost::CheckpointConfig;
    /// assert_eq!(CheckpointConfig::parse_num_to_keep("3").unwrap(), 3);
    /// assert!(CheckpointConfig::parse_num_to_keep("-1").is_err());
    /// ```
    pub fn parse_num_to_keep(text: &str) -> Result<usize, Error> {
        let n: i128 = text.trim().parse().map_err(|_| {
            Error::InvalidConfig(format!(
                "num_to_keep {text:?} is not a whole number; give N >= 1, or leave it unset to keep every checkpoint"
            ))
        })?;
        check_num_to_keep(n)?;
        usize::try_from(n)
            .map_err(|_| Error::InvalidConfig(format!("num_to_keep {n} is too large")))
    }

    /// Check the settings and turn them into the policy a run applies.
    pub(crate) fn retention(&self) -> Result<Retention, Error> {
        if let Some(n) = self.num_to_keep {
            check_num_to_keep(n as i128)?;
        }
        if self.keep_every == Some(0) {
            return Err(Error::InvalidConfig(
                "keep_every is 0; give N >= 1 to keep every N-th checkpoint".into(),
            ));
        }
        if self.checkpoint_score_attribute.is_none() && self.checkpoint_score_order.is_some() {
            return Err(Error::InvalidConfig(
                "checkpoint_score_order is set without checkpoint_score_attribute; name the metric to rank by".into(),
            ));
        }
        if self.keep_every.is_some() && self.num_to_keep.is_none() {
            return Err(Error::InvalidConfig(
                "keep_every needs num_to_keep: without num_to_keep every checkpoint is kept anyway"
                    .into(),
            ));
        }
        let score = match &self.checkpoint_score_attribute {
            None => None,
            Some(given) => Some(self.score(given)?),
        };
        Ok(Retention {
            num_to_keep: self.num_to_keep,
            score,
            keep_every: self.keep_every,
        })
    }

    /// The metric and order `given` names, with Tune's `max-`/`min-`
    /// shorthand resolved against `checkpoint_score_order`.
    fn score(&self, given: &str) -> Result<(String, ScoreOrder), Error> {
        let (attr, implied) = match given.split_once('-') {
            Some(("max", rest)) if !rest.is_empty() => (rest, Some(ScoreOrder::Max)),
            Some(("min", rest)) if !rest.is_empty() => (rest, Some(ScoreOrder::Min)),
            _ => (given, None),
        };
        if attr.is_empty() {
            return Err(Error::InvalidConfig(
                "checkpoint_score_attribute is empty".into(),
            ));
        }
        let order = match (implied, self.checkpoint_score_order) {
            (Some(a), Some(b)) if a != b => {
                return Err(Error::InvalidConfig(format!(
                    "checkpoint_score_attribute {given:?} implies order {a:?} but checkpoint_score_order is {b:?}; drop one"
                )));
            }
            (Some(o), _) | (None, Some(o)) => o,
            (None, None) => ScoreOrder::Max,
        };
        Ok((attr.to_owned(), order))
    }
}

/// R13: keep at least one, or leave it unset.
fn check_num_to_keep(n: i128) -> Result<(), Error> {
    if n < 1 {
        return Err(Error::InvalidConfig(format!(
            "num_to_keep must be at least 1, got {n}; leave it unset to keep every checkpoint"
        )));
    }
    Ok(())
}

/// Whether a higher or a lower score is better.
///
/// ```
/// use trainhost::ScoreOrder;
/// assert_eq!("min".parse::<ScoreOrder>().unwrap(), ScoreOrder::Min);
/// assert_eq!(ScoreOrder::default(), ScoreOrder::Max);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScoreOrder {
    /// Higher is better (accuracy). Ray's default.
    #[default]
    Max,
    /// Lower is better (loss).
    Min,
}

impl std::str::FromStr for ScoreOrder {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "max" => Ok(ScoreOrder::Max),
            "min" => Ok(ScoreOrder::Min),
            other => Err(Error::InvalidConfig(format!(
                "score order must be max or min, not {other:?}"
            ))),
        }
    }
}

/// The retention policy, validated. Stored in the run state so that
/// listings rank checkpoints as the run did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Retention {
    pub num_to_keep: Option<usize>,
    pub score: Option<(String, ScoreOrder)>,
    pub keep_every: Option<u64>,
}

/// Why a report's metrics cannot be ranked; the guest sees it (R17).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "the score attribute {attribute:?} must be a number, got {value}; report it as an integer or float, or choose another score attribute"
)]
pub(crate) struct NotAScore {
    pub attribute: String,
    pub value: MetricValue,
}

impl Retention {
    /// A report's metrics must give the score attribute as a number, if
    /// they give it at all (R17).
    pub fn check_metrics(&self, metrics: &Metrics) -> Result<(), NotAScore> {
        let Some((attr, _)) = &self.score else {
            return Ok(());
        };
        match metrics.get(attr) {
            None | Some(MetricValue::Integer(_) | MetricValue::Float(_)) => Ok(()),
            Some(other) => Err(NotAScore {
                attribute: attr.clone(),
                value: other.clone(),
            }),
        }
    }

    /// The score of `metrics`: `None` when missing or NaN, which ranks
    /// worst (R17).
    pub fn score_of(&self, metrics: &Metrics) -> Option<f64> {
        let (attr, _) = self.score.as_ref()?;
        metrics
            .get(attr)
            .and_then(MetricValue::as_f64)
            .filter(|v| !v.is_nan())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tunes_shorthand_sets_the_order() {
        let config = CheckpointConfig {
            num_to_keep: Some(2),
            checkpoint_score_attribute: Some("min-loss".into()),
            ..CheckpointConfig::default()
        };
        let policy = config.retention().unwrap();
        assert_eq!(policy.score, Some(("loss".into(), ScoreOrder::Min)));
        let conflicting = CheckpointConfig {
            checkpoint_score_order: Some(ScoreOrder::Max),
            ..config
        };
        let err = conflicting.retention().unwrap_err().to_string();
        assert!(err.contains("implies order Min"), "{err}");
    }

    #[test]
    fn num_to_keep_is_checked_the_same_way_from_text_and_from_the_struct() {
        let from_text = CheckpointConfig::parse_num_to_keep("-2")
            .unwrap_err()
            .to_string();
        assert!(
            from_text.contains("must be at least 1, got -2"),
            "{from_text}"
        );
        let from_struct = CheckpointConfig {
            num_to_keep: Some(0),
            ..CheckpointConfig::default()
        }
        .retention()
        .unwrap_err()
        .to_string();
        assert!(
            from_struct.contains("must be at least 1, got 0"),
            "{from_struct}"
        );
        assert!(CheckpointConfig::parse_num_to_keep("three").is_err());
    }

    #[test]
    fn integer_scores_count_and_non_numeric_ones_are_refused() {
        let p = Retention {
            num_to_keep: Some(1),
            score: Some(("loss".into(), ScoreOrder::Max)),
            keep_every: None,
        };
        assert!(
            p.check_metrics(&[("loss", MetricValue::Integer(3))].into_iter().collect())
                .is_ok()
        );
        assert!(p.check_metrics(&Metrics::new()).is_ok());
        let err = p
            .check_metrics(
                &[("loss", MetricValue::Text("low".into()))]
                    .into_iter()
                    .collect(),
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"loss\" must be a number"), "{err}");
    }
}
