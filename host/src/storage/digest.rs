//! A file's SHA-256 as it is written to storage, and the check that it
//! held the bytes it was listed with; shared by both ways of writing. And a
//! file hashed before its upload, with what the upload will need.

use std::io::Read;

use sha2::{Digest, Sha256};

use super::buffers::PART_SIZE;
use super::part_digests::FileAndParts;
use crate::error::Error;

/// A file hashed before it is uploaded (to look for it among the files
/// stored already, `Storage::hash_for_upload`): its SHA-256 and, when the
/// upload will sign each part of the file with the part's own, those too,
/// computed in the same pass, so that the upload hashes nothing again.
#[derive(Debug, Clone)]
pub(crate) struct Hashed {
    pub(crate) sha256: String,
    parts: Vec<[u8; 32]>,
}

/// The SHA-256 of the file at `path` in `dir`.
pub(crate) fn sha256_of(dir: &cap_std::fs::Dir, path: &str) -> Result<String, Error> {
    hash_file(dir, path, false).map(|h| h.sha256)
}

/// Hash the file at `path` in `dir`, with the digest of each part of
/// [`PART_SIZE`] when `parts`.
pub(super) fn hash_file(dir: &cap_std::fs::Dir, path: &str, parts: bool) -> Result<Hashed, Error> {
    let io_err = |source| Error::Io {
        path: path.into(),
        operation: "read a checkpoint file",
        source,
    };
    let mut file = dir.open(path).map_err(io_err)?;
    let mut buf = vec![0u8; 1 << 20];
    if !parts {
        let mut hasher = Sha256::new();
        loop {
            match file.read(&mut buf).map_err(io_err)? {
                0 => break,
                n => hasher.update(&buf[..n]),
            }
        }
        return Ok(Hashed {
            sha256: hex::encode(hasher.finalize()),
            parts: Vec::new(),
        });
    }
    let mut hasher = FileAndParts::new();
    let mut digests = Vec::new();
    let mut in_part = 0;
    loop {
        // A read never runs past the end of a part.
        let want = buf.len().min(PART_SIZE - in_part);
        let n = file.read(&mut buf[..want]).map_err(io_err)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        in_part += n;
        if in_part == PART_SIZE {
            digests.push(hasher.end_part());
            in_part = 0;
        }
    }
    if in_part > 0 {
        digests.push(hasher.end_part());
    }
    Ok(Hashed {
        sha256: hex::encode(hasher.digest()),
        parts: digests,
    })
}

/// A file's SHA-256 as it is uploaded: computed from its bytes (with each
/// part's own, for a store that signs every request's payload), or known
/// beforehand (the caller hashed the file already, perhaps with its parts)
/// and then not computed again. Cloned to start again from the same point
/// (an upload made again from the start).
#[derive(Clone)]
pub(super) enum FileDigest {
    Computing(Sha256),
    WithParts(FileAndParts),
    Known(String, std::vec::IntoIter<[u8; 32]>),
}

impl FileDigest {
    pub(super) fn new(known: Option<String>) -> Self {
        known.map_or_else(
            || Self::Computing(Sha256::new()),
            |sha256| Self::Known(sha256, Vec::new().into_iter()),
        )
    }

    /// For a file sent in parts, each signed with its own digest, which
    /// [`FileDigest::part`] gives.
    pub(super) fn with_parts() -> Self {
        Self::WithParts(FileAndParts::new())
    }

    /// The digests of a file hashed before.
    pub(super) fn known(hashed: Hashed) -> Self {
        Self::Known(hashed.sha256, hashed.parts.into_iter())
    }

    pub(super) fn update(&mut self, bytes: &[u8]) {
        match self {
            Self::Computing(hasher) => hasher.update(bytes),
            Self::WithParts(hasher) => hasher.update(bytes),
            Self::Known(..) => {}
        }
    }

    /// Feed `part`, the file's next bytes; its own SHA-256 when this digest
    /// computes or knows those of the parts (else the part is hashed where
    /// its digest is needed).
    pub(super) fn part(&mut self, part: &[u8]) -> Option<[u8; 32]> {
        match self {
            Self::WithParts(hasher) => Some(hasher.part(part)),
            Self::Known(_, parts) => parts.next(),
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
            Self::Known(hex, _) => hex::decode(hex).ok()?.try_into().ok(),
        }
    }

    /// The digest, in hex.
    pub(super) fn finish(self) -> String {
        match self {
            Self::Computing(hasher) => hex::encode(hasher.finalize()),
            Self::WithParts(hasher) => hex::encode(hasher.digest()),
            Self::Known(hex, _) => hex,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_hashed_before_its_upload_has_its_parts_digests_when_asked() {
        let tmp = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..2 * PART_SIZE + 5).map(|i| (i % 251) as u8).collect();
        std::fs::write(tmp.path().join("f"), &data).unwrap();
        let dir =
            cap_std::fs::Dir::open_ambient_dir(tmp.path(), cap_std::ambient_authority()).unwrap();
        let sha256 = |b: &[u8]| -> [u8; 32] { Sha256::digest(b).into() };

        let plain = hash_file(&dir, "f", false).unwrap();
        assert_eq!(plain.sha256, hex::encode(sha256(&data)));
        assert!(plain.parts.is_empty());

        let with_parts = hash_file(&dir, "f", true).unwrap();
        assert_eq!(with_parts.sha256, plain.sha256);
        let expected: Vec<[u8; 32]> = data.chunks(PART_SIZE).map(sha256).collect();
        assert_eq!(with_parts.parts, expected);

        // The upload takes them in order, then hashes any part beyond.
        let mut known = FileDigest::known(with_parts);
        for part in &expected {
            assert_eq!(known.part(b"not read").as_ref(), Some(part));
        }
        assert_eq!(known.part(b"more"), None);
        assert_eq!(known.finish(), plain.sha256);
    }
}
