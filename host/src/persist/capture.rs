//! Listing a rank's checkpoint directory through its sandbox handle.
//!
//! The directory arrives as a `cap_std::fs::Dir` already resolved inside the
//! rank's sandbox; everything here goes through that handle, so no path can
//! lead outside it. Symbolic links and special files are refused rather than
//! followed or skipped: a checkpoint that silently lost a file would restore
//! wrong.

use std::collections::HashSet;
use std::path::PathBuf;

use cap_std::fs::Dir;

use super::lend::Inode;
use crate::record::layout::RESERVED_DIR;

/// Deeper directory trees than this are refused (a guard against guests
/// that nest directories until the host's stack or path limits break).
const MAX_DEPTH: usize = 64;

/// One rank's checkpoint directory, listed and ready to persist.
#[derive(Debug)]
pub(crate) struct Capture {
    /// The reporting rank.
    pub rank: u32,
    /// The checkpoint directory, opened inside the rank's sandbox.
    pub dir: Dir,
    /// Regular files below it: `/`-separated relative path and size.
    pub files: Vec<(String, u64)>,
    /// Set when the rank handed the directory over: `dir` is then the
    /// host's, moved out of the sandbox, and removed once persisted.
    pub handed_over: Option<HandedOver>,
    /// The files the rank holds open for writing: a snapshot copies these
    /// rather than linking them (see `lend`).
    pub open_for_writing: HashSet<Inode>,
}

/// A directory a rank handed over, removed when dropped: once its
/// checkpoint is persisted, or when its report goes no further.
#[derive(Debug)]
pub(crate) struct HandedOver(PathBuf);

impl HandedOver {
    pub fn new(path: PathBuf) -> Self {
        Self(path)
    }
}

impl Drop for HandedOver {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(dir = %self.0.display(), "cannot remove a handed-over checkpoint directory: {e}");
        }
    }
}

/// Why a rank's checkpoint directory cannot be captured; the guest sees
/// it as an invalid checkpoint. `at` is the path as the guest would write
/// it (the directory it named, and the entry below it).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CaptureError {
    #[error("{at} is nested more than {MAX_DEPTH} directories deep")]
    TooDeep { at: String },
    #[error("{at} has a name that is not UTF-8; checkpoint file names must be UTF-8")]
    NotUtf8 { at: String },
    #[error("{at} uses a name reserved for trainhost's manifest; rename it")]
    Reserved { at: String },
    #[error("{at} is a symbolic link; checkpoints may hold only regular files and directories")]
    Symlink { at: String },
    #[error(
        "{at} is a special file (FIFO, socket or device); checkpoints may hold only regular files and directories"
    )]
    Special { at: String },
    #[error("cannot {operation} {at}: {source}")]
    Io {
        operation: &'static str,
        at: String,
        #[source]
        source: std::io::Error,
    },
}

/// List every regular file below `dir`, refusing anything that is not a
/// regular file or directory, names that are not UTF-8 and the reserved
/// top-level name. `shown` is the directory as the guest named it, for
/// messages.
pub(crate) fn capture(rank: u32, dir: Dir, shown: &str) -> Result<Capture, CaptureError> {
    let mut files = Vec::new();
    walk(&dir, "", shown, 0, &mut files)?;
    files.sort();
    Ok(Capture {
        rank,
        dir,
        files,
        handed_over: None,
        open_for_writing: HashSet::new(),
    })
}

fn walk(
    dir: &Dir,
    prefix: &str,
    shown: &str,
    depth: usize,
    out: &mut Vec<(String, u64)>,
) -> Result<(), CaptureError> {
    let io = |operation, at: String| {
        move |source| CaptureError::Io {
            operation,
            at,
            source,
        }
    };
    if depth > MAX_DEPTH {
        return Err(CaptureError::TooDeep {
            at: format!("{shown}/{prefix}"),
        });
    }
    let entries = dir
        .entries()
        .map_err(io("list", format!("{shown}/{prefix}")))?;
    for entry in entries {
        let entry = entry.map_err(io("list", format!("{shown}/{prefix}")))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return Err(CaptureError::NotUtf8 {
                at: format!("{shown}/{prefix}{}", name.to_string_lossy()),
            });
        };
        let rel = format!("{prefix}{name}");
        let at = format!("{shown}/{rel}");
        if depth == 0 && name == RESERVED_DIR {
            return Err(CaptureError::Reserved { at });
        }
        let kind = entry.file_type().map_err(io("inspect", at.clone()))?;
        if kind.is_symlink() {
            return Err(CaptureError::Symlink { at });
        } else if kind.is_dir() {
            let sub = entry.open_dir().map_err(io("open", at))?;
            walk(&sub, &format!("{rel}/"), shown, depth + 1, out)?;
        } else if kind.is_file() {
            let meta = entry.metadata().map_err(io("inspect", at))?;
            out.push((rel, meta.len()));
        } else {
            return Err(CaptureError::Special { at });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_special_file_in_a_checkpoint_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let ckpt = tmp.path().join("ckpt");
        std::fs::create_dir_all(ckpt.join("sub")).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(ckpt.join("pipe"))
            .status()
            .unwrap();
        assert!(made.success());
        let dir = Dir::open_ambient_dir(&ckpt, cap_std::ambient_authority()).unwrap();
        let err = capture(0, dir, "ckpt").unwrap_err().to_string();
        assert!(err.contains("ckpt/pipe is a special file"), "{err}");
    }
}
