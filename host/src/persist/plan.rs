//! Planning the files of one report: the ranks' captures merged into one
//! file list (R7), collisions refused, and a snapshot of the plan when the
//! upload continues in the background (R8).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use cap_std::fs::Dir;

use super::capture::{Capture, HandedOver};
use super::lend::{Inode, LentDir};
use crate::error::Error;
use crate::storage::sha256_of;

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
    /// The snapshot the files are in, if any: removed with the plan,
    /// which releases the guest files it links to.
    pub _snapshot: Option<LentDir>,
}

impl Plan {
    /// No files: a node whose ranks reported none while others did.
    pub fn empty() -> Self {
        Self {
            files: Vec::new(),
            ranks: Vec::new(),
            handed_over: Vec::new(),
            _snapshot: None,
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
        _snapshot: None,
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
