//! A node other than 0 persisting its ranks' share of a checkpoint into
//! the run's shared storage (a run over several hosts).
//!
//! Node 0 owns the commit: it names the checkpoint, tells each node which
//! of its files to persist (`Persist`), and writes the manifest once every
//! node has said its files are durable (`Persisted`). This node's part
//! follows the same modes as node 0's recorder (R8):
//!
//! - in the background mode, `report` returns once the files are listed;
//!   they are linked into a snapshot they are lent to (`persist::lend`),
//!   out of the guests' reach, and a task uploads or writes and flushes
//!   them and tells node 0;
//! - in the blocking mode, the files are persisted and flushed before the
//!   node goes on with the round; node 0 commits before any rank returns.
//!
//! One checkpoint is persisted at a time, as on node 0. A storage failure
//! is kept and fails the attempt (the watcher, or the next report), which
//! every node hears of; node 0 then commits nothing.

use std::sync::{Arc, Mutex};

use tokio::runtime::Handle;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::queue::RecordFailed;
use crate::cluster::Link;
use crate::cluster::wire::{Header, Message, Shipped};
use crate::error::Error;
use crate::persist::{self, Plan, Snapshots};
use crate::record::layout;
use crate::storage::Storage;

/// Persists this node's files of each checkpoint; see the module's
/// description.
#[derive(Debug)]
pub(super) struct Shipper {
    /// The run's directory in storage.
    run: Storage,
    /// Where snapshots go in the background mode; `None` blocks instead.
    snapshots: Option<Snapshots>,
    link: Arc<Link>,
    attempt: u64,
    handle: Handle,
    /// One permit: the checkpoint being persisted holds it.
    slot: Arc<Semaphore>,
    failed: Arc<Mutex<Option<RecordFailed>>>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Shipper {
    pub fn new(
        run: Storage,
        snapshots: Option<Snapshots>,
        link: Arc<Link>,
        attempt: u64,
        handle: Handle,
    ) -> Self {
        Self {
            run,
            snapshots,
            link,
            attempt,
            handle,
            slot: Arc::new(Semaphore::new(1)),
            failed: Arc::default(),
            tasks: Mutex::default(),
        }
    }

    /// The storage failure that stopped persisting, if any.
    pub fn failure(&self) -> Option<RecordFailed> {
        lock(&self.failed).clone()
    }

    /// Persist `plan` as this node's files of checkpoint `checkpoint`, as
    /// the mode says; node 0 hears once they are durable. Returns once the
    /// guests may change their directories.
    pub fn ship(&self, checkpoint: u64, plan: Plan) -> Result<(), RecordFailed> {
        let slot = self
            .handle
            .block_on(Arc::clone(&self.slot).acquire_owned())
            .expect("the semaphore is never closed");
        if let Some(failed) = self.failure() {
            return Err(failed);
        }
        let dest = self.run.child(&layout::checkpoint_dir_name(checkpoint));
        let job = Job {
            dest,
            checkpoint,
            link: Arc::clone(&self.link),
            attempt: self.attempt,
            _slot: slot,
        };
        let fail = |e: Error| {
            let failed = RecordFailed::from(e);
            lock(&self.failed).get_or_insert(failed).clone()
        };
        match &self.snapshots {
            None => self.handle.block_on(job.finish(plan)).map_err(fail),
            Some(_) if plan.files.iter().all(|f| f.host_owned) => {
                self.spawn(job.finish(plan));
                Ok(())
            }
            Some(snapshots) => {
                let dir = snapshots
                    .root
                    .join(format!("node-{}", layout::checkpoint_dir_name(checkpoint)));
                let _ = std::fs::remove_dir_all(&dir);
                // Linked after `report` returns, as on node 0 (`recorder`).
                let snapshot = persist::snapshot(plan, &dir, &snapshots.lent).map_err(fail)?;
                let linking = self.handle.spawn_blocking(move || snapshot.link());
                self.spawn(async move {
                    let plan = linking.await.map_err(|e| Error::Io {
                        path: dir,
                        operation: "link the checkpoint files into a snapshot",
                        source: std::io::Error::other(e),
                    })??;
                    job.finish(plan).await
                });
                Ok(())
            }
        }
    }

    fn spawn(&self, work: impl Future<Output = Result<(), Error>> + Send + 'static) {
        let failed = Arc::clone(&self.failed);
        let task = self.handle.spawn(async move {
            if let Err(e) = work.await {
                lock(&failed).get_or_insert(e.into());
            }
        });
        lock(&self.tasks).push(task);
    }

    /// Wait for everything shipped so far. Returns the storage failure
    /// that stopped persisting, if any.
    pub fn finish(&self) -> Result<(), RecordFailed> {
        let tasks = std::mem::take(&mut *lock(&self.tasks));
        for task in tasks {
            if self.handle.block_on(task).is_err() {
                lock(&self.failed).get_or_insert(RecordFailed::Stopped);
            }
        }
        self.failure().map_or(Ok(()), Err)
    }
}

/// One checkpoint's files on their way to storage.
struct Job {
    dest: Storage,
    checkpoint: u64,
    link: Arc<Link>,
    attempt: u64,
    /// The one permit to persist a checkpoint, released when this drops.
    _slot: OwnedSemaphorePermit,
}

impl Job {
    /// Persist `plan`, make it durable and tell node 0. Its snapshot, if
    /// any, is removed at the end.
    async fn finish(self, plan: Plan) -> Result<(), Error> {
        let result = async {
            let files = persist::persist(&self.dest, &plan, None).await?.0;
            let paths = files.iter().map(|f| f.path.clone()).collect();
            self.dest.sync_uploads(paths).await?;
            Ok::<_, Error>(files)
        }
        .await;
        drop(plan);
        let files = result?;
        self.link.send(
            0,
            &Message::new(Header::Persisted {
                attempt: self.attempt,
                checkpoint: self.checkpoint,
                files: files
                    .into_iter()
                    .map(|f| Shipped {
                        path: f.path,
                        size: f.size,
                        sha256: f.sha256,
                        ranks: f.ranks,
                    })
                    .collect(),
            }),
        );
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
