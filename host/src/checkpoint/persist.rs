//! Persisting the files of one report: merging the ranks' captures into one
//! file list, refusing collisions, and streaming each file to storage once.

use std::collections::BTreeMap;
use std::io::Read;

use futures::{StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};

use super::capture::Capture;
use super::manifest::FileEntry;
use crate::Error;
use crate::storage::Storage;

/// How many files are uploaded at once.
const CONCURRENT_FILES: usize = 8;

/// Why a report's files could not be persisted.
#[derive(Debug)]
pub(crate) enum PersistError {
    /// Ranks disagree about a file's bytes: the guest's mistake, reported to
    /// every rank; nothing was written.
    Collision(String),
    /// Storage or local I/O failed: the run's failure.
    Failed(Error),
}

/// One file to upload: which capture holds it, and every rank that has it.
struct Planned<'a> {
    path: &'a str,
    size: u64,
    source: &'a Capture,
    ranks: Vec<u32>,
}

/// Merge the captures (R7), then upload every file below `dest`. Returns
/// the manifest entries, sorted by path.
pub(crate) async fn persist(
    dest: &Storage,
    captures: &[Capture],
) -> Result<Vec<FileEntry>, PersistError> {
    let plan = merge(captures)?;
    let total = plan.iter().map(|p| p.size).sum();
    let meter = dest.meter(
        total,
        format!("↑ {}", dest.url().rsplit('/').next().unwrap_or_default()),
    );
    let meter = &meter;
    let uploads = plan.into_iter().map(|p| async move {
        let file = p
            .source
            .dir
            .open(p.path)
            .map_err(|source| Error::Io {
                path: p.path.into(),
                operation: "open a checkpoint file",
                source,
            })?
            .into_std();
        let sha256 = dest
            .upload_file(p.path, tokio::fs::File::from_std(file), p.size, meter)
            .await?;
        Ok::<_, Error>(FileEntry {
            path: p.path.to_owned(),
            size: p.size,
            sha256,
            ranks: p.ranks,
        })
    });
    let mut entries: Vec<FileEntry> = futures::stream::iter(uploads)
        .buffer_unordered(CONCURRENT_FILES)
        .try_collect()
        .await
        .map_err(PersistError::Failed)?;
    meter.finish();
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(entries)
}

/// The union of all ranks' files. A path reported by several ranks must
/// have the same bytes everywhere (compared by size, then SHA-256 of each
/// copy); only the first copy is uploaded.
fn merge(captures: &[Capture]) -> Result<Vec<Planned<'_>>, PersistError> {
    let mut by_path: BTreeMap<&str, Vec<(&Capture, u64)>> = BTreeMap::new();
    for c in captures {
        for (path, size) in &c.files {
            by_path.entry(path).or_default().push((c, *size));
        }
    }
    let mut plan = Vec::with_capacity(by_path.len());
    for (path, copies) in by_path {
        let (first, size) = copies[0];
        if copies.len() > 1 {
            check_identical(path, &copies)?;
        }
        plan.push(Planned {
            path,
            size,
            source: first,
            ranks: copies.iter().map(|(c, _)| c.rank).collect(),
        });
    }
    Ok(plan)
}

fn check_identical(path: &str, copies: &[(&Capture, u64)]) -> Result<(), PersistError> {
    let describe = |groups: Vec<(String, Vec<u32>)>| {
        let parts: Vec<String> = groups
            .into_iter()
            .map(|(what, ranks)| format!("ranks {ranks:?} wrote {what}"))
            .collect();
        PersistError::Collision(format!(
            "file {path:?} differs between ranks: {}; give each rank's file its own name (e.g. with the rank in it) or write identical bytes",
            parts.join(", ")
        ))
    };
    let sizes = group(copies.iter().map(|(c, s)| (format!("{s} bytes"), c.rank)));
    if sizes.len() > 1 {
        return Err(describe(sizes));
    }
    let mut digests = Vec::with_capacity(copies.len());
    for (c, _) in copies {
        let digest = sha256_of(&c.dir, path).map_err(PersistError::Failed)?;
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

fn sha256_of(dir: &cap_std::fs::Dir, path: &str) -> Result<String, Error> {
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
