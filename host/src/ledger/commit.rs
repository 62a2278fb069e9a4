//! Committing a checkpoint (steps 1-3 of the ledger's order) and deleting
//! what retention drops (step 5).

use std::sync::Arc;

use bytes::Bytes;

use super::Ledger;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::persist::{PersistStats, Plan, Previous, persist};
use crate::record::{CheckpointRecord, FileEntry, Manifest, layout, ranking};

/// A checkpoint's files persisted but not yet committed.
#[derive(Debug)]
pub(crate) struct Uploaded {
    files: Vec<FileEntry>,
    stats: PersistStats,
}

impl Uploaded {
    /// Add files other nodes persisted into the same checkpoint, and ranks
    /// of other nodes that reported identical copies of files here
    /// (`also`: path and ranks).
    pub fn add(&mut self, files: Vec<FileEntry>, also: &[(String, Vec<u32>)]) {
        self.files.extend(files);
        for (path, ranks) in also {
            if let Some(entry) = self.files.iter_mut().find(|f| &f.path == path) {
                entry.ranks.extend(ranks);
                entry.ranks.sort_unstable();
            }
        }
        self.files.sort_by(|a, b| a.path.cmp(&b.path));
    }
}

/// A checkpoint committed and recorded in the run state.
#[derive(Debug)]
pub(crate) struct Committed {
    /// What persisting its files did.
    pub stats: PersistStats,
    /// Checkpoints retention no longer keeps: the run state no longer lists
    /// them, and [`Ledger::delete_dropped`] deletes them.
    pub dropped: Vec<CheckpointRecord>,
}

impl Ledger {
    /// Clear checkpoint `checkpoint_index`'s directory before anything is
    /// written into it: a host killed mid-upload can leave files under
    /// its name with no manifest, never committed.
    pub async fn clear(&self, checkpoint_index: u64) -> Result<(), Error> {
        let dir = self
            .storage
            .child(&layout::checkpoint_dir_name(checkpoint_index));
        // Opening the run adopted or removed every directory from the next
        // index on, and this host commits them in order: a manifest here
        // is either this host's, of a commit that failed before the run
        // state named it (storage failed; the attempt that reported it
        // failed with it), or was written by a host that took the run
        // over, and is not this host's to delete (R27).
        if let Some(found) = dir.get(layout::MANIFEST).await? {
            let ours = self
                .lock()
                .manifest_tried
                .as_ref()
                .is_some_and(|(index, bytes)| *index == checkpoint_index && *bytes == found);
            if !ours {
                return Err(self.fenced(format!(
                    "{} was committed by another host, which took the run over",
                    dir.url()
                )));
            }
            // First, so that what is left is never restorable (R18).
            dir.delete(layout::MANIFEST).await?;
        }
        dir.delete_all("", &[]).await
    }

    /// Step 1 of a commit: persist the files of `plan` into checkpoint
    /// `checkpoint_index`'s directory, which nothing reads until
    /// [`Ledger::commit_uploaded`] writes its manifest. The previous
    /// checkpoint must be committed already (its files are linked).
    /// Local files are flushed to disk as they are written. With `clear`, the directory is cleared first (see
    /// [`Ledger::clear`]); without, the caller cleared it, since other
    /// nodes may be writing their files into it.
    pub async fn upload(
        &self,
        checkpoint_index: u64,
        plan: &Plan,
        clear: bool,
    ) -> Result<Uploaded, Error> {
        let dest = self
            .storage
            .child(&layout::checkpoint_dir_name(checkpoint_index));
        if clear {
            self.clear(checkpoint_index).await?;
        }
        let previous = self.previous().await;
        let (files, stats) = persist(&dest, plan, previous).await?;
        Ok(Uploaded { files, stats })
    }

    /// Steps 2 and 3 of a commit, for files [`Ledger::upload`] persisted
    /// (and other nodes', added with [`Uploaded::add`]):
    /// make them durable, write the manifest, then the run state. Returns
    /// what retention dropped, still to be deleted.
    pub async fn commit_uploaded(
        &self,
        report_index: u64,
        checkpoint_index: u64,
        metrics: &Metrics,
        ranks: &[u32],
        world_size: u32,
        uploaded: Uploaded,
    ) -> Result<Committed, Error> {
        let Uploaded { files, stats } = uploaded;
        let run_name = self.lock().state.run_name.clone();
        let dest = self
            .storage
            .child(&layout::checkpoint_dir_name(checkpoint_index));
        let manifest = Manifest {
            format: layout::FORMAT,
            run_name,
            checkpoint_index,
            report_index,
            metrics: metrics.clone(),
            ranks: ranks.to_vec(),
            world_size,
            files,
            committed_at: layout::now_rfc3339(),
        };
        let json = serde_json::to_vec_pretty(&manifest).expect("manifests serialize");
        // The manifest is written after every file is durable (R11).
        let paths = manifest.files.iter().map(|f| f.path.clone()).collect();
        dest.sync_uploads(paths).await?;
        // Created, never replaced: a host that lost the run cannot
        // overwrite a checkpoint the run's owner committed (R27).
        let json = Bytes::from(json);
        self.lock().manifest_tried = Some((checkpoint_index, json.clone()));
        if !dest.create(layout::MANIFEST, json).await? {
            return Err(self.fenced(format!(
                "{} already has a manifest, written by a host that took the run over",
                dest.url()
            )));
        }
        tracing::info!(
            checkpoint = %dest.url(),
            files = manifest.files.len(),
            bytes = manifest.total_bytes(),
            reused_files = stats.reused.0,
            "committed checkpoint"
        );
        let record = CheckpointRecord {
            index: checkpoint_index,
            report_index,
            metrics: metrics.clone(),
        };
        ranking::warn_unscored(&self.retention, &record);
        {
            let mut inner = self.lock();
            inner.state.reports = report_index + 1;
            inner.state.next_checkpoint_index = checkpoint_index + 1;
            inner.state.checkpoints.push(record);
            inner.previous = Some(Arc::new(Previous {
                storage: dest,
                files: manifest.files,
            }));
        }
        let dropped = self.retain().await?;
        Ok(Committed { stats, dropped })
    }

    /// Apply retention to the retained list and write the run state
    /// (R12): from here on, the dropped checkpoints are not the run's, and
    /// a host killed before deleting them leaves them for the next open to
    /// remove. Returns them.
    pub(super) async fn retain(&self) -> Result<Vec<CheckpointRecord>, Error> {
        let dropped = {
            let mut inner = self.lock();
            let (kept, dropped) = ranking::split(&self.retention, &inner.state.checkpoints);
            inner.state.checkpoints = kept;
            dropped
        };
        self.write_state().await?;
        Ok(dropped)
    }

    /// Delete checkpoints [`Ledger::commit_uploaded`] dropped (step 5). The
    /// run state no longer names them, so this may run while later reports
    /// are committed.
    pub async fn delete_dropped(&self, dropped: &[CheckpointRecord]) -> Result<(), Error> {
        for record in dropped {
            tracing::info!(checkpoint = record.index, "retention: deleting checkpoint");
            self.delete_checkpoint(&record.dir_name()).await?;
        }
        Ok(())
    }

    /// Delete a checkpoint: manifest first, so that a half-deleted
    /// checkpoint is never restorable (R18).
    pub(super) async fn delete_checkpoint(&self, dir_name: &str) -> Result<(), Error> {
        let dir = self.storage.child(dir_name);
        dir.delete(layout::MANIFEST).await?;
        dir.delete_all("", &[]).await
    }

    /// The latest committed checkpoint's files, to share with the next one
    /// (incremental upload). Read from its manifest once per host; `None`
    /// if there is none or it cannot be read (then every file is sent).
    async fn previous(&self) -> Option<Arc<Previous>> {
        if let Some(previous) = self.lock().previous.clone() {
            return Some(previous);
        }
        let latest = self.lock().state.checkpoints.last()?.dir_name();
        let storage = self.storage.child(&latest);
        let manifest = crate::record::read_manifest(&storage).await.ok()?;
        let previous = Arc::new(Previous {
            storage,
            files: manifest.files,
        });
        self.lock().previous = Some(Arc::clone(&previous));
        Some(previous)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Retention;
    use crate::failure::{FailureKind, RunFailure};
    use crate::storage::Storage;

    fn open(rt: &tokio::runtime::Runtime, storage: &Storage) -> Ledger {
        crate::ledger::open_for_test(rt, storage, Retention::default(), false).unwrap()
    }

    /// One file holding `text`, planned as rank 0's.
    fn plan(dir: &std::path::Path, text: &str) -> Plan {
        std::fs::write(dir.join("w"), text).unwrap();
        let handle = cap_std::fs::Dir::open_ambient_dir(dir, cap_std::ambient_authority()).unwrap();
        let capture = crate::persist::capture(0, handle, "ck").unwrap();
        crate::persist::merge(vec![capture]).unwrap()
    }

    /// A host whose run another host took over (its lease lapsed while it
    /// was paused, say) cannot write the run state, overwrite a manifest,
    /// or clear a checkpoint the new owner committed.
    #[test]
    fn a_host_that_lost_the_run_commits_and_deletes_nothing() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let store = Arc::new(object_store::memory::InMemory::new());
        let storage = Storage::from_store(store, "memory://t").child("run");
        let work = tempfile::tempdir().unwrap();
        let stale = open(&rt, &storage);
        let stale_upload = rt
            .block_on(stale.upload(0, &plan(work.path(), "stale"), true))
            .unwrap();
        // The new owner opens the run (writing its state) and commits.
        let owner = open(&rt, &storage);
        let metrics = Metrics::new();
        let uploaded = rt
            .block_on(owner.upload(0, &plan(work.path(), "owner"), true))
            .unwrap();
        rt.block_on(owner.commit_uploaded(0, 0, &metrics, &[0], 1, uploaded))
            .unwrap();

        let e = rt
            .block_on(stale.commit_uploaded(0, 0, &metrics, &[0], 1, stale_upload))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no longer owns the run") && e.contains("already has a manifest"),
            "{e}"
        );
        let e = rt.block_on(stale.clear(0)).unwrap_err().to_string();
        assert!(e.contains("was committed by another host"), "{e}");
        let failure = RunFailure {
            rank: None,
            kind: FailureKind::Host,
            message: "x".into(),
        };
        stale.note_failure(&failure);
        let e = stale.store_now().unwrap_err().to_string();
        assert!(e.contains("changed since this host last wrote it"), "{e}");

        let dir = storage.child("checkpoint_000000");
        let kept = rt.block_on(dir.get("w")).unwrap().unwrap();
        assert_eq!(&kept[..], b"owner");
        assert_eq!(owner.note_failure(&failure), 1);
        owner.store_now().unwrap();
        let reopened = open(&rt, &storage);
        assert_eq!(reopened.newest_first().len(), 1);
        assert_eq!(reopened.snapshot().2, [failure]);
    }

    /// A manifest this host wrote for a commit the run state never named
    /// (storage failed in between) is cleared like any leftover when the
    /// next attempt reuses the checkpoint's number.
    #[test]
    fn this_hosts_own_failed_commit_is_cleared_not_fenced() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let store = Arc::new(object_store::memory::InMemory::new());
        let storage = Storage::from_store(store, "memory://t").child("run");
        let ledger = open(&rt, &storage);
        let dir = storage.child("checkpoint_000000");
        rt.block_on(dir.put("w", Bytes::from_static(b"x"))).unwrap();
        let manifest = Bytes::from_static(b"{}");
        rt.block_on(dir.create(layout::MANIFEST, manifest.clone()))
            .unwrap();
        ledger.lock().manifest_tried = Some((0, manifest));
        rt.block_on(ledger.clear(0)).unwrap();
        assert!(rt.block_on(dir.get(layout::MANIFEST)).unwrap().is_none());
        assert!(rt.block_on(dir.get("w")).unwrap().is_none());
    }
}
