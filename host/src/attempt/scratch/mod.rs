//! The scratch limit (`ResourceLimits::max_scratch_bytes`): a thread
//! beside the ranks measures the disk each rank's scratch directory uses
//! and fails the rank whose directory holds more than the limit.
//!
//! A guest writes its files through WASI, by many calls (streams, writes
//! at offsets, truncations, links, renames); counting each would put a
//! cost on every write. Measuring the directory now and then costs the
//! writes nothing and is exact when it measures, as Kubernetes measures a
//! pod's ephemeral storage: what it allows past the limit is what a rank
//! writes between two measurements. Those come every second, or, when a
//! rank keeps a great many files, as often as keeps the measuring to a
//! twentieth of a core, but at least every 5 seconds: a guest cannot
//! widen the gap at will by making files, only make measuring cost more
//! (about 2 µs a file), and no more than the limit allows, as each file
//! counts at least a block (a limit of 1 GiB allows 262 144 files, half
//! a second of measuring).
//!
//! A measurement is the walk of the directory's tree (`walk.rs`) and the
//! files the rank deleted while holding them open, which no walk finds
//! (`held.rs`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::Shared;
use crate::config::human_bytes;
use crate::failure::{FailureKind, RunFailure};

mod held;
mod walk;

/// The shortest time between two measurements of the ranks' directories.
const EVERY: Duration = Duration::from_secs(1);

/// Measuring takes at most one part in this many of the time, unless
/// that would leave more than [`AT_MOST`] between two measurements.
const SHARE_INVERSE: u32 = 20;

/// The longest time between the end of a measurement and the next.
const AT_MOST: Duration = Duration::from_secs(5);

/// Measure the ranks' scratch directories (`dirs`, by local rank) until
/// `done` is set or one holds more than `limit` bytes, which fails its
/// rank.
pub(super) fn watch(attempt: &Shared, dirs: &[PathBuf], limit: u64, done: &AtomicBool) {
    // As the system names the files held open: absolute, no links.
    let named: Vec<PathBuf> = dirs
        .iter()
        .map(|dir| dir.canonicalize().unwrap_or_else(|_| dir.clone()))
        .collect();
    while !done.load(Ordering::SeqCst) {
        let started = Instant::now();
        let deleted = held::deleted_but_open(&named);
        for (rank, dir) in dirs.iter().enumerate() {
            let used = walk::disk_used(dir).saturating_add(deleted[rank]);
            if used > limit {
                let of_which = match deleted[rank] {
                    0 => String::new(),
                    held => format!(
                        ", {} of it in files it deleted but holds open",
                        human_bytes(held)
                    ),
                };
                attempt.fail(RunFailure {
                    rank: Some(rank as u32),
                    kind: FailureKind::Limit,
                    message: format!(
                        "exceeded the scratch limit of {} (--max-scratch): its scratch directory held {}{of_which}; delete the files it no longer needs (and close them), or raise the limit",
                        human_bytes(limit),
                        human_bytes(used)
                    ),
                });
                return;
            }
        }
        // Parked, so that the end of the attempt wakes it at once.
        let pause = started.elapsed() * (SHARE_INVERSE - 1);
        std::thread::park_timeout(pause.clamp(EVERY, AT_MOST));
    }
}
