//! One measurement of a scratch directory's tree.

use std::collections::HashSet;
use std::ffi::CString;
use std::mem::MaybeUninit;
use std::path::Path;

use rustix::fd::OwnedFd;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, RawDir};

/// The disk the files below `dir` use: their allocated blocks (a sparse
/// file counts what it holds, not its length), each file once however
/// many names it has, and the directories' own; each name counts at least
/// [`ENTRY_BYTES`]. What disappears while it is measured is not counted;
/// what cannot be read is skipped.
pub(super) fn disk_used(dir: &Path) -> u64 {
    Walk::default().measure(dir, |_| {})
}

/// What a name costs at least: an empty file holds no blocks, yet takes
/// an inode and a directory entry, and each costs the measuring about
/// 2 µs. Counted at a block, a million empty files hold 4 GiB, so the
/// limit also bounds the files a rank keeps, and with them the inodes it
/// takes from the host's file system and the time measuring takes.
pub(super) const ENTRY_BYTES: u64 = 4096;

/// What a file, directory or link of `blocks` allocated blocks counts
/// for: its blocks, at least [`ENTRY_BYTES`].
pub(super) fn charged(blocks: u64) -> u64 {
    blocks.saturating_mul(512).max(ENTRY_BYTES)
}

/// What a walk keeps of each directory from the scratch directory down
/// to the one it is in.
struct Level {
    /// The directory's device and inode: going back up by `..` must lead
    /// to it.
    id: (u64, u64),
    /// Its name in its parent (empty for the scratch directory), to reach
    /// it again from the top when `..` does not lead to it.
    name: CString,
    /// Its subdirectories not walked yet.
    subdirs: Vec<CString>,
}

/// One measurement of a scratch directory.
///
/// The guest changes the tree while it is measured, so the walk never
/// follows a symbolic link and never builds a path: it opens each
/// directory by its name in its parent's descriptor (refusing a link),
/// and goes back up by `..`, checking that this leads to the directory it
/// came from. A directory swapped for a link to `/` after it was listed
/// cannot take the walk out of the scratch directory, and a tree
/// thousands of levels deep costs time in proportion to its size (a path
/// from the top would be resolved anew at each level, and past the
/// system's path length not at all). Only the directory being listed is
/// held open, however deep the tree.
#[derive(Default)]
struct Walk {
    used: u64,
    /// Files with several names, counted once.
    linked: HashSet<(u64, u64)>,
    /// Directories listed: one the guest moves during the walk to where
    /// the walk has yet to go is not listed (nor counted) twice.
    listed: HashSet<(u64, u64)>,
}

/// How the walk opens a directory: never through a symbolic link.
fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

fn identity(fd: &OwnedFd) -> Option<(u64, u64)> {
    let stat = rustix::fs::fstat(fd).ok()?;
    Some((stat.st_dev, stat.st_ino))
}

impl Walk {
    /// Measure `dir`; `entered` is told the depth of each directory the
    /// walk enters below it (for tests that change the tree meanwhile).
    fn measure(mut self, dir: &Path, mut entered: impl FnMut(usize)) -> u64 {
        let Ok(top) = rustix::fs::open(dir, dir_flags(), Mode::empty()) else {
            return 0;
        };
        let Ok(mut here) = top.try_clone() else {
            return 0;
        };
        // The scratch directory's own blocks are not the rank's.
        let Some(first) = self.list(&here, CString::default(), false) else {
            return 0;
        };
        let mut levels = vec![first];
        while let Some(level) = levels.last_mut() {
            if let Some(name) = level.subdirs.pop() {
                // A subdirectory since replaced by a link or a file, or
                // gone, is not walked.
                let Ok(sub) = rustix::fs::openat(&here, &name, dir_flags(), Mode::empty()) else {
                    continue;
                };
                if let Some(listed) = self.list(&sub, name, true) {
                    levels.push(listed);
                    here = sub;
                    entered(levels.len() - 1);
                }
                continue;
            }
            levels.pop();
            let Some(parent) = levels.last() else {
                break;
            };
            let up = rustix::fs::openat(&here, c"..", dir_flags(), Mode::empty())
                .ok()
                .filter(|fd| identity(fd) == Some(parent.id));
            here = match up.or_else(|| reach(&top, &mut levels)) {
                Some(fd) => fd,
                None => break,
            };
        }
        self.used
    }

    /// List the directory `dir` (called `name` in its parent): count its
    /// entries, and its own blocks if `counted`, and return what the walk
    /// keeps of it; `None` if it was listed already or cannot be read.
    fn list(&mut self, dir: &OwnedFd, name: CString, counted: bool) -> Option<Level> {
        let stat = rustix::fs::fstat(dir).ok()?;
        let id = (stat.st_dev, stat.st_ino);
        if !self.listed.insert(id) {
            return None;
        }
        if counted {
            self.count(stat.st_blocks as u64);
        }
        let mut subdirs = Vec::new();
        let mut buf = [MaybeUninit::<u8>::uninit(); 16 << 10];
        let mut entries = RawDir::new(dir, &mut buf);
        while let Some(Ok(entry)) = entries.next() {
            let name = entry.file_name();
            if name == c"." || name == c".." {
                continue;
            }
            // Not following symbolic links: a link's own blocks only.
            let Ok(stat) = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) else {
                continue;
            };
            match FileType::from_raw_mode(stat.st_mode) {
                // Counted when listed, as it may be moved meanwhile.
                FileType::Directory => subdirs.push(name.to_owned()),
                _ if stat.st_nlink > 1 && !self.linked.insert((stat.st_dev, stat.st_ino)) => {}
                _ => self.count(stat.st_blocks as u64),
            }
        }
        // Walked in name order (popped from the end): the same tree is
        // always walked the same way.
        subdirs.sort_unstable_by(|a, b| b.cmp(a));
        Some(Level { id, name, subdirs })
    }

    fn count(&mut self, blocks: u64) {
        self.used = self.used.saturating_add(charged(blocks));
    }
}

/// The directory of the walk's last level, reached from the top by the
/// levels' names when `..` no longer leads to it (the guest moved a
/// directory on the way). Where a name no longer leads to the directory
/// the walk listed, the levels from there on are dropped: their
/// directories have moved, and are walked where they are now if the walk
/// still goes there. `None` only if the top cannot be opened again.
fn reach(top: &OwnedFd, levels: &mut Vec<Level>) -> Option<OwnedFd> {
    let mut here = top.try_clone().ok()?;
    for depth in 1..levels.len() {
        let level = &levels[depth];
        let next = rustix::fs::openat(&here, &level.name, dir_flags(), Mode::empty())
            .ok()
            .filter(|fd| identity(fd) == Some(level.id));
        match next {
            Some(fd) => here = fd,
            None => {
                levels.truncate(depth);
                break;
            }
        }
    }
    Some(here)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use rustix::fs::{Mode, OFlags};

    use super::{ENTRY_BYTES, Walk, disk_used};

    #[test]
    fn a_directory_uses_its_files_blocks_counted_once_and_not_a_sparse_files_length() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let empty = disk_used(dir);
        assert_eq!(empty, 0);
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
    fn each_name_counts_at_least_a_block() {
        let tmp = tempfile::tempdir().unwrap();
        for i in 0..1000 {
            std::fs::File::create(tmp.path().join(i.to_string())).unwrap();
        }
        assert!(disk_used(tmp.path()) >= 1000 * ENTRY_BYTES);
    }

    #[test]
    fn a_link_out_is_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let scratch = tmp.path().join("scratch");
        std::fs::create_dir(&scratch).unwrap();
        std::fs::write(tmp.path().join("outside"), vec![1u8; 1 << 20]).unwrap();
        std::os::unix::fs::symlink("..", scratch.join("up")).unwrap();
        std::os::unix::fs::symlink(tmp.path(), scratch.join("abs")).unwrap();
        assert!(disk_used(&scratch) < 64 << 10);
    }

    /// A chain of `depth` directories below `dir`, each made in the last
    /// one's descriptor (its path is longer than the system allows), with
    /// a file of `bytes` at the bottom.
    fn chain(dir: &Path, depth: usize, bytes: usize) {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let mut here = rustix::fs::open(dir, flags, Mode::empty()).unwrap();
        for _ in 0..depth {
            rustix::fs::mkdirat(&here, c"level-of-a-deep-tree", Mode::RWXU).unwrap();
            here =
                rustix::fs::openat(&here, c"level-of-a-deep-tree", flags, Mode::empty()).unwrap();
        }
        let file = rustix::fs::openat(
            &here,
            c"bottom",
            OFlags::WRONLY | OFlags::CREATE | OFlags::CLOEXEC,
            Mode::RUSR | Mode::WUSR,
        )
        .unwrap();
        rustix::io::write(&file, &vec![1u8; bytes]).unwrap();
    }

    #[test]
    fn a_tree_deeper_than_a_path_can_name_is_measured_to_the_bottom() {
        let tmp = tempfile::tempdir().unwrap();
        // 21 bytes a level: paths of 21 000 bytes, past PATH_MAX (4096).
        chain(tmp.path(), 1000, 1 << 20);
        let used = disk_used(tmp.path());
        assert!(used >= (1 << 20) + 1000 * ENTRY_BYTES, "{used}");
    }

    #[test]
    fn a_directory_moved_while_it_is_measured_is_counted_once() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        std::fs::create_dir_all(dir.join("a/b/c")).unwrap();
        std::fs::create_dir_all(dir.join("a/b2")).unwrap();
        std::fs::create_dir(dir.join("z")).unwrap();
        for file in ["a/b/c/file", "a/b/file", "a/b2/file", "z/file"] {
            std::fs::write(dir.join(file), vec![1u8; 1 << 20]).unwrap();
        }
        let still = disk_used(dir);
        // Once the walk is in a/b/c, a/b goes into z: `..` from b then
        // leads to z, not to a, and the walk finds a again from the top to
        // go on with a/b2; in z it finds b listed already.
        let mut moved = false;
        let used = Walk::default().measure(dir, |depth| {
            if depth == 3 && !moved {
                std::fs::rename(dir.join("a/b"), dir.join("z/b")).unwrap();
                moved = true;
            }
        });
        assert!(moved);
        assert_eq!(used, still);
    }
}
