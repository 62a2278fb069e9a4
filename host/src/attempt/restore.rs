//! Restoring checkpoints for the ranks of one host (R21, R22): which
//! checkpoint `get-checkpoint` hands out, and a local copy of it that is
//! downloaded and verified once, then shared read-only by every local rank.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::sync::OnceCell;

use crate::ledger::Ledger;

use crate::checkpoint::Checkpoint;
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
}

impl RestoreCache {
    /// `host_root` is preopened read-only in every rank at `guest_root`.
    pub fn new(host_root: PathBuf, guest_root: &str) -> Self {
        Self {
            host_root,
            guest_root: guest_root.to_owned(),
            entries: Mutex::new(HashMap::new()),
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
        cell.get_or_init(|| async {
            match self.download(key, checkpoint).await {
                Ok(()) => Ok(format!("{}/{key}", self.guest_root)),
                Err(e @ Error::Verification { .. }) => Err(RestoreFailed::Corrupt(Arc::new(e))),
                Err(e) => Err(RestoreFailed::Failed(Arc::new(e))),
            }
        })
        .await
        .clone()
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
        checkpoint.download_into(&staging).await?;
        std::fs::rename(&staging, &final_dir).map_err(|source| Error::Io {
            path: final_dir.clone(),
            operation: "move a restored checkpoint into place",
            source,
        })?;
        tracing::info!(checkpoint = %checkpoint.location(), "restored checkpoint");
        Ok(())
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
    /// Damaged checkpoints already reported: every rank runs into them.
    damaged: Mutex<HashSet<String>>,
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
            damaged: Mutex::new(HashSet::new()),
        }
    }

    /// Restore `checkpoint` (node 0's choice), or none, on a node that
    /// follows node 0.
    pub fn given(cache: Arc<RestoreCache>, checkpoint: Option<Checkpoint>) -> Self {
        Self {
            cache,
            ledger: None,
            resume_from: checkpoint,
            damaged: Mutex::new(HashSet::new()),
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
                    let first_time = self
                        .damaged
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(name.clone());
                    if first_time {
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
