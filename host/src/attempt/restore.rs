//! Restoring checkpoints for the ranks of one host (R21, R22): which
//! checkpoint `get-checkpoint` hands out, and a local copy of it that is
//! downloaded and verified once, then shared read-only by every local rank.
//! Since the ranks only read it, a file of local storage on the same file
//! system is hard-linked into the copy (and read back to verify it) instead
//! of copied: a restore then writes nothing, however large the checkpoint.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::path::PathBuf;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use futures::future;
use tokio::runtime::Handle;
use tokio::sync::{OnceCell, oneshot};

use crate::ledger::Ledger;

use crate::checkpoint::{Access, Checkpoint};
use crate::error::Error;

/// One checkpoint's local copy: its guest path once downloaded, or why the
/// download failed. Filled once, by the first rank that asks.
type Restored = OnceCell<Result<String, RestoreFailed>>;

/// Why one checkpoint could not be restored.
#[derive(Debug, Clone)]
enum RestoreFailed {
    /// Its bytes or manifest in storage are wrong: another checkpoint may
    /// do.
    Corrupt(Arc<Error>),
    /// Anything else (storage unreachable, local disk full).
    Failed(Arc<Error>),
}

/// Why no checkpoint could be handed to the ranks; the attempt fails with
/// it.
#[derive(Debug, thiserror::Error)]
pub(super) enum RestoreError {
    /// The run has committed checkpoints and none of them verifies.
    #[error("none of the run's {count} committed checkpoints verifies: {}", join(.damaged))]
    NoneVerifies {
        count: usize,
        damaged: Vec<Arc<Error>>,
    },
    /// A checkpoint could not be restored for another reason than damage.
    #[error("{}", crate::error::chain(.0.as_ref()))]
    Failed(Arc<Error>),
}

fn join(errors: &[Arc<Error>]) -> String {
    errors
        .iter()
        .map(|e| crate::error::chain(e.as_ref()))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Local copies of checkpoints for the ranks of one host: each is
/// downloaded and verified once, then shared read-only by every local rank
/// (R22).
#[derive(Debug)]
pub(crate) struct RestoreCache {
    host_root: PathBuf,
    guest_root: String,
    entries: Mutex<HashMap<String, Arc<Restored>>>,
    /// Damaged checkpoints already reported: every rank, and every attempt,
    /// runs into them.
    damaged: Mutex<HashSet<String>>,
}

impl RestoreCache {
    /// `host_root` is preopened read-only in every rank at `guest_root`.
    pub fn new(host_root: PathBuf, guest_root: &str) -> Self {
        Self {
            host_root,
            guest_root: guest_root.to_owned(),
            entries: Mutex::new(HashMap::new()),
            damaged: Mutex::new(HashSet::new()),
        }
    }

    /// Start restoring, in the background, the checkpoint the ranks of the
    /// next attempt will be handed (the one [`Restorer::resolve`] chooses
    /// from `ledger` and `resume_from`), so that the copy overlaps what
    /// comes before they ask for it: recording the failure, starting them.
    /// They wait for this copy instead of making their own; its outcome is
    /// the cache's, met and acted on by the attempt's own resolve.
    ///
    /// Dropping the returned [`Prefetch`] stops the copy if it is still
    /// under way, so keep it until the attempt is over, and drop it before
    /// this cache's directory is removed.
    pub fn prefetch(
        self: &Arc<Self>,
        ledger: Arc<Ledger>,
        resume_from: Option<Checkpoint>,
        handle: &Handle,
    ) -> Prefetch {
        let restorer = Restorer::new(Arc::clone(self), ledger, resume_from);
        let handle = handle.clone();
        let (stop, stopped) = oneshot::channel::<Infallible>();
        // On a thread of its own: the copy's future borrows across awaits
        // in ways `spawn` cannot take, and the I/O runtime's workers are
        // busy recording the failure meanwhile.
        let started = std::thread::Builder::new()
            .name("trainhost-restore".into())
            .spawn(move || {
                // Stopped halfway, the cell is left for the next rank that
                // asks to fill (R22 still holds); files already opened may
                // still be written, but nothing is created by path.
                handle.block_on(future::select(pin!(restorer.resolve()), stopped));
            });
        let thread = started
            .inspect_err(|e| {
                // The ranks copy it themselves, as without a prefetch.
                tracing::debug!("cannot start copying the checkpoint ahead: {e}");
            })
            .ok();
        Prefetch {
            stop: Some(stop),
            thread,
        }
    }

    /// The guest path of `checkpoint` under the name `key`, downloading it
    /// on first use. Concurrent callers wait for the one download.
    async fn materialize(
        &self,
        key: &str,
        checkpoint: &Checkpoint,
    ) -> Result<String, RestoreFailed> {
        let cell = {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(entries.entry(key.to_owned()).or_default())
        };
        // The first caller downloads; the others wait for its result.
        let restored = cell
            .get_or_init(|| async {
                match self.download(key, checkpoint).await {
                    Ok(()) => Ok(format!("{}/{key}", self.guest_root)),
                    Err(e @ Error::Verification { .. }) => Err(RestoreFailed::Corrupt(Arc::new(e))),
                    Err(e) => Err(RestoreFailed::Failed(Arc::new(e))),
                }
            })
            .await
            .clone();
        if let Err(RestoreFailed::Failed(_)) = &restored {
            // Storage that failed may work again: the next attempt tries
            // anew (damage, by contrast, stays).
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            if entries.get(key).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                entries.remove(key);
            }
        }
        restored
    }

    /// Whether `name` is reported damaged for the first time.
    fn first_report_of_damage(&self, name: &str) -> bool {
        self.damaged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_owned())
    }

    async fn download(&self, key: &str, checkpoint: &Checkpoint) -> Result<(), Error> {
        let final_dir = self.host_root.join(key);
        if final_dir.exists() {
            return Ok(());
        }
        let staging = self.host_root.join(format!(".partial-{key}"));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging).map_err(|source| Error::Io {
            path: staging.clone(),
            operation: "create a restore directory",
            source,
        })?;
        checkpoint.download_into(&staging, Access::ReadOnly).await?;
        std::fs::rename(&staging, &final_dir).map_err(|source| Error::Io {
            path: final_dir.clone(),
            operation: "move a restored checkpoint into place",
            source,
        })?;
        tracing::info!(checkpoint = %checkpoint.location(), "restored checkpoint");
        Ok(())
    }
}

/// A checkpoint being copied ahead of an attempt (see
/// [`RestoreCache::prefetch`]). Dropping it stops the copy and waits for
/// its thread: a run that ends while it is still copying, or a restart
/// that no longer wants it, removes nothing from under it, and no thread
/// of a run outlives the run.
#[derive(Debug)]
#[must_use = "dropping it stops the copy"]
pub(crate) struct Prefetch {
    /// Dropped to stop the copy; nothing is ever sent.
    stop: Option<oneshot::Sender<Infallible>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Chooses the checkpoint the ranks of one attempt restore from.
#[derive(Debug)]
pub(super) struct Restorer {
    cache: Arc<RestoreCache>,
    /// `None` on a node that follows node 0: it restores `resume_from`,
    /// node 0's choice.
    ledger: Option<Arc<Ledger>>,
    resume_from: Option<Checkpoint>,
}

impl Restorer {
    pub fn new(
        cache: Arc<RestoreCache>,
        ledger: Arc<Ledger>,
        resume_from: Option<Checkpoint>,
    ) -> Self {
        Self {
            cache,
            ledger: Some(ledger),
            resume_from,
        }
    }

    /// Restore `checkpoint` (node 0's choice), or none, on a node that
    /// follows node 0.
    pub fn given(cache: Arc<RestoreCache>, checkpoint: Option<Checkpoint>) -> Self {
        Self {
            cache,
            ledger: None,
            resume_from: checkpoint,
        }
    }

    /// The guest path of the checkpoint to resume from (R21): the run's
    /// latest committed checkpoint that verifies, else `resume_from`, else
    /// none.
    pub async fn resolve(&self) -> Result<Option<String>, RestoreError> {
        let committed = self
            .ledger
            .as_ref()
            .map(|l| l.newest_first())
            .unwrap_or_default();
        let mut damaged = Vec::new();
        for record in &committed {
            let name = record.dir_name();
            let storage = self
                .ledger
                .as_ref()
                .expect("committed comes from it")
                .storage();
            let restored = match Checkpoint::load(storage.child(&name)).await {
                Ok(checkpoint) => self.cache.materialize(&name, &checkpoint).await,
                Err(e @ Error::NotACheckpoint { .. }) => Err(RestoreFailed::Corrupt(Arc::new(e))),
                Err(e) => Err(RestoreFailed::Failed(Arc::new(e))),
            };
            match restored {
                Ok(path) => return Ok(Some(path)),
                // Every rank walks the same cached results, so all settle on
                // the same older checkpoint.
                Err(RestoreFailed::Corrupt(e)) => {
                    if self.cache.first_report_of_damage(&name) {
                        tracing::error!(
                            "checkpoint {name} of the run is damaged in storage and is skipped: {}",
                            crate::error::chain(e.as_ref())
                        );
                    }
                    damaged.push(e);
                }
                Err(RestoreFailed::Failed(e)) => return Err(RestoreError::Failed(e)),
            }
        }
        if !committed.is_empty() {
            return Err(RestoreError::NoneVerifies {
                count: committed.len(),
                damaged,
            });
        }
        match &self.resume_from {
            Some(checkpoint) => match self.cache.materialize("resume_from", checkpoint).await {
                Ok(path) => Ok(Some(path)),
                Err(RestoreFailed::Corrupt(e) | RestoreFailed::Failed(e)) => {
                    Err(RestoreError::Failed(e))
                }
            },
            None => Ok(None),
        }
    }
}

#[cfg(test)]
#[path = "restore_tests.rs"]
mod tests;
