//! The `context` and `session` imports: where a rank sits, the run's
//! config, and `report` / `get-checkpoint`, turned into the attempt's calls
//! and their refusals back into WIT types.

use std::path::Path;

use futures::FutureExt;
use futures::future::Either;

use super::bindings::trainhost::train::{context, session};
use super::limits::LimitHit;
use super::rank::{RankState, StoppedByHost};
use super::sandbox::SCRATCH_GUEST_PATH;
use crate::attempt::{Aborted, HandOver, Refused, Reported};
use crate::metrics::{MetricValue, Metrics};

impl context::Host for RankState {
    fn world_rank(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.world_rank)
    }
    fn world_size(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.world_size)
    }
    fn local_rank(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.local_rank)
    }
    fn local_world_size(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.local_world_size)
    }
    fn node_rank(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.node_rank)
    }
    fn config(&mut self) -> wasmtime::Result<String> {
        Ok(self.shared.config_json.to_string())
    }
    fn run_name(&mut self) -> wasmtime::Result<String> {
        Ok(self.shared.run_name.to_string())
    }
    fn scratch_dir(&mut self) -> wasmtime::Result<String> {
        Ok(SCRATCH_GUEST_PATH.to_owned())
    }
}

impl session::Host for RankState {
    // `report` is a plain function returning its future rather than an
    // `async fn`: the bindings box that future at every call, and nested
    // `async fn`s would keep each layer's arguments beside the future they
    // moved into (over a kilobyte, past the allocator's per-thread cache).
    fn report(
        &mut self,
        metrics: Vec<session::Metric>,
        checkpoint: Option<String>,
    ) -> impl Future<Output = wasmtime::Result<Result<(), session::ReportError>>> + Send {
        self.report_with(metrics, checkpoint, false)
    }

    fn report_handing_over(
        &mut self,
        metrics: Vec<session::Metric>,
        checkpoint: String,
    ) -> impl Future<Output = wasmtime::Result<Result<(), session::ReportError>>> + Send {
        self.report_with(metrics, Some(checkpoint), true)
    }

    fn preemption_requested(&mut self) -> wasmtime::Result<bool> {
        Ok(self.attempt.preemption_requested())
    }

    fn get_checkpoint(&mut self) -> wasmtime::Result<Option<String>> {
        self.attempt
            .get_checkpoint()
            .map_err(|Aborted| wasmtime::Error::new(StoppedByHost))
    }
}

impl RankState {
    /// `report`, or with `hand_over`, `report-handing-over`: the metrics
    /// and the checkpoint are taken (or refused) at once, and the future
    /// returned waits for the other ranks.
    fn report_with(
        &mut self,
        metrics: Vec<session::Metric>,
        checkpoint: Option<String>,
        hand_over: bool,
    ) -> impl Future<Output = wasmtime::Result<Result<(), session::ReportError>>> + Send + use<'_>
    {
        use session::ReportError;
        let refuse = |error| Either::Left(std::future::ready(Ok(Err(error))));
        // Refusals before the ranks meet do not count as this rank's
        // report: the guest may fix the call and make it again.
        let metrics = match Metrics::from_pairs(metrics.into_iter().map(|m| {
            let value = match m.value {
                session::MetricValue::Integer(v) => MetricValue::Integer(v),
                session::MetricValue::Float(v) => MetricValue::Float(v),
                session::MetricValue::Text(v) => MetricValue::Text(v),
                session::MetricValue::Boolean(v) => MetricValue::Boolean(v),
            };
            (m.name, value)
        })) {
            Ok(m) => m,
            Err(e) => return refuse(ReportError::InvalidMetrics(e.to_string())),
        };
        if let Err(refused) = self.attempt.check_metrics(&metrics) {
            return refuse(report_error(refused));
        }
        if let Err(hit) = self.charge_recorded(&metrics) {
            return Either::Left(std::future::ready(Err(wasmtime::Error::new(hit))));
        }
        let open_for_writing = match checkpoint {
            Some(_) => self.writers.inodes(),
            None => Default::default(),
        };
        let sandbox = &self.sandbox;
        let move_out =
            |path: &str, to: &Path| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
                Ok(sandbox.hand_over(path, to)?)
            };
        let reported = match &checkpoint {
            None => None,
            Some(path) => match sandbox.open_dir(path) {
                Ok(dir) => Some(Reported {
                    dir,
                    shown: path.as_str(),
                    hand_over: hand_over.then_some(&move_out as HandOver<'_>),
                    open_for_writing,
                }),
                Err(e) => return refuse(ReportError::InvalidCheckpoint(e.to_string())),
            },
        };
        Either::Right(
            self.attempt
                .report(metrics, reported)
                .map(|reported| match reported {
                    Ok(Ok(())) => Ok(Ok(())),
                    Ok(Err(refused)) => Ok(Err(report_error(refused))),
                    Err(Aborted) => Err(wasmtime::Error::new(StoppedByHost)),
                }),
        )
    }

    /// Rank 0's metrics are the report's, and the run's history keeps
    /// every report's in memory and in storage: they draw on its output
    /// budget as its printing does (R58), so that a loop reporting far
    /// faster than it trains fails the rank instead of filling the host's
    /// memory. The other ranks' metrics are dropped once checked.
    fn charge_recorded(&mut self, metrics: &Metrics) -> Result<(), LimitHit> {
        let Some(rate) = self.shared.limits.max_output_rate else {
            return Ok(());
        };
        if self.info.world_rank != 0 {
            return Ok(());
        }
        self.metrics_owed += HISTORY_LINE_BYTES + metrics.json_bytes();
        // At most a sixteenth of the budget's burst is owed, so that a
        // loop within the limit never owes more than the budget holds.
        let batch = usize::try_from(rate / 4).unwrap_or(usize::MAX);
        if self.metrics_owed < OWED_AT_MOST.min(batch) {
            return Ok(());
        }
        self.output
            .take(std::mem::take(&mut self.metrics_owed))
            .map_err(|LimitHit(hit)| {
                LimitHit(format!(
                    "{hit}, counting the metrics it reported (the run's history keeps rank 0's): report less often or fewer metrics, or raise the limit"
                ))
            })
    }
}

/// What a report's line in the history holds besides its metrics: its
/// index, its time and the field names.
const HISTORY_LINE_BYTES: usize = 64;

/// Reported metrics are taken from the budget a few KiB at a time: the
/// budget's lock and clock cost a report of one metric 3% when taken at
/// every report, and a budget allows four seconds' worth at once.
const OWED_AT_MOST: usize = 4 << 10;

/// A refused report as the guest sees it.
fn report_error(refused: Refused) -> session::ReportError {
    use session::ReportError;
    let message = refused.to_string();
    match refused {
        Refused::Score(_) => ReportError::InvalidMetrics(message),
        Refused::Capture(_) | Refused::TooLarge { .. } | Refused::HandOver(_) => {
            ReportError::InvalidCheckpoint(message)
        }
        Refused::Collision(_) | Refused::Elsewhere(_) => ReportError::Collision(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of what `f` returns, without calling it (no rank needed).
    fn size_of_output<R>(_: impl FnOnce(&'static mut RankState) -> R) -> usize {
        size_of::<R>()
    }

    #[test]
    fn a_reports_future_stays_below_the_allocators_thread_cache() {
        // The bindings box this future at every report, with their own
        // state beside it. Past glibc's per-thread cache (1032 bytes) each
        // report took a malloc and a free from the shared arenas and copied
        // a kilobyte: at 1008 bytes the quiet `report` rows were 20–40%
        // slower than at 176.
        let report = size_of_output(|s| session::Host::report(s, Vec::new(), None));
        let handing_over =
            size_of_output(|s| session::Host::report_handing_over(s, Vec::new(), String::new()));
        for size in [report, handing_over] {
            assert!(size <= 512, "a report's future is {size} bytes");
        }
    }
}
