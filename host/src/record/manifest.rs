//! The manifest that commits a checkpoint (R11), and the rule that keeps
//! its file paths inside the checkpoint.

use serde::{Deserialize, Serialize};

use super::layout::{FORMAT, MANIFEST};
use crate::metrics::Metrics;

/// One file of a checkpoint, as its [`Manifest`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the checkpoint directory, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the bytes, lower-case hex.
    pub sha256: String,
    /// The ranks that reported this file (more than one when several ranks
    /// wrote identical bytes).
    pub ranks: Vec<u32>,
}

/// What makes a checkpoint committed: its file list with checksums, the
/// metrics it was reported with, and where it came from.
///
/// ```no_run
/// let checkpoint = trainhost::Checkpoint::open("./trainhost_results/demo/checkpoint_000004")?;
/// let manifest = checkpoint.manifest();
/// for f in &manifest.files {
///     println!("{} {} bytes sha256={} from ranks {:?}", f.path, f.size, f.sha256, f.ranks);
/// }
/// # Ok::<(), trainhost::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version (1).
    pub format: u32,
    /// The run's name.
    pub run_name: String,
    /// The checkpoint's index in the run.
    pub checkpoint_index: u64,
    /// The report that created it (counting every report of the run).
    pub report_index: u64,
    /// The metrics reported with it (rank 0's).
    pub metrics: Metrics,
    /// The ranks that contributed files.
    pub ranks: Vec<u32>,
    /// The world size of the run that wrote it.
    pub world_size: u32,
    /// Every file, sorted by path.
    pub files: Vec<FileEntry>,
    /// When it was committed (RFC 3339, UTC).
    pub committed_at: String,
}

/// Why stored bytes are not a manifest this trainhost can trust: the
/// checkpoint does not count as committed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ManifestError {
    #[error("it has no {MANIFEST}")]
    Missing,
    #[error("unreadable manifest: {0}")]
    Unreadable(#[source] serde_json::Error),
    #[error("manifest format {found} is not supported (this trainhost reads format {FORMAT})")]
    Format { found: u32 },
    #[error("its manifest lists the unsafe path {0:?}")]
    UnsafePath(String),
}

impl Manifest {
    /// Parse a manifest, refusing other format versions. (Its paths are
    /// checked apart, by [`check_relative_path`].)
    pub(crate) fn from_json(bytes: &[u8]) -> Result<Self, ManifestError> {
        let m: Manifest = serde_json::from_slice(bytes).map_err(ManifestError::Unreadable)?;
        if m.format != FORMAT {
            return Err(ManifestError::Format { found: m.format });
        }
        Ok(m)
    }

    /// The total size of the files.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// A manifest's file path must stay inside the checkpoint: relative,
/// `/`-separated, no empty, `.` or `..` parts. Storage is not trusted.
pub(crate) fn check_relative_path(path: &str) -> Result<(), ManifestError> {
    let bad = path.is_empty()
        || path.starts_with('/')
        || path.contains('\0')
        || path
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..");
    if bad {
        Err(ManifestError::UnsafePath(path.to_owned()))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::layout::now_rfc3339;

    #[test]
    fn refuses_unknown_format() {
        let m = Manifest {
            format: 99,
            run_name: "r".into(),
            checkpoint_index: 0,
            report_index: 0,
            metrics: Metrics::new(),
            ranks: vec![0],
            world_size: 1,
            files: vec![],
            committed_at: now_rfc3339(),
        };
        let err = Manifest::from_json(&serde_json::to_vec(&m).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("format 99"), "{err}");
    }

    #[test]
    fn manifest_paths_must_stay_inside() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a//b",
            "./a",
            "a/\0",
        ] {
            assert!(check_relative_path(bad).is_err(), "{bad:?}");
        }
        for good in ["a", "a/b.bin", "model-rank=1.safetensors", "..hidden"] {
            assert!(check_relative_path(good).is_ok(), "{good:?}");
        }
    }
}
