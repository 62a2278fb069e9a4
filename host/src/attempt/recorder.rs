//! Recording reports: one background task per attempt writes them to
//! storage, in report order, while the ranks go on training.
//!
//! The gate's leader hands each collective report to
//! [`Recorder::record_plan`], its ranks' files merged (collisions refused
//! to the guests before), and then:
//!
//! - in the background mode (the default), `report` returns once the
//!   planned files are listed; a blocking task takes them into a local
//!   snapshot, and the writing task uploads (or writes and flushes) and
//!   commits it. Taking them costs no copy: they are hard-linked and lent
//!   (`persist::lend`), and a guest that writes one of them later gets a
//!   copy of its own, so the guests may change their directories at once
//!   (R8); a guest call that could change them before they are all linked
//!   waits for the links.
//! - files a rank handed over (`report-handing-over`) were moved out of its
//!   sandbox before it arrived: nothing is copied for them, and when every
//!   file of a report was handed over `report` returns at once, in either
//!   mode, leaving all the work to the task.
//! - in the blocking mode, `report` returns once the task has committed
//!   the checkpoint and added the report to the history in memory. The
//!   history file is stored with the others' lines, as in the background
//!   mode: storing the whole file at every report would cost more than the
//!   report itself, and a checkpoint's line lost to a killed host is
//!   restored from the checkpoint's record (R9).
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

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::runtime::Handle;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::queue::{Files, Job, Message, Pending, RecordFailed, Remote, Shared};
use super::writer::{delete_dropped, write_reports};
use crate::ledger::{Assigned, Ledger};
use crate::metrics::Metrics;
use crate::persist::{self, Plan, Snapshots};
use crate::record::layout;

/// Reports that may wait to be written before `report` waits too.
const QUEUE: usize = 1024;

/// Writes an attempt's reports to storage; see the module's description.
#[derive(Debug)]
pub(crate) struct Recorder {
    /// Where snapshots go in the background mode; `None` blocks instead.
    snapshots: Option<Snapshots>,
    ledger: Arc<Ledger>,
    handle: Handle,
    queue: mpsc::Sender<Message>,
    /// One permit: the checkpoint being persisted holds it.
    slot: Arc<Semaphore>,
    /// What the recorder and the writing task share.
    shared: Arc<Shared>,
    worker: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The task deleting what retention drops.
    deleter: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Recorder {
    /// Start the writing task on `handle`. `snapshots` is the directory for
    /// snapshots in the background mode, `None` for the blocking mode.
    pub fn start(
        ledger: Arc<Ledger>,
        world_size: u32,
        snapshots: Option<Snapshots>,
        handle: Handle,
    ) -> Self {
        let (queue, rx) = mpsc::channel(QUEUE);
        ledger.restart_numbering();
        let shared = Arc::new(Shared::default());
        let (dropped, dropped_rx) = mpsc::unbounded_channel();
        let deleter = handle.spawn(delete_dropped(
            Arc::clone(&ledger),
            dropped_rx,
            Arc::clone(&shared),
        ));
        let worker = handle.spawn(write_reports(
            Arc::clone(&ledger),
            world_size,
            rx,
            dropped,
            Arc::clone(&shared),
        ));
        Self {
            snapshots,
            ledger,
            handle,
            queue,
            slot: Arc::new(Semaphore::new(1)),
            shared,
            worker: Mutex::new(Some(worker)),
            deleter: Mutex::new(Some(deleter)),
        }
    }

    /// The storage failure that stopped the writing task, or the run's
    /// record left behind by the restart before this attempt, if any.
    pub fn failure(&self) -> Option<RecordFailed> {
        self.shared
            .failure()
            .or_else(|| self.ledger.behind_failure().map(RecordFailed::Storage))
    }

    /// The attempt failed: leave the history to the run, which stores it
    /// with the failure's record (see `ledger::writes`).
    pub fn leave_history(&self) {
        self.shared.history_left.store(true, Ordering::Release);
    }

    /// Record a report whose files are planned: `plan` holds this node's,
    /// and `remote` says which other nodes persist theirs into the same
    /// checkpoint (a run over several hosts; see `shards.rs`). `Err` fails
    /// the run.
    pub fn record_plan(
        &self,
        metrics: Metrics,
        plan: Option<Plan>,
        remote: Option<Remote>,
    ) -> Result<(), RecordFailed> {
        if let Some(failed) = self.failure() {
            return Err(failed);
        }
        let checkpoint = match plan {
            None => None,
            Some(plan) => {
                // Wait for the previous checkpoint to be persisted: this
                // bounds memory and snapshot disk to one checkpoint.
                let slot = self
                    .handle
                    .block_on(Arc::clone(&self.slot).acquire_owned())
                    .expect("the semaphore is never closed");
                if let Some(failed) = self.failure() {
                    return Err(failed);
                }
                let index = self.ledger.next_checkpoint_index();
                if let Some(remote) = &remote {
                    // Cleared before any node writes into it.
                    self.handle.block_on(self.ledger.clear(index))?;
                    remote.announce(index);
                }
                let files = match &self.snapshots {
                    // Every file was handed over: no guest can change them,
                    // so the writing task persists them from where they are.
                    Some(_) if plan.files.iter().all(|f| f.host_owned) => Files::Planned(plan),
                    // Lent (linked) into a snapshot, which costs no copy;
                    // linked after `report` returns, then hashed, written
                    // and flushed by the writing task. (Writing them to
                    // their place in local storage now, unflushed, kept a
                    // guest waiting for a copy of every byte; linking them
                    // now, for a link per file.)
                    Some(snapshots) => {
                        let dir = snapshots.root.join(layout::checkpoint_dir_name(index));
                        let _ = std::fs::remove_dir_all(&dir);
                        let snapshot = persist::snapshot(plan, &dir, &snapshots.lent)?;
                        Files::Linking(self.handle.spawn_blocking(move || snapshot.link()))
                    }
                    None => Files::Planned(plan),
                };
                Some(Pending {
                    index,
                    files,
                    remote,
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
            && self.shared.queued.load(Ordering::Acquire) == 0
        {
            self.ledger.append_report(report_index, metrics, None);
            if !self.shared.unwritten.swap(true, Ordering::AcqRel) {
                // The first unwritten line: tell the task. A full queue
                // means the task is busy and will look anyway.
                let _ = self.queue.try_send(Message::Unwritten);
            }
            return Ok(());
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
        self.shared.queued.fetch_add(1, Ordering::AcqRel);
        if self
            .queue
            .blocking_send(Message::Report(Box::new(job)))
            .is_err()
        {
            return Err(self.stopped());
        }
        match wait {
            None => Ok(()),
            Some(rx) => match rx.blocking_recv() {
                Ok(result) => result,
                Err(_) => Err(self.stopped()),
            },
        }
    }

    /// Wait until everything recorded so far is written. Returns the
    /// storage failure that stopped the task, if any.
    pub fn flush(&self) -> Result<(), RecordFailed> {
        let (tx, rx) = oneshot::channel();
        if self.queue.blocking_send(Message::Flush(tx)).is_ok() {
            let _ = rx.blocking_recv();
        }
        match self.failure() {
            Some(failed) => Err(failed),
            None => Ok(()),
        }
    }

    /// Write everything recorded so far and stop the task. Returns the
    /// storage failure that stopped it, if any.
    pub fn finish(&self) -> Result<(), RecordFailed> {
        let result = self.flush();
        if let Some(worker) = lock(&self.worker).take() {
            // Idle now: everything sent before the flush is written.
            worker.abort();
            let _ = self.handle.block_on(worker);
        }
        // The writer is gone, and with it the deleter's queue: the deleter
        // ends once it has deleted what it was given.
        if let Some(deleter) = lock(&self.deleter).take() {
            let _ = self.handle.block_on(deleter);
        }
        result.and_then(|()| self.failure().map_or(Ok(()), Err))
    }

    /// Why a task that is gone stopped.
    fn stopped(&self) -> RecordFailed {
        self.failure().unwrap_or(RecordFailed::Stopped)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc as std_mpsc;
    use std::time::Duration;

    use super::*;
    use crate::config::Retention;
    use crate::persist::{Capture, Lent, merge};
    use crate::storage::Storage;

    /// A new run of one rank at `storage`.
    fn open(rt: &tokio::runtime::Runtime, storage: &Storage, retention: Retention) -> Arc<Ledger> {
        Arc::new(crate::ledger::open_for_test(rt, storage, retention, false).unwrap())
    }

    /// List a new `w.bin` holding `bytes` in `dir`, as a guest would leave
    /// it after the last report, with the snapshot of that report still
    /// linking (`lent`).
    fn capture(
        rank: u32,
        dir: &std::path::Path,
        bytes: &[u8],
        lent: &Lent,
        rt: &tokio::runtime::Handle,
    ) -> Capture {
        // A new file each time: the snapshot may still hold the last one
        // lent, and only a guest's writes (through WASI) get a copy first.
        // The unlink waits for the links, as a guest's does.
        rt.block_on(lent.settled());
        let _ = std::fs::remove_file(dir.join("w.bin"));
        std::fs::write(dir.join("w.bin"), bytes).unwrap();
        let handle = cap_std::fs::Dir::open_ambient_dir(dir, cap_std::ambient_authority()).unwrap();
        persist::capture(rank, handle, "ckpt").unwrap()
    }

    /// Deleting what retention drops never holds a guest: with every delete
    /// held back, checkpoints keep being reported and committed in both
    /// modes; the deletions happen before the attempt ends.
    #[test]
    fn reports_do_not_wait_for_retention_to_delete() {
        for background in [true, false] {
            let rt = tokio::runtime::Runtime::new().unwrap();
            let store = Arc::new(crate::storage::held::Held::deletes());
            let gate = Arc::clone(&store.deletes);
            let storage = Storage::from_store(store, "held://").child("run");
            let keep_one = Retention {
                num_to_keep: Some(1),
                ..Retention::default()
            };
            let ledger = open(&rt, &storage, keep_one);
            let work = tempfile::tempdir().unwrap();
            let lent = Arc::new(Lent::default());
            let snapshots = background.then(|| Snapshots {
                root: work.path().join("snapshots"),
                lent: Arc::clone(&lent),
            });
            let recorder = Arc::new(Recorder::start(
                Arc::clone(&ledger),
                1,
                snapshots,
                rt.handle().clone(),
            ));
            let (tx, rx) = std_mpsc::channel();
            let reporting = {
                let recorder = Arc::clone(&recorder);
                let dir = work.path().join("ckpt");
                std::fs::create_dir(&dir).unwrap();
                let rt = rt.handle().clone();
                std::thread::spawn(move || {
                    for i in 0..4u8 {
                        let c = capture(0, &dir, &[i; 64], &lent, &rt);
                        let plan = merge(vec![c]).unwrap();
                        recorder
                            .record_plan(Metrics::new(), Some(plan), None)
                            .unwrap();
                        tx.send(i).unwrap();
                    }
                    recorder.flush().unwrap();
                })
            };
            for i in 0..4u8 {
                let got = rx.recv_timeout(Duration::from_secs(20));
                assert_eq!(
                    got,
                    Ok(i),
                    "report {i} waited for a deletion (background: {background})"
                );
            }
            reporting.join().unwrap();
            assert_eq!(ledger.newest_first().len(), 1, "the run state keeps one");
            let dirs = rt
                .block_on(crate::record::checkpoint_dirs(&storage))
                .unwrap();
            assert_eq!(dirs.len(), 4, "nothing deleted while deletes are held");
            gate.add_permits(1000);
            recorder.finish().unwrap();
            let dirs = rt
                .block_on(crate::record::checkpoint_dirs(&storage))
                .unwrap();
            assert_eq!(
                dirs,
                [(3, "checkpoint_000003".to_owned())],
                "deleted by the end"
            );
        }
    }
}
