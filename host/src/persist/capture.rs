//! Listing a rank's checkpoint directory through its sandbox handle.
//!
//! The directory arrives as a `cap_std::fs::Dir` already resolved inside the
//! rank's sandbox; everything here goes through that handle, so no path can
//! lead outside it. Symbolic links and special files are refused rather than
//! followed or skipped: a checkpoint that silently lost a file would restore
//! wrong.

use cap_std::fs::Dir;

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
}

/// List every regular file below `dir`, refusing anything that is not a
/// regular file or directory, names that are not UTF-8 and the reserved
/// top-level name. `shown` is the directory as the guest named it, for
/// messages.
pub(crate) fn capture(rank: u32, dir: Dir, shown: &str) -> Result<Capture, String> {
    let mut files = Vec::new();
    walk(&dir, "", shown, 0, &mut files)?;
    files.sort();
    Ok(Capture { rank, dir, files })
}

fn walk(
    dir: &Dir,
    prefix: &str,
    shown: &str,
    depth: usize,
    out: &mut Vec<(String, u64)>,
) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!(
            "{shown}/{prefix} is nested more than {MAX_DEPTH} directories deep"
        ));
    }
    let entries = dir
        .entries()
        .map_err(|e| format!("cannot list {shown}/{prefix}: {e}"))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot list {shown}/{prefix}: {e}"))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return Err(format!(
                "{shown}/{prefix}{} has a name that is not UTF-8; checkpoint file names must be UTF-8",
                name.to_string_lossy()
            ));
        };
        let rel = format!("{prefix}{name}");
        if depth == 0 && name == RESERVED_DIR {
            return Err(format!(
                "{shown}/{name} uses a name reserved for trainhost's manifest; rename it"
            ));
        }
        let kind = entry
            .file_type()
            .map_err(|e| format!("cannot inspect {shown}/{rel}: {e}"))?;
        if kind.is_symlink() {
            return Err(format!(
                "{shown}/{rel} is a symbolic link; checkpoints may hold only regular files and directories"
            ));
        } else if kind.is_dir() {
            let sub = entry
                .open_dir()
                .map_err(|e| format!("cannot open {shown}/{rel}: {e}"))?;
            walk(&sub, &format!("{rel}/"), shown, depth + 1, out)?;
        } else if kind.is_file() {
            let meta = entry
                .metadata()
                .map_err(|e| format!("cannot inspect {shown}/{rel}: {e}"))?;
            out.push((rel, meta.len()));
        } else {
            return Err(format!(
                "{shown}/{rel} is a special file (FIFO, socket or device); checkpoints may hold only regular files and directories"
            ));
        }
    }
    Ok(())
}
