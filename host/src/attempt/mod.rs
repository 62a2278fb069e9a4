//! One attempt's shared state, as the ranks' imports use it: the report
//! gate, the ledger, the restore cache, preemption, and the attempt's first
//! failure.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;

mod gate;
mod recorder;
mod restore;

pub(crate) use gate::Aborted;
pub(crate) use recorder::ReportRefused;
pub(crate) use restore::RestoreCache;

use gate::ReportGate;
use recorder::Recorder;
use restore::RestoreFailed;

use crate::checkpoint::Checkpoint;
use crate::failure::{FailureKind, RunFailure};
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::persist::Capture;
use crate::preemption::Preemption;

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
    gate: ReportGate<Arrival, Outcome>,
    ledger: Arc<Ledger>,
    recorder: Recorder,
    restore: Arc<RestoreCache>,
    resume_from: Option<Checkpoint>,
    preemption: Preemption,
    handle: Handle,
    failure: Mutex<Option<RunFailure>>,
    aborted: AtomicBool,
    /// Reports completed in this attempt.
    completed: AtomicU64,
    /// Once preemption is requested: the number of completed reports after
    /// which every rank sees `preemption-requested` true.
    preempt_after: OnceLock<u64>,
    started: Instant,
    /// Per rank: milliseconds after `started` of its last sign of life (a
    /// report, an output line).
    alive_at: Vec<AtomicU64>,
    /// Per rank: waiting for the other ranks inside `report`.
    waiting: Vec<AtomicBool>,
    /// Per rank: returned (or failed).
    ended: Vec<AtomicBool>,
    /// Damaged checkpoints already reported: every rank runs into them.
    damaged: Mutex<HashSet<String>>,
}

impl Session {
    /// `snapshots`: where checkpoints are copied so that `report` returns
    /// before they are uploaded; `None` to return once committed.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        world_size: u32,
        report_timeout: std::time::Duration,
        ledger: Arc<Ledger>,
        snapshots: Option<std::path::PathBuf>,
        restore: Arc<RestoreCache>,
        resume_from: Option<Checkpoint>,
        preemption: Preemption,
        handle: Handle,
    ) -> Self {
        Self {
            gate: ReportGate::new(world_size as usize, report_timeout),
            recorder: Recorder::start(Arc::clone(&ledger), world_size, snapshots, handle.clone()),
            ledger,
            restore,
            resume_from,
            preemption,
            handle,
            failure: Mutex::new(None),
            aborted: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            preempt_after: OnceLock::new(),
            started: Instant::now(),
            alive_at: (0..world_size).map(|_| AtomicU64::new(0)).collect(),
            waiting: (0..world_size).map(|_| AtomicBool::new(false)).collect(),
            ended: (0..world_size).map(|_| AtomicBool::new(false)).collect(),
            damaged: Mutex::new(HashSet::new()),
        }
    }

    /// Rank `rank` showed a sign of life.
    pub fn touch(&self, rank: u32) {
        let now = self.started.elapsed().as_millis() as u64;
        self.alive_at[rank as usize].store(now, Ordering::Relaxed);
    }

    /// Rank `rank` ended; it can no longer stall.
    pub fn ended(&self, rank: u32) {
        self.ended[rank as usize].store(true, Ordering::Relaxed);
    }

    /// How long this attempt has run.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// A rank that has shown no sign of life for longer than `timeout`
    /// while running its own code, and for how long.
    pub fn stalled(&self, timeout: Duration) -> Option<(u32, Duration)> {
        let now = self.started.elapsed();
        (0..self.alive_at.len()).find_map(|r| {
            if self.ended[r].load(Ordering::Relaxed) || self.waiting[r].load(Ordering::Relaxed) {
                return None;
            }
            let quiet = now.saturating_sub(Duration::from_millis(
                self.alive_at[r].load(Ordering::Relaxed),
            ));
            (quiet > timeout).then_some((r as u32, quiet))
        })
    }

    /// Whether every rank must stop now. Cheap: read on every epoch tick of
    /// every rank.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Relaxed)
    }

    /// Fail the attempt (the first failure is the one kept) and stop every
    /// rank.
    pub fn fail(&self, failure: RunFailure) {
        {
            let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                tracing::error!("{failure}");
                *slot = Some(failure);
            }
        }
        self.stop();
    }

    /// Stop every rank without a failure (preemption's grace ran out).
    pub fn stop(&self) {
        self.aborted.store(true, Ordering::Relaxed);
        self.gate.abort();
    }

    /// The attempt's first failure.
    pub fn failure(&self) -> Option<RunFailure> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Refuse metrics that cannot be recorded: a score attribute that is not
    /// a number (R17).
    pub fn check_metrics(&self, metrics: &Metrics) -> Result<(), String> {
        self.ledger
            .retention()
            .check_metrics(metrics)
            .map_err(|e| e.to_string())
    }

    /// Whether a rank that has made `reports` reports in this attempt sees
    /// preemption requested.
    pub fn preemption_requested(&self, reports: u64) -> bool {
        self.preempt_after
            .get()
            .is_some_and(|after| reports >= *after)
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
        self.touch(rank);
        // Waiting for slower ranks is not stalling.
        self.waiting[rank as usize].store(true, Ordering::Relaxed);
        let outcome = self.gate.arrive(rank as usize, arrival, |gathered| {
            let mut arrivals = gathered.arrivals;
            let captures: Vec<Capture> = arrivals
                .iter_mut()
                .filter_map(|a| a.capture.take())
                .collect();
            // Rank 0's metrics are the report's (R6).
            let metrics = std::mem::take(&mut arrivals[0].metrics);
            let outcome = match self.recorder.record(metrics, captures) {
                Ok(Ok(())) => Outcome::Recorded,
                Ok(Err(refused)) => Outcome::Refused(refused),
                Err(message) => {
                    self.fail(RunFailure {
                        rank: None,
                        kind: FailureKind::Storage,
                        message,
                    });
                    Outcome::Failed
                }
            };
            // Latched here, between reports, so that every rank sees the
            // request after the same report.
            let completed = self.completed.fetch_add(1, Ordering::SeqCst) + 1;
            if self.preemption.is_requested() {
                self.preempt_after.get_or_init(|| completed);
            }
            outcome
        });
        self.waiting[rank as usize].store(false, Ordering::Relaxed);
        self.touch(rank);
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

    /// Fail the attempt if writing reports in the background failed, so
    /// that ranks stop without waiting for their next report.
    pub fn check_background(&self) {
        if let Some(message) = self.recorder.failure() {
            self.fail(RunFailure {
                rank: None,
                kind: FailureKind::Storage,
                message,
            });
        }
    }

    /// Write every report recorded in this attempt to storage; a failure
    /// to do so fails the attempt. Called once the ranks have ended.
    pub fn finish_recording(&self) {
        if let Err(message) = self.recorder.finish() {
            if self.failure().is_some() {
                tracing::error!("writing reports to storage failed as well: {message}");
            }
            self.fail(RunFailure {
                rank: None,
                kind: FailureKind::Storage,
                message,
            });
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
    /// latest committed checkpoint that verifies, else `resume_from`, else
    /// none.
    pub fn get_checkpoint(&self, rank: u32) -> Result<Option<String>, Aborted> {
        self.touch(rank);
        // A checkpoint reported earlier in this attempt may still be on its
        // way to storage; it is the latest once committed.
        if let Err(message) = self.recorder.flush() {
            self.fail(RunFailure {
                rank: None,
                kind: FailureKind::Storage,
                message,
            });
            return Err(Aborted);
        }
        self.handle
            .block_on(self.resolve_checkpoint())
            .map_err(|message| {
                self.fail(RunFailure {
                    rank: Some(rank),
                    kind: FailureKind::Restore,
                    message,
                });
                Aborted
            })
    }

    async fn resolve_checkpoint(&self) -> Result<Option<String>, String> {
        let committed = self.ledger.newest_first();
        let mut corrupt = Vec::new();
        for record in &committed {
            let name = record.dir_name();
            let restored = match Checkpoint::load(self.ledger.storage().child(&name)).await {
                Ok(checkpoint) => self.restore.materialize(&name, &checkpoint).await,
                Err(e @ crate::error::Error::NotACheckpoint { .. }) => {
                    Err(RestoreFailed::Corrupt(crate::error::chain(&e)))
                }
                Err(e) => Err(RestoreFailed::Failed(crate::error::chain(&e))),
            };
            match restored {
                Ok(path) => return Ok(Some(path)),
                // Every rank walks the same cached results, so all settle on
                // the same older checkpoint.
                Err(RestoreFailed::Corrupt(message)) => {
                    let first_time = self
                        .damaged
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(name.clone());
                    if first_time {
                        tracing::error!(
                            "checkpoint {name} of the run is damaged in storage and is skipped: {message}"
                        );
                    }
                    corrupt.push(message);
                }
                Err(RestoreFailed::Failed(message)) => return Err(message),
            }
        }
        if !committed.is_empty() {
            return Err(format!(
                "none of the run's {} committed checkpoints verifies: {}",
                committed.len(),
                corrupt.join("; ")
            ));
        }
        match &self.resume_from {
            Some(checkpoint) => match self.restore.materialize("resume_from", checkpoint).await {
                Ok(path) => Ok(Some(path)),
                Err(RestoreFailed::Corrupt(m) | RestoreFailed::Failed(m)) => Err(m),
            },
            None => Ok(None),
        }
    }
}
