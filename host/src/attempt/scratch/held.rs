//! What a rank's deleted files still hold on disk.
//!
//! A file the guest deletes while it holds it open keeps its blocks until
//! the last descriptor closes, and the guest may go on writing to it: a
//! walk of the directory never sees it. (Measuring with `du`, as
//! Kubernetes does for ephemeral storage, has the same blind spot.) The
//! guest's descriptors are the host process's, so the process's table
//! (`/proc/self/fd`) lists them: a descriptor whose file has no name left
//! and was named below a rank's scratch directory counts against that
//! rank. Where there is no such table, nothing is counted.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::walk::charged;

/// What the system appends to the name of a deleted file it shows.
const DELETED: &[u8] = b" (deleted)";

/// For each of `dirs` (absolute, without symbolic links), the disk used by
/// the files last named below it that no name leads to any more but this
/// process holds open: each file as [`charged`] counts it, once however
/// many descriptors it has.
pub(super) fn deleted_but_open(dirs: &[PathBuf]) -> Vec<u64> {
    deleted_but_open_in(Path::new("/proc/self/fd"), dirs)
}

/// As [`deleted_but_open`], from the descriptor table `table`.
fn deleted_but_open_in(table: &Path, dirs: &[PathBuf]) -> Vec<u64> {
    let mut used = vec![0u64; dirs.len()];
    let Ok(entries) = std::fs::read_dir(table) else {
        return used;
    };
    let mut counted = HashSet::new();
    for entry in entries.flatten() {
        // The name the file had, or a description (a pipe, a socket).
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let Some(named) = target.as_os_str().as_bytes().strip_suffix(DELETED) else {
            continue;
        };
        let named = Path::new(OsStr::from_bytes(named));
        let Some(rank) = dirs.iter().position(|dir| named.starts_with(dir)) else {
            continue;
        };
        // Through the descriptor: the file itself, whatever its name was.
        // The descriptor may have closed and its number been reused since
        // it was read: the count of links tells a deleted file still.
        let Ok(stat) = rustix::fs::stat(entry.path()) else {
            continue;
        };
        let file = (stat.st_dev, stat.st_ino);
        if stat.st_nlink == 0 && counted.insert(file) {
            used[rank] = used[rank].saturating_add(charged(stat.st_blocks as u64));
        }
    }
    used
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn a_deleted_file_held_open_counts_for_the_directory_it_was_in() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let (a, b) = (root.join("rank-1"), root.join("rank-10"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        let dirs = [a.clone(), b.clone()];
        let before = deleted_but_open(&dirs);

        let mut held = std::fs::File::create(b.join("gone")).unwrap();
        // A second descriptor of the same file counts it once.
        let again = std::fs::File::open(b.join("gone")).unwrap();
        std::fs::remove_file(b.join("gone")).unwrap();
        held.write_all(&vec![1u8; 1 << 20]).unwrap();
        held.sync_all().unwrap();
        // Open but not deleted: the walk counts it, not this.
        let _named = std::fs::File::create(a.join("kept")).unwrap();

        let after = deleted_but_open(&dirs);
        assert_eq!(after[0], before[0]);
        let grew = after[1] - before[1];
        assert!((1 << 20..(1 << 20) + (64 << 10)).contains(&grew), "{grew}");

        drop((held, again));
        assert_eq!(deleted_but_open(&dirs), before);
    }

    #[test]
    fn without_a_descriptor_table_nothing_counts() {
        let dirs = [PathBuf::from("/")];
        assert_eq!(
            deleted_but_open_in(Path::new("/nonexistent/fd"), &dirs),
            vec![0]
        );
    }
}
