//! The run state (R12): what a run has committed and retains, how far it
//! got, and every failure, written after each commit and before any
//! deletion so that a run killed at any instant can resume.

use serde::{Deserialize, Serialize};

use super::layout::checkpoint_dir_name;
use super::manifest::Manifest;
use crate::config::Retention;
use crate::failure::RunFailure;
use crate::metrics::Metrics;

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
    /// The record of checkpoint `index`, committed with `manifest`.
    pub(crate) fn committed(index: u64, manifest: &Manifest) -> Self {
        Self {
            index,
            report_index: manifest.report_index,
            metrics: manifest.metrics.clone(),
        }
    }

    /// The checkpoint's directory name.
    pub fn dir_name(&self) -> String {
        checkpoint_dir_name(self.index)
    }
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
    /// Written from the ledger's policy; nothing reads it during a run.
    #[serde(default)]
    pub retention: Retention,
    /// Attempts started over the run's life, across restarts of the host:
    /// the state names the attempt that wrote it.
    #[serde(default)]
    pub attempts: u64,
    pub updated_at: String,
}

/// Parse a run state as a ledger reads it; `None` when unreadable.
pub(crate) fn parse_run_state(bytes: &[u8]) -> Option<RunState> {
    serde_json::from_slice(bytes).ok()
}
