//! The run's record in storage: committed checkpoints, the run state and the
//! metrics history, and the order in which they are written.
//!
//! A report with a checkpoint is written in this order, so that a host
//! killed at any instant leaves storage resumable (R11, R12):
//! 1. the checkpoint's files;
//! 2. its manifest (the commit);
//! 3. the run state, naming the new checkpoint;
//! 4. the metrics history.

use std::sync::Mutex;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;

use super::capture::Capture;
use super::manifest::{self, Manifest};
use super::persist::{PersistError, persist};
use crate::storage::Storage;
use crate::{Error, Metrics};

/// A committed checkpoint as the run state lists it.
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

/// One entry of the metrics history: one report.
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
    /// Committed checkpoints still in storage, in commit order.
    pub checkpoints: Vec<CheckpointRecord>,
    /// How many times the run failed.
    pub failures: u32,
    pub updated_at: String,
}

/// The outcome of one collective report, as the guests see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReportRefused {
    /// Ranks wrote the same path with different bytes.
    Collision(String),
}

struct Inner {
    state: RunState,
    history: Vec<ReportRecord>,
    /// The history file's bytes, kept so each report appends one line
    /// instead of re-serializing everything.
    history_jsonl: Vec<u8>,
}

/// The run's record: owns the run directory in storage.
pub(crate) struct Ledger {
    storage: Storage,
    handle: Handle,
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
    /// fingerprint), else start a new one.
    pub async fn open(
        storage: Storage,
        run_name: &str,
        config_fingerprint: &str,
        world_size: u32,
        handle: Handle,
    ) -> Result<Self, Error> {
        let existing = storage.get(manifest::RUN_STATE).await?;
        let is_new = existing.is_none();
        let state = match existing {
            Some(bytes) => {
                let state: RunState =
                    serde_json::from_slice(&bytes).map_err(|e| Error::RunConflict {
                        run: storage.url().to_owned(),
                        reason: format!(
                            "{} is unreadable ({e}); choose another run name or remove the run",
                            manifest::RUN_STATE
                        ),
                    })?;
                if state.format != manifest::FORMAT {
                    return Err(Error::RunConflict {
                        run: storage.url().to_owned(),
                        reason: format!(
                            "it was written in format {}, this trainhost reads format {}",
                            state.format,
                            manifest::FORMAT
                        ),
                    });
                }
                if state.config_fingerprint != config_fingerprint {
                    return Err(Error::RunConflict {
                        run: storage.url().to_owned(),
                        reason: "it exists with a different config; resume it with the same config, or choose another run name".into(),
                    });
                }
                state
            }
            None => RunState {
                format: manifest::FORMAT,
                run_name: run_name.to_owned(),
                config_fingerprint: config_fingerprint.to_owned(),
                world_size,
                reports: 0,
                next_checkpoint_index: 0,
                checkpoints: Vec::new(),
                failures: 0,
                updated_at: manifest::now_rfc3339(),
            },
        };
        let history_jsonl = storage
            .get(manifest::HISTORY)
            .await?
            .map(|b| b.to_vec())
            .unwrap_or_default();
        let history = parse_history(&history_jsonl).map_err(|reason| Error::RunConflict {
            run: storage.url().to_owned(),
            reason,
        })?;
        let mut state = state;
        // The history is written after the state, so a host killed between
        // the two leaves the state one report ahead; the larger count wins.
        if let Some(last) = history.last() {
            state.reports = state.reports.max(last.report_index + 1);
        }
        if is_new {
            // Written at once, so that a run that never commits can still
            // be recognized (and its config checked) when resumed.
            let json = serde_json::to_vec_pretty(&state).expect("state serializes");
            storage.put(manifest::RUN_STATE, Bytes::from(json)).await?;
        }
        Ok(Self {
            storage,
            handle,
            inner: Mutex::new(Inner {
                state,
                history,
                history_jsonl,
            }),
        })
    }

    /// The run's storage location.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The latest committed checkpoint.
    pub fn latest(&self) -> Option<CheckpointRecord> {
        self.lock().state.checkpoints.last().cloned()
    }

    /// Committed checkpoints in commit order, the metrics history, and the
    /// failure count.
    pub fn snapshot(&self) -> (Vec<CheckpointRecord>, Vec<ReportRecord>, u32) {
        let inner = self.lock();
        (
            inner.state.checkpoints.clone(),
            inner.history.clone(),
            inner.state.failures,
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (every
        // mutation is a push or an assignment after the I/O), so a poisoned
        // lock is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record one collective report: commit a checkpoint from `captures` if
    /// there are any, then append the report to the history. Called by one
    /// thread at a time (the report gate's leader).
    pub fn record(
        &self,
        metrics: Metrics,
        captures: Vec<Capture>,
        world_size: u32,
    ) -> Result<Result<(), ReportRefused>, Error> {
        self.handle
            .block_on(self.record_async(metrics, captures, world_size))
    }

    async fn record_async(
        &self,
        metrics: Metrics,
        captures: Vec<Capture>,
        world_size: u32,
    ) -> Result<Result<(), ReportRefused>, Error> {
        let (report_index, checkpoint_index, run_name) = {
            let inner = self.lock();
            (
                inner.state.reports,
                inner.state.next_checkpoint_index,
                inner.state.run_name.clone(),
            )
        };
        let mut committed = None;
        if !captures.is_empty() {
            let dir_name = manifest::checkpoint_dir_name(checkpoint_index);
            let dest = self.storage.child(&dir_name);
            // A host killed mid-upload can leave files under this name with
            // no manifest; they were never committed, so clear them first.
            dest.delete_all("").await?;
            let files = match persist(&dest, &captures).await {
                Ok(files) => files,
                Err(PersistError::Collision(msg)) => return Ok(Err(ReportRefused::Collision(msg))),
                Err(PersistError::Failed(e)) => return Err(e),
            };
            let mut ranks: Vec<u32> = captures.iter().map(|c| c.rank).collect();
            ranks.sort_unstable();
            let manifest = Manifest {
                format: manifest::FORMAT,
                run_name,
                checkpoint_index,
                report_index,
                metrics: metrics.clone(),
                ranks,
                world_size,
                files,
                committed_at: manifest::now_rfc3339(),
            };
            let json = serde_json::to_vec_pretty(&manifest).expect("manifests serialize");
            dest.put(manifest::MANIFEST, Bytes::from(json)).await?;
            tracing::info!(
                checkpoint = %dest.url(),
                files = manifest.files.len(),
                bytes = manifest.total_bytes(),
                "committed checkpoint"
            );
            committed = Some(CheckpointRecord {
                index: checkpoint_index,
                report_index,
                metrics: metrics.clone(),
            });
        }

        let (state_json, history_bytes) = {
            let mut inner = self.lock();
            inner.state.reports = report_index + 1;
            if let Some(record) = &committed {
                inner.state.next_checkpoint_index = record.index + 1;
                inner.state.checkpoints.push(record.clone());
                inner.state.updated_at = manifest::now_rfc3339();
            }
            let record = ReportRecord {
                report_index,
                metrics,
                checkpoint: committed.as_ref().map(|c| c.index),
                time: manifest::now_rfc3339(),
            };
            let mut line = serde_json::to_vec(&record).expect("reports serialize");
            line.push(b'\n');
            inner.history_jsonl.extend_from_slice(&line);
            inner.history.push(record);
            let state_json = committed
                .is_some()
                .then(|| serde_json::to_vec_pretty(&inner.state).expect("state serializes"));
            (state_json, Bytes::from(inner.history_jsonl.clone()))
        };
        if let Some(json) = state_json {
            self.storage
                .put(manifest::RUN_STATE, Bytes::from(json))
                .await?;
        }
        self.storage.put(manifest::HISTORY, history_bytes).await?;
        Ok(Ok(()))
    }
}

fn parse_history(bytes: &[u8]) -> Result<Vec<ReportRecord>, String> {
    let mut out = Vec::new();
    for (i, line) in bytes.split(|b| *b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice(line) {
            Ok(record) => out.push(record),
            // A host killed while writing leaves at most a torn last line.
            Err(_) if i + 1 == bytes.split(|b| *b == b'\n').count() => break,
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
