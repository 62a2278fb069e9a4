//! The names of things in a run's storage (R10).
//!
//! Layout of a run:
//! ```text
//! <storage>/<run>/
//!     trainhost-run.json                  run state (R12)
//!     trainhost-owner.json                who owns the run (R27)
//!     metrics.jsonl                       every report, one JSON object a line (R9)
//!     events.out.tfevents.trainhost       the same reports for TensorBoard (R49)
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

/// Top-level name inside a checkpoint reserved for trainhost's own files.
pub const RESERVED_DIR: &str = ".trainhost";
/// The manifest's path inside a checkpoint directory.
pub const MANIFEST: &str = ".trainhost/manifest.json";
/// The run state's path inside a run directory.
pub const RUN_STATE: &str = "trainhost-run.json";
/// Who owns the run (R27): on local storage the file the owner holds a
/// lock on, on object stores the owner's lease.
pub const OWNER: &str = "trainhost-owner.json";
/// The metrics history's path inside a run directory.
pub const HISTORY: &str = "metrics.jsonl";
/// The history as a TensorBoard event file ("tfevents" in the name is how
/// TensorBoard finds it).
pub const TENSORBOARD: &str = "events.out.tfevents.trainhost";
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

/// Current time as RFC 3339 with seconds, UTC.
pub fn now_rfc3339() -> String {
    rfc3339(std::time::SystemTime::now())
}

/// `time` as RFC 3339 with seconds, UTC.
pub fn rfc3339(time: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(time).to_string()
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
}
