//! The run's record in storage: its layout, what each file holds, how
//! committed checkpoints rank, and reading it back.
//!
//! Everything here reads; nothing writes. The ledger (`crate::ledger`) is
//! the one writer of a run's record, and the public
//! [`crate::checkpoint::Checkpoint`] and [`crate::committed_checkpoints`] read it with
//! the same parsers, so a file is understood the same way wherever it is
//! read. See [`layout`] for the files of a run.

pub(crate) mod history;
pub(crate) mod layout;
pub(crate) mod manifest;
pub(crate) mod ranking;
pub(crate) mod state;
pub(crate) mod tensorboard;

pub use history::ReportRecord;
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use history::parse_history;
pub(crate) use history::{History, HistoryError};
use manifest::ManifestError;
pub use manifest::{FileEntry, Manifest};
pub use state::CheckpointRecord;
pub(crate) use state::{RunState, parse_run_state};

use crate::error::Error;
use crate::storage::Storage;

/// The checkpoint directories of the run at `storage`, committed or not,
/// with their indices, in index order.
pub(crate) async fn checkpoint_dirs(storage: &Storage) -> Result<Vec<(u64, String)>, Error> {
    let mut dirs: Vec<(u64, String)> = storage
        .list_dirs("")
        .await?
        .into_iter()
        .filter_map(|name| layout::parse_checkpoint_dir_name(&name).map(|i| (i, name)))
        .collect();
    dirs.sort();
    Ok(dirs)
}

/// The manifest of the checkpoint directory at `storage`: it must exist,
/// parse, and list only paths inside the checkpoint, or the directory is
/// not a committed checkpoint.
pub(crate) async fn read_manifest(storage: &Storage) -> Result<Manifest, Error> {
    let not_committed = |reason: ManifestError| Error::NotACheckpoint {
        location: storage.url().to_owned(),
        reason: Box::new(reason),
    };
    let bytes = storage
        .get(layout::MANIFEST)
        .await?
        .ok_or_else(|| not_committed(ManifestError::Missing))?;
    let manifest = Manifest::from_json(&bytes).map_err(not_committed)?;
    for f in &manifest.files {
        manifest::check_relative_path(&f.path).map_err(not_committed)?;
    }
    Ok(manifest)
}
