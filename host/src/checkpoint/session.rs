//! One attempt's shared state, as the ranks' imports use it: the report
//! gate, the ledger, the restore cache, and the run's first failure.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::runtime::Handle;

use super::capture::Capture;
use super::gate::{Aborted, ReportGate};
use super::ledger::{Ledger, ReportRefused};
use super::restore::{Checkpoint, RestoreCache};
use crate::Metrics;
use crate::result::{FailureKind, RunFailure};

/// What a rank brings to a report.
pub(crate) struct Arrival {
    pub metrics: Metrics,
    pub capture: Option<Capture>,
}

/// A report's outcome, the same for every rank.
#[derive(Debug, Clone)]
enum Outcome {
    Recorded,
    Refused(ReportRefused),
    Failed,
}

/// Shared by the ranks of one attempt.
#[derive(Debug)]
pub(crate) struct Session {
    world_size: u32,
    gate: ReportGate<Arrival, Outcome>,
    ledger: Arc<Ledger>,
    restore: Arc<RestoreCache>,
    resume_from: Option<Checkpoint>,
    handle: Handle,
    failure: Mutex<Option<RunFailure>>,
    aborted: AtomicBool,
}

impl Session {
    pub fn new(
        world_size: u32,
        report_timeout: std::time::Duration,
        ledger: Arc<Ledger>,
        restore: Arc<RestoreCache>,
        resume_from: Option<Checkpoint>,
        handle: Handle,
    ) -> Self {
        Self {
            world_size,
            gate: ReportGate::new(world_size as usize, report_timeout),
            ledger,
            restore,
            resume_from,
            handle,
            failure: Mutex::new(None),
            aborted: AtomicBool::new(false),
        }
    }

    /// Whether the run is failing and every rank must stop. Cheap: read on
    /// every epoch tick of every rank.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Relaxed)
    }

    /// Fail the run (the first failure is the one kept) and stop every
    /// rank.
    pub fn fail(&self, failure: RunFailure) {
        {
            let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                tracing::error!("{failure}");
                *slot = Some(failure);
            }
        }
        self.aborted.store(true, Ordering::Relaxed);
        self.gate.abort();
    }

    /// The run's first failure.
    pub fn failure(&self) -> Option<RunFailure> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Rank `rank`'s part of the next collective report. Returns the
    /// report's outcome, or `Aborted` if the run is failing (this call may
    /// be the cause).
    pub fn report(
        &self,
        rank: u32,
        metrics: Metrics,
        capture: Option<Capture>,
    ) -> Result<Result<(), ReportRefused>, Aborted> {
        let arrival = Arrival { metrics, capture };
        let outcome = self.gate.arrive(rank as usize, arrival, |gathered| {
            let mut arrivals = gathered.arrivals;
            let captures: Vec<Capture> = arrivals
                .iter_mut()
                .filter_map(|a| a.capture.take())
                .collect();
            // Rank 0's metrics are the report's (R6).
            let metrics = std::mem::take(&mut arrivals[0].metrics);
            match self.ledger.record(metrics, captures, self.world_size) {
                Ok(Ok(())) => Outcome::Recorded,
                Ok(Err(refused)) => Outcome::Refused(refused),
                Err(e) => {
                    self.fail(RunFailure {
                        rank: None,
                        kind: FailureKind::Storage,
                        message: crate::error::chain(&e),
                    });
                    Outcome::Failed
                }
            }
        });
        match outcome {
            Ok(Outcome::Recorded) => Ok(Ok(())),
            Ok(Outcome::Refused(r)) => Ok(Err(r)),
            Ok(Outcome::Failed) | Err(Err(Aborted)) => Err(Aborted),
            Err(Ok(violation)) => {
                // A disagreement between ranks: the message names them all.
                self.fail(RunFailure {
                    rank: None,
                    kind: FailureKind::Protocol,
                    message: violation,
                });
                Err(Aborted)
            }
        }
    }

    /// Rank `rank` returned from `train` after `reports` reports.
    pub fn finish(&self, rank: u32, reports: u64) {
        if let Err(violation) = self.gate.finish(rank as usize, reports) {
            self.fail(RunFailure {
                rank: None,
                kind: FailureKind::Protocol,
                message: violation,
            });
        }
    }

    /// The guest path of the checkpoint to resume from (R21): the run's
    /// latest committed checkpoint, else `resume_from`, else none.
    pub fn get_checkpoint(&self, rank: u32) -> Result<Option<String>, Aborted> {
        let result = self.handle.block_on(async {
            if let Some(latest) = self.ledger.latest() {
                let name = latest.dir_name();
                let checkpoint = Checkpoint::load(self.ledger.storage().child(&name))
                    .await
                    .map_err(|e| crate::error::chain(&e))?;
                return self.restore.materialize(&name, &checkpoint).await.map(Some);
            }
            match &self.resume_from {
                Some(checkpoint) => self
                    .restore
                    .materialize("resume_from", checkpoint)
                    .await
                    .map(Some),
                None => Ok(None),
            }
        });
        result.map_err(|message| {
            self.fail(RunFailure {
                rank: Some(rank),
                kind: FailureKind::Restore,
                message,
            });
            Aborted
        })
    }
}
