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

    /// Open the directory a guest names, or say why not in words the guest
    /// author can act on.
    pub fn open_dir(&self, guest_path: &str) -> Result<Dir, String> {
        if guest_path.is_empty() {
            return Err("the checkpoint path is empty".into());
        }
        if guest_path.contains('\0') {
            return Err(format!(
                "checkpoint path {guest_path:?} contains a NUL byte"
            ));
        }
        let mut parts = components(guest_path);
        if parts.iter().any(|p| p == "..") {
            return Err(format!(
                "checkpoint path {guest_path:?} contains '..'; name the directory without climbing"
            ));
        }
        if !guest_path.starts_with('/') {
            let mut full = self.cwd.clone();
            full.append(&mut parts);
            parts = full;
        }
        let mount = self
            .mounts
            .iter()
            .filter(|m| parts.starts_with(&m.guest))
            .max_by_key(|m| m.guest.len())
            .ok_or_else(|| {
                format!(
                    "checkpoint path {guest_path:?} is outside the sandbox; write checkpoints below {SCRATCH_GUEST_PATH}"
                )
            })?;
        let rest = &parts[mount.guest.len()..];
        if rest.is_empty() {
            return mount
                .dir
                .try_clone()
                .map_err(|e| format!("cannot open {guest_path:?}: {e}"));
        }
        mount.dir.open_dir(rest.join("/")).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => format!("checkpoint directory {guest_path:?} does not exist"),
            std::io::ErrorKind::NotADirectory => format!("checkpoint path {guest_path:?} is not a directory"),
            _ if e.to_string().contains("outside of the filesystem") => format!(
                "checkpoint path {guest_path:?} leads outside the sandbox through a symbolic link"
            ),
            _ => format!("cannot open checkpoint directory {guest_path:?}: {e}"),
        })
    }
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
            let err = sb.open_dir(path).unwrap_err();
            assert!(err.contains(expected), "{path}: {err}");
        }
    }
}
