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
//!
//! The links themselves are made after `report` returns (a link costs
//! ~12 µs on ext4 here, and checkpoints of hundreds of files are common):
//! until they are, the snapshot is *linking*, and every guest call that
//! could change what it is about to link (opening a file to write it,
//! unlinking, renaming, removing a directory) waits at
//! [`Lent::settled`]. Reading goes on meanwhile.

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cap_std::fs::{Dir, Metadata, MetadataExt, OpenOptions};
use tokio::sync::Notify;

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
    /// Snapshots whose files are still being linked.
    linking: AtomicUsize,
    /// Told when the last of them is done.
    settled: Notify,
}

impl Lent {
    /// A snapshot starts linking the guests' files: until the returned
    /// guard drops, [`settled`](Self::settled) waits.
    pub fn begin_linking(self: &Arc<Self>) -> Linking {
        self.linking.fetch_add(1, Ordering::AcqRel);
        Linking(Arc::clone(self))
    }

    /// Resolves once no snapshot is linking the guests' files: what a
    /// guest call that could change a file or a name waits for first.
    /// Costs one load when nothing is linking.
    pub async fn settled(&self) {
        loop {
            // Created before the check, so a wake-up between the two is
            // not lost (`notify_waiters` reaches every `Notified` made).
            let notified = self.settled.notified();
            if self.linking.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }

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
        let (fresh, file) = create_fresh(dir, &named)?;
        let filled = (|| {
            if !truncate {
                // Its bytes are about to go when truncating: then an empty
                // file will do.
                let mut source = dir.open(&named)?.into_std();
                std::io::copy(&mut source, &mut file.into_std())?;
            }
            dir.set_permissions(&fresh, meta.permissions())?;
            dir.rename(&fresh, dir, &named)
        })();
        if let Err(e) = filled {
            let _ = dir.remove_file(&fresh);
            return Err(e);
        }
        // The inode stays recorded: the guest may hold another link to it.
        Ok(())
    }
}

/// Create a file of a name no other file has beside `named`, for a copy
/// of it: the guest's own files are never touched, whatever their names.
/// The name is short whatever the file's (which may be as long as the
/// file system allows).
fn create_fresh(dir: &Dir, named: &Path) -> io::Result<(PathBuf, cap_std::fs::File)> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let fresh = named.with_file_name(format!(".trainhost-copy-{n}"));
        match dir.open_with(&fresh, OpenOptions::new().write(true).create_new(true)) {
            Ok(file) => return Ok((fresh, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// A snapshot linking the guests' files; dropped when it is done (or
/// gave up), which lets the waiting guest calls go on.
#[derive(Debug)]
pub(crate) struct Linking(Arc<Lent>);

impl Drop for Linking {
    fn drop(&mut self) {
        if self.0.linking.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.settled.notify_waiters();
        }
    }
}

/// A snapshot's directory and the guest files it links to: removed when
/// dropped, and only then are those files released (they stay lent while
/// it may hold them). Keeps the record of lent files as small as the
/// snapshots in flight (one checkpoint at a time), whatever the guest does
/// with its files.
#[derive(Debug)]
pub(crate) struct LentDir {
    path: PathBuf,
    lent: Arc<Lent>,
    inodes: Vec<Inode>,
}

impl LentDir {
    /// `path` (created by the caller) holds links to guest files from now
    /// on; it is removed when this drops.
    pub fn new(path: PathBuf, lent: Arc<Lent>) -> Self {
        Self {
            path,
            lent,
            inodes: Vec::new(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `inode` is now linked from this directory too.
    pub fn add(&mut self, inode: Inode) {
        self.lent.record(inode);
        self.inodes.push(inode);
    }
}

impl Drop for LentDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %self.path.display(), "cannot remove a checkpoint snapshot: {e}");
        }
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

    /// The copy is made under a name no guest file has: files named like
    /// the host's temporary copies keep their bytes, and the copy keeps
    /// the file's permissions.
    #[test]
    fn a_guest_file_named_like_a_copy_is_never_touched() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let (guest, host) = (tmp.path().join("guest"), tmp.path().join("host"));
        std::fs::create_dir_all(&guest).unwrap();
        std::fs::create_dir_all(&host).unwrap();
        std::fs::write(guest.join("a"), "old a").unwrap();
        std::fs::set_permissions(guest.join("a"), std::fs::Permissions::from_mode(0o640)).unwrap();
        let mut lookalikes = vec![".trainhost-copy-a".to_owned()];
        lookalikes.extend((0..64).map(|n| format!(".trainhost-copy-{n}")));
        for name in &lookalikes {
            std::fs::write(guest.join(name), "the guest's").unwrap();
        }
        let (g, h) = (open(&guest), open(&host));
        g.hard_link("a", &h, "a").unwrap();
        let lent = Lent::default();
        lent.record(inode(&g.metadata("a").unwrap()));

        lent.before_write(&g, "a", true, false).unwrap();
        assert_eq!(std::fs::read_to_string(guest.join("a")).unwrap(), "old a");
        let mode = std::fs::metadata(guest.join("a"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o640);
        // Lent again (as by the next report), then truncated.
        g.remove_file("a").ok();
        std::fs::write(guest.join("a"), "old a").unwrap();
        lent.record(inode(&g.metadata("a").unwrap()));
        lent.before_write(&g, "a", true, true).unwrap();
        assert_eq!(std::fs::read_to_string(guest.join("a")).unwrap(), "");

        for name in &lookalikes {
            assert_eq!(
                std::fs::read_to_string(guest.join(name)).unwrap(),
                "the guest's",
                "{name}"
            );
        }
        let left = std::fs::read_dir(&guest).unwrap().count();
        assert_eq!(left, lookalikes.len() + 1, "no temporary file left");
        assert_eq!(std::fs::read_to_string(host.join("a")).unwrap(), "old a");
    }

    /// A file whose name is as long as the file system allows is copied
    /// like any other.
    #[test]
    fn a_file_with_the_longest_name_is_copied_on_write() {
        let tmp = tempfile::tempdir().unwrap();
        let (guest, host) = (tmp.path().join("guest"), tmp.path().join("host"));
        std::fs::create_dir_all(&guest).unwrap();
        std::fs::create_dir_all(&host).unwrap();
        let name = "n".repeat(255);
        std::fs::write(guest.join(&name), "old").unwrap();
        let (g, h) = (open(&guest), open(&host));
        g.hard_link(&name, &h, &name).unwrap();
        let lent = Lent::default();
        lent.record(inode(&g.metadata(&name).unwrap()));
        lent.before_write(&g, &name, true, false).unwrap();
        assert_ne!(
            inode(&g.metadata(&name).unwrap()),
            inode(&h.metadata(&name).unwrap())
        );
        assert_eq!(std::fs::read_to_string(guest.join(&name)).unwrap(), "old");
    }

    /// The guests' calls that could change a file wait while any snapshot
    /// is linking, and go on once the last one is done.
    #[tokio::test]
    async fn settled_waits_for_every_snapshot_still_linking() {
        use std::time::Duration;
        let lent = Arc::new(Lent::default());
        lent.settled().await;
        let (one, two) = (lent.begin_linking(), lent.begin_linking());
        let waiting = tokio::spawn({
            let lent = Arc::clone(&lent);
            async move { lent.settled().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(one);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "one snapshot is still linking");
        drop(two);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("settled once no snapshot is linking")
            .unwrap();
        lent.settled().await;
    }

    /// A snapshot's files stop being lent when it is dropped, after its
    /// directory is gone.
    #[test]
    fn a_dropped_snapshot_releases_its_files() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("snapshot");
        std::fs::create_dir_all(path.join("sub")).unwrap();
        let lent = Arc::new(Lent::default());
        let mut files = LentDir::new(path.clone(), Arc::clone(&lent));
        files.add((1, 2));
        files.add((1, 3));
        assert!(lent.maybe_any());
        drop(files);
        assert!(!path.exists());
        assert!(!lent.maybe_any());
        assert!(lent.inodes.lock().unwrap().is_empty());
    }
}
