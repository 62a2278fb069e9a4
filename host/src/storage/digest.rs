//! A file's SHA-256 as it is written to storage, and the check that it
//! held the bytes it was listed with; shared by both ways of writing.

use sha2::{Digest, Sha256};

use crate::error::Error;

/// A file's SHA-256 as it is uploaded: computed from its bytes, or known
/// beforehand (the caller hashed the file already) and then not computed
/// again.
pub(super) enum FileDigest {
    Computing(Sha256),
    Known(String),
}

impl FileDigest {
    pub(super) fn new(known: Option<String>) -> Self {
        known.map_or_else(|| Self::Computing(Sha256::new()), Self::Known)
    }

    pub(super) fn update(&mut self, bytes: &[u8]) {
        if let Self::Computing(hasher) = self {
            hasher.update(bytes);
        }
    }

    /// The digest of what was given so far (or the known one), as bytes;
    /// `None` if the known one is not a SHA-256 in hex.
    pub(super) fn current(&self) -> Option<[u8; 32]> {
        match self {
            Self::Computing(hasher) => Some(hasher.clone().finalize().into()),
            Self::Known(hex) => hex::decode(hex).ok()?.try_into().ok(),
        }
    }

    /// The digest, in hex.
    pub(super) fn finish(self) -> String {
        match self {
            Self::Computing(hasher) => hex::encode(hasher.finalize()),
            Self::Known(hex) => hex,
        }
    }
}

pub(super) fn check_size(relative: &str, expected: u64, read: u64) -> Result<(), Error> {
    if read == expected {
        Ok(())
    } else {
        Err(Error::Io {
            path: relative.into(),
            operation: "read a checkpoint file",
            source: std::io::Error::other(format!(
                "the file changed while it was persisted ({expected} bytes when listed, {read} when read)"
            )),
        })
    }
}
