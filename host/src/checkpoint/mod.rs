//! Reports and checkpoints: the collective report gate, capture of a rank's
//! directory, persisting and committing, retention, the run's record, and
//! restore.

mod capture;
mod gate;
mod ledger;
pub(crate) mod manifest;
pub(crate) mod persist;
mod recorder;
mod restore;
mod retention;
mod session;

pub(crate) use capture::capture;
pub(crate) use gate::Aborted;
pub use ledger::{CheckpointRecord, ReportRecord};
pub(crate) use ledger::{Ledger, LedgerOptions, parse_history, parse_run_state};
pub use manifest::{FileEntry, Manifest};
pub(crate) use persist::{merge, persist};
pub(crate) use recorder::ReportRefused;
pub use restore::{Checkpoint, CheckpointDir, committed_checkpoints, committed_checkpoints_with};
pub(crate) use restore::{RestoreCache, check_relative_path};
pub(crate) use session::Session;
