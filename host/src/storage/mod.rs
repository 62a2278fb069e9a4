//! Where runs live: a location (local directory, `file://`, `memory://`, or
//! an object store URL) turned into an [`ObjectStore`] plus a prefix, and
//! the few operations trainhost needs on it, each naming the location and
//! the operation when it fails.
//!
//! Nothing here knows about wasm, ranks or reports; the only
//! trainhost-specific knowledge is that files are streamed with a running
//! SHA-256, which the manifest records.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::{Path as ObjectPath, PathPart};
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::config::{Location, StorageOptions};
use crate::error::Error;
use resend::Resend;

mod backends;
mod buffers;
mod conditional;
mod digest;
mod download;
mod fence;
#[cfg(test)]
pub(crate) mod held;
mod local;
mod part_digests;
mod progress;
mod resend;
mod signing;
mod transfer;

pub(crate) use conditional::Claim;
pub(crate) use digest::sha256_of;
pub(crate) use fence::Fence;
pub(crate) use progress::Meter;
// Only the benchmarks need it outside `storage`.
#[cfg(feature = "bench")]
pub(crate) use transfer::SINGLE_REQUEST_AT_MOST;

/// A storage location: an object store and a prefix inside it.
///
/// Cheap to clone; clones share the connection.
#[derive(Clone, Debug)]
pub struct Storage {
    store: Arc<dyn ObjectStore>,
    /// The same store when it is a local directory: files are then written
    /// straight to the filesystem (see [`Storage::upload_file`]).
    local: Option<Arc<LocalFileSystem>>,
    root: ObjectPath,
    url: String,
    /// Whether transfers draw progress bars.
    progress: bool,
    /// When set, writes happen only while this host owns the location.
    fence: Option<Arc<Fence>>,
    /// Whether local checkpoint files are flushed to disk as they are
    /// written (always, but in the benchmark suite's page-cache measure).
    flush: bool,
    /// How requests that never left are sent again (see [`resend`]).
    resend: Resend,
    /// Whether the store signs every request with its payload's SHA-256
    /// (S3 over plain HTTP): a file sent in parts then has each part's
    /// digest computed in the pass that hashes the file (`part_digests`).
    signs_payloads: bool,
}

impl Storage {
    /// Open a storage location: a local directory (created if missing),
    /// `memory://` (a fresh in-memory store), or an object store configured
    /// from the environment and `options` (which local and memory locations
    /// ignore).
    pub fn open(location: &Location, options: &StorageOptions) -> Result<Self, Error> {
        match location {
            Location::Local(dir) => Self::local(dir, options.progress),
            Location::Memory(prefix) => Ok(Self {
                store: Arc::new(InMemory::new()),
                local: None,
                root: ObjectPath::from(prefix.as_str()),
                url: location.to_string(),
                progress: false,
                fence: None,
                flush: true,
                resend: Resend::never(),
                signs_payloads: false,
            }),
            Location::ObjectStore(url) => {
                let cloud = backends::cloud(url.as_str(), url, options)?;
                Ok(Self {
                    store: cloud.store,
                    local: None,
                    root: cloud.root,
                    url: url.as_str().to_owned(),
                    progress: options.progress,
                    fence: None,
                    flush: true,
                    resend: Resend::new(options),
                    signs_payloads: cloud.signs_payloads,
                })
            }
        }
    }

    /// The root of `store`, named `url` (for tests that put a store of
    /// their own behind a location).
    #[cfg(test)]
    pub(crate) fn from_store(store: Arc<dyn ObjectStore>, url: &str) -> Self {
        Self {
            store,
            local: None,
            root: ObjectPath::default(),
            url: url.to_owned(),
            progress: false,
            fence: None,
            flush: true,
            resend: Resend::never(),
            signs_payloads: false,
        }
    }

    /// Check that the location answers and can be written, so that missing
    /// credentials, a wrong endpoint or a missing bucket show before any
    /// rank starts: write, read back and delete a small object.
    pub async fn probe(&self) -> Result<(), Error> {
        const PROBE: &str = ".trainhost-probe";
        let hint = |e: Error| match e {
            Error::Storage {
                url,
                operation,
                source,
            } => Error::Storage {
                url,
                operation: format!(
                    "{operation} (checking the storage before starting: is the bucket there, the endpoint right, are the credentials valid?)"
                ),
                source,
            },
            other => other,
        };
        self.put(PROBE, Bytes::from_static(b"trainhost"))
            .await
            .map_err(hint)?;
        self.get(PROBE).await.map_err(hint)?;
        self.delete(PROBE).await.map_err(hint)
    }

    /// A local directory, created if missing.
    fn local(dir: &Path, progress: bool) -> Result<Self, Error> {
        if dir.is_file() {
            return Err(Error::InvalidConfig(format!(
                "{} is a file, not a directory; give a directory (it is created if missing) or a URL",
                dir.display()
            )));
        }
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            operation: "create the storage directory",
            source,
        })?;
        let abs = std::fs::canonicalize(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            operation: "resolve the storage directory",
            source,
        })?;
        let store = LocalFileSystem::new_with_prefix(&abs)
            .map_err(|e| Error::InvalidConfig(format!("storage directory {}: {e}", abs.display())))?
            // Deleting a checkpoint's files removes its now empty directories.
            .with_automatic_cleanup(true)
            // A manifest, run state or history written here must survive a
            // power loss once written (R11, R12), not only a killed process.
            .with_fsync(true);
        let store = Arc::new(store);
        Ok(Self {
            local: Some(Arc::clone(&store)),
            store,
            root: ObjectPath::default(),
            url: abs.display().to_string(),
            progress,
            fence: None,
            flush: true,
            resend: Resend::never(),
            signs_payloads: false,
        })
    }

    /// The location below this one at `relative` (`/`-separated).
    pub fn child(&self, relative: &str) -> Self {
        let root = self.object_path(relative);
        let url = if self.url.ends_with('/') {
            format!("{}{relative}", self.url)
        } else {
            format!("{}/{relative}", self.url)
        };
        Self {
            store: Arc::clone(&self.store),
            local: self.local.clone(),
            root,
            url,
            progress: self.progress,
            fence: self.fence.clone(),
            flush: self.flush,
            resend: self.resend,
            signs_payloads: self.signs_payloads,
        }
    }

    /// This location, with local checkpoint files left in the page cache
    /// as they are written: the benchmark suite's measure of persisting
    /// without the disk.
    #[cfg(feature = "bench")]
    pub(crate) fn without_flush(self) -> Self {
        Self {
            flush: false,
            ..self
        }
    }

    /// This location, written only while `fence` says this host owns it;
    /// locations below it inherit the fence.
    pub(crate) fn fenced(&self, fence: Arc<Fence>) -> Self {
        Self {
            fence: Some(fence),
            ..self.clone()
        }
    }

    /// Run the write `make()` builds, fenced if this location is (see
    /// [`Fence::guard`]), and send it again if it never left this host.
    async fn write<T, F, Fut>(&self, mut make: F) -> Result<T, Error>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, Error>>,
    {
        let mut attempts = self.resend.attempts();
        loop {
            match self.fenced_write(&mut make).await {
                Err(e) if attempts.again(&e).await => {}
                result => return result,
            }
        }
    }

    /// Run the write `make()` builds, fenced if this location is: made
    /// again from the start if ownership lapses while it is in flight.
    async fn fenced_write<T, F, Fut>(&self, mut make: F) -> Result<T, Error>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, Error>>,
    {
        match &self.fence {
            Some(fence) => fence.guard(&self.url, make).await,
            None => make().await,
        }
    }

    /// A meter for a transfer of `total` bytes, drawn if this storage was
    /// opened with progress bars.
    pub(crate) fn meter(&self, total: u64, what: String) -> Meter {
        Meter::start(self.progress, total, what)
    }

    /// The location as the user would write it (a directory or URL).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The local directory behind this location, if it is a local one
    /// (its URL is the directory's absolute path).
    pub fn local_path(&self) -> Option<&Path> {
        self.local.as_ref().map(|_| Path::new(&self.url))
    }

    fn object_path(&self, relative: &str) -> ObjectPath {
        let mut path = self.root.clone();
        for part in relative.split('/').filter(|p| !p.is_empty()) {
            path = path.join(PathPart::from(part));
        }
        path
    }

    fn error(&self, operation: String, source: object_store::Error) -> Error {
        Error::Storage {
            url: self.url.clone(),
            operation,
            source,
        }
    }

    /// Copy the object at `source`/`from` to `to` below this location
    /// without sending its bytes again: a server-side copy on object
    /// stores, a hard link on local storage. Both locations must be in the
    /// same store (children of one [`Storage`]).
    pub async fn copy_from(&self, source: &Storage, from: &str, to: &str) -> Result<(), Error> {
        debug_assert!(Arc::ptr_eq(&self.store, &source.store));
        let (from_path, to_path) = (source.object_path(from), self.object_path(to));
        self.write(|| async {
            self.store
                .copy(&from_path, &to_path)
                .await
                .map_err(|e| self.error(format!("copy {}/{from} to {to}", source.url), e))
        })
        .await
    }

    /// Store `data` at `relative`, replacing what was there.
    pub async fn put(&self, relative: &str, data: Bytes) -> Result<(), Error> {
        let path = self.object_path(relative);
        self.write(|| async {
            self.store
                .put(&path, PutPayload::from(data.clone()))
                .await
                .map(drop)
                .map_err(|e| self.error(format!("write {relative}"), e))
        })
        .await
    }

    /// The bytes at `relative`, or `None` if there is no such object.
    pub async fn get(&self, relative: &str) -> Result<Option<Bytes>, Error> {
        let path = self.object_path(relative);
        self.resend
            .run(|| async {
                match self.store.get(&path).await {
                    Ok(r) => r
                        .bytes()
                        .await
                        .map(Some)
                        .map_err(|e| self.error(format!("read {relative}"), e)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(self.error(format!("read {relative}"), e)),
                }
            })
            .await
    }

    /// Delete the object at `relative`; deleting a missing object is fine.
    pub async fn delete(&self, relative: &str) -> Result<(), Error> {
        self.delete_path(&self.object_path(relative), relative)
            .await
    }

    async fn delete_path(&self, path: &ObjectPath, shown: &str) -> Result<(), Error> {
        self.write(|| async {
            match self.store.delete(path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(self.error(format!("delete {shown}"), e)),
            }
        })
        .await
    }

    /// Delete every object below `relative` but those at the paths in
    /// `keep` (relative to this location).
    pub async fn delete_all(&self, relative: &str, keep: &[&str]) -> Result<(), Error> {
        let prefix = self.object_path(relative);
        let keep: Vec<ObjectPath> = keep.iter().map(|k| self.object_path(k)).collect();
        let mut listing = self.store.list(Some(&prefix));
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(|e| self.error(format!("list {relative}"), e))?;
            if keep.contains(&meta.location) {
                continue;
            }
            self.delete_path(&meta.location, meta.location.as_ref())
                .await?;
        }
        Ok(())
    }

    /// The names of the "directories" directly below `relative`.
    pub async fn list_dirs(&self, relative: &str) -> Result<Vec<String>, Error> {
        let prefix = self.object_path(relative);
        let listing = self
            .resend
            .run(|| async {
                self.store
                    .list_with_delimiter(Some(&prefix))
                    .await
                    .map_err(|e| self.error(format!("list {relative}"), e))
            })
            .await?;
        Ok(listing
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_owned))
            .collect())
    }

    /// The size of the object at `relative`, from its metadata.
    pub async fn size(&self, relative: &str) -> Result<u64, Error> {
        let path = self.object_path(relative);
        self.resend
            .run(|| async {
                self.store
                    .head(&path)
                    .await
                    .map(|meta| meta.size)
                    .map_err(|e| self.error(format!("read the metadata of {relative}"), e))
            })
            .await
    }
}
