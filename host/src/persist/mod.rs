//! Writing one report's checkpoint files: listing each rank's directory
//! through its sandbox handle, merging the ranks' files into one plan,
//! snapshotting it when the upload goes on in the background (lending the
//! files to the host rather than copying them), and
//! uploading it. What makes the files a committed checkpoint (the
//! manifest, the run state) is the ledger's part.

mod capture;
mod lend;
mod plan;
mod snapshot;
mod upload;

pub(crate) use capture::{Capture, CaptureError, HandedOver, capture};
pub(crate) use lend::{Inode, Lent};
pub(crate) use plan::{Collision, Plan, PlanError, merge};
pub(crate) use snapshot::{Snapshots, snapshot};
#[cfg(feature = "bench")]
pub(crate) use upload::COPY_AT_LEAST;
pub(crate) use upload::{PersistStats, Previous, persist};
