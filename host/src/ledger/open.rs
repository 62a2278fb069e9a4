//! Opening a run's record: a new run, or an existing one continued (R23),
//! repaired from whatever a killed host left behind.

use std::sync::Mutex;

use tokio::runtime::Handle;

use super::{Inner, Ledger, Numbering, Writes};
use crate::config::Retention;
use crate::error::Error;
use crate::record::layout::{self, FORMAT, RUN_STATE};
use crate::record::tensorboard::EventFile;
use crate::record::{self, CheckpointRecord, History, HistoryError, RunState};
use crate::storage::Storage;

/// Why a run in storage cannot be continued as asked.
#[derive(Debug, thiserror::Error)]
enum Conflict {
    #[error(
        "it holds {} but no {RUN_STATE} (left by an interrupted start-fresh, or the state was deleted); choose another run name, or start fresh with --fresh (RunConfig::fresh), which deletes them",
        .0.join(", ")
    )]
    Leftovers(Vec<String>),
    #[error(
        "{RUN_STATE} is unreadable ({0}); choose another run name, or start fresh with --fresh (RunConfig::fresh), which deletes the run"
    )]
    Unreadable(#[source] serde_json::Error),
    #[error("it was written in format {0}, this trainhost reads format {FORMAT}")]
    Format(u32),
    #[error(
        "it exists with a different config; resume it with the same config, start a new run (another --name) from one of its checkpoints with --resume-from, or start it over with --fresh (RunConfig::fresh), which deletes it"
    )]
    ConfigChanged,
    #[error(transparent)]
    History(#[from] HistoryError),
    #[error(
        "a run exists under the name trainhost generated for a new run; start again (the next name differs), or give a name (--name)"
    )]
    NameTaken,
}

/// How to open a run.
#[derive(Debug)]
pub(crate) struct LedgerOptions<'a> {
    pub run_name: &'a str,
    pub config_fingerprint: &'a str,
    pub world_size: u32,
    pub retention: Retention,
    /// Delete an existing run of this name instead of continuing it.
    pub fresh: bool,
    /// Refuse to continue a run: the name was generated for a new one.
    pub must_be_new: bool,
    /// Store the history as a TensorBoard event file too.
    pub tensorboard: bool,
}

impl Ledger {
    /// Open the run at `storage`: continue it if it exists (same config
    /// fingerprint, R23), else start a new one.
    pub async fn open(
        storage: Storage,
        options: LedgerOptions<'_>,
        handle: Handle,
    ) -> Result<Self, Error> {
        let conflict = |reason: Conflict| Error::RunConflict {
            run: storage.url().to_owned(),
            reason: Box::new(reason),
        };
        let mut existing = storage.get_versioned(layout::RUN_STATE).await?;
        // A new run writes its state before anything else, so files of a
        // run without a state are left by an interrupted start-fresh (the
        // state is deleted first) or by hand. They belong to another run:
        // a resume would adopt its checkpoints as this run's.
        let leftovers = match existing {
            Some(_) => Vec::new(),
            None => leftovers(&storage).await?,
        };
        if options.must_be_new && (existing.is_some() || !leftovers.is_empty()) {
            return Err(conflict(Conflict::NameTaken));
        }
        if options.fresh && (existing.is_some() || !leftovers.is_empty()) {
            tracing::warn!(run = %storage.url(), "deleting the existing run to start fresh");
            storage.delete(layout::RUN_STATE).await?;
            // The owner's file stays: it says who owns the run (R27).
            storage.delete_all("", &[layout::OWNER]).await?;
            existing = None;
        } else if !leftovers.is_empty() {
            return Err(conflict(Conflict::Leftovers(leftovers)));
        }
        let resuming = existing.is_some();
        // Every write of the state is conditional on this version (R27).
        let state_version = existing.as_ref().map(|found| found.version.clone());
        let mut state = match existing {
            Some(found) => {
                let state: RunState = serde_json::from_slice(&found.bytes)
                    .map_err(|e| conflict(Conflict::Unreadable(e)))?;
                if state.format != FORMAT {
                    return Err(conflict(Conflict::Format(state.format)));
                }
                if state.config_fingerprint != options.config_fingerprint {
                    return Err(conflict(Conflict::ConfigChanged));
                }
                state
            }
            None => RunState {
                format: layout::FORMAT,
                run_name: options.run_name.to_owned(),
                config_fingerprint: options.config_fingerprint.to_owned(),
                world_size: options.world_size,
                reports: 0,
                next_checkpoint_index: 0,
                checkpoints: Vec::new(),
                failures: Vec::new(),
                retention: options.retention.clone(),
                attempts: 0,
                updated_at: layout::now_rfc3339(),
            },
        };
        let stored = storage
            .get(layout::HISTORY)
            .await?
            .map(|b| b.to_vec())
            .unwrap_or_default();
        let history = History::parse(stored).map_err(|e| conflict(e.into()))?;
        // The history is written after the state, so a host killed between
        // the two leaves the state one report ahead; the larger count wins.
        state.reports = state.reports.max(history.next_report_index());
        let ledger = Self {
            storage,
            handle,
            retention: options.retention,
            writes: Writes::default(),
            inner: Mutex::new(Inner {
                state,
                events: options
                    .tensorboard
                    .then(|| EventFile::of(history.records())),
                history,
                assigned: Numbering::default(),
                previous: None,
                state_version,
                manifest_tried: None,
            }),
        };
        if resuming {
            ledger.repair().await?;
            ledger.backfill_history().await?;
            // The policy may have changed: apply it (this also records it).
            let dropped = ledger.retain().await?;
            ledger.delete_dropped(&dropped).await?;
        } else {
            // Written at once, so that a run that never commits can still
            // be recognized (and its config checked) when resumed.
            ledger.write_state().await?;
        }
        ledger.restart_numbering();
        Ok(ledger)
    }

    /// Bring storage and state into agreement after a host was killed.
    async fn repair(&self) -> Result<(), Error> {
        let dirs = record::checkpoint_dirs(&self.storage).await?;
        let (retained, next) = {
            let inner = self.lock();
            let retained: Vec<u64> = inner.state.checkpoints.iter().map(|c| c.index).collect();
            (retained, inner.state.next_checkpoint_index)
        };
        let mut adopted = false;
        for (index, name) in dirs {
            if retained.contains(&index) {
                continue;
            }
            if index >= next {
                // Committed (or not) after the last state write.
                let dir = self.storage.child(&name);
                match record::read_manifest(&dir).await {
                    Ok(manifest) => {
                        tracing::warn!(checkpoint = %dir.url(), "adopting a checkpoint committed after the run state was last written");
                        let mut inner = self.lock();
                        let record = CheckpointRecord::committed(index, &manifest);
                        inner.state.reports = inner.state.reports.max(record.report_index + 1);
                        inner.state.checkpoints.push(record);
                        inner.state.next_checkpoint_index = index + 1;
                        adopted = true;
                        continue;
                    }
                    Err(Error::NotACheckpoint { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            tracing::warn!(
                dir = %self.storage.child(&name).url(),
                "removing a checkpoint directory that is not a retained committed checkpoint (left by an interrupted upload or deletion)"
            );
            self.delete_checkpoint(&name).await?;
        }
        if adopted {
            let dropped = self.retain().await?;
            self.delete_dropped(&dropped).await?;
        }
        Ok(())
    }

    /// A host killed after committing a checkpoint but before appending its
    /// report to the history leaves the history short of that report (R9).
    /// The checkpoint's record holds the report's index and metrics, so the
    /// line is restored from it.
    async fn backfill_history(&self) -> Result<(), Error> {
        let bytes = {
            let mut inner = self.lock();
            let next = inner.history.next_report_index();
            let missing: Vec<CheckpointRecord> = inner
                .state
                .checkpoints
                .iter()
                .filter(|c| c.report_index >= next)
                .cloned()
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            for c in missing {
                tracing::warn!(
                    report = c.report_index,
                    "restoring a history line lost when the host was killed"
                );
                inner
                    .history
                    .append(c.report_index, c.metrics.clone(), Some(c.index));
            }
            inner.history.to_bytes()
        };
        self.storage.put(layout::HISTORY, bytes).await
    }
}

/// What a run without a state holds of a run: checkpoint directories and a
/// history (at most three named).
async fn leftovers(storage: &Storage) -> Result<Vec<String>, Error> {
    let mut found: Vec<String> = record::checkpoint_dirs(storage)
        .await?
        .into_iter()
        .map(|(_, name)| name)
        .collect();
    let dirs = found.len();
    if dirs > 3 {
        found.truncate(3);
        found.push(format!("{} more checkpoint directories", dirs - 3));
    }
    for file in [layout::HISTORY, layout::TENSORBOARD] {
        if storage.get(file).await?.is_some() {
            found.push(file.to_owned());
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_generated_name_never_continues_an_existing_run() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let store = Arc::new(object_store::memory::InMemory::new());
        let storage = Storage::from_store(store, "memory://t").child("run");
        let open = |must_be_new| {
            crate::ledger::open_for_test(&rt, &storage, Retention::default(), must_be_new)
        };
        open(true).unwrap();
        open(false).expect("a name given again continues its run");
        let e = open(true).unwrap_err().to_string();
        assert!(e.contains("generated"), "{e}");
    }
}
