//! What passes between the recorder (the gate's leader, on a rank's
//! thread) and the task that writes reports to storage: the messages, the
//! checkpoint waiting to be committed, and the state both ends share.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, oneshot};

use crate::error::Error;
use crate::ledger::Uploaded;
use crate::metrics::Metrics;
use crate::persist::Plan;

/// Why reports can no longer be recorded; the attempt fails with it.
#[derive(Debug, Clone, thiserror::Error)]
pub(super) enum RecordFailed {
    /// Storage (or the local disk) failed; nothing is written after it.
    #[error("{}", crate::error::chain(.0.as_ref()))]
    Storage(Arc<Error>),
    /// The writing task ended without saying why (it panicked).
    #[error("the task writing reports to storage stopped")]
    Stopped,
}

impl From<Error> for RecordFailed {
    fn from(e: Error) -> Self {
        Self::Storage(Arc::new(e))
    }
}

/// What the recorder and the writing task share.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// The first failure; nothing is written after it.
    failed: Mutex<Option<RecordFailed>>,
    /// Reports sent to the task and not yet added to the history.
    pub queued: AtomicUsize,
    /// Lines added to the history in memory but not yet stored.
    pub unwritten: AtomicBool,
}

impl Shared {
    /// The failure that stopped the writing, if any.
    pub fn failure(&self) -> Option<RecordFailed> {
        lock(&self.failed).clone()
    }

    /// Keep the first failure and return it.
    pub fn fail(&self, e: RecordFailed) -> RecordFailed {
        lock(&self.failed).get_or_insert(e).clone()
    }
}

/// What the recorder sends the writing task.
pub(super) enum Message {
    Report(Box<Job>),
    /// Lines were added to the history directly; store them in time.
    Unwritten,
    /// Answered once everything before it is written.
    Flush(oneshot::Sender<()>),
}

/// One report to write.
pub(super) struct Job {
    pub report_index: u64,
    pub metrics: Metrics,
    pub checkpoint: Option<Pending>,
    /// In the blocking mode: told once the report is written.
    pub done: Option<oneshot::Sender<Result<(), RecordFailed>>>,
}

/// A checkpoint planned (and in the background mode, snapshotted or
/// uploaded) but not yet committed.
pub(super) struct Pending {
    pub index: u64,
    pub plan: Plan,
    /// The snapshot to remove once persisted.
    pub snapshot: Option<PathBuf>,
    /// Set when the files are in storage already; only the commit is left.
    pub uploaded: Option<Uploaded>,
    /// The one permit to persist a checkpoint, released when this drops.
    pub _slot: OwnedSemaphorePermit,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(dir) = &self.snapshot
            && let Err(e) = std::fs::remove_dir_all(dir)
        {
            tracing::warn!(dir = %dir.display(), "cannot remove a checkpoint snapshot: {e}");
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
