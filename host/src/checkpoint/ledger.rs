//! The run's record in storage: committed checkpoints, the run state and the
//! metrics history, and the order in which they are written.
//!
//! A report with a checkpoint is written in this order, so that a host
//! killed at any instant leaves storage resumable (R11, R12, R18):
//! 1. the checkpoint's files, made durable ([`Storage::sync_uploads`]);
//! 2. its manifest (the commit);
//! 3. the run state, naming the new checkpoint and the retained ones;
//! 4. deletions by retention, each manifest first;
//! 5. the metrics history.
//!
//! Opening an existing run repairs what a killed host can leave behind:
//! a checkpoint committed after the last state write is adopted, and
//! directories that are not retained committed checkpoints (partial
//! uploads, half-done deletions) are removed.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;

use super::manifest::FileEntry;
use super::manifest::{self, Manifest};
use super::persist::{PersistStats, Plan, Previous, persist};
use super::restore::Checkpoint;
use crate::config::Retention;
use crate::failure::RunFailure;
use crate::storage::Storage;
use crate::{Error, Metrics};

/// A committed checkpoint as the run state lists it.
///
/// ```
/// let record = trainhost::CheckpointRecord {
///     index: 7,
///     report_index: 12,
///     metrics: trainhost::Metrics::new(),
/// };
/// assert_eq!(record.dir_name(), "checkpoint_000007");
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointRecord {
    /// Index in the run (`checkpoint_{index:06}`).
    pub index: u64,
    /// The report that created it.
    pub report_index: u64,
    /// The metrics reported with it.
    pub metrics: Metrics,
}

impl CheckpointRecord {
    /// The checkpoint's directory name.
    pub fn dir_name(&self) -> String {
        manifest::checkpoint_dir_name(self.index)
    }
}

/// One entry of the metrics history: one report (see
/// [`crate::TrainResult::metrics_history`]).
///
/// ```no_run
/// let result = trainhost::Trainer::builder("loop.wasm").build()?.fit()?;
/// for r in &result.metrics_history {
///     println!("report {}: {} (checkpoint {:?})", r.report_index, r.metrics, r.checkpoint);
/// }
/// # Ok::<(), trainhost::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportRecord {
    /// The report's index in the run, from 0.
    pub report_index: u64,
    /// Rank 0's metrics.
    pub metrics: Metrics,
    /// The checkpoint the report committed, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<u64>,
    /// When the report was recorded (RFC 3339, UTC).
    pub time: String,
}

/// What the run state file holds (R12).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RunState {
    pub format: u32,
    pub run_name: String,
    /// SHA-256 of the loop's config, to refuse resuming with another one.
    pub config_fingerprint: String,
    pub world_size: u32,
    /// How many reports the run has made.
    pub reports: u64,
    /// The index the next checkpoint gets.
    pub next_checkpoint_index: u64,
    /// Retained committed checkpoints, in commit order.
    pub checkpoints: Vec<CheckpointRecord>,
    /// Every failure of the run, oldest first.
    #[serde(default)]
    pub failures: Vec<RunFailure>,
    /// The retention policy last used, to rank checkpoints in listings.
    #[serde(default)]
    pub retention: Retention,
    pub updated_at: String,
}

struct Inner {
    state: RunState,
    history: Vec<ReportRecord>,
    /// The history file's bytes, kept so each report appends one line
    /// instead of re-serializing everything.
    history_jsonl: Vec<u8>,
    /// The latest committed checkpoint's files, once known.
    previous: Option<Arc<Previous>>,
}

impl Inner {
    /// Add one report to the history, and its line to the file's bytes.
    fn append_history(&mut self, record: ReportRecord) {
        let mut line = serde_json::to_vec(&record).expect("reports serialize");
        line.push(b'\n');
        self.history_jsonl.extend_from_slice(&line);
        self.history.push(record);
    }
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
}

/// The run's record: owns the run directory in storage.
pub(crate) struct Ledger {
    storage: Storage,
    handle: Handle,
    retention: Retention,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("storage", &self.storage.url())
            .finish_non_exhaustive()
    }
}

impl Ledger {
    /// Open the run at `storage`: continue it if it exists (same config
    /// fingerprint, R23), else start a new one.
    pub async fn open(
        storage: Storage,
        options: LedgerOptions<'_>,
        handle: Handle,
    ) -> Result<Self, Error> {
        let conflict = |reason: String| Error::RunConflict {
            run: storage.url().to_owned(),
            reason,
        };
        let mut existing = storage.get(manifest::RUN_STATE).await?;
        // A new run writes its state before anything else, so files of a
        // run without a state are left by an interrupted start-fresh (the
        // state is deleted first) or by hand. They belong to another run:
        // a resume would adopt its checkpoints as this run's.
        let leftovers = match existing {
            Some(_) => Vec::new(),
            None => Self::leftovers(&storage).await?,
        };
        if options.fresh && (existing.is_some() || !leftovers.is_empty()) {
            tracing::warn!(run = %storage.url(), "deleting the existing run to start fresh");
            storage.delete(manifest::RUN_STATE).await?;
            storage.delete_all("").await?;
            existing = None;
        } else if !leftovers.is_empty() {
            return Err(conflict(format!(
                "it holds {} but no {} (left by an interrupted start-fresh, or the state was deleted); choose another run name, or start fresh (which deletes them)",
                leftovers.join(", "),
                manifest::RUN_STATE
            )));
        }
        let resuming = existing.is_some();
        let mut state = match existing {
            Some(bytes) => {
                let state: RunState = serde_json::from_slice(&bytes).map_err(|e| {
                    conflict(format!(
                        "{} is unreadable ({e}); choose another run name, or start fresh",
                        manifest::RUN_STATE
                    ))
                })?;
                if state.format != manifest::FORMAT {
                    return Err(conflict(format!(
                        "it was written in format {}, this trainhost reads format {}",
                        state.format,
                        manifest::FORMAT
                    )));
                }
                if state.config_fingerprint != options.config_fingerprint {
                    return Err(conflict(
                        "it exists with a different config; resume it with the same config, choose another run name, or start fresh (which deletes it)".into(),
                    ));
                }
                state
            }
            None => RunState {
                format: manifest::FORMAT,
                run_name: options.run_name.to_owned(),
                config_fingerprint: options.config_fingerprint.to_owned(),
                world_size: options.world_size,
                reports: 0,
                next_checkpoint_index: 0,
                checkpoints: Vec::new(),
                failures: Vec::new(),
                retention: options.retention.clone(),
                updated_at: manifest::now_rfc3339(),
            },
        };
        // A resumed run may change its retention policy; the new one rules.
        state.retention = options.retention.clone();
        let history_jsonl = storage
            .get(manifest::HISTORY)
            .await?
            .map(|b| b.to_vec())
            .unwrap_or_default();
        let history = parse_history(&history_jsonl).map_err(conflict)?;
        // The history is written after the state, so a host killed between
        // the two leaves the state one report ahead; the larger count wins.
        if let Some(last) = history.last() {
            state.reports = state.reports.max(last.report_index + 1);
        }
        let ledger = Self {
            storage,
            handle,
            retention: options.retention,
            inner: Mutex::new(Inner {
                state,
                history,
                history_jsonl,
                previous: None,
            }),
        };
        if resuming {
            ledger.repair().await?;
            ledger.backfill_history().await?;
            // The policy may have changed: apply it (this also records it).
            ledger.apply_retention().await?;
        } else {
            // Written at once, so that a run that never commits can still
            // be recognized (and its config checked) when resumed.
            ledger.write_state().await?;
        }
        Ok(ledger)
    }

    /// What a run without a state holds of a run: checkpoint directories
    /// and a history (at most three named).
    async fn leftovers(storage: &Storage) -> Result<Vec<String>, Error> {
        let mut found: Vec<String> = checkpoint_dirs(storage)
            .await?
            .into_iter()
            .map(|(_, name)| name)
            .collect();
        let dirs = found.len();
        if dirs > 3 {
            found.truncate(3);
            found.push(format!("{} more checkpoint directories", dirs - 3));
        }
        if storage.get(manifest::HISTORY).await?.is_some() {
            found.push(manifest::HISTORY.to_owned());
        }
        Ok(found)
    }

    /// Bring storage and state into agreement after a host was killed.
    async fn repair(&self) -> Result<(), Error> {
        let dirs = checkpoint_dirs(&self.storage).await?;
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
                match Checkpoint::load(self.storage.child(&name)).await {
                    Ok(c) => {
                        tracing::warn!(checkpoint = %c.location(), "adopting a checkpoint committed after the run state was last written");
                        let mut inner = self.lock();
                        inner.state.checkpoints.push(CheckpointRecord {
                            index,
                            report_index: c.manifest().report_index,
                            metrics: c.metrics().clone(),
                        });
                        inner.state.next_checkpoint_index = index + 1;
                        inner.state.reports =
                            inner.state.reports.max(c.manifest().report_index + 1);
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
            self.apply_retention().await?;
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
            let next = inner.history.last().map_or(0, |r| r.report_index + 1);
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
                inner.append_history(ReportRecord {
                    report_index: c.report_index,
                    metrics: c.metrics.clone(),
                    checkpoint: Some(c.index),
                    time: manifest::now_rfc3339(),
                });
            }
            Bytes::from(inner.history_jsonl.clone())
        };
        self.storage.put(manifest::HISTORY, bytes).await
    }

    /// The run's storage location.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// A number that changes whenever the run writes to storage (a report
    /// or a failure).
    pub fn generation(&self) -> u64 {
        let inner = self.lock();
        inner.state.reports + inner.state.failures.len() as u64
    }

    /// The retention policy.
    pub fn retention(&self) -> &Retention {
        &self.retention
    }

    /// Retained committed checkpoints, newest first.
    pub fn newest_first(&self) -> Vec<CheckpointRecord> {
        let mut out = self.lock().state.checkpoints.clone();
        out.reverse();
        out
    }

    /// Retained checkpoints best first, the metrics history, and every
    /// failure so far.
    pub fn snapshot(&self) -> (Vec<CheckpointRecord>, Vec<ReportRecord>, Vec<RunFailure>) {
        let inner = self.lock();
        (
            self.retention.ranked(&inner.state.checkpoints),
            inner.history.clone(),
            inner.state.failures.clone(),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every mutation is a push or an assignment after the I/O, so a
        // lock poisoned by a panic still guards consistent data.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn write_state(&self) -> Result<(), Error> {
        let json = {
            let mut inner = self.lock();
            inner.state.updated_at = manifest::now_rfc3339();
            serde_json::to_vec_pretty(&inner.state).expect("state serializes")
        };
        self.storage
            .put(manifest::RUN_STATE, Bytes::from(json))
            .await
    }

    /// Record a failure; returns how many the run has had in all.
    pub fn record_failure(&self, failure: &RunFailure) -> Result<usize, Error> {
        let count = {
            let mut inner = self.lock();
            inner.state.failures.push(failure.clone());
            inner.state.failures.len()
        };
        self.handle.block_on(self.write_state())?;
        Ok(count)
    }

    /// Delete a checkpoint: manifest first, so that a half-deleted
    /// checkpoint is never restorable (R18).
    async fn delete_checkpoint(&self, dir_name: &str) -> Result<(), Error> {
        let dir = self.storage.child(dir_name);
        dir.delete(manifest::MANIFEST).await?;
        dir.delete_all("").await
    }

    /// Apply retention to the retained list: state first (R12), then the
    /// deletions.
    async fn apply_retention(&self) -> Result<(), Error> {
        let dropped = {
            let mut inner = self.lock();
            let (kept, dropped) = self.retention.apply(&inner.state.checkpoints);
            inner.state.checkpoints = kept;
            dropped
        };
        self.write_state().await?;
        for record in dropped {
            tracing::info!(checkpoint = record.index, "retention: deleting checkpoint");
            self.delete_checkpoint(&record.dir_name()).await?;
        }
        Ok(())
    }

    /// The index the next report gets, and the index the next checkpoint
    /// gets.
    pub fn next_indices(&self) -> (u64, u64) {
        let inner = self.lock();
        (inner.state.reports, inner.state.next_checkpoint_index)
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
        let checkpoint = Checkpoint::load(storage.clone()).await.ok()?;
        let previous = Arc::new(Previous {
            storage,
            files: checkpoint.manifest().files.clone(),
        });
        self.lock().previous = Some(Arc::clone(&previous));
        Some(previous)
    }

    /// Whether the run's storage is a local directory.
    pub fn is_local(&self) -> bool {
        self.storage.local_path().is_some()
    }

    /// Commit `plan` as checkpoint `checkpoint_index` of report
    /// `report_index`: steps 1 to 4 of the order above. Called for one
    /// report at a time, in report order.
    pub async fn commit(
        &self,
        report_index: u64,
        checkpoint_index: u64,
        metrics: &Metrics,
        plan: &Plan,
        world_size: u32,
    ) -> Result<PersistStats, Error> {
        let uploaded = self.upload(checkpoint_index, plan).await?;
        self.commit_uploaded(
            report_index,
            checkpoint_index,
            metrics,
            &plan.ranks,
            world_size,
            uploaded,
        )
        .await
    }

    /// Steps 1 and 2 of a commit: persist the files of `plan` into
    /// checkpoint `checkpoint_index`'s directory, which nothing reads until
    /// [`Ledger::commit_uploaded`] writes its manifest. The previous
    /// checkpoint must be committed already (its files are linked).
    pub async fn upload(&self, checkpoint_index: u64, plan: &Plan) -> Result<Uploaded, Error> {
        let dest = self
            .storage
            .child(&manifest::checkpoint_dir_name(checkpoint_index));
        // A host killed mid-upload can leave files under this name with no
        // manifest; they were never committed, so clear them first.
        dest.delete_all("").await?;
        let previous = self.previous().await;
        let (files, stats) = persist(&dest, plan, previous).await?;
        Ok(Uploaded { files, stats })
    }

    /// Steps 3 and 4 of a commit, for files [`Ledger::upload`] persisted.
    pub async fn commit_uploaded(
        &self,
        report_index: u64,
        checkpoint_index: u64,
        metrics: &Metrics,
        ranks: &[u32],
        world_size: u32,
        uploaded: Uploaded,
    ) -> Result<PersistStats, Error> {
        let Uploaded { files, stats } = uploaded;
        let run_name = self.lock().state.run_name.clone();
        let dest = self
            .storage
            .child(&manifest::checkpoint_dir_name(checkpoint_index));
        let manifest = Manifest {
            format: manifest::FORMAT,
            run_name,
            checkpoint_index,
            report_index,
            metrics: metrics.clone(),
            ranks: ranks.to_vec(),
            world_size,
            files,
            committed_at: manifest::now_rfc3339(),
        };
        let json = serde_json::to_vec_pretty(&manifest).expect("manifests serialize");
        // The manifest is written after every file is durable (R11).
        dest.sync_uploads().await?;
        dest.put(manifest::MANIFEST, Bytes::from(json)).await?;
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
        self.retention.warn_unscored(&record);
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
        self.apply_retention().await?;
        Ok(stats)
    }

    /// Add report `report_index` to the history in memory; `write_history`
    /// stores it (step 5).
    pub fn append_report(&self, report_index: u64, metrics: Metrics, checkpoint: Option<u64>) {
        let mut inner = self.lock();
        inner.state.reports = report_index + 1;
        inner.append_history(ReportRecord {
            report_index,
            metrics,
            checkpoint,
            time: manifest::now_rfc3339(),
        });
    }

    /// Store the metrics history as it is in memory.
    pub async fn write_history(&self) -> Result<(), Error> {
        let bytes = Bytes::from(self.lock().history_jsonl.clone());
        self.storage.put(manifest::HISTORY, bytes).await
    }
}

/// The checkpoint directories of the run at `storage`, committed or not,
/// by index.
async fn checkpoint_dirs(storage: &Storage) -> Result<Vec<(u64, String)>, Error> {
    let mut dirs: Vec<(u64, String)> = storage
        .list_dirs("")
        .await?
        .into_iter()
        .filter_map(|name| manifest::parse_checkpoint_dir_name(&name).map(|i| (i, name)))
        .collect();
    dirs.sort();
    Ok(dirs)
}

/// A checkpoint's files persisted but not yet committed.
#[derive(Debug)]
pub(crate) struct Uploaded {
    files: Vec<FileEntry>,
    stats: PersistStats,
}

/// Parse a run state as `Ledger::open` does; `None` when unreadable.
pub(crate) fn parse_run_state(bytes: &[u8]) -> Option<RunState> {
    serde_json::from_slice(bytes).ok()
}

pub(crate) fn parse_history(bytes: &[u8]) -> Result<Vec<ReportRecord>, String> {
    let lines: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice(line) {
            Ok(record) => out.push(record),
            // A host killed while writing leaves at most a torn last line.
            Err(_) if i + 1 == lines.len() => break,
            Err(e) => {
                return Err(format!(
                    "{} line {} is unreadable ({e}); choose another run name or repair the file",
                    manifest::HISTORY,
                    i + 1
                ));
            }
        }
    }
    Ok(out)
}
