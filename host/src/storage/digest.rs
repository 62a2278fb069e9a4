//! A file's SHA-256 as it is written to storage, and the check that it
//! held the bytes it was listed with; shared by both ways of writing.

use sha2::{Digest, Sha256};

use super::part_digests::FileAndParts;
use crate::error::Error;

/// A file's SHA-256 as it is uploaded: computed from its bytes (with each
/// part's own, for a store that signs every request's payload), or known
/// beforehand (the caller hashed the file already) and then not computed
/// again.
pub(super) enum FileDigest {
    Computing(Sha256),
    WithParts(FileAndParts),
    Known(String),
}

impl FileDigest {
    pub(super) fn new(known: Option<String>) -> Self {
        known.map_or_else(|| Self::Computing(Sha256::new()), Self::Known)
    }

    /// As [`FileDigest::new`], for a file sent in parts whose own digests
    /// [`FileDigest::part`] gives.
    pub(super) fn with_parts(known: Option<String>) -> Self {
        known.map_or_else(|| Self::WithParts(FileAndParts::new()), Self::Known)
    }

    pub(super) fn update(&mut self, bytes: &[u8]) {
        match self {
            Self::Computing(hasher) => hasher.update(bytes),
            Self::WithParts(hasher) => hasher.update(bytes),
            Self::Known(_) => {}
        }
    }

    /// Feed `part`, the file's next bytes; its own SHA-256 when this digest
    /// was made [`FileDigest::with_parts`] and the file is being hashed in
    /// the same pass (else the part is hashed where its digest is needed).
    pub(super) fn part(&mut self, part: &[u8]) -> Option<[u8; 32]> {
        match self {
            Self::WithParts(hasher) => Some(hasher.part(part)),
            other => {
                other.update(part);
                None
            }
        }
    }

    /// The digest of what was given so far (or the known one), as bytes;
    /// `None` if the known one is not a SHA-256 in hex.
    pub(super) fn current(&self) -> Option<[u8; 32]> {
        match self {
            Self::Computing(hasher) => Some(hasher.clone().finalize().into()),
            Self::WithParts(hasher) => Some(hasher.digest()),
            Self::Known(hex) => hex::decode(hex).ok()?.try_into().ok(),
        }
    }

    /// The digest, in hex.
    pub(super) fn finish(self) -> String {
        match self {
            Self::Computing(hasher) => hex::encode(hasher.finalize()),
            Self::WithParts(hasher) => hex::encode(hasher.digest()),
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
