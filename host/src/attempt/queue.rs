//! What passes between the recorder (the gate's leader, on a rank's
//! thread) and the task that writes reports to storage: the messages, the
//! checkpoint waiting to be committed (with, in a run over several hosts,
//! the other nodes' files it waits for), and the state both ends share.

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, oneshot};
use tokio::task::JoinHandle;

use crate::cluster::Link;
use crate::cluster::wire::{self, Header};
use crate::error::Error;
use crate::ledger::Uploaded;
use crate::metrics::Metrics;
use crate::persist::Plan;
use crate::record::FileEntry;

/// Why reports can no longer be recorded; the attempt fails with it.
#[derive(Debug, Clone, thiserror::Error)]
pub(super) enum RecordFailed {
    /// Storage (or the local disk) failed; nothing is written after it.
    #[error("{}", crate::error::chain(.0.as_ref()))]
    Storage(Arc<Error>),
    /// The writing task ended without saying why (it panicked).
    #[error("the task writing reports to storage stopped")]
    Stopped,
    /// The attempt stopped before every node had persisted its files of
    /// a checkpoint (the reason is the attempt's failure).
    #[error("the run stopped before every node had persisted its checkpoint files")]
    Abandoned,
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
    /// The attempt failed: the run stores the history with the failure's
    /// record while the next attempt starts (see `ledger::writes`), so the
    /// task stores it only before a commit (R9), not while idle or at the
    /// end.
    pub history_left: AtomicBool,
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

/// A checkpoint planned (and in the background mode, snapshotted) but not
/// yet committed.
pub(super) struct Pending {
    pub index: u64,
    pub files: Files,
    /// Other nodes' files of the checkpoint, to wait for before the commit.
    pub remote: Option<Remote>,
    /// The one permit to persist a checkpoint, released when this drops.
    pub _slot: OwnedSemaphorePermit,
}

/// A checkpoint's files as the writing task receives them: planned, or
/// still being linked into a snapshot on a blocking thread (`report` has
/// returned; see `persist::lend`). A snapshot owns its directory: dropped
/// (the run failed meanwhile), it removes it, once linking has stopped.
pub(super) enum Files {
    Planned(Plan),
    Linking(JoinHandle<Result<Plan, Error>>),
}

impl Files {
    /// The plan, once its snapshot is complete.
    pub async fn plan(&mut self) -> Result<&Plan, RecordFailed> {
        if let Self::Linking(task) = self {
            let plan = task.await.map_err(|_| RecordFailed::Stopped)??;
            *self = Self::Planned(plan);
        }
        match self {
            Self::Planned(plan) => Ok(plan),
            Self::Linking(_) => Err(RecordFailed::Stopped),
        }
    }
}

/// Node 0's view of the other nodes' share of one checkpoint: whom to
/// tell what, and whose files to wait for before the commit.
#[derive(Debug)]
pub(super) struct Remote {
    pub link: Arc<Link>,
    pub attempt: u64,
    pub round: u64,
    /// Per node with files to persist: the paths it leaves out.
    pub persist: Vec<(u32, Vec<String>)>,
    /// Paths persisted here or by another node, with the ranks of the
    /// nodes that left their identical copies out.
    pub also: Vec<(String, Vec<u32>)>,
    /// The world ranks of other nodes that reported files.
    pub ranks: Vec<u32>,
}

impl Remote {
    /// Tell the nodes with files the checkpoint's number; its directory
    /// is cleared.
    pub fn announce(&self, checkpoint: u64) {
        for (node, skip) in &self.persist {
            self.link.send(
                *node,
                &wire::Message::new(Header::Persist {
                    attempt: self.attempt,
                    round: self.round,
                    checkpoint,
                    skip: skip.clone(),
                }),
            );
        }
    }

    /// Wait until every node told persisted its files of `checkpoint`;
    /// then add them (and the ranks of copies left out) to what this node
    /// uploaded. Blocks: run it off the async runtime's threads.
    ///
    /// A failing attempt still commits what its ranks reported before
    /// (as on one host): a node sends its `Persisted` before it says its
    /// part of the attempt ended, so only a node that ended without it
    /// (its storage failed) abandons the checkpoint.
    pub fn wait(
        self,
        checkpoint: u64,
        uploaded: &mut Uploaded,
        ranks: &mut Vec<u32>,
    ) -> Result<(), RecordFailed> {
        let mut files = Vec::new();
        for (node, _) in &self.persist {
            let wanted = |from: u32, h: &Header| {
                from == *node
                    && matches!(h, Header::Persisted { attempt, checkpoint: c, .. } if *attempt == self.attempt && *c == checkpoint)
            };
            let ended = || {
                self.link
                    .find(
                        *node,
                        |h| matches!(h, Header::Ended { attempt, .. } if *attempt == self.attempt),
                    )
                    .is_some()
            };
            let Some((_, message)) = self.link.take(wanted, ended) else {
                return Err(RecordFailed::Abandoned);
            };
            let Header::Persisted { files: theirs, .. } = message.header else {
                return Err(RecordFailed::Abandoned);
            };
            files.extend(theirs.into_iter().map(|f| FileEntry {
                path: f.path,
                size: f.size,
                sha256: f.sha256,
                ranks: f.ranks,
            }));
        }
        uploaded.add(files, &self.also);
        ranks.extend(&self.ranks);
        ranks.sort_unstable();
        ranks.dedup();
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
