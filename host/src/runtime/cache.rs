//! An on-disk cache of compiled guests.
//!
//! Compiling a guest with Cranelift takes tens of milliseconds for a small
//! Rust guest and seconds for a large one (a Python interpreter); loading
//! the compiled artefact takes well under a millisecond. The artefact is
//! native code for one engine configuration, so the cache key covers
//! everything that decides whether it fits:
//!
//! - the engine's compatibility hash (target triple, Cranelift and ISA
//!   flags, tunables, wasm features, and the wasmtime version);
//! - the guest's bytes.
//!
//! An entry is `<key>.cwasm`: wasmtime's serialized component followed by
//! the SHA-256 of those bytes, so a truncated or damaged file is detected
//! and recompiled instead of loaded. Entries are written to a temporary file
//! and renamed into place, so hosts sharing a cache directory never see a
//! partial entry. wasmtime itself refuses an artefact from another version
//! or configuration; such an entry is recompiled and replaced.
//!
//! The cache holds native code that the host runs: it must be writable only
//! by users trusted as much as the host binary itself.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Version of the entry format, part of every key.
const FORMAT: &[u8] = b"trainhost-compiled-v1";
const DIGEST_LEN: usize = 32;

/// A directory of compiled guests.
#[derive(Debug, Clone)]
pub(crate) struct CompileCache {
    dir: PathBuf,
}

/// What the cache did for one guest, for logs and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CacheOutcome {
    /// Loaded from the cache.
    Hit,
    /// Compiled, and stored for next time.
    Miss,
    /// Compiled; an entry existed but did not fit (another wasmtime or
    /// configuration, or damaged) and was replaced.
    Replaced,
}

impl CompileCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The entry for `bytes` compiled by `engine`.
    fn entry(&self, engine: &Engine, bytes: &[u8]) -> PathBuf {
        let mut hasher = DigestHasher(Sha256::new());
        hasher.0.update(FORMAT);
        engine.precompile_compatibility_hash().hash(&mut hasher);
        hasher.0.update(Sha256::digest(bytes));
        self.dir
            .join(format!("{}.cwasm", hex::encode(hasher.0.finalize())))
    }

    /// The compiled component for `bytes`: from the cache if a fitting
    /// entry exists, else compiled by `compile` and stored. Failing to read
    /// or write the cache is never an error: the guest is compiled instead.
    pub fn get_or_compile(
        &self,
        engine: &Engine,
        bytes: &[u8],
        compile: impl FnOnce() -> Result<Component, crate::error::Error>,
    ) -> Result<(Component, CacheOutcome), crate::error::Error> {
        let entry = self.entry(engine, bytes);
        let mut outcome = CacheOutcome::Miss;
        match std::fs::read(&entry) {
            Ok(data) => match load(engine, &data) {
                Ok(component) => return Ok((component, CacheOutcome::Hit)),
                Err(reason) => {
                    tracing::warn!(
                        entry = %entry.display(),
                        "compiled guest in the cache does not fit this host ({reason}); compiling again and replacing it"
                    );
                    outcome = CacheOutcome::Replaced;
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(entry = %entry.display(), "cannot read the compile cache ({e}); compiling");
            }
        }
        let component = compile()?;
        if let Err(e) = store(&self.dir, &entry, &component) {
            tracing::warn!(
                cache = %self.dir.display(),
                "cannot write the compile cache ({e}); the next run compiles again"
            );
        }
        Ok((component, outcome))
    }
}

/// Why a cache entry is not used; it is compiled again and replaced.
#[derive(Debug, thiserror::Error)]
enum Unusable {
    #[error("entry is truncated")]
    Truncated,
    #[error("entry is damaged: its checksum does not match")]
    Damaged,
    #[error("{0:#}")]
    Refused(wasmtime::Error),
}

fn load(engine: &Engine, data: &[u8]) -> Result<Component, Unusable> {
    let Some(split) = data.len().checked_sub(DIGEST_LEN) else {
        return Err(Unusable::Truncated);
    };
    let (artefact, digest) = data.split_at(split);
    if Sha256::digest(artefact).as_slice() != digest {
        return Err(Unusable::Damaged);
    }
    // SAFETY: the bytes were produced by `Component::serialize` of a
    // wasmtime whose version and settings are part of the entry's name
    // (and wasmtime checks both again), and the checksum rules out damage.
    // What remains is the documented trust in the cache directory itself.
    unsafe { Component::deserialize(engine, artefact) }.map_err(Unusable::Refused)
}

fn store(dir: &Path, entry: &Path, component: &Component) -> std::io::Result<()> {
    let artefact = component
        .serialize()
        .map_err(|e| std::io::Error::other(format!("{e:#}")))?;
    create_private_dir(dir)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .suffix(".cwasm")
        .tempfile_in(dir)?;
    tmp.write_all(&artefact)?;
    tmp.write_all(&Sha256::digest(&artefact))?;
    // Renamed into place whole: another host reading the same entry sees
    // the old file, the new one, or none.
    tmp.persist(entry).map_err(|e| e.error)?;
    Ok(())
}

/// Create the cache directory readable and writable by its owner only: it
/// holds native code the host will run.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)
}

/// Feeds `Hash` into SHA-256, so a key is stable across processes (std's
/// hashers are randomly seeded).
struct DigestHasher(Sha256);

impl Hasher for DigestHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn finish(&self) -> u64 {
        // Only the SHA-256 state is used; `finish` is never called.
        0
    }
}

/// The cache directory used when none is given: `$TRAINHOST_CACHE_DIR`,
/// else `$XDG_CACHE_HOME/trainhost`, else `$HOME/.cache/trainhost`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("TRAINHOST_CACHE_DIR") {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("trainhost"));
    }
    var("HOME").map(|home| PathBuf::from(home).join(".cache").join("trainhost"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(epochs: bool) -> Engine {
        let mut config = wasmtime::Config::new();
        config.epoch_interruption(epochs);
        Engine::new(&config).unwrap()
    }

    fn guest() -> Vec<u8> {
        std::fs::read(trainhost_test_artifacts::TEST_GUEST).unwrap()
    }

    fn get(cache: &CompileCache, engine: &Engine, bytes: &[u8]) -> CacheOutcome {
        let compile = || Ok(Component::new(engine, bytes).unwrap());
        cache.get_or_compile(engine, bytes, compile).unwrap().1
    }

    #[test]
    fn compiles_once_then_loads() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CompileCache::new(dir.path().join("nested"));
        let (engine, bytes) = (engine(true), guest());
        assert_eq!(get(&cache, &engine, &bytes), CacheOutcome::Miss);
        assert_eq!(get(&cache, &engine, &bytes), CacheOutcome::Hit);
        // Another guest is another entry.
        let other = std::fs::read(trainhost_test_artifacts::LINEAR_REGRESSION).unwrap();
        assert_eq!(get(&cache, &engine, &other), CacheOutcome::Miss);
        let entries = std::fs::read_dir(dir.path().join("nested"))
            .unwrap()
            .count();
        assert_eq!(entries, 2, "no temporary files are left behind");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("nested"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o700, "the cache holds native code");
        }
    }

    #[test]
    fn damaged_entries_are_compiled_again() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CompileCache::new(dir.path());
        let (engine, bytes) = (engine(true), guest());
        get(&cache, &engine, &bytes);
        let entry = cache.entry(&engine, &bytes);
        let mut data = std::fs::read(&entry).unwrap();
        let middle = data.len() / 2;
        data[middle] ^= 0xff;
        std::fs::write(&entry, &data).unwrap();
        assert_eq!(get(&cache, &engine, &bytes), CacheOutcome::Replaced);
        assert_eq!(get(&cache, &engine, &bytes), CacheOutcome::Hit);
        std::fs::write(&entry, b"short").unwrap();
        assert_eq!(get(&cache, &engine, &bytes), CacheOutcome::Replaced);
    }

    #[test]
    fn settings_are_part_of_the_key_and_checked_again_on_load() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CompileCache::new(dir.path());
        let bytes = guest();
        let (with, without) = (engine(true), engine(false));
        assert_ne!(cache.entry(&with, &bytes), cache.entry(&without, &bytes));
        // An artefact of another configuration under this engine's name (a
        // cache shared by hosts built differently): wasmtime refuses it.
        get(&cache, &without, &bytes);
        std::fs::rename(cache.entry(&without, &bytes), cache.entry(&with, &bytes)).unwrap();
        assert_eq!(get(&cache, &with, &bytes), CacheOutcome::Replaced);
        assert_eq!(get(&cache, &with, &bytes), CacheOutcome::Hit);
    }
}
