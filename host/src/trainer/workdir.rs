//! A run's working directory on this machine (the ranks' scratch
//! directories, checkpoint snapshots, restored checkpoints), and the
//! removal of those that killed hosts left behind.
//!
//! Working directories live in one directory per user,
//! `$TMPDIR/trainhost-<uid>/run-*`. Each is locked (`flock`) by its
//! process for as long as the process lives; the kernel releases the lock
//! when the process ends, however it ends. So a directory whose lock can
//! be taken belongs to no live process, and every run, when it starts,
//! removes the ones it finds (a preemptible fleet would otherwise fill its
//! disks with SIGKILLed runs' scratch data).
//!
//! Between creating its directory and locking it a process holds no lock
//! on it. To keep a sweep from taking such a directory for a dead one,
//! creators hold the parent directory's lock shared while they create and
//! lock theirs, and a sweep holds it exclusively.

use std::fs::File;
use std::path::{Path, PathBuf};

use rustix::fs::{FlockOperation, flock};

use crate::error::Error;

/// Prefix of the working directories in the per-user directory.
const PREFIX: &str = "run-";

/// This run's working directory; removed when dropped.
#[derive(Debug)]
pub(super) struct WorkDir {
    path: PathBuf,
    /// Held open, and locked, for as long as the run lives.
    _lock: File,
}

impl WorkDir {
    /// Create this run's working directory, after removing those of
    /// processes that ended without removing theirs.
    pub fn create() -> Result<Self, Error> {
        let parent =
            std::env::temp_dir().join(format!("trainhost-{}", rustix::process::getuid().as_raw()));
        let io = |path: &Path, operation| {
            let path = path.to_path_buf();
            move |source| Error::Io {
                path,
                operation,
                source,
            }
        };
        create_private_dir(&parent)
            .map_err(io(&parent, "create the working directories' directory"))?;
        let parent_lock =
            File::open(&parent).map_err(io(&parent, "open the working directories' directory"))?;

        lock(&parent_lock, FlockOperation::LockShared)
            .map_err(io(&parent, "lock the working directories' directory"))?;
        let path = tempfile::Builder::new()
            .prefix(PREFIX)
            .tempdir_in(&parent)
            .map_err(io(&parent, "create the run's working directory"))?
            .keep();
        let own = File::open(&path).map_err(io(&path, "open the run's working directory"))?;
        lock(&own, FlockOperation::NonBlockingLockExclusive)
            .map_err(io(&path, "lock the run's working directory"))?;
        lock(&parent_lock, FlockOperation::Unlock)
            .map_err(io(&parent, "unlock the working directories' directory"))?;

        sweep(&parent, &parent_lock, &path);
        Ok(Self { path, _lock: own })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!(dir = %self.path.display(), "cannot remove the run's working directory: {e}");
        }
    }
}

fn lock(file: &File, operation: FlockOperation) -> std::io::Result<()> {
    flock(file, operation).map_err(std::io::Error::from)
}

/// The per-user directory, readable by its user only: it holds guests'
/// scratch data.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = std::fs::symlink_metadata(dir)?;
            if !meta.is_dir() || meta.uid() != rustix::process::getuid().as_raw() {
                return Err(std::io::Error::other(
                    "it exists and is not a directory of this user; remove it, or set TMPDIR to another directory",
                ));
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Remove the working directories below `parent` (but `own`) whose lock is
/// free. Failing to is never an error of this run: it is logged.
fn sweep(parent: &Path, parent_lock: &File, own: &Path) {
    if let Err(e) = lock(parent_lock, FlockOperation::LockExclusive) {
        tracing::warn!(dir = %parent.display(), "cannot look for working directories left behind: {e}");
        return;
    }
    let entries = match std::fs::read_dir(parent) {
        Ok(entries) => entries,
        Err(e) => {
            tracing::warn!(dir = %parent.display(), "cannot look for working directories left behind: {e}");
            return;
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_ours = entry.file_name().to_string_lossy().starts_with(PREFIX);
        if !is_ours || path == own {
            continue;
        }
        // A live process holds its directory's lock: not ours to take.
        let Ok(dir) = File::open(&path) else { continue };
        if lock(&dir, FlockOperation::NonBlockingLockExclusive).is_err() {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => tracing::info!(
                dir = %path.display(),
                "removed the working directory of a trainhost process that ended without removing it"
            ),
            Err(e) => {
                tracing::warn!(dir = %path.display(), "cannot remove a working directory left behind: {e}")
            }
        }
    }
    let _ = lock(parent_lock, FlockOperation::Unlock);
}
