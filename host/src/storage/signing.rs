//! The hashing behind S3's request signing, without hashing a checkpoint
//! file twice.
//!
//! SigV4 signs every request with the SHA-256 of its payload, which
//! `object_store` computes from the bytes it sends. A file sent in one
//! request has that payload, and the upload has just computed its SHA-256
//! for the manifest: with [`known_payload`] around the request, the
//! signing takes that digest instead of reading every byte again (with
//! perf, the two passes were half the uploading process's user time).
//! A part of a multipart upload is signed the same way with its own
//! SHA-256, which is not a step of the file's: the upload computes both in
//! one pass over the part (`part_digests`). (Over HTTPS payloads go
//! unsigned by default and none of this hashing happens; see
//! `backends.rs`.)
//!
//! The digest is taken only when the bytes hashed are the very buffers it
//! was computed from, in order (the same addresses and lengths, and
//! `Bytes` never change), so any other hashing in the request (the
//! canonical request, a part, a body `object_store` built itself) is
//! computed as before. A wrong digest could
//! not pass silently anyway: S3 rejects a payload whose SHA-256 differs
//! from the signed one.

use std::future::Future;

use hmac::{Hmac, Mac};
use object_store::PutPayload;
use object_store::client::{
    CryptoProvider, DigestAlgorithm, DigestContext, HmacContext, Signer, SigningAlgorithm,
};
use sha2::{Digest, Sha256};

tokio::task_local! {
    static KNOWN: Known;
}

/// A request payload and its SHA-256.
#[derive(Clone)]
struct Known {
    payload: PutPayload,
    sha256: [u8; 32],
}

impl Known {
    fn parts(&self) -> &[bytes::Bytes] {
        self.payload.as_ref()
    }

    /// A hasher given the first `parts` parts.
    fn hash_of_first(&self, parts: usize) -> Sha256 {
        let mut hasher = Sha256::new();
        self.parts()[..parts].iter().for_each(|p| hasher.update(p));
        hasher
    }
}

/// Run `request`, which sends `payload` as one request body, with the
/// payload's SHA-256 (`sha256`, computed by the caller from these bytes)
/// handed to the request signing.
pub(super) async fn known_payload<F: Future>(
    payload: PutPayload,
    sha256: [u8; 32],
    request: F,
) -> F::Output {
    KNOWN.scope(Known { payload, sha256 }, request).await
}

/// The [`CryptoProvider`] the S3 client is built with: SHA-256 and
/// HMAC-SHA256 from the RustCrypto crates the manifest's hashing uses,
/// taking a [`known_payload`]'s digest where one applies.
#[derive(Debug, Default)]
pub(super) struct Signing;

fn not_supported(what: String) -> object_store::Error {
    object_store::Error::NotSupported {
        source: what.into(),
    }
}

impl CryptoProvider for Signing {
    fn digest(&self, algorithm: DigestAlgorithm) -> object_store::Result<Box<dyn DigestContext>> {
        match algorithm {
            DigestAlgorithm::Sha256 => Ok(Box::new(Sha256Context::Empty)),
            other => Err(not_supported(format!("digest {other:?}"))),
        }
    }

    fn hmac(
        &self,
        algorithm: DigestAlgorithm,
        secret: &[u8],
    ) -> object_store::Result<Box<dyn HmacContext>> {
        match algorithm {
            DigestAlgorithm::Sha256 => Ok(Box::new(HmacSha256 {
                mac: Some(
                    Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length"),
                ),
                tag: [0; 32],
            })),
            other => Err(not_supported(format!("HMAC with {other:?}"))),
        }
    }

    /// Only Google's service-account keys use RSA signatures; this
    /// provider is for S3.
    fn sign(
        &self,
        algorithm: SigningAlgorithm,
        _pem: &[u8],
    ) -> object_store::Result<Box<dyn Signer>> {
        Err(not_supported(format!(
            "{algorithm:?} signatures in the S3 client"
        )))
    }
}

enum Sha256Context {
    /// Nothing given yet.
    Empty,
    /// Given exactly the first `matched` parts of a known payload.
    Known(Known, usize),
    Hashing(Sha256),
    Finished([u8; 32]),
}

/// Whether `data` is `part` itself, not equal bytes elsewhere.
fn same(part: &[u8], data: &[u8]) -> bool {
    !data.is_empty() && part.as_ptr() == data.as_ptr() && part.len() == data.len()
}

impl DigestContext for Sha256Context {
    fn update(&mut self, data: &[u8]) {
        *self = match std::mem::replace(self, Self::Empty) {
            Self::Empty => {
                let known = KNOWN
                    .try_with(|k| {
                        k.parts()
                            .first()
                            .is_some_and(|p| same(p, data))
                            .then(|| k.clone())
                    })
                    .ok()
                    .flatten();
                match known {
                    Some(k) => Self::Known(k, 1),
                    None => Self::Hashing(Sha256::new_with_prefix(data)),
                }
            }
            Self::Known(k, matched) => {
                if k.parts().get(matched).is_some_and(|p| same(p, data)) {
                    Self::Known(k, matched + 1)
                } else {
                    // Not the known payload after all: hash what was given.
                    Self::Hashing(k.hash_of_first(matched).chain_update(data))
                }
            }
            Self::Hashing(hasher) => Self::Hashing(hasher.chain_update(data)),
            // Updating a finished digest is the caller's mistake
            // (`DigestContext` leaves it undefined); start a new one.
            Self::Finished(_) => Self::Hashing(Sha256::new_with_prefix(data)),
        };
    }

    fn finish(&mut self) -> object_store::Result<&[u8]> {
        let digest = match std::mem::replace(self, Self::Empty) {
            Self::Empty => Sha256::digest([]).into(),
            Self::Known(k, matched) if matched == k.parts().len() => k.sha256,
            Self::Known(k, matched) => k.hash_of_first(matched).finalize().into(),
            Self::Finished(digest) => digest,
            Self::Hashing(hasher) => hasher.finalize().into(),
        };
        *self = Self::Finished(digest);
        match self {
            Self::Finished(digest) => Ok(digest),
            _ => unreachable!("just set"),
        }
    }
}

struct HmacSha256 {
    mac: Option<Hmac<Sha256>>,
    tag: [u8; 32],
}

impl HmacContext for HmacSha256 {
    fn update(&mut self, data: &[u8]) {
        if let Some(mac) = &mut self.mac {
            mac.update(data);
        }
    }

    fn finish(&mut self) -> object_store::Result<&[u8]> {
        if let Some(mac) = self.mac.take() {
            self.tag = mac.finalize().into_bytes().into();
        }
        Ok(&self.tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn sha256_of(provider: &Signing, parts: &[&[u8]]) -> Vec<u8> {
        let mut ctx = provider.digest(DigestAlgorithm::Sha256).unwrap();
        for part in parts {
            ctx.update(part);
        }
        ctx.finish().unwrap().to_vec()
    }

    #[test]
    fn digests_and_hmacs_are_the_standard_ones() {
        let p = Signing;
        assert_eq!(
            hex::encode(sha256_of(&p, &[b"ab", b"c"])),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex::encode(sha256_of(&p, &[])),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        // RFC 4231, test case 2.
        let mut mac = p.hmac(DigestAlgorithm::Sha256, b"Jefe").unwrap();
        mac.update(b"what do ya want ");
        mac.update(b"for nothing?");
        assert_eq!(
            hex::encode(mac.finish().unwrap()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[tokio::test]
    async fn the_known_digest_is_taken_for_its_own_buffers_only() {
        let p = Signing;
        let (a, b) = (Bytes::from(vec![7u8; 1000]), Bytes::from(vec![8u8; 10]));
        let payload = PutPayload::from_iter([a.clone(), b.clone()]);
        let whole = [&a[..], &b[..]].concat();
        let real = Sha256::digest(&whole).to_vec();
        let hash = |parts: &[&[u8]]| Sha256::digest(parts.concat()).to_vec();
        // A digest that is not the payload's shows whether it was taken.
        let marker = [1u8; 32];
        known_payload(payload.clone(), marker, async {
            assert_eq!(sha256_of(&p, &[&a, &b]), marker, "the payload itself");
            assert_eq!(sha256_of(&p, &[&whole]), real, "equal bytes elsewhere");
            assert_eq!(sha256_of(&p, &[&a]), hash(&[&a]), "its first part");
            assert_eq!(sha256_of(&p, &[&a[..500]]), hash(&[&a[..500]]), "a piece");
            assert_eq!(sha256_of(&p, &[&b, &a]), hash(&[&b, &a]), "out of order");
            assert_eq!(
                sha256_of(&p, &[&a, &b, b"more"]),
                hash(&[&a, &b, b"more"]),
                "the payload and more"
            );
            assert_eq!(
                sha256_of(&p, &[&a, b"x"]),
                hash(&[&a, b"x"]),
                "its first part and something else"
            );
            assert_eq!(
                sha256_of(&p, &[b"", &a, &b]),
                real,
                "the payload after something else"
            );
        })
        .await;
        assert_eq!(sha256_of(&p, &[&a, &b]), real, "outside the request");
    }
}
