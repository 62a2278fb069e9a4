//! Planning the files of one report: the ranks' captures merged into one
//! file list (R7), collisions refused, and a snapshot of the plan when the
//! upload continues in the background (R8).

use std::collections::{BTreeMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cap_std::fs::Dir;
use sha2::{Digest, Sha256};

use super::capture::{Capture, HandedOver};
use super::lend::{Inode, Lent, LentFiles};
use crate::error::Error;

/// Why a report's files could not be planned.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PlanError {
    /// Ranks disagree about a file's bytes: the guest's mistake, reported to
    /// every rank; nothing was written.
    #[error(transparent)]
    Collision(Collision),
    /// Local I/O failed: the run's failure.
    #[error(transparent)]
    Failed(Error),
}

/// Ranks wrote different bytes under one path (R7).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "file {path:?} differs between ranks: {}; give each rank's file its own name (e.g. with the rank in it) or write identical bytes",
    describe(.groups)
)]
pub(crate) struct Collision {
    path: String,
    /// What each group of ranks wrote ("8 bytes", "sha256 ..."), in the
    /// order first seen.
    groups: Vec<(String, Vec<u32>)>,
}

impl Collision {
    /// The collision among copies of `path`, described by what each
    /// holds ("8 bytes", "sha256 ...") with the ranks that hold it, if
    /// they do not all hold the same: for copies on several nodes, which
    /// only the node that gathers them can compare.
    pub fn among(path: &str, copies: impl Iterator<Item = (String, Vec<u32>)>) -> Option<Self> {
        let mut groups: Vec<(String, Vec<u32>)> = Vec::new();
        for (what, ranks) in copies {
            match groups.iter_mut().find(|(w, _)| *w == what) {
                Some((_, all)) => all.extend(ranks),
                None => groups.push((what, ranks)),
            }
        }
        (groups.len() > 1).then(|| Self {
            path: path.to_owned(),
            groups,
        })
    }
}

fn describe(groups: &[(String, Vec<u32>)]) -> String {
    groups
        .iter()
        .map(|(what, ranks)| format!("ranks {ranks:?} wrote {what}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One file of a checkpoint to persist: where its bytes are now, and every
/// rank that reported it.
#[derive(Debug, Clone)]
pub(crate) struct PlannedFile {
    pub path: String,
    pub size: u64,
    /// The directory holding `path`: a rank's checkpoint directory, a
    /// directory it handed over, or a snapshot.
    pub source: Arc<Dir>,
    /// Whether `source` is the host's (handed over or a snapshot): no guest
    /// can change it any more.
    pub host_owned: bool,
    pub ranks: Vec<u32>,
    /// The files `source`'s rank holds open for writing.
    pub open_for_writing: Arc<HashSet<Inode>>,
}

/// The files of one checkpoint, sorted by path, and the ranks that
/// contributed.
#[derive(Debug)]
pub(crate) struct Plan {
    pub files: Vec<PlannedFile>,
    pub ranks: Vec<u32>,
    /// The directories ranks handed over, removed with the plan.
    pub handed_over: Vec<HandedOver>,
    /// The guest files a snapshot of the plan links to, lent until the
    /// plan is dropped (after the snapshot's directory is removed).
    pub _lent: Option<LentFiles>,
}

impl Plan {
    /// No files: a node whose ranks reported none while others did.
    pub fn empty() -> Self {
        Self {
            files: Vec::new(),
            ranks: Vec::new(),
            handed_over: Vec::new(),
            _lent: None,
        }
    }

    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// The union of all ranks' files (R7). A path reported by several ranks
/// must have the same bytes everywhere (compared by size, then SHA-256 of
/// each copy); only the first copy is persisted.
pub(crate) fn merge(captures: Vec<Capture>) -> Result<Plan, PlanError> {
    let mut handed_over = Vec::new();
    let captures: Vec<Shared> = captures
        .into_iter()
        .map(|c| {
            let host_owned = c.handed_over.is_some();
            handed_over.extend(c.handed_over);
            Shared {
                rank: c.rank,
                dir: Arc::new(c.dir),
                files: c.files,
                host_owned,
                open_for_writing: Arc::new(c.open_for_writing),
            }
        })
        .collect();
    let mut by_path: BTreeMap<&str, Vec<Copy<'_>>> = BTreeMap::new();
    for c in &captures {
        for (path, size) in &c.files {
            by_path.entry(path).or_default().push(Copy {
                rank: c.rank,
                dir: &c.dir,
                size: *size,
                host_owned: c.host_owned,
                open_for_writing: &c.open_for_writing,
            });
        }
    }
    let mut files = Vec::with_capacity(by_path.len());
    for (path, copies) in by_path {
        if copies.len() > 1 {
            check_identical(path, &copies)?;
        }
        files.push(PlannedFile {
            path: path.to_owned(),
            size: copies[0].size,
            source: Arc::clone(copies[0].dir),
            host_owned: copies[0].host_owned,
            ranks: copies.iter().map(|c| c.rank).collect(),
            open_for_writing: Arc::clone(copies[0].open_for_writing),
        });
    }
    let mut ranks: Vec<u32> = captures.iter().map(|c| c.rank).collect();
    ranks.sort_unstable();
    Ok(Plan {
        files,
        ranks,
        handed_over,
        _lent: None,
    })
}

/// A capture whose directory the plan's files can share.
struct Shared {
    rank: u32,
    dir: Arc<Dir>,
    files: Vec<(String, u64)>,
    host_owned: bool,
    open_for_writing: Arc<HashSet<Inode>>,
}

/// One rank's copy of a path.
struct Copy<'a> {
    rank: u32,
    dir: &'a Arc<Dir>,
    size: u64,
    host_owned: bool,
    open_for_writing: &'a Arc<HashSet<Inode>>,
}

fn check_identical(path: &str, copies: &[Copy<'_>]) -> Result<(), PlanError> {
    let describe = |groups| {
        PlanError::Collision(Collision {
            path: path.to_owned(),
            groups,
        })
    };
    let sizes = group(copies.iter().map(|c| (format!("{} bytes", c.size), c.rank)));
    if sizes.len() > 1 {
        return Err(describe(sizes));
    }
    let mut digests = Vec::with_capacity(copies.len());
    for c in copies {
        let digest = sha256_of(c.dir, path).map_err(PlanError::Failed)?;
        digests.push((format!("sha256 {}", &digest[..12]), c.rank));
    }
    let digests = group(digests.into_iter());
    if digests.len() > 1 {
        return Err(describe(digests));
    }
    Ok(())
}

/// Group ranks by a description of what they wrote, in first-seen order.
fn group(items: impl Iterator<Item = (String, u32)>) -> Vec<(String, Vec<u32>)> {
    let mut groups: Vec<(String, Vec<u32>)> = Vec::new();
    for (what, rank) in items {
        match groups.iter_mut().find(|(w, _)| *w == what) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((what, vec![rank])),
        }
    }
    groups
}

pub(crate) fn sha256_of(dir: &Dir, path: &str) -> Result<String, Error> {
    let io_err = |source| Error::Io {
        path: path.into(),
        operation: "read a checkpoint file",
        source,
    };
    let mut file = dir.open(path).map_err(io_err)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_err)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Where the background mode's snapshots go, and the record of the guest
/// files they hold lent.
#[derive(Debug, Clone)]
pub(crate) struct Snapshots {
    /// A host directory on the file system of the ranks' scratch
    /// directories (links cannot cross file systems).
    pub root: PathBuf,
    pub lent: Arc<Lent>,
}

/// Take the plan's files below `staging` (a host directory that must not
/// exist yet, on the guests' file system) and point the plan at them, so
/// the guests may change their directories as soon as `report` returns
/// (R8).
///
/// Each file is hard-linked and lent (see `lend`): no bytes are copied
/// while the guest waits, and a guest that later opens the file to write
/// gets a copy of its own. A file its rank holds open for writing, or one
/// that cannot be linked, is copied: `std::io::copy` between files uses
/// `copy_file_range`, a reflink on filesystems that share extents (XFS,
/// Btrfs) and an in-kernel copy elsewhere.
pub(crate) fn snapshot(plan: Plan, staging: &Path, lent: &Arc<Lent>) -> Result<Plan, Error> {
    let io_err = |path: &Path, operation, source| Error::Io {
        path: path.to_path_buf(),
        operation,
        source,
    };
    std::fs::create_dir_all(staging)
        .map_err(|e| io_err(staging, "create the checkpoint snapshot directory", e))?;
    let root = Arc::new(
        Dir::open_ambient_dir(staging, cap_std::ambient_authority())
            .map_err(|e| io_err(staging, "open the checkpoint snapshot directory", e))?,
    );
    let mut parents = Parents::default();
    let mut lent_files = LentFiles::new(Arc::clone(lent));
    let mut files = Vec::with_capacity(plan.files.len());
    for file in plan.files {
        if file.host_owned {
            // Handed over: no guest can change it, nothing to copy.
            files.push(file);
            continue;
        }
        let target = staging.join(&file.path);
        let (parent, name) = file.path.rsplit_once('/').unwrap_or(("", &file.path));
        let (from, to) = parents
            .get(&file.source, &root, parent)
            .map_err(|e| io_err(&target, "open a checkpoint directory", e))?;
        let changed = |size| {
            io_err(
                Path::new(&file.path),
                "snapshot a checkpoint file",
                std::io::Error::other(format!(
                    "it holds {size} bytes, {} when listed: the guest changed it during report",
                    file.size
                )),
            )
        };
        // By name in its directory, never following a link: the capture
        // refused links, and nothing the guests do runs meanwhile.
        let stat = rustix::fs::statat(from, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_err(Path::new(&file.path), "inspect a checkpoint file", e.into()))?;
        if stat.st_size as u64 != file.size {
            return Err(changed(stat.st_size as u64));
        }
        let id: Inode = (stat.st_dev, stat.st_ino);
        let linked = !file.open_for_writing.contains(&id)
            && rustix::fs::linkat(from, name, to, name, rustix::fs::AtFlags::empty()).is_ok();
        if linked {
            lent_files.add(id);
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
        files.push(PlannedFile {
            source: Arc::clone(&root),
            host_owned: true,
            ..file
        });
    }
    Ok(Plan {
        files,
        ranks: plan.ranks,
        handed_over: plan.handed_over,
        _lent: Some(lent_files),
    })
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
