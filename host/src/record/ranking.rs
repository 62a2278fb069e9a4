//! Ranking committed checkpoints, and which of them a retention policy
//! keeps (R14-R17).
//!
//! Ranking: with a score attribute, by score in the configured order, a
//! missing or NaN score ranking worst; without one, by recency. Ties go to
//! the newer checkpoint. The latest checkpoint is always kept (so a crash
//! can resume from it), as is every `keep_every`-th.

use std::cmp::Ordering;

use super::state::CheckpointRecord;
use crate::config::{Retention, ScoreOrder};

/// `a` compared to `b` under `policy`: `Less` when `a` ranks better.
fn compare(policy: &Retention, a: &CheckpointRecord, b: &CheckpointRecord) -> Ordering {
    let newer_first = b.index.cmp(&a.index);
    let Some((_, order)) = &policy.score else {
        return newer_first;
    };
    match (policy.score_of(&a.metrics), policy.score_of(&b.metrics)) {
        (Some(x), Some(y)) => {
            let better = match order {
                ScoreOrder::Max => y.total_cmp(&x),
                ScoreOrder::Min => x.total_cmp(&y),
            };
            better.then(newer_first)
        }
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => newer_first,
    }
}

/// `records` ordered best first.
pub(crate) fn ranked(policy: &Retention, records: &[CheckpointRecord]) -> Vec<CheckpointRecord> {
    let mut out = records.to_vec();
    out.sort_by(|a, b| compare(policy, a, b));
    out
}

/// Split `records` (in commit order) into those to keep and those to
/// delete, both in commit order.
pub(crate) fn split(
    policy: &Retention,
    records: &[CheckpointRecord],
) -> (Vec<CheckpointRecord>, Vec<CheckpointRecord>) {
    let Some(num_to_keep) = policy.num_to_keep else {
        return (records.to_vec(), Vec::new());
    };
    let latest = records.iter().map(|r| r.index).max();
    let best: Vec<u64> = ranked(policy, records)
        .iter()
        .take(num_to_keep)
        .map(|r| r.index)
        .collect();
    records.iter().cloned().partition(|r| {
        Some(r.index) == latest
            || best.contains(&r.index)
            || policy.keep_every.is_some_and(|n| r.index % n == 0)
    })
}

/// Log a warning for a checkpoint whose score is missing or NaN.
pub(crate) fn warn_unscored(policy: &Retention, record: &CheckpointRecord) {
    if let Some((attr, _)) = &policy.score
        && policy.score_of(&record.metrics).is_none()
    {
        tracing::warn!(
            checkpoint = record.index,
            "checkpoint has no numeric {attr:?} metric (missing or NaN); it ranks worst for retention"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::MetricValue;

    fn rec(index: u64, metrics: &[(&str, MetricValue)]) -> CheckpointRecord {
        CheckpointRecord {
            index,
            report_index: index,
            metrics: metrics.iter().cloned().collect(),
        }
    }

    fn losses(values: &[Option<f64>]) -> Vec<CheckpointRecord> {
        values
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Some(v) => rec(i as u64, &[("loss", MetricValue::Float(*v))]),
                None => rec(i as u64, &[("other", MetricValue::Integer(1))]),
            })
            .collect()
    }

    fn policy(keep: usize, order: Option<ScoreOrder>) -> Retention {
        Retention {
            num_to_keep: Some(keep),
            score: order.map(|o| ("loss".to_owned(), o)),
            keep_every: None,
        }
    }

    fn indexes(records: &[CheckpointRecord]) -> Vec<u64> {
        records.iter().map(|r| r.index).collect()
    }

    #[test]
    fn keeps_the_best_by_min_plus_the_latest() {
        let records = losses(&[Some(2.0), Some(4.0), Some(1.0), Some(3.0)]);
        let p = policy(2, Some(ScoreOrder::Min));
        let (kept, dropped) = split(&p, &records);
        assert_eq!(
            indexes(&kept),
            [0, 2, 3],
            "the two best (1, 2) plus the latest (3)"
        );
        assert_eq!(indexes(&dropped), [1]);
        assert_eq!(indexes(&ranked(&p, &kept)), [2, 0, 3]);
    }

    #[test]
    fn without_a_score_the_most_recent_are_kept() {
        let records = losses(&[Some(1.0), Some(1.0), Some(1.0), Some(1.0)]);
        let (kept, _) = split(&policy(2, None), &records);
        assert_eq!(indexes(&kept), [2, 3]);
    }

    #[test]
    fn ties_go_to_the_newer_checkpoint() {
        let records = losses(&[Some(1.0), Some(1.0), Some(5.0)]);
        let p = policy(1, Some(ScoreOrder::Min));
        assert_eq!(indexes(&ranked(&p, &records)), [1, 0, 2]);
        let (kept, _) = split(&p, &records);
        assert_eq!(indexes(&kept), [1, 2]);
    }

    #[test]
    fn missing_and_nan_scores_rank_worst_under_both_orders() {
        let records = losses(&[None, Some(f64::NAN), Some(3.0), Some(1.0), None]);
        for order in [ScoreOrder::Min, ScoreOrder::Max] {
            let ranked = indexes(&ranked(&policy(1, Some(order)), &records));
            assert_eq!(&ranked[2..], [4, 1, 0], "{order:?}: {ranked:?}");
        }
        let (kept, _) = split(&policy(1, Some(ScoreOrder::Max)), &records);
        assert_eq!(
            indexes(&kept),
            [2, 4],
            "best (3.0) and the latest, though unscored"
        );
    }

    #[test]
    fn keep_every_keeps_every_nth_checkpoint_whatever_its_score() {
        let records = losses(&[
            Some(9.0),
            Some(8.0),
            Some(7.0),
            Some(1.0),
            Some(6.0),
            Some(5.0),
        ]);
        let p = Retention {
            keep_every: Some(2),
            ..policy(1, Some(ScoreOrder::Min))
        };
        let (kept, dropped) = split(&p, &records);
        assert_eq!(indexes(&kept), [0, 2, 3, 4, 5]);
        assert_eq!(indexes(&dropped), [1]);
    }

    #[test]
    fn keeping_all_deletes_nothing() {
        let records = losses(&[Some(1.0), Some(2.0)]);
        let (kept, dropped) = split(&Retention::default(), &records);
        assert_eq!(indexes(&kept), [0, 1]);
        assert!(dropped.is_empty());
    }
}
