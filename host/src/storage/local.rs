//! Writing a checkpoint file to local storage directly.
//!
//! Through `object_store`, a local upload costs several blocking-pool
//! round trips per file (opening, reading, staging, each multipart part)
//! and a rename, which dominate for checkpoints of many small files. Here
//! one blocking task creates the file, reads, hashes and writes it.
//!
//! Each file is made durable (`fdatasync`) by the task that wrote it, as
//! soon as it is written: with several files in flight, one file's flush
//! overlaps the others' writes, and only the checkpoint's own pages are
//! flushed. Within a file larger than one chunk, each chunk's write-back
//! is started as soon as it is written (`sync_file_range`), so that the
//! disk writes while the next chunk is read and hashed and the flush waits
//! only for the last one (a 4 MiB file's flush went from 2-3 ms to about
//! 1 ms). Flushing the whole file system once (`syncfs`) was as fast on
//! a quiet machine but wrote back every other process's dirty pages too,
//! and took as long as they did. The directories naming the files are
//! flushed once all are written ([`sync_directories`]).
//!
//! Flushing every file only once all are written (write-back started as
//! each was written), so that one journal commit carries every file's
//! block allocations, was faster on an idle disk (64 MiB as 1000 files:
//! 53-75 ms against 81-101 ms) but slower once the disk had been busy
//! for a while, as it is on a machine that checkpoints again and again.
//! Five alternating runs of the suite's `persist` rows there: 64 MiB as
//! 516 files took 270-533 ms flushed at the end, 176-421 ms with each
//! file's data waited for as it was written and the commits at the end,
//! 91-171 ms in this order; as 1000 files 757-834, 670-938 and 174-329
//! ms. Why was not settled: `cp -r` + `sync` slowed the same way
//! (271-481 ms for the 516 files in the same runs), and so did waiting
//! for each file's data, whose writes go out as a flush's do; what this
//! order does differently is a journal commit per file.
//!
//! The file is written in place, not staged and renamed: checkpoint files
//! are written into a checkpoint directory that nothing reads until its
//! manifest is committed, and a run cleans up uncommitted directories, so
//! a half-written file is never seen. A file that is already there (left
//! by an attempt that failed before committing) is unlinked first, never
//! written through: it may be a hard link to a file of a committed
//! checkpoint (incremental persists link unchanged files).

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};

use super::Meter;
use super::digest::{FileDigest, check_size};
use crate::error::Error;

/// Read buffer per file being written.
const CHUNK: usize = 1 << 20;

/// Copy `file` (`size` bytes, named `shown` in errors) to `target`, hashing
/// it unless `known_sha256` is given, and flush it to disk if `flush`.
/// Returns the SHA-256.
pub(super) fn write_file(
    mut file: File,
    shown: &str,
    target: &Path,
    size: u64,
    known_sha256: Option<String>,
    meter: &Meter,
    flush: bool,
) -> Result<String, Error> {
    let mut out = create(target)?;
    let mut hasher = FileDigest::new(known_sha256);
    let from = (&mut file, shown.into(), "read a checkpoint file");
    let to = (&mut out, target, "write a checkpoint file");
    let read = pump(from, to, &mut hasher, meter, size, flush)?;
    check_size(shown, size, read)?;
    // fdatasync reports the file's write-back errors, so a file that did
    // not reach the disk fails the commit.
    if flush {
        out.sync_data().map_err(|source| Error::Io {
            path: target.to_path_buf(),
            operation: "flush a checkpoint file to disk",
            source,
        })?;
    }
    Ok(hasher.finish())
}

/// Copy the stored file `source` (`relative` in storage) into `out` (`shown`
/// in errors), returning its size and SHA-256.
pub(super) fn copy_file(
    source: &Path,
    relative: &str,
    mut out: File,
    shown: &Path,
    meter: &Meter,
) -> Result<(u64, String), Error> {
    let mut file = File::open(source).map_err(|source| Error::Io {
        path: relative.into(),
        operation: "open a stored checkpoint file",
        source,
    })?;
    let mut hasher = FileDigest::new(None);
    let from = (&mut file, relative.into(), "read a stored checkpoint file");
    let to = (&mut out, shown, "write a restored checkpoint file");
    let size = pump(from, to, &mut hasher, meter, u64::MAX, false)?;
    Ok((size, hasher.finish()))
}

/// Hard-link the stored file `source` as `target` in `dir` (`shown` in
/// errors) and hash it by reading it back: a restored file without a copy
/// of its bytes. `None` when the file system will not link it there
/// (another file system, one without hard links, too many links): the
/// caller copies it instead.
pub(super) fn link_file(
    source: &Path,
    dir: &cap_std::fs::Dir,
    target: &str,
    shown: &Path,
    meter: &Meter,
) -> Result<Option<(u64, String)>, Error> {
    let io = |operation| {
        move |source| Error::Io {
            path: shown.to_path_buf(),
            operation,
            source,
        }
    };
    let (Some(parent), Some(name)) = (source.parent(), source.file_name()) else {
        return Ok(None);
    };
    let stored = cap_std::fs::Dir::open_ambient_dir(parent, cap_std::ambient_authority())
        .map_err(io("open a stored checkpoint file's directory"))?;
    match stored.hard_link(name, dir, target) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EXDEV | libc::EPERM | libc::EMLINK | libc::EOPNOTSUPP)
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(io("link a restored checkpoint file to the stored one")(e)),
    }
    let mut file = dir
        .open(target)
        .map_err(io("open a restored checkpoint file"))?
        .into_std();
    let mut hasher = FileDigest::new(None);
    let mut buf = vec![0u8; CHUNK];
    let mut size = 0u64;
    loop {
        let n = file
            .read(&mut buf)
            .map_err(io("read a restored checkpoint file"))?;
        if n == 0 {
            return Ok(Some((size, hasher.finish())));
        }
        hasher.update(&buf[..n]);
        size += n as u64;
        meter.inc(n as u64);
    }
}

/// One side of [`pump`]: the file, its name in errors, and what is done
/// to it, in words.
type End<'a, P> = (&'a mut File, P, &'static str);

/// Copy `from` into `to`, hashing on the way, until the end of `from` or
/// just past `limit` bytes. Returns the bytes read (more than `limit` when
/// the file grew past it, and then only `limit` or fewer are written).
fn pump(
    (from, from_name, reading): End<'_, std::path::PathBuf>,
    (to, to_name, writing): End<'_, &Path>,
    hasher: &mut FileDigest,
    meter: &Meter,
    limit: u64,
    write_back: bool,
) -> Result<u64, Error> {
    let mut buf = vec![0u8; usize::try_from(limit).unwrap_or(CHUNK).clamp(1, CHUNK)];
    let mut read = 0u64;
    loop {
        let n = from.read(&mut buf).map_err(|source| Error::Io {
            path: from_name.clone(),
            operation: reading,
            source,
        })?;
        if n == 0 {
            return Ok(read);
        }
        read += n as u64;
        if read > limit {
            return Ok(read);
        }
        hasher.update(&buf[..n]);
        to.write_all(&buf[..n]).map_err(|source| Error::Io {
            path: to_name.to_path_buf(),
            operation: writing,
            source,
        })?;
        meter.inc(n as u64);
        if write_back && read < limit {
            start_write_back(to, read - n as u64, n);
        }
    }
}

/// Start writing `len` bytes of `file` from `offset` back to disk, without
/// waiting for it: the flush that follows the last chunk then finds the
/// earlier ones written or on their way, and the disk works while the
/// next chunk is read and hashed.
#[cfg(target_os = "linux")]
fn start_write_back(file: &File, offset: u64, len: usize) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on a file descriptor `file` keeps open;
    // it touches no memory of this process.
    let _ = unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        )
    };
}

#[cfg(not(target_os = "linux"))]
fn start_write_back(_file: &File, _offset: u64, _len: usize) {}

/// Create `target` as a new file, creating missing directories and
/// unlinking a file left there.
fn create(target: &Path) -> Result<File, Error> {
    let io_err = |path: &Path, operation, source| Error::Io {
        path: path.to_path_buf(),
        operation,
        source,
    };
    // Each failure below fixes its cause, so three tries are enough.
    let mut last = None;
    for _ in 0..3 {
        match OpenOptions::new().write(true).create_new(true).open(target) {
            Ok(f) => return Ok(f),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                std::fs::remove_file(target)
                    .map_err(|e| io_err(target, "replace a stale checkpoint file", e))?;
                last = Some(e);
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let parent = target.parent().unwrap_or(target);
                std::fs::create_dir_all(parent)
                    .map_err(|e| io_err(parent, "create a checkpoint directory", e))?;
                last = Some(e);
            }
            Err(e) => return Err(io_err(target, "create a checkpoint file", e)),
        }
    }
    Err(io_err(
        target,
        "create a checkpoint file",
        last.expect("tried at least once"),
    ))
}

/// Flush the directory entries of a checkpoint's files (below `root`,
/// the checkpoint's directory) to disk: every directory from each file's
/// up to `root`, and `root`'s parent, which names it. The files' contents
/// were flushed already; files linked from the previous checkpoint were
/// flushed when it was committed. Directories that do not exist (a
/// checkpoint without files has none) are skipped.
pub(super) fn sync_directories(root: &Path, files: &[PathBuf]) -> Result<(), Error> {
    let mut dirs = std::collections::BTreeSet::new();
    if let Some(parent) = root.parent() {
        dirs.insert(parent.to_path_buf());
    }
    dirs.insert(root.to_path_buf());
    for file in files {
        let mut dir = file.parent();
        while let Some(d) = dir.filter(|d| d.starts_with(root)) {
            if !dirs.insert(d.to_path_buf()) {
                break;
            }
            dir = d.parent();
        }
    }
    for dir in dirs {
        let handle = match File::open(&dir) {
            Ok(handle) => handle,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(Error::Io {
                    path: dir,
                    operation: "open a checkpoint directory to flush it",
                    source,
                });
            }
        };
        handle.sync_all().map_err(|source| Error::Io {
            path: dir.clone(),
            operation: "flush a checkpoint directory to disk",
            source,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(dir: &Path, bytes: &[u8]) -> File {
        let path = dir.join("source");
        std::fs::write(&path, bytes).unwrap();
        File::open(path).unwrap()
    }

    #[test]
    fn writes_and_hashes_creating_directories() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("a/b/weights.bin");
        let sha = write_file(
            source(dir.path(), b"abc"),
            "weights.bin",
            &target,
            3,
            None,
            &Meter::default(),
            true,
        )
        .unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"abc");
        assert_eq!(
            sha,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_stale_hard_link_is_replaced_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let committed = dir.path().join("committed");
        std::fs::write(&committed, b"old").unwrap();
        let target = dir.path().join("retry/state.bin");
        std::fs::create_dir(dir.path().join("retry")).unwrap();
        std::fs::hard_link(&committed, &target).unwrap();
        write_file(
            source(dir.path(), b"new bytes"),
            "state.bin",
            &target,
            9,
            Some("given".into()),
            &Meter::default(),
            true,
        )
        .unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new bytes");
        assert_eq!(std::fs::read(&committed).unwrap(), b"old");
    }

    #[test]
    fn a_file_that_changed_size_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for listed in [2, 5] {
            let err = write_file(
                source(dir.path(), b"abc"),
                "x.bin",
                &dir.path().join("out"),
                listed,
                None,
                &Meter::default(),
                true,
            )
            .unwrap_err();
            let Error::Io { source, .. } = &err else {
                panic!("{err:?}")
            };
            assert!(
                source
                    .to_string()
                    .contains("changed while it was persisted"),
                "{err:?}"
            );
        }
    }

    #[test]
    fn syncs_nested_directories_and_skips_missing_ones() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("checkpoint_000001");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/weights.bin"), b"abc").unwrap();
        let files = [root.join("a/b/weights.bin"), root.join("top.bin")];
        sync_directories(&root, &files).unwrap();
        // An empty checkpoint has no directory of its own.
        sync_directories(&dir.path().join("checkpoint_000000"), &[]).unwrap();
    }
}
