//! Why a call of this crate failed.

use std::fmt;
use std::path::PathBuf;

use trainhost_guest::collective::CollectiveError;

/// Why saving, restoring, reporting or averaging failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A file of the checkpoint could not be written or read.
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// burn's recorder could not write or read a record.
    Record { path: PathBuf, message: String },
    /// The checkpoint is not one [`save`](crate::save) wrote, or not for
    /// this model.
    Checkpoint(String),
    /// trainhost refused the report.
    Report(trainhost_guest::Error),
    /// A collective call failed: on `Mismatch` or `Aborted`, return from
    /// the training loop.
    Collective(CollectiveError),
    /// A tensor's data could not be read as `f32`.
    Tensor(String),
    /// The ranks' parameters differ ([`check_in_sync`](crate::check_in_sync)).
    OutOfSync(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Record { path, message } => {
                write!(f, "burn record {}: {message}", path.display())
            }
            Error::Checkpoint(m) => write!(f, "not a checkpoint of this model: {m}"),
            Error::Report(e) => e.fmt(f),
            Error::Collective(e) => e.fmt(f),
            Error::Tensor(m) => write!(f, "tensor data: {m}"),
            Error::OutOfSync(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            Error::Report(e) => Some(e),
            Error::Collective(e) => Some(e),
            _ => None,
        }
    }
}

impl From<trainhost_guest::Error> for Error {
    fn from(e: trainhost_guest::Error) -> Self {
        Error::Report(e)
    }
}

impl From<CollectiveError> for Error {
    fn from(e: CollectiveError) -> Self {
        Error::Collective(e)
    }
}
