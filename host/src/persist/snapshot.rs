//! Taking a plan's files out of the guests' reach when the upload goes on
//! in the background (R8, R51): a snapshot directory on the guests' file
//! system, into which each file is hard-linked (lent, see `lend`) after
//! `report` has returned, or copied when it cannot be.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cap_std::fs::Dir;

use super::capture::HandedOver;
use super::lend::{Inode, Lent, LentDir, Linking};
use super::plan::{Plan, PlannedFile};
use crate::error::Error;

/// Where the background mode's snapshots go, and the record of the guest
/// files they hold lent.
#[derive(Debug, Clone)]
pub(crate) struct Snapshots {
    /// A host directory on the file system of the ranks' scratch
    /// directories (links cannot cross file systems).
    pub root: PathBuf,
    pub lent: Arc<Lent>,
}

/// Start taking the plan's files below `staging` (a host directory that
/// must not exist yet, on the guests' file system), so the guests may
/// change their directories as soon as `report` returns (R8). What is
/// left runs in [`Snapshot::link`], after `report` has returned.
///
/// Each file is hard-linked and lent (see `lend`): no bytes are copied
/// while the guest waits, and a guest that later opens the file to write
/// gets a copy of its own. A file its rank holds open for writing, or one
/// that cannot be linked, is copied: `std::io::copy` between files uses
/// `copy_file_range`, a reflink on filesystems that share extents (XFS,
/// Btrfs) and an in-kernel copy elsewhere. Files of a rank that holds
/// any file open for writing are taken here, while its guest waits: it can
/// write through those handles as soon as `report` returns, which no
/// fence sees.
pub(crate) fn snapshot(plan: Plan, staging: &Path, lent: &Arc<Lent>) -> Result<Snapshot, Error> {
    std::fs::create_dir_all(staging)
        .map_err(|e| io_err(staging, "create the checkpoint snapshot directory", e))?;
    // Owned from here: removed again if anything below fails.
    let dir = LentDir::new(staging.to_path_buf(), Arc::clone(lent));
    let root = Arc::new(
        Dir::open_ambient_dir(staging, cap_std::ambient_authority())
            .map_err(|e| io_err(staging, "open the checkpoint snapshot directory", e))?,
    );
    let mut taker = Taker {
        staging: dir,
        root,
        parents: Parents::default(),
    };
    let mut taken = Vec::with_capacity(plan.files.len());
    let mut later = Vec::new();
    for file in plan.files {
        if file.host_owned {
            // Handed over: no guest can change it, nothing to copy.
            taken.push(file);
        } else if file.open_for_writing.is_empty() {
            later.push(file);
        } else {
            taken.push(taker.take(file)?);
        }
    }
    Ok(Snapshot {
        taker,
        taken,
        later,
        ranks: plan.ranks,
        handed_over: plan.handed_over,
        _linking: lent.begin_linking(),
    })
}

/// A plan whose snapshot is under way: the files left to link, which the
/// guests cannot change meanwhile (they wait at `Lent::settled`).
pub(crate) struct Snapshot {
    taker: Taker,
    taken: Vec<PlannedFile>,
    later: Vec<PlannedFile>,
    ranks: Vec<u32>,
    handed_over: Vec<HandedOver>,
    _linking: Linking,
}

impl Snapshot {
    /// Link (or copy) the files left and return the plan pointing at the
    /// snapshot, which owns its directory from then on. Blocks: a system
    /// call or two per file. Dropping the snapshot before it is done, or
    /// an error, removes the directory.
    pub fn link(self) -> Result<Plan, Error> {
        let Self {
            mut taker,
            mut taken,
            later,
            ranks,
            handed_over,
            _linking,
        } = self;
        for file in later {
            taken.push(taker.take(file)?);
        }
        taken.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(Plan {
            files: taken,
            ranks,
            handed_over,
            _snapshot: Some(taker.staging),
        })
    }
}

fn io_err(path: &Path, operation: &'static str, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        operation,
        source,
    }
}

/// What takes files into one snapshot.
struct Taker {
    staging: LentDir,
    root: Arc<Dir>,
    parents: Parents,
}

impl Taker {
    /// Link `file` into the snapshot (or copy it) and point it there.
    fn take(&mut self, file: PlannedFile) -> Result<PlannedFile, Error> {
        let target = self.staging.path().join(&file.path);
        let (parent, name) = file.path.rsplit_once('/').unwrap_or(("", &file.path));
        let (from, to) = self
            .parents
            .get(&file.source, &self.root, parent)
            .map_err(|e| io_err(&target, "open a checkpoint directory", e))?;
        let changed = |size| {
            io_err(
                Path::new(&file.path),
                "snapshot a checkpoint file",
                std::io::Error::other(format!(
                    "it holds {size} bytes, {} when listed: it changed after report listed it",
                    file.size
                )),
            )
        };
        // By name in its directory, never following a link: the capture
        // refused links, and the guests' calls that could change names or
        // bytes wait until the snapshot is done.
        let stat = rustix::fs::statat(from, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_err(Path::new(&file.path), "inspect a checkpoint file", e.into()))?;
        if stat.st_size as u64 != file.size {
            return Err(changed(stat.st_size as u64));
        }
        let id: Inode = (stat.st_dev, stat.st_ino);
        let linked = !file.open_for_writing.contains(&id)
            && rustix::fs::linkat(from, name, to, name, rustix::fs::AtFlags::empty()).is_ok();
        if linked {
            self.staging.add(id);
        } else {
            let mut source = from
                .open(name)
                .map_err(|e| io_err(Path::new(&file.path), "open a checkpoint file", e))?
                .into_std();
            let mut copy = to
                .create(name)
                .map_err(|e| io_err(&target, "create a snapshot file", e))?
                .into_std();
            let copied = std::io::copy(&mut source, &mut copy)
                .map_err(|e| io_err(&target, "copy a checkpoint file into the snapshot", e))?;
            if copied != file.size {
                return Err(changed(copied));
            }
        }
        Ok(PlannedFile {
            source: Arc::clone(&self.root),
            host_owned: true,
            ..file
        })
    }
}

/// The directories a snapshot links between, each opened once: a rank's
/// directory holding files and its counterpart in the snapshot. Linking by
/// name inside opened directories costs two system calls a file, where
/// resolving each path from the top (as `cap_std` does, safely, for any
/// path) costs several per path component.
#[derive(Default)]
struct Parents {
    /// By source directory (its address) and parent path.
    opened: std::collections::HashMap<(usize, String), (Dir, Dir)>,
}

impl Parents {
    fn get(
        &mut self,
        source: &Arc<Dir>,
        root: &Dir,
        parent: &str,
    ) -> std::io::Result<(&Dir, &Dir)> {
        let key = (Arc::as_ptr(source) as usize, parent.to_owned());
        if !self.opened.contains_key(&key) {
            let opened = if parent.is_empty() {
                (source.try_clone()?, root.try_clone()?)
            } else {
                root.create_dir_all(parent)?;
                (source.open_dir(parent)?, root.open_dir(parent)?)
            };
            self.opened.insert(key.clone(), opened);
        }
        let (from, to) = &self.opened[&key];
        Ok((from, to))
    }
}
