//! Taking a guest's checkpoint files without copying them: copy-on-write
//! between a rank's scratch directory and the host's snapshot.
//!
//! A snapshot that copies a 64 MiB checkpoint keeps the guest waiting in
//! `report` for the copy (tens of milliseconds, more with hashing). Instead the snapshot hard-links each file
//! (the scratch directory and the snapshot share one file system) and
//! records its inode here as *lent*. A hard link alone would break R8: a
//! guest that opens a file to write it in place would change the host's
//! copy too. So every `open-at` a guest makes for writing asks
//! [`Lent::before_write`] first, which gives the guest a fresh copy under
//! the same name (copy, then rename over it) while the snapshot still holds
//! the original. Files a guest already holds open for writing when it
//! reports cannot be protected that way and are copied at once.

use std::collections::HashSet;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cap_std::fs::{Dir, Metadata, MetadataExt, OpenOptions};

/// A file's identity on this machine: device and inode number.
pub(crate) type Inode = (u64, u64);

/// The identity of the file `meta` describes.
fn inode(meta: &Metadata) -> Inode {
    (meta.dev(), meta.ino())
}

/// The inodes of guest files that a snapshot also links to. Shared by the
/// ranks of one host (inodes are the machine's, not a rank's).
#[derive(Debug, Default)]
pub(crate) struct Lent {
    inodes: Mutex<HashSet<Inode>>,
    /// Whether `inodes` may be non-empty: the check every guest `open-at`
    /// makes for writing costs one load while nothing is lent.
    any: AtomicBool,
}

impl Lent {
    /// `inode` is now linked from a snapshot as well as from a guest's
    /// directory.
    pub fn record(&self, inode: Inode) {
        let mut inodes = self.inodes.lock().unwrap_or_else(|e| e.into_inner());
        inodes.insert(inode);
        self.any.store(true, Ordering::Release);
    }

    /// The files of one snapshot are no longer linked from it (it was
    /// persisted and removed): the guests' writes no longer concern them.
    fn release(&self, released: &[Inode]) {
        let mut inodes = self.inodes.lock().unwrap_or_else(|e| e.into_inner());
        for id in released {
            inodes.remove(id);
        }
        self.any.store(!inodes.is_empty(), Ordering::Release);
    }

    /// Whether anything may be lent: when not, a write cannot concern a
    /// snapshot (one atomic load).
    pub fn maybe_any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// Make sure that opening `path` below `dir` for writing cannot change
    /// a lent file: if `path` (followed through symbolic links when
    /// `follow`) is a file still linked from a snapshot, replace it in the
    /// guest's directory by a copy of itself, emptied when the open is to
    /// truncate it anyway. A path that does not exist or is no lent file is
    /// left alone; the open that follows reports any error of its own.
    pub fn before_write(
        &self,
        dir: &Dir,
        path: &str,
        follow: bool,
        truncate: bool,
    ) -> io::Result<()> {
        if !self.maybe_any() {
            return Ok(());
        }
        let meta = match if follow {
            dir.metadata(path)
        } else {
            dir.symlink_metadata(path)
        } {
            Ok(meta) if meta.is_file() => meta,
            _ => return Ok(()),
        };
        let lent = {
            let inodes = self.inodes.lock().unwrap_or_else(|e| e.into_inner());
            inodes.contains(&inode(&meta))
        };
        if !lent {
            return Ok(());
        }
        // The name the file has in the guest's directory, symbolic links
        // resolved (inside the sandbox: `dir` is its handle).
        let named = if follow {
            dir.canonicalize(path)?
        } else {
            path.into()
        };
        let fresh = named.with_file_name(format!(
            ".trainhost-copy-{}",
            named
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        if truncate {
            // Its bytes are about to go: an empty file with its permissions.
            let file = dir.open_with(&fresh, OpenOptions::new().write(true).create_new(true))?;
            file.set_permissions(meta.permissions())?;
        } else {
            dir.copy(&named, dir, &fresh)?;
        }
        if let Err(e) = dir.rename(&fresh, dir, &named) {
            let _ = dir.remove_file(&fresh);
            return Err(e);
        }
        // The inode stays recorded: the guest may hold another link to it.
        Ok(())
    }
}

/// The files one snapshot holds lent, released when dropped: after the
/// snapshot's directory is removed. Keeps the record of lent files as
/// small as the snapshots in flight (one checkpoint at a time), whatever
/// the guest does with its files.
#[derive(Debug)]
pub(crate) struct LentFiles {
    lent: Arc<Lent>,
    inodes: Vec<Inode>,
}

impl LentFiles {
    pub fn new(lent: Arc<Lent>) -> Self {
        Self {
            lent,
            inodes: Vec::new(),
        }
    }

    /// `inode` is now linked from this snapshot too.
    pub fn add(&mut self, inode: Inode) {
        self.lent.record(inode);
        self.inodes.push(inode);
    }
}

impl Drop for LentFiles {
    fn drop(&mut self) {
        self.lent.release(&self.inodes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &std::path::Path) -> Dir {
        Dir::open_ambient_dir(path, cap_std::ambient_authority()).unwrap()
    }

    /// A file lent to a snapshot keeps its bytes whatever the guest does
    /// to its own name afterwards; a file not lent is never touched.
    #[test]
    fn a_write_to_a_lent_file_goes_to_a_fresh_copy() {
        let tmp = tempfile::tempdir().unwrap();
        let (guest, host) = (tmp.path().join("guest"), tmp.path().join("host"));
        std::fs::create_dir_all(guest.join("sub")).unwrap();
        std::fs::create_dir_all(&host).unwrap();
        for name in ["a", "b", "sub/c"] {
            std::fs::write(guest.join(name), format!("old {name}")).unwrap();
        }
        std::fs::write(guest.join("other"), "mine").unwrap();
        std::os::unix::fs::symlink("sub/c", guest.join("link")).unwrap();
        let (g, h) = (open(&guest), open(&host));
        h.create_dir_all("sub").unwrap();
        let lent = Lent::default();
        for name in ["a", "b", "sub/c"] {
            g.hard_link(name, &h, name).unwrap();
            lent.record(inode(&g.metadata(name).unwrap()));
        }
        let before = inode(&g.metadata("other").unwrap());

        lent.before_write(&g, "a", true, false).unwrap();
        lent.before_write(&g, "b", true, true).unwrap();
        lent.before_write(&g, "link", true, false).unwrap();
        lent.before_write(&g, "other", true, false).unwrap();
        lent.before_write(&g, "missing", true, true).unwrap();

        // The guest's names now point at copies: writing them in place
        // leaves the host's links alone.
        std::fs::OpenOptions::new()
            .write(true)
            .open(guest.join("a"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"NEW"))
            .unwrap();
        assert_eq!(std::fs::read(guest.join("a")).unwrap(), b"NEW a");
        assert_eq!(std::fs::read(guest.join("b")).unwrap(), b"", "emptied");
        for name in ["a", "b", "sub/c"] {
            assert_eq!(
                std::fs::read_to_string(host.join(name)).unwrap(),
                format!("old {name}")
            );
        }
        assert_eq!(
            std::fs::read_to_string(guest.join("sub/c")).unwrap(),
            "old sub/c"
        );
        assert!(
            std::fs::symlink_metadata(guest.join("link"))
                .unwrap()
                .is_symlink(),
            "the link itself stays a link to the copy"
        );
        assert_ne!(
            inode(&g.metadata("sub/c").unwrap()),
            inode(&h.metadata("sub/c").unwrap())
        );
        assert_eq!(
            inode(&g.metadata("other").unwrap()),
            before,
            "not lent: untouched"
        );
        let names: Vec<_> = std::fs::read_dir(&guest)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(".trainhost"))
            .collect();
        assert!(names.is_empty(), "no temporary file left: {names:?}");
    }

    /// A snapshot's files stop being lent when it is dropped.
    #[test]
    fn a_dropped_snapshot_releases_its_files() {
        let lent = Arc::new(Lent::default());
        let mut files = LentFiles::new(Arc::clone(&lent));
        files.add((1, 2));
        files.add((1, 3));
        assert!(lent.maybe_any());
        drop(files);
        assert!(!lent.maybe_any());
        assert!(lent.inodes.lock().unwrap().is_empty());
    }
}
