//! A rank's view of the filesystem, and resolving the paths a guest hands
//! to the host.
//!
//! wasmtime-wasi does not expose its preopen table, so the sandbox keeps
//! its own: guest path prefix → `cap_std` directory handle. A guest path is
//! matched against whole path components, and everything after the match
//! is opened through the handle, which refuses any way out (symlinks
//! leading outside included). `..` is refused outright: there is no reason
//! to report a checkpoint by climbing, and refusing it avoids reasoning
//! about where it would land.

use std::path::Path;

use cap_std::ambient_authority;
use cap_std::fs::Dir;

/// Where a rank's scratch directory appears in the guest.
pub(crate) const SCRATCH_GUEST_PATH: &str = "/scratch";
/// Where restored checkpoints appear in the guest (read-only).
pub(crate) const RESTORE_GUEST_PATH: &str = "/checkpoints";

struct Mount {
    guest: Vec<String>,
    dir: Dir,
}

/// The directories one rank can see, by guest path.
pub(crate) struct Sandbox {
    mounts: Vec<Mount>,
    /// Relative guest paths are resolved against this mount (the scratch
    /// directory, the guest's working directory).
    cwd: Vec<String>,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mounts: Vec<String> = self
            .mounts
            .iter()
            .map(|m| format!("/{}", m.guest.join("/")))
            .collect();
        f.debug_struct("Sandbox").field("mounts", &mounts).finish()
    }
}

fn components(path: &str) -> Vec<String> {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .map(str::to_owned)
        .collect()
}

impl Sandbox {
    pub fn new(cwd: &str) -> Self {
        Self {
            mounts: Vec::new(),
            cwd: components(cwd),
        }
    }

    /// Make `host` visible at the absolute guest path `guest`.
    pub fn mount(&mut self, guest: &str, host: &Path) -> std::io::Result<()> {
        let dir = Dir::open_ambient_dir(host, ambient_authority())?;
        self.mounts.push(Mount {
            guest: components(guest),
            dir,
        });
        Ok(())
    }

    /// The mount a guest path lies in, and the components below it.
    fn resolve(&self, guest_path: &str) -> Result<(&Mount, Vec<String>), PathError> {
        let path = guest_path.to_owned();
        if guest_path.is_empty() {
            return Err(PathError::Empty);
        }
        if guest_path.contains('\0') {
            return Err(PathError::Nul(path));
        }
        let mut parts = components(guest_path);
        if parts.iter().any(|p| p == "..") {
            return Err(PathError::Climbs(path));
        }
        if !guest_path.starts_with('/') {
            let mut full = self.cwd.clone();
            full.append(&mut parts);
            parts = full;
        }
        let Some(mount) = self
            .mounts
            .iter()
            .filter(|m| parts.starts_with(&m.guest))
            .max_by_key(|m| m.guest.len())
        else {
            return Err(PathError::Outside(path));
        };
        let rest = parts[mount.guest.len()..].to_vec();
        // The restore directory holds restored checkpoints, one directory
        // each; itself it is never one (and empty before any restore).
        if rest.is_empty() && mount.guest == components(RESTORE_GUEST_PATH) {
            return Err(PathError::RestoreRoot(path));
        }
        Ok((mount, rest))
    }

    /// Open the directory a guest names, or say why not in words the guest
    /// author can act on.
    pub fn open_dir(&self, guest_path: &str) -> Result<Dir, PathError> {
        let (mount, rest) = self.resolve(guest_path)?;
        let path = guest_path.to_owned();
        if rest.is_empty() {
            return mount
                .dir
                .try_clone()
                .map_err(|source| PathError::Io { path, source });
        }
        mount
            .dir
            .open_dir(rest.join("/"))
            .map_err(|source| open_error(path, source))
    }

    /// Move the directory a guest names out of its sandbox, to the host
    /// path `to` (which must not exist, on the same file system), and leave
    /// an empty directory in its place: the guest hands the files over
    /// (`report-handing-over`). One rename, whatever the directory holds.
    pub fn hand_over(&self, guest_path: &str, to: &Path) -> Result<(), PathError> {
        let (mount, rest) = self.resolve(guest_path)?;
        let path = guest_path.to_owned();
        if mount.guest == components(RESTORE_GUEST_PATH) {
            return Err(PathError::HandOverRestored(path));
        }
        let Some((name, parents)) = rest.split_last() else {
            return Err(PathError::HandOverMount(path));
        };
        let parent = open_below(mount, parents, &path)?;
        let io = |source| PathError::Io {
            path: path.clone(),
            source,
        };
        // Renaming a symbolic link would move the link, not the directory.
        let meta = parent
            .symlink_metadata(name)
            .map_err(|source| match source.kind() {
                std::io::ErrorKind::NotFound => PathError::Missing(path.clone()),
                _ => io(source),
            })?;
        if meta.is_symlink() {
            return Err(PathError::HandOverLink(path));
        }
        if !meta.is_dir() {
            return Err(PathError::NotADirectory(path));
        }
        let (Some(to_parent), Some(to_name)) = (to.parent(), to.file_name()) else {
            return Err(io(std::io::Error::other(format!(
                "{} is not a directory path",
                to.display()
            ))));
        };
        let to_parent = Dir::open_ambient_dir(to_parent, ambient_authority()).map_err(io)?;
        parent.rename(name, &to_parent, to_name).map_err(io)?;
        parent.create_dir(name).map_err(io)
    }
}

/// The directory `parents` below `mount`; `path` names it in errors.
fn open_below(mount: &Mount, parents: &[String], path: &str) -> Result<Dir, PathError> {
    if parents.is_empty() {
        mount.dir.try_clone()
    } else {
        mount.dir.open_dir(parents.join("/"))
    }
    .map_err(|source| open_error(path.to_owned(), source))
}

impl Sandbox {
    /// The directory that holds the file a guest names, and the file's
    /// name in it, for the host to read or (with `write`) write that file
    /// through the directory's handle. Restored checkpoints are read-only.
    pub fn file_in(&self, guest_path: &str, write: bool) -> Result<(Dir, String), PathError> {
        let (mount, rest) = self.resolve(guest_path)?;
        let path = guest_path.to_owned();
        let Some((name, parents)) = rest.split_last() else {
            return Err(PathError::NotAFile(path));
        };
        if write && mount.guest == components(RESTORE_GUEST_PATH) {
            return Err(PathError::ReadOnly(path));
        }
        Ok((open_below(mount, parents, &path)?, name.clone()))
    }
}

/// What an error opening a directory below a mount means to the guest.
fn open_error(path: String, source: std::io::Error) -> PathError {
    match source.kind() {
        std::io::ErrorKind::NotFound => PathError::Missing(path),
        std::io::ErrorKind::NotADirectory => PathError::NotADirectory(path),
        _ if source.to_string().contains("outside of the filesystem") => {
            PathError::EscapingLink(path)
        }
        _ => PathError::Io { path, source },
    }
}

/// Why the directory a guest named cannot be opened; the guest sees it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PathError {
    #[error("the checkpoint path is empty")]
    Empty,
    #[error("checkpoint path {0:?} contains a NUL byte")]
    Nul(String),
    #[error("checkpoint path {0:?} contains '..'; name the directory without climbing")]
    Climbs(String),
    #[error(
        "checkpoint path {0:?} is outside the sandbox; write checkpoints below {SCRATCH_GUEST_PATH}"
    )]
    Outside(String),
    #[error("checkpoint directory {0:?} does not exist")]
    Missing(String),
    #[error(
        "checkpoint path {0:?} is where restored checkpoints appear, not a checkpoint; write checkpoints below {SCRATCH_GUEST_PATH}"
    )]
    RestoreRoot(String),
    #[error("checkpoint path {0:?} is not a directory")]
    NotADirectory(String),
    #[error("checkpoint path {0:?} leads outside the sandbox through a symbolic link")]
    EscapingLink(String),
    #[error(
        "checkpoint path {0:?} is a restored checkpoint, which is read-only: report it with `report`, which copies it"
    )]
    HandOverRestored(String),
    #[error(
        "checkpoint path {0:?} is the scratch directory itself, which cannot be handed over: write the checkpoint into a directory below it"
    )]
    HandOverMount(String),
    #[error(
        "checkpoint path {0:?} is a symbolic link; hand over the directory it points to, by its own path"
    )]
    HandOverLink(String),
    #[error("{0:?} is a directory the sandbox mounts, not a file")]
    NotAFile(String),
    #[error(
        "{0:?} is in a restored checkpoint, which is read-only; write files below {SCRATCH_GUEST_PATH}"
    )]
    ReadOnly(String),
    #[error("cannot open checkpoint directory {path:?}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox() -> (tempfile::TempDir, Sandbox) {
        let tmp = tempfile::tempdir().unwrap();
        let scratch = tmp.path().join("scratch");
        std::fs::create_dir_all(scratch.join("ckpt/sub")).unwrap();
        std::fs::write(scratch.join("file"), b"x").unwrap();
        std::fs::create_dir_all(tmp.path().join("outside")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("outside"), scratch.join("abs-link")).unwrap();
        std::os::unix::fs::symlink("../outside", scratch.join("rel-link")).unwrap();
        std::os::unix::fs::symlink("ckpt", scratch.join("inside-link")).unwrap();
        let mut sb = Sandbox::new(SCRATCH_GUEST_PATH);
        sb.mount(SCRATCH_GUEST_PATH, &scratch).unwrap();
        (tmp, sb)
    }

    #[test]
    fn resolves_absolute_and_relative_paths_inside() {
        let (_tmp, sb) = sandbox();
        for ok in [
            "/scratch/ckpt",
            "ckpt",
            "./ckpt/sub",
            "/scratch",
            "/scratch//ckpt/",
            "inside-link",
        ] {
            assert!(sb.open_dir(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn refuses_every_way_out() {
        let (_tmp, sb) = sandbox();
        let cases = [
            ("../outside", "'..'"),
            ("/scratch/../outside", "'..'"),
            ("/etc", "outside the sandbox"),
            ("/", "outside the sandbox"),
            ("/scratchy", "outside the sandbox"),
            ("abs-link", "symbolic link"),
            ("rel-link", "symbolic link"),
            ("file", "not a directory"),
            ("missing", "does not exist"),
            ("", "empty"),
        ];
        for (path, expected) in cases {
            let err = sb.open_dir(path).unwrap_err().to_string();
            assert!(err.contains(expected), "{path}: {err}");
        }
    }

    #[test]
    fn files_resolve_to_their_directory_and_restored_ones_are_read_only() {
        let (tmp, mut sb) = sandbox();
        let restored = tmp.path().join("restored");
        std::fs::create_dir_all(restored.join("ckpt-1")).unwrap();
        sb.mount(RESTORE_GUEST_PATH, &restored).unwrap();
        let (dir, name) = sb.file_in("ckpt/sub/w.safetensors", true).unwrap();
        assert_eq!(name, "w.safetensors");
        dir.write(&name, b"w").unwrap();
        assert!(tmp.path().join("scratch/ckpt/sub/w.safetensors").exists());
        assert!(
            sb.file_in("/checkpoints/ckpt-1/w.safetensors", false)
                .is_ok()
        );
        let cases = [
            ("/checkpoints/ckpt-1/w.safetensors", "read-only"),
            ("/scratch", "not a file"),
            ("abs-link/w", "symbolic link"),
            ("../w", "'..'"),
            ("/etc/passwd", "outside the sandbox"),
            ("missing/w", "does not exist"),
        ];
        for (path, expected) in cases {
            let err = sb.file_in(path, true).unwrap_err().to_string();
            assert!(err.contains(expected), "{path}: {err}");
        }
    }
}
