//! The manifest that commits a checkpoint, and the names of things in a
//! run's storage.
//!
//! Layout of a run (R10):
//! ```text
//! <storage>/<run>/
//!     trainhost-run.json                  run state (R12)
//!     metrics.jsonl                       every report, one JSON object a line (R9)
//!     checkpoint_000000/
//!         <the guest's files, paths and bytes as written>
//!         .trainhost/manifest.json        written last: the commit (R11)
//!     checkpoint_000001/ ...
//! ```
//! A checkpoint directory without a valid manifest is not a checkpoint.
//! Guests cannot write `.trainhost` at the top of a checkpoint, so the
//! manifest never collides with their files. Several hosts contributing to
//! one checkpoint will each add `.trainhost/shards/<node>.json` and the
//! committing host merges them into the manifest.

use serde::{Deserialize, Serialize};

use crate::Metrics;

/// Top-level name inside a checkpoint reserved for trainhost's own files.
pub const RESERVED_DIR: &str = ".trainhost";
/// The manifest's path inside a checkpoint directory.
pub const MANIFEST: &str = ".trainhost/manifest.json";
/// The run state's path inside a run directory.
pub const RUN_STATE: &str = "trainhost-run.json";
/// The metrics history's path inside a run directory.
pub const HISTORY: &str = "metrics.jsonl";
/// The format version written into manifests and run state.
pub const FORMAT: u32 = 1;

/// The directory name of checkpoint number `index` (zero-padded, so names
/// sort in commit order).
pub fn checkpoint_dir_name(index: u64) -> String {
    format!("checkpoint_{index:06}")
}

/// The index of a checkpoint directory name, if it is one.
pub fn parse_checkpoint_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("checkpoint_")?;
    (digits.len() >= 6 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

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

impl Manifest {
    /// Parse a manifest, refusing other format versions.
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        let m: Manifest =
            serde_json::from_slice(bytes).map_err(|e| format!("unreadable manifest: {e}"))?;
        if m.format != FORMAT {
            return Err(format!(
                "manifest format {} is not supported (this trainhost reads format {FORMAT})",
                m.format
            ));
        }
        Ok(m)
    }

    /// The total size of the files.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// Current time as RFC 3339 with seconds, UTC.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_names_sort_and_parse() {
        assert_eq!(checkpoint_dir_name(7), "checkpoint_000007");
        assert_eq!(parse_checkpoint_dir_name("checkpoint_000007"), Some(7));
        assert_eq!(
            parse_checkpoint_dir_name("checkpoint_1234567"),
            Some(1_234_567)
        );
        assert_eq!(parse_checkpoint_dir_name("checkpoint_7"), None);
        assert_eq!(parse_checkpoint_dir_name("checkpoint_00000x"), None);
        assert!(checkpoint_dir_name(9) < checkpoint_dir_name(10));
    }

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
        let err = Manifest::from_json(&serde_json::to_vec(&m).unwrap()).unwrap_err();
        assert!(err.contains("format 99"), "{err}");
    }
}
