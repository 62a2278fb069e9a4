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
//! (about 2 µs a file).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::Shared;
use crate::config::human_bytes;
use crate::failure::{FailureKind, RunFailure};

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
    while !done.load(Ordering::SeqCst) {
        let started = Instant::now();
        for (rank, dir) in dirs.iter().enumerate() {
            let used = disk_used(dir);
            if used > limit {
                attempt.fail(RunFailure {
                    rank: Some(rank as u32),
                    kind: FailureKind::Limit,
                    message: format!(
                        "exceeded the scratch limit of {} (--max-scratch): its scratch directory held {}; delete the files it no longer needs, or raise the limit",
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

/// The disk the files below `dir` use: their allocated blocks (a sparse
/// file counts what it holds, not its length), each file once however
/// many names it has, and the directories' own. What disappears while it
/// is measured is not counted; what cannot be read is skipped.
pub(super) fn disk_used(dir: &Path) -> u64 {
    let mut used = 0u64;
    let mut linked = HashSet::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            // Not following symbolic links: a link's own blocks only.
            let Ok(meta) = entry.metadata() else {
                continue;
            };
            if meta.is_dir() {
                pending.push(entry.path());
            } else if meta.nlink() > 1 && !linked.insert((meta.dev(), meta.ino())) {
                continue;
            }
            used = used.saturating_add(meta.blocks().saturating_mul(512));
        }
    }
    used
}

#[cfg(test)]
mod tests {
    use super::disk_used;

    #[test]
    fn a_directory_uses_its_files_blocks_counted_once_and_not_a_sparse_files_length() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let empty = disk_used(dir);
        std::fs::create_dir(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/a"), vec![1u8; 1 << 20]).unwrap();
        let one = disk_used(dir);
        assert!(one >= empty + (1 << 20), "{one}");
        // A second name of the same file costs nothing more.
        std::fs::hard_link(dir.join("sub/a"), dir.join("b")).unwrap();
        assert_eq!(disk_used(dir), one);
        // A sparse file of a terabyte holds no blocks.
        let sparse = std::fs::File::create(dir.join("sparse")).unwrap();
        sparse.set_len(1 << 40).unwrap();
        assert!(disk_used(dir) < one + (64 << 10));
    }
}
