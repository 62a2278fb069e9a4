//! Sending a planned checkpoint's files to storage: each file once,
//! hashed on the way, several at a time, or not at all when the previous
//! checkpoint holds the same bytes (incremental upload).

use std::collections::HashMap;
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};

use super::plan::{Plan, PlannedFile};
use crate::error::Error;
use crate::record::FileEntry;
use crate::storage::{Meter, Storage};

/// How many files are uploaded at once to an object store. Each holds up
/// to a few multipart parts in memory.
const CONCURRENT_FILES: usize = 8;
/// How many files are written at once to local storage. Each holds a
/// 1 MiB buffer at most, and most of its time waits for its `fdatasync`:
/// with more files in flight, one file's flush overlaps the others'
/// writes (64 MiB of files flushed 1.4 to 1.8 times slower than `cp -r` +
/// `sync` with 8 at a time, 1.0 to 1.4 times with 32). But files created
/// at once in one directory queue on its lock: with 32 threads on 2 cores
/// a profile of a run showed them spinning on it. 16 is between the two.
const CONCURRENT_LOCAL_FILES: usize = 16;
/// The smallest unchanged file an object store is asked to copy instead
/// of being sent again. A copy takes two requests, the copy and the size
/// check after it, where a small file goes in one; below about a megabyte
/// a request's round trip costs more than sending the bytes. On moto,
/// persisting an unchanged 64 MiB checkpoint of 512 files of 128 KiB and 4
/// of 8 MiB took 2.3 times as long as a new one when every file was
/// copied, 1.2 times when every file was sent again, and 1.0 times with
/// this bound. (A hard link on local storage is always cheaper than a
/// write and its flush.)
pub(crate) const COPY_AT_LEAST: u64 = 1 << 20;

/// The checkpoint committed before this one, whose files a new checkpoint
/// may share instead of sending them again.
#[derive(Debug)]
pub(crate) struct Previous {
    pub storage: Storage,
    pub files: Vec<FileEntry>,
}

/// What one persist did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PersistStats {
    /// Files and bytes sent to storage.
    pub uploaded: (usize, u64),
    /// Files and bytes copied from the previous checkpoint in storage.
    pub reused: (usize, u64),
}

/// Persist every file of `plan` below `dest`. A file whose size and
/// SHA-256 equal a file of `previous` is copied there inside the store
/// (a hard link on local storage; server-side on an object store, for
/// files of [`COPY_AT_LEAST`] bytes or more) instead of uploaded. Returns
/// the manifest entries, sorted by path.
pub(crate) async fn persist(
    dest: &Storage,
    plan: &Plan,
    previous: Option<Arc<Previous>>,
) -> Result<(Vec<FileEntry>, PersistStats), Error> {
    // Only files whose size matches one in the previous checkpoint that
    // may be copied are hashed up front; every other file is hashed while
    // it is uploaded.
    let least = if dest.local_path().is_some() {
        0
    } else {
        COPY_AT_LEAST
    };
    let mut by_size: HashMap<u64, Vec<FileEntry>> = HashMap::new();
    if let Some(previous) = &previous {
        for entry in previous.files.iter().filter(|e| e.size >= least) {
            by_size.entry(entry.size).or_default().push(entry.clone());
        }
    }
    let by_size = Arc::new(by_size);
    let meter = dest.meter(
        plan.total_bytes(),
        format!("↑ {}", dest.url().rsplit('/').next().unwrap_or_default()),
    );
    // Each file's future owns what it uses, so the whole persist can run
    // as a spawned task.
    let uploads: Vec<_> = plan
        .files
        .iter()
        .map(|file| {
            persist_file(
                dest.clone(),
                file.clone(),
                previous.clone(),
                Arc::clone(&by_size),
                meter.clone(),
            )
        })
        .collect();
    let done: Vec<(FileEntry, bool)> = futures::stream::iter(uploads)
        .buffer_unordered(if dest.local_path().is_some() {
            CONCURRENT_LOCAL_FILES
        } else {
            CONCURRENT_FILES
        })
        .try_collect()
        .await?;
    meter.finish();
    let mut stats = PersistStats::default();
    let mut entries = Vec::with_capacity(done.len());
    for (entry, reused) in done {
        let slot = if reused {
            &mut stats.reused
        } else {
            &mut stats.uploaded
        };
        slot.0 += 1;
        slot.1 += entry.size;
        entries.push(entry);
    }
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok((entries, stats))
}

/// Persist one file; `true` with the entry if it was copied from
/// `previous` rather than uploaded.
async fn persist_file(
    dest: Storage,
    file: PlannedFile,
    previous: Option<Arc<Previous>>,
    by_size: Arc<HashMap<u64, Vec<FileEntry>>>,
    meter: Meter,
) -> Result<(FileEntry, bool), Error> {
    let entry = |sha256| FileEntry {
        path: file.path.clone(),
        size: file.size,
        sha256,
        ranks: file.ranks.clone(),
    };
    // Set when the file was hashed to look for it in `previous`, so that
    // the upload does not hash it again.
    let mut known = None;
    if let (Some(previous), Some(candidates)) = (&previous, by_size.get(&file.size)) {
        let hashed = dest
            .hash_for_upload(Arc::clone(&file.source), file.path.clone(), file.size)
            .await?;
        if let Some(same) = candidates.iter().find(|c| c.sha256 == hashed.sha256) {
            dest.copy_from(&previous.storage, &same.path, &file.path)
                .await?;
            // Trust, but check: a store that answers a copy request
            // without copying (some emulators) would otherwise commit an
            // empty file. The upload below replaces it.
            let copied = dest.size(&file.path).await?;
            if copied == file.size {
                meter.inc(file.size);
                return Ok((entry(hashed.sha256), true));
            }
            tracing::warn!(
                store = %dest.url(),
                "the store's copy of {} holds {copied} bytes instead of {}; uploading it instead (server-side copies look unsupported)",
                file.path,
                file.size
            );
        }
        known = Some(hashed);
    }
    let handle = file
        .source
        .open(&file.path)
        .map_err(|source| Error::Io {
            path: file.path.clone().into(),
            operation: "open a checkpoint file",
            source,
        })?
        .into_std();
    let sha256 = dest
        .upload_file(&file.path, handle, file.size, known, &meter)
        .await?;
    Ok((entry(sha256), false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Location, StorageOptions};
    use crate::persist::{capture, merge};

    /// Persist the files of `dir` below `dest`, sharing with `previous`.
    fn persist_dir(
        rt: &tokio::runtime::Runtime,
        dest: &Storage,
        dir: &std::path::Path,
        previous: Option<Arc<Previous>>,
    ) -> (Vec<FileEntry>, PersistStats) {
        let handle = cap_std::fs::Dir::open_ambient_dir(dir, cap_std::ambient_authority()).unwrap();
        let plan = merge(vec![capture(0, handle, "ck").unwrap()]).unwrap();
        rt.block_on(persist(dest, &plan, previous)).unwrap()
    }

    /// An unchanged file is copied inside an object store only from
    /// [`COPY_AT_LEAST`] bytes up, and sent again below; local storage
    /// links every unchanged file. Both keep every byte.
    #[test]
    fn unchanged_files_are_copied_by_size_on_object_stores_and_always_linked_locally() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let work = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..COPY_AT_LEAST).map(|i| (i % 251) as u8).collect();
        std::fs::write(work.path().join("big"), &big).unwrap();
        std::fs::write(work.path().join("small"), b"small").unwrap();
        let local = tempfile::tempdir().unwrap();
        let stores = [
            (Location::Memory("m".into()), (1, 5), (1, COPY_AT_LEAST)),
            (
                Location::Local(local.path().to_owned()),
                (0, 0),
                (2, COPY_AT_LEAST + 5),
            ),
        ];
        for (location, uploaded, reused) in stores {
            let root = Storage::open(&location, &StorageOptions::default()).unwrap();
            let (first, _) = persist_dir(&rt, &root.child("a"), work.path(), None);
            let previous = Arc::new(Previous {
                storage: root.child("a"),
                files: first.clone(),
            });
            let dest = root.child("b");
            let (second, stats) = persist_dir(&rt, &dest, work.path(), Some(previous));
            assert_eq!(second, first, "{location:?}");
            assert_eq!(stats.uploaded, uploaded, "{location:?}");
            assert_eq!(stats.reused, reused, "{location:?}");
            let kept = rt.block_on(dest.get("big")).unwrap().unwrap();
            assert_eq!(&kept[..], &big[..], "{location:?}");
            let kept = rt.block_on(dest.get("small")).unwrap().unwrap();
            assert_eq!(&kept[..], b"small", "{location:?}");
        }
    }
}
