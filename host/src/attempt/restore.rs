//! Restoring checkpoints for the ranks of one host (R21, R22): which
//! checkpoint `get-checkpoint` hands out, and a local copy of it that is
//! downloaded and verified once, then shared read-only by every local rank.
//! Since the ranks only read it, a file of local storage on the same file
//! system is hard-linked into the copy (and read back to verify it) instead
//! of copied: a restore then writes nothing, however large the checkpoint.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::runtime::Handle;
use tokio::sync::OnceCell;

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
    pub fn prefetch(
        self: &Arc<Self>,
        ledger: Arc<Ledger>,
        resume_from: Option<Checkpoint>,
        handle: &Handle,
    ) {
        let restorer = Restorer::new(Arc::clone(self), ledger, resume_from);
        let handle = handle.clone();
        // On a thread of its own: the copy's future borrows across awaits
        // in ways `spawn` cannot take, and the I/O runtime's workers are
        // busy recording the failure meanwhile.
        let started = std::thread::Builder::new()
            .name("trainhost-restore".into())
            .spawn(move || {
                let _ = handle.block_on(restorer.resolve());
            });
        if let Err(e) = started {
            // The ranks copy it themselves, as without a prefetch.
            tracing::debug!("cannot start copying the checkpoint ahead: {e}");
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
mod tests {
    use super::*;
    use crate::config::Retention;
    use crate::metrics::Metrics;
    use crate::storage::Storage;

    /// A run in memory with one committed checkpoint holding `w`, and an
    /// empty restore cache for it.
    struct Fixture {
        rt: tokio::runtime::Runtime,
        ledger: Arc<Ledger>,
        storage: Storage,
        root: tempfile::TempDir,
        cache: Arc<RestoreCache>,
    }

    fn committed() -> Fixture {
        let store = Arc::new(object_store::memory::InMemory::new());
        committed_in(Storage::from_store(store, "memory://t"))
    }

    fn committed_in(storage: Storage) -> Fixture {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let storage = storage.child("run");
        let ledger =
            crate::ledger::open_for_test(&rt, &storage, Retention::default(), false).unwrap();
        let work = tempfile::tempdir().unwrap();
        std::fs::write(work.path().join("w"), "weights").unwrap();
        let dir =
            cap_std::fs::Dir::open_ambient_dir(work.path(), cap_std::ambient_authority()).unwrap();
        let plan =
            crate::persist::merge(vec![crate::persist::capture(0, dir, "ck").unwrap()]).unwrap();
        let uploaded = rt.block_on(ledger.upload(0, &plan, true)).unwrap();
        rt.block_on(ledger.commit_uploaded(0, 0, &Metrics::new(), &[0], 1, uploaded))
            .unwrap();
        let root = tempfile::tempdir().unwrap();
        let cache = Arc::new(RestoreCache::new(root.path().to_path_buf(), "/restored"));
        Fixture {
            rt,
            ledger: Arc::new(ledger),
            storage,
            root,
            cache,
        }
    }

    /// Storage that failed during a restore is asked again by the next
    /// attempt: only damage is remembered for the run.
    #[test]
    fn a_restore_that_failed_is_tried_again_by_the_next_attempt() {
        let Fixture {
            rt,
            ledger,
            storage,
            root,
            cache,
        } = committed();
        let dir = storage.child("checkpoint_000000");
        let bytes = rt.block_on(dir.get("w")).unwrap().unwrap();
        rt.block_on(dir.delete("w")).unwrap();
        let first = Restorer::new(Arc::clone(&cache), Arc::clone(&ledger), None);
        let e = rt.block_on(first.resolve()).unwrap_err();
        assert!(matches!(e, RestoreError::Failed(_)), "{e}");

        rt.block_on(dir.put("w", bytes)).unwrap();
        let next = Restorer::new(Arc::clone(&cache), ledger, None);
        let path = rt.block_on(next.resolve()).unwrap();
        assert_eq!(path.as_deref(), Some("/restored/checkpoint_000000"));
        let restored = root.path().join("checkpoint_000000/w");
        assert_eq!(std::fs::read_to_string(restored).unwrap(), "weights");
    }

    /// The copy started ahead of an attempt is the one its ranks are
    /// handed.
    #[test]
    fn the_ranks_are_handed_the_copy_started_ahead() {
        let Fixture {
            rt,
            ledger,
            root,
            cache,
            ..
        } = committed();
        cache.prefetch(Arc::clone(&ledger), None, rt.handle());
        let restored = root.path().join("checkpoint_000000/w");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !restored.exists() {
            assert!(std::time::Instant::now() < deadline, "no copy was made");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let key = "checkpoint_000000";
        let cell = Arc::clone(cache.entries.lock().unwrap().get(key).unwrap());
        let path = rt
            .block_on(Restorer::new(Arc::clone(&cache), ledger, None).resolve())
            .unwrap();
        assert_eq!(path.as_deref(), Some("/restored/checkpoint_000000"));
        // Handed the prefetch's result, not a second copy.
        assert!(Arc::ptr_eq(
            &cell,
            cache.entries.lock().unwrap().get(key).unwrap()
        ));
        assert!(cell.initialized());
    }

    /// On local storage the restored files are the stored ones, linked
    /// (nothing is copied), and still verified: a stored file changed
    /// behind its manifest's back fails the restore as damage.
    #[test]
    fn a_checkpoint_in_local_storage_is_restored_as_links_and_verified() {
        use std::os::unix::fs::MetadataExt;
        let stored_root = tempfile::tempdir().unwrap();
        let local = Storage::open(
            &crate::config::Location::Local(stored_root.path().to_owned()),
            &crate::config::StorageOptions::default(),
        )
        .unwrap();
        let Fixture {
            rt, ledger, root, ..
        } = committed_in(local);
        let restorer = |root: &tempfile::TempDir| {
            let cache = Arc::new(RestoreCache::new(root.path().to_owned(), "/restored"));
            Restorer::new(cache, Arc::clone(&ledger), None)
        };
        let path = rt.block_on(restorer(&root).resolve()).unwrap();
        assert_eq!(path.as_deref(), Some("/restored/checkpoint_000000"));
        let stored = stored_root.path().join("run/checkpoint_000000/w");
        let restored = root.path().join("checkpoint_000000/w");
        assert_eq!(std::fs::read_to_string(&restored).unwrap(), "weights");
        assert_eq!(
            std::fs::metadata(&restored).unwrap().ino(),
            std::fs::metadata(&stored).unwrap().ino(),
            "restored by a link to the stored file"
        );

        std::fs::write(&stored, "weightz").unwrap();
        let again = tempfile::tempdir().unwrap();
        let e = rt.block_on(restorer(&again).resolve()).unwrap_err();
        assert!(matches!(e, RestoreError::NoneVerifies { .. }), "{e}");
    }
}
