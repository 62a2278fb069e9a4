//! Listing a run's committed checkpoints, ranked as the run ranks them.

use super::{Checkpoint, block_on};
use crate::config::{Location, StorageOptions};
use crate::error::Error;
use crate::record::{self, CheckpointRecord, layout, ranking};
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
