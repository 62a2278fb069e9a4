//! Why a run failed after it started (R19): the record every layer speaks,
//! from the rank that trapped to the run state that remembers it.

use std::fmt;

/// Why a run failed after it started.
///
/// ```
/// use trainhost::{FailureKind, RunFailure};
/// let f = RunFailure { rank: Some(1), kind: FailureKind::GuestError, message: "diverged".into() };
/// assert_eq!(f.to_string(), "rank 1 returned an error: diverged");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunFailure {
    /// The rank that failed first, when one rank is to blame.
    pub rank: Option<u32>,
    /// What kind of failure it was.
    pub kind: FailureKind,
    /// What happened, as the guest or the host said it.
    pub message: String,
}

/// The kinds of [`RunFailure`] (SEMANTICS R19).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FailureKind {
    /// The guest trapped: a panic, `unreachable`, an out-of-bounds access.
    Trap,
    /// The guest's `train` returned an error.
    GuestError,
    /// The guest called `exit` with a non-zero status.
    Exit,
    /// Ranks disagreed on the number of reports.
    Protocol,
    /// Persisting a report failed.
    Storage,
    /// The checkpoint to resume from could not be restored.
    Restore,
    /// The rank hit a resource limit (memory, stall, wall clock, output).
    Limit,
    /// The host itself failed (a bug in trainhost).
    Host,
}

impl RunFailure {
    /// The failure on one line: the rank, the kind and the message's first
    /// line, without the evidence that follows it (a trap's wasm backtrace
    /// and the rank's last lines of stderr): what a log line says when the
    /// failure happens, before the run decides to restart or to fail.
    ///
    /// ```
    /// use trainhost::{FailureKind, RunFailure};
    /// let f = RunFailure {
    ///     rank: Some(0),
    ///     kind: FailureKind::Trap,
    ///     message: "panicked at src/lib.rs:3:5: boom\nwasm backtrace: ..".into(),
    /// };
    /// assert_eq!(f.headline(), "rank 0 trapped: panicked at src/lib.rs:3:5: boom");
    /// ```
    pub fn headline(&self) -> String {
        let first = self.message.lines().next().unwrap_or_default();
        self.with_message(first)
    }

    fn with_message(&self, message: &str) -> String {
        let what = match self.kind {
            FailureKind::Trap => "trapped",
            FailureKind::GuestError => "returned an error",
            FailureKind::Exit => "exited",
            FailureKind::Protocol => "broke the report protocol",
            FailureKind::Storage => "could not persist a report",
            FailureKind::Restore => "could not restore a checkpoint",
            FailureKind::Limit => "hit a limit",
            FailureKind::Host => "hit a host error",
        };
        match self.rank {
            Some(rank) => format!("rank {rank} {what}: {message}"),
            None => message.to_owned(),
        }
    }
}

impl fmt::Display for RunFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.with_message(&self.message))
    }
}

impl std::error::Error for RunFailure {}
