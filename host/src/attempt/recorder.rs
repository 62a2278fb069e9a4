//! Recording reports: one background task per attempt writes them to
//! storage, in report order, while the ranks go on training.
//!
//! The gate's leader hands each collective report to [`Recorder::record`].
//! A report's checkpoint is planned there (ranks' files merged, collisions
//! refused to the guests), and then:
//!
//! - in the background mode (the default), the planned files are copied to
//!   a local snapshot and `report` returns; the task uploads and commits the
//!   snapshot. On local storage a snapshot would cost as much as the
//!   upload itself, so the files are written to their place in storage
//!   before `report` returns and the task only commits them. Either way
//!   the guests may change their directories at once (R8).
//! - in the blocking mode, `report` returns once the checkpoint is
//!   committed and the report is in the history, as the task says so.
//!
//! Either way one task does the storage writes, so their order is the order
//! of the ledger (R9, R11, R12, R18). Memory and disk stay bounded: one
//! checkpoint is persisted at a time (a second one waits in `report` for
//! the first, so at most one snapshot exists), and at most [`QUEUE`]
//! reports wait to be written. Reports without a checkpoint that arrive
//! faster than storage takes them are written together: the history file
//! is stored once for all of them.
//!
//! A storage failure is never silent: the task stops writing, the next
//! `report` (or the watcher, or the end of the attempt) fails the run with
//! it, and everything committed before stays as it was.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use crate::ledger::{Assigned, Committed, Ledger, Uploaded};
use crate::metrics::Metrics;
use crate::persist::{self, Capture, Plan, PlanError, merge};
use crate::record::layout;

/// Reports that may wait to be written before `report` waits too.
const QUEUE: usize = 1024;

/// A report the guests get back as an error; the run goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReportRefused {
    /// Ranks wrote the same path with different bytes.
    Collision(String),
}

/// Writes an attempt's reports to storage; see the module's description.
#[derive(Debug)]
pub(crate) struct Recorder {
    /// Where snapshots go in the background mode; `None` blocks instead.
    snapshots: Option<PathBuf>,
    ledger: Arc<Ledger>,
    handle: Handle,
    queue: mpsc::Sender<Message>,
    /// One permit: the checkpoint being persisted holds it.
    slot: Arc<Semaphore>,
    failed: Arc<Mutex<Option<String>>>,
    /// What the recorder and the writing task share about the history.
    history: Arc<History>,
    worker: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// The history's state, shared by the recorder and the writing task.
#[derive(Debug, Default)]
struct History {
    /// Reports sent to the task and not yet added to the history.
    queued: AtomicUsize,
    /// Lines added to the history in memory but not yet stored.
    unwritten: AtomicBool,
}

enum Message {
    Report(Job),
    /// Lines were added to the history directly; store them in time.
    Unwritten,
    /// Answered once everything before it is written.
    Flush(oneshot::Sender<()>),
}

struct Job {
    report_index: u64,
    metrics: Metrics,
    checkpoint: Option<Pending>,
    /// In the blocking mode: told once the report is written.
    done: Option<oneshot::Sender<Result<(), String>>>,
}

/// A checkpoint planned (and in the background mode, snapshotted or
/// uploaded) but not yet committed.
struct Pending {
    index: u64,
    plan: Plan,
    /// The snapshot to remove once persisted.
    snapshot: Option<PathBuf>,
    /// Set when the files are in storage already; only the commit is left.
    uploaded: Option<Uploaded>,
    _slot: OwnedSemaphorePermit,
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

impl Recorder {
    /// Start the writing task on `handle`. `snapshots` is the directory for
    /// snapshots in the background mode, `None` for the blocking mode.
    pub fn start(
        ledger: Arc<Ledger>,
        world_size: u32,
        snapshots: Option<PathBuf>,
        handle: Handle,
    ) -> Self {
        let (queue, rx) = mpsc::channel(QUEUE);
        let failed = Arc::new(Mutex::new(None));
        ledger.restart_numbering();
        let history = Arc::new(History::default());
        let worker = handle.spawn(write_reports(
            Arc::clone(&ledger),
            world_size,
            rx,
            Arc::clone(&failed),
            Arc::clone(&history),
        ));
        Self {
            snapshots,
            ledger,
            handle,
            queue,
            slot: Arc::new(Semaphore::new(1)),
            failed,
            history,
            worker: Mutex::new(Some(worker)),
        }
    }

    /// The storage failure that stopped the writing task, if any.
    pub fn failure(&self) -> Option<String> {
        lock(&self.failed).clone()
    }

    /// Record one collective report with rank 0's `metrics` and the
    /// captures of the ranks that passed a checkpoint. `Err` is a failure
    /// of the run (storage or local I/O), with its message.
    pub fn record(
        &self,
        metrics: Metrics,
        captures: Vec<Capture>,
    ) -> Result<Result<(), ReportRefused>, String> {
        if let Some(message) = self.failure() {
            return Err(message);
        }
        let plan = if captures.is_empty() {
            None
        } else {
            match merge(captures) {
                Ok(plan) => Some(plan),
                Err(PlanError::Collision(msg)) => return Ok(Err(ReportRefused::Collision(msg))),
                Err(PlanError::Failed(e)) => return Err(crate::error::chain(&e)),
            }
        };
        let checkpoint = match plan {
            None => None,
            Some(plan) => {
                // Wait for the previous checkpoint to be persisted: this
                // bounds memory and snapshot disk to one checkpoint.
                let slot = self
                    .handle
                    .block_on(Arc::clone(&self.slot).acquire_owned())
                    .expect("the semaphore is never closed");
                if let Some(message) = self.failure() {
                    return Err(message);
                }
                let index = self.ledger.next_checkpoint_index();
                let (plan, snapshot, uploaded) = match &self.snapshots {
                    // On local storage, persisting the files costs what a
                    // snapshot would (a copy, in parallel, hashed on the
                    // way; unchanged files only hashed and linked): persist
                    // them now, and leave the commit to the writing task.
                    Some(_) if self.ledger.is_local() => {
                        match self.handle.block_on(self.ledger.upload(index, &plan)) {
                            Ok(uploaded) => (plan, None, Some(uploaded)),
                            Err(e) => return Err(crate::error::chain(&e)),
                        }
                    }
                    Some(root) => {
                        let dir = root.join(layout::checkpoint_dir_name(index));
                        let _ = std::fs::remove_dir_all(&dir);
                        match persist::snapshot(plan, &dir) {
                            Ok(plan) => (plan, Some(dir), None),
                            Err(e) => {
                                let _ = std::fs::remove_dir_all(&dir);
                                return Err(crate::error::chain(&e));
                            }
                        }
                    }
                    None => (plan, None, None),
                };
                Some(Pending {
                    index,
                    plan,
                    snapshot,
                    uploaded,
                    _slot: slot,
                })
            }
        };
        let Assigned {
            report: report_index,
            checkpoint: checkpoint_index,
        } = self.ledger.assign(checkpoint.is_some());
        debug_assert_eq!(checkpoint_index, checkpoint.as_ref().map(|c| c.index));
        // A report without a checkpoint in the background mode, with no
        // report still queued before it, goes straight into the history in
        // memory: waking the writing task for every such report would cost
        // a thread switch per report. The task stores the lines within
        // HISTORY_INTERVAL. (Reports are recorded one at a time, by each
        // round's leader, so nothing is queued behind this one.)
        if checkpoint.is_none()
            && self.snapshots.is_some()
            && self.history.queued.load(Ordering::Acquire) == 0
        {
            self.ledger.append_report(report_index, metrics, None);
            if !self.history.unwritten.swap(true, Ordering::AcqRel) {
                // The first unwritten line: tell the task. A full queue
                // means the task is busy and will look anyway.
                let _ = self.queue.try_send(Message::Unwritten);
            }
            return Ok(Ok(()));
        }
        let (done, wait) = if self.snapshots.is_none() {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let job = Job {
            report_index,
            metrics,
            checkpoint,
            done,
        };
        self.history.queued.fetch_add(1, Ordering::AcqRel);
        if self.queue.blocking_send(Message::Report(job)).is_err() {
            return Err(self.stopped());
        }
        match wait {
            None => Ok(Ok(())),
            Some(rx) => match rx.blocking_recv() {
                Ok(result) => result.map(Ok),
                Err(_) => Err(self.stopped()),
            },
        }
    }

    /// Wait until everything recorded so far is written. Returns the
    /// storage failure that stopped the task, if any.
    pub fn flush(&self) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        if self.queue.blocking_send(Message::Flush(tx)).is_ok() {
            let _ = rx.blocking_recv();
        }
        match self.failure() {
            Some(message) => Err(message),
            None => Ok(()),
        }
    }

    /// Write everything recorded so far and stop the task. Returns the
    /// storage failure that stopped it, if any.
    pub fn finish(&self) -> Result<(), String> {
        let result = self.flush();
        if let Some(worker) = lock(&self.worker).take() {
            // Idle now: everything sent before the flush is written.
            worker.abort();
            let _ = self.handle.block_on(worker);
        }
        result
    }

    /// The message for a task that is gone.
    fn stopped(&self) -> String {
        self.failure()
            .unwrap_or_else(|| "the task writing reports to storage stopped".into())
    }
}

/// While reports keep coming, the history is stored at most this often in
/// the background mode (and at once before a commit, at a flush and at
/// the end). Each write stores the whole file, so a loop reporting
/// thousands of times a second would otherwise keep the writer rewriting
/// it, taking a core from the ranks. A report after a quiet spell is
/// stored at once.
const HISTORY_INTERVAL: Duration = Duration::from_millis(50);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The writing task: reports in order, each checkpoint committed before the
/// history lines after it are stored.
async fn write_reports(
    ledger: Arc<Ledger>,
    world_size: u32,
    mut rx: mpsc::Receiver<Message>,
    failed: Arc<Mutex<Option<String>>>,
    history: Arc<History>,
) {
    let mut writer = Writer {
        ledger,
        world_size,
        failed,
        history,
        written_at: None,
    };
    loop {
        let message = match rx.try_recv() {
            Ok(message) => message,
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => {
                // Nothing waiting: store the lines so far in one write,
                // once the interval since the last write has passed.
                if writer.history.unwritten.load(Ordering::Acquire)
                    && let Some(due) = writer.written_at.map(|at| at + HISTORY_INTERVAL)
                    && let Ok(received) = tokio::time::timeout_at(due, rx.recv()).await
                {
                    match received {
                        Some(message) => message,
                        None => {
                            let _ = writer.write_history().await;
                            return;
                        }
                    }
                } else {
                    let _ = writer.write_history().await;
                    match rx.recv().await {
                        Some(message) => message,
                        None => return,
                    }
                }
            }
        };
        match message {
            Message::Flush(tx) => {
                let _ = writer.write_history().await;
                let _ = tx.send(());
            }
            Message::Unwritten => {}
            Message::Report(mut job) => {
                let done = job.done.take();
                let result = writer.write(job).await;
                writer.history.queued.fetch_sub(1, Ordering::AcqRel);
                if let Some(done) = done {
                    let _ = done.send(result);
                }
            }
        }
    }
}

/// The writing task's state.
struct Writer {
    ledger: Arc<Ledger>,
    world_size: u32,
    failed: Arc<Mutex<Option<String>>>,
    history: Arc<History>,
    /// When the history was last stored.
    written_at: Option<Instant>,
}

impl Writer {
    /// Keep the first failure; nothing is written after it.
    fn fail(&self, e: &crate::error::Error) -> String {
        lock(&self.failed)
            .get_or_insert_with(|| crate::error::chain(e))
            .clone()
    }

    /// Store the history if lines are waiting.
    async fn write_history(&mut self) -> Result<(), String> {
        if let Some(message) = lock(&self.failed).clone() {
            return Err(message);
        }
        if self.history.unwritten.swap(false, Ordering::AcqRel) {
            self.written_at = Some(Instant::now());
            if let Err(e) = self.ledger.write_history().await {
                return Err(self.fail(&e));
            }
        }
        Ok(())
    }

    /// Commit the job's checkpoint, if any, and append the report to the
    /// history; in the blocking mode store the history too.
    async fn write(&mut self, job: Job) -> Result<(), String> {
        if let Some(message) = lock(&self.failed).clone() {
            return Err(message);
        }
        let mut committed = None;
        if let Some(mut pending) = job.checkpoint {
            // Lines of earlier reports go first (R9): a host killed during
            // the commit must not lose them.
            self.write_history().await?;
            let result = match pending.uploaded.take() {
                Some(uploaded) => {
                    self.ledger
                        .commit_uploaded(
                            job.report_index,
                            pending.index,
                            &job.metrics,
                            &pending.plan.ranks,
                            self.world_size,
                            uploaded,
                        )
                        .await
                }
                None => {
                    self.ledger
                        .commit(
                            job.report_index,
                            pending.index,
                            &job.metrics,
                            &pending.plan,
                            self.world_size,
                        )
                        .await
                }
            };
            let Committed { stats, dropped } = result.map_err(|e| self.fail(&e))?;
            tracing::debug!(checkpoint = pending.index, ?stats, "persisted");
            self.ledger
                .delete_dropped(&dropped)
                .await
                .map_err(|e| self.fail(&e))?;
            committed = Some(pending.index);
        }
        self.ledger
            .append_report(job.report_index, job.metrics, committed);
        self.history.unwritten.store(true, Ordering::Release);
        if job.done.is_some() {
            self.write_history().await?;
        }
        Ok(())
    }
}
