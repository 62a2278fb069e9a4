//! The ledger: the one writer of a run's record in storage (see
//! [`crate::record`] for what the files hold).
//!
//! A report with a checkpoint is written in this order, so that a host
//! killed at any instant leaves storage resumable (R11, R12, R18):
//! 1. the checkpoint's files, made durable ([`Storage::sync_uploads`]);
//! 2. its manifest (the commit);
//! 3. the run state, naming the new checkpoint and the retained ones;
//! 4. the metrics history;
//! 5. deletions by retention, each manifest first.
//!
//! Steps 1-3 are [`Ledger::upload`] and [`Ledger::commit_uploaded`]. Step
//! 5 is [`Ledger::delete_dropped`], which the caller runs after the commit
//! returned, beside later reports, so that nothing waits on deletions: from
//! step 3 on the run state no longer names what is deleted. Opening an
//! existing run repairs what a killed host can leave behind (`open.rs`).
//!
//! After a failure that is restarted, the run state naming it and the
//! history are stored while the next attempt starts; whole-file writes
//! land in the order their contents were taken (`writes.rs`).
//!
//! The ledger also owns the run's numbering: the index the next report and
//! the next checkpoint get ([`Ledger::assign`]).

mod commit;
mod open;
mod writes;

use std::sync::{Arc, Mutex};

use object_store::UpdateVersion;
use tokio::runtime::Handle;

pub(crate) use commit::{Committed, Uploaded};
pub(crate) use open::LedgerOptions;
use writes::Writes;

use crate::config::Retention;
use crate::error::Error;
use crate::failure::RunFailure;
use crate::metrics::Metrics;
use crate::persist::Previous;
use crate::record::tensorboard::EventFile;
use crate::record::{CheckpointRecord, History, ReportRecord, RunState, layout, ranking};
use crate::storage::Storage;

/// The indices a report is recorded under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Assigned {
    /// The report's index in the run.
    pub report: u64,
    /// The checkpoint's index, if the report has one.
    pub checkpoint: Option<u64>,
}

/// The indices the next report and checkpoint get.
#[derive(Debug, Clone, Copy, Default)]
struct Numbering {
    report: u64,
    checkpoint: u64,
}

struct Inner {
    /// What storage holds (or is about to, for the history).
    state: RunState,
    history: History,
    /// The history as a TensorBoard event file, when the run writes one
    /// (R49).
    events: Option<EventFile>,
    /// Indices handed out to reports that may not be written yet. Runs
    /// ahead of `state` while reports are on their way to storage; set
    /// back to it when an attempt starts (see [`Ledger::restart_numbering`]).
    assigned: Numbering,
    /// The latest committed checkpoint's files, once known.
    previous: Option<Arc<Previous>>,
    /// The version of the run state this host last read or wrote, on
    /// object stores: the next write must find it unchanged (R27).
    state_version: Option<UpdateVersion>,
    /// The last manifest this host set out to write, with its checkpoint:
    /// one found where the run state names none is this host's failed
    /// commit if it holds these bytes, else another host's (see
    /// `Ledger::clear`). Commits go in order, so only the last can fail.
    manifest_tried: Option<(u64, bytes::Bytes)>,
}

impl Inner {
    /// The indices after everything recorded so far.
    fn recorded(&self) -> Numbering {
        Numbering {
            report: self.state.reports,
            checkpoint: self.state.next_checkpoint_index,
        }
    }
}

/// The run's record: owns the run directory in storage.
pub(crate) struct Ledger {
    storage: Storage,
    handle: Handle,
    retention: Retention,
    /// The order of the run state's and the history's writes.
    writes: Writes,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("storage", &self.storage.url())
            .finish_non_exhaustive()
    }
}

impl Ledger {
    /// The run's storage location.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The retention policy (the one owner of it while the run goes on;
    /// the run state stores it when written).
    pub fn retention(&self) -> &Retention {
        &self.retention
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every mutation is a push or an assignment after the I/O, so a
        // lock poisoned by a panic still guards consistent data.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A number that changes whenever the run writes to storage (a report
    /// or a failure).
    pub fn generation(&self) -> u64 {
        let inner = self.lock();
        inner.state.reports + inner.state.failures.len() as u64
    }

    /// Retained committed checkpoints, newest first.
    pub fn newest_first(&self) -> Vec<CheckpointRecord> {
        let mut out = self.lock().state.checkpoints.clone();
        out.reverse();
        out
    }

    /// Retained checkpoints best first, the metrics history, and every
    /// failure so far.
    pub fn snapshot(&self) -> (Vec<CheckpointRecord>, Vec<ReportRecord>, Vec<RunFailure>) {
        let inner = self.lock();
        (
            ranking::ranked(&self.retention, &inner.state.checkpoints),
            inner.history.records().to_vec(),
            inner.state.failures.clone(),
        )
    }

    /// Number reports from what is recorded: indices handed out to reports
    /// of a failed attempt that never reached storage are given again.
    pub fn restart_numbering(&self) {
        let mut inner = self.lock();
        inner.assigned = inner.recorded();
    }

    /// The indices of the next report, which has a checkpoint or not.
    /// Reports are assigned one at a time, in report order.
    pub fn assign(&self, with_checkpoint: bool) -> Assigned {
        let mut inner = self.lock();
        let next = &mut inner.assigned;
        let assigned = Assigned {
            report: next.report,
            checkpoint: with_checkpoint.then_some(next.checkpoint),
        };
        next.report += 1;
        if with_checkpoint {
            next.checkpoint += 1;
        }
        assigned
    }

    /// The index the next checkpoint will get, without assigning it.
    pub fn next_checkpoint_index(&self) -> u64 {
        self.lock().assigned.checkpoint
    }

    /// Store the run state, if no other host wrote it since this one last
    /// did (R27): a host that lost the run commits and deletes nothing
    /// more, since both follow a state write.
    async fn write_state(&self) -> Result<(), Error> {
        let _in_order = self.writes.state.lock().await;
        let (json, version) = {
            let mut inner = self.lock();
            // The ledger's policy is the run's: a resumed run may change it
            // (the new one rules), and the state records it for listings.
            inner.state.retention = self.retention.clone();
            inner.state.updated_at = layout::now_rfc3339();
            let json = serde_json::to_vec_pretty(&inner.state).expect("state serializes");
            (json, inner.state_version.clone())
        };
        match self
            .storage
            .replace(layout::RUN_STATE, bytes::Bytes::from(json), version)
            .await?
        {
            Some(version) => {
                self.lock().state_version = Some(version);
                Ok(())
            }
            None => Err(self.fenced(format!(
                "{} changed since this host last wrote it: another host took the run over",
                layout::RUN_STATE
            ))),
        }
    }

    /// This host no longer owns the run, as `reason` shows.
    fn fenced(&self, reason: String) -> Error {
        Error::Fenced {
            run: self.storage.url().to_owned(),
            reason,
        }
    }

    /// An attempt starts: the next state write names it.
    pub fn begin_attempt(&self) {
        self.lock().state.attempts += 1;
    }

    /// How many failures the run has had.
    pub fn failure_count(&self) -> usize {
        self.lock().state.failures.len()
    }

    /// Add report `report_index` to the history in memory; `write_history`
    /// stores it (step 5).
    pub fn append_report(&self, report_index: u64, metrics: Metrics, checkpoint: Option<u64>) {
        let mut inner = self.lock();
        inner.state.reports = report_index + 1;
        inner.history.append(report_index, metrics, checkpoint);
        let Inner {
            history, events, ..
        } = &mut *inner;
        if let (Some(events), Some(last)) = (events, history.records().last()) {
            events.push(last);
        }
    }

    /// Store the metrics history as it is in memory, and its TensorBoard
    /// event file after it.
    pub async fn write_history(&self) -> Result<(), Error> {
        let _in_order = self.writes.history.lock().await;
        let (bytes, events) = {
            let inner = self.lock();
            let events = inner.events.as_ref().map(EventFile::to_bytes);
            (inner.history.to_bytes(), events)
        };
        self.storage.put(layout::HISTORY, bytes).await?;
        match events {
            Some(events) => self.storage.put(layout::TENSORBOARD, events).await,
            None => Ok(()),
        }
    }
}

/// Open (or continue) a run of one rank named "run" at `storage`, for
/// tests.
#[cfg(test)]
pub(crate) fn open_for_test(
    rt: &tokio::runtime::Runtime,
    storage: &Storage,
    retention: Retention,
    must_be_new: bool,
) -> Result<Ledger, Error> {
    let options = LedgerOptions {
        run_name: "run",
        config_fingerprint: "f",
        world_size: 1,
        retention,
        fresh: false,
        must_be_new,
        tensorboard: true,
    };
    rt.block_on(Ledger::open(storage.clone(), options, rt.handle().clone()))
}
