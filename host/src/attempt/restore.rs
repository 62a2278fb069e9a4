//! Restoring checkpoints for the ranks of one host: each checkpoint is
//! downloaded and verified once, then shared read-only by every local rank
//! (R22).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::sync::OnceCell;

use crate::checkpoint::Checkpoint;
use crate::error::Error;

/// One checkpoint's local copy: its guest path once downloaded, or why the
/// download failed. Filled once, by the first rank that asks.
type Restored = OnceCell<Result<String, RestoreFailed>>;

/// Why a checkpoint could not be restored.
#[derive(Debug, Clone)]
pub(crate) enum RestoreFailed {
    /// Its bytes or manifest in storage are wrong: another checkpoint may
    /// do.
    Corrupt(String),
    /// Anything else (storage unreachable, local disk full).
    Failed(String),
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
    pub async fn materialize(
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
                Err(e @ Error::Verification { .. }) => {
                    Err(RestoreFailed::Corrupt(crate::error::chain(&e)))
                }
                Err(e) => Err(RestoreFailed::Failed(crate::error::chain(&e))),
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
