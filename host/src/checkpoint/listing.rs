//! Reading a stored run: its committed checkpoints, ranked as the run
//! ranks them, and its metrics history.

use super::{Checkpoint, block_on};
use crate::config::{Location, StorageOptions};
use crate::error::Error;
use crate::record::{self, CheckpointRecord, History, ReportRecord, layout, ranking};
use crate::storage::Storage;

/// The committed checkpoints of the run stored at `run_location` (a
/// directory or URL), best first as the run's retention policy ranks them
/// (without a score attribute, newest first). Directories without a valid
/// manifest were never committed and are left out.
///
/// ```no_run
/// for c in trainhost::committed_checkpoints("./trainhost_results/demo")? {
///     println!("{} {}", c.location(), c.metrics());
/// }
/// # Ok::<(), trainhost::Error>(())
/// ```
pub fn committed_checkpoints(run_location: &str) -> Result<Vec<Checkpoint>, Error> {
    committed_checkpoints_with(run_location, &StorageOptions::default())
}

/// [`committed_checkpoints`] with storage options (endpoint, credentials,
/// retries).
pub fn committed_checkpoints_with(
    run_location: &str,
    options: &StorageOptions,
) -> Result<Vec<Checkpoint>, Error> {
    block_on(async {
        let storage = Storage::open(&Location::parse(run_location)?, options)?;
        let Some(state) = storage.get(layout::RUN_STATE).await? else {
            return Err(Error::InvalidConfig(format!(
                "{} holds no trainhost run (no {}); give the run's directory, <storage>/<run name>",
                storage.url(),
                layout::RUN_STATE
            )));
        };
        // A state this trainhost cannot read still lists its checkpoints,
        // newest first.
        let retention = record::parse_run_state(&state)
            .map(|s| s.retention)
            .unwrap_or_default();
        let mut found = Vec::new();
        for (index, name) in record::checkpoint_dirs(&storage).await? {
            match Checkpoint::load(storage.child(&name)).await {
                Ok(c) => found.push((CheckpointRecord::committed(index, c.manifest()), c)),
                Err(Error::NotACheckpoint { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let records: Vec<CheckpointRecord> = found.iter().map(|(r, _)| r.clone()).collect();
        Ok(ranking::ranked(&retention, &records)
            .iter()
            .filter_map(|r| {
                found
                    .iter()
                    .find(|(f, _)| f.index == r.index)
                    .map(|(_, c)| c.clone())
            })
            .collect())
    })
}

/// Every report of the run stored at `run_location` (a directory or URL),
/// oldest first, as its `metrics.jsonl` holds them (R9; a torn last line,
/// left by a host killed while writing, is left out).
///
/// ```no_run
/// use trainhost::StorageOptions;
/// let history = trainhost::stored_history("./trainhost_results/demo", &StorageOptions::default())?;
/// for r in history {
///     println!("{} {}", r.report_index, r.metrics);
/// }
/// # Ok::<(), trainhost::Error>(())
/// ```
pub fn stored_history(
    run_location: &str,
    options: &StorageOptions,
) -> Result<Vec<ReportRecord>, Error> {
    block_on(async {
        let storage = Storage::open(&Location::parse(run_location)?, options)?;
        let Some(bytes) = storage.get(layout::HISTORY).await? else {
            let what = match storage.get(layout::RUN_STATE).await? {
                Some(_) => "has reported nothing yet",
                None => "holds no trainhost run; give the run's directory, <storage>/<run name>",
            };
            return Err(Error::InvalidConfig(format!(
                "{} {what} (no {})",
                storage.url(),
                layout::HISTORY
            )));
        };
        let history = History::parse(bytes.to_vec())
            .map_err(|e| Error::InvalidConfig(format!("{}: {e}", storage.url())))?;
        Ok(history.records().to_vec())
    })
}
