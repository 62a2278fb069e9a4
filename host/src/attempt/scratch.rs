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
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cap_std::fs::{Dir, MetadataExt};

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
///
/// The guest changes the tree while it is measured, so every directory is
/// opened within `dir` (`cap_std`): one the guest swaps for a symbolic
/// link to `/` after it was listed cannot take the measuring out of the
/// scratch directory and through the host's file system.
pub(super) fn disk_used(dir: &Path) -> u64 {
    let Ok(root) = Dir::open_ambient_dir(dir, cap_std::ambient_authority()) else {
        return 0;
    };
    let mut used = 0u64;
    let mut linked = HashSet::new();
    // Directories to list, relative to `root`.
    let mut pending = vec![PathBuf::new()];
    while let Some(rel) = pending.pop() {
        let opened = match rel.as_os_str().is_empty() {
            true => root.try_clone(),
            false => root.open_dir(&rel),
        };
        let Ok(entries) = opened.and_then(|d| d.entries()) else {
            continue;
        };
        for entry in entries.flatten() {
            // Not following symbolic links: a link's own blocks only.
            let Ok(meta) = entry.metadata() else {
                continue;
            };
            if meta.is_dir() {
                pending.push(rel.join(entry.file_name()));
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
    use cap_std::fs::Dir;

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
        let with_sparse = disk_used(dir);
        assert!(with_sparse < one + (64 << 10));
        // A symbolic link counts as itself, wherever it leads.
        std::os::unix::fs::symlink("/", dir.join("root")).unwrap();
        std::os::unix::fs::symlink(".", dir.join("sub/loop")).unwrap();
        assert!(disk_used(dir) < with_sparse + (64 << 10));
    }

    #[test]
    fn a_directory_swapped_for_a_link_out_is_not_followed() {
        // What a guest swapping a listed directory for a link finds when
        // the measuring opens it: the link is resolved within the scratch
        // directory or refused.
        let tmp = tempfile::tempdir().unwrap();
        let scratch = tmp.path().join("scratch");
        std::fs::create_dir(&scratch).unwrap();
        std::fs::write(tmp.path().join("outside"), vec![1u8; 1 << 20]).unwrap();
        std::os::unix::fs::symlink("..", scratch.join("up")).unwrap();
        let root = Dir::open_ambient_dir(&scratch, cap_std::ambient_authority()).unwrap();
        assert!(root.open_dir("up").is_err());
        assert!(disk_used(&scratch) < 64 << 10);
    }
}
