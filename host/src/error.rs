//! The library's error type.

use std::path::PathBuf;

/// Everything that can stop trainhost from starting or finishing a run, or
/// from reading a checkpoint.
///
/// A run that starts and then fails (a rank traps, a guest returns an
/// error) is not an `Error`: [`crate::Trainer::fit`] returns a
/// [`crate::TrainResult`] whose `error` says what happened, alongside
/// everything committed before it.
///
/// ```
/// match trainhost::Checkpoint::open("/no/such/run/checkpoint_000000") {
///     Err(trainhost::Error::NotACheckpoint { location, reason }) => {
///         eprintln!("{location}: {reason}");
///     }
///     Err(other) => eprintln!("{other}"),
///     Ok(c) => println!("{}", c.metrics()),
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is missing, malformed or contradicts another.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// The guest could not be read, is not a component, or does not fit
    /// trainhost's WIT world.
    #[error("guest {path}: {message}")]
    Guest {
        /// The guest as given (a path, or `<bytes>`).
        path: String,
        /// What is wrong and what to do.
        message: String,
        /// The underlying error, if any.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },

    /// A storage operation failed.
    #[error("storage {url}: {operation} failed")]
    Storage {
        /// The storage location.
        url: String,
        /// What trainhost was doing.
        operation: String,
        /// The object store's error.
        #[source]
        source: object_store::Error,
    },

    /// A local file operation failed.
    #[error("{}: cannot {operation}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What trainhost was doing.
        operation: &'static str,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },

    /// A location does not hold a committed checkpoint (no manifest, or an
    /// unreadable one).
    #[error("{location} is not a committed checkpoint: {reason}")]
    NotACheckpoint {
        /// Where the checkpoint was looked for.
        location: String,
        /// Why it does not count.
        #[source]
        reason: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A checkpoint's files do not match its manifest.
    #[error("checkpoint {location} failed verification: {reason}")]
    Verification {
        /// The checkpoint.
        location: String,
        /// Which file differs, and how.
        reason: String,
    },

    /// A run of this name exists in storage and cannot be continued with
    /// these settings.
    #[error("run {run}: {reason}")]
    RunConflict {
        /// The run's storage path.
        run: String,
        /// Why, and what to do.
        #[source]
        reason: Box<dyn std::error::Error + Send + Sync>,
    },

    /// Another live host owns the run (R27): it is being run right now.
    #[error("run {run} is in use by {holder}; {remedy}")]
    RunInUse {
        /// The run's storage path.
        run: String,
        /// Who holds it: process, host, and since when.
        holder: String,
        /// What to do about it.
        remedy: String,
    },

    /// This host lost its ownership of the run while running it (R27):
    /// another host took it over after this one's lease expired, or the
    /// lease could not be renewed for the whole retry timeout. Nothing more
    /// is written to the run by this host.
    #[error("run {run}: this host no longer owns the run and writes nothing more to it: {reason}")]
    Fenced {
        /// The run's storage path.
        run: String,
        /// What happened.
        reason: String,
    },

    /// The WebAssembly engine failed outside any guest's code.
    #[error("wasm runtime: cannot {operation}")]
    Engine {
        /// What trainhost was doing.
        operation: &'static str,
        /// The engine's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// [`crate::Trainer::fit`] blocks; it was called from inside an async
    /// runtime, where blocking would stall other tasks.
    #[error(
        "Trainer::fit blocks and was called from inside an async runtime; call it through tokio::task::spawn_blocking"
    )]
    InsideAsyncRuntime,

    /// This process is one of several that a launcher (`mpiexec`, `srun`)
    /// started for one job, and trainhost was built without the `mpi`
    /// feature. Each would run the whole run on its own, so the run is
    /// refused instead of being trained several times over.
    #[error(
        "this trainhost is process {index} of {processes} started by {launcher}, but it was built without the `mpi` feature, so a run lives in one process: start trainhost once, not under {launcher}, with --workers set to the ranks you want, or build trainhost with `--features mpi` to run one trainhost per node"
    )]
    SeveralProcesses {
        /// This process's index among them.
        index: u32,
        /// How many processes the launcher started.
        processes: u32,
        /// The launcher, as its environment told it.
        launcher: &'static str,
    },

    /// The nodes of a run over several hosts could not agree to start: a
    /// node's settings, guest or storage differ from node 0's, or MPI
    /// could not be set up.
    #[error("{0}")]
    Cluster(String),
}

/// `e` and its sources, `: `-separated, for messages that cross into a
/// guest or a [`crate::RunFailure`], where the source chain would be lost.
/// A source whose text a message before it already carries is left out:
/// some errors (object_store's, [`Error::NotACheckpoint`]) say their
/// source in their own message too.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_says_each_cause_once() {
        let e = Error::Io {
            path: "/x".into(),
            operation: "write a file",
            source: std::io::Error::other("disk on fire"),
        };
        assert_eq!(chain(&e), "/x: cannot write a file: disk on fire");
        let e = Error::NotACheckpoint {
            location: "/c".into(),
            reason: "it has no manifest".into(),
        };
        assert_eq!(
            chain(&e),
            "/c is not a committed checkpoint: it has no manifest"
        );
    }
}
