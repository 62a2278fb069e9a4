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
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::config::{Location, StorageOptions};
use crate::error::Error;

mod backends;
#[cfg(test)]
pub(crate) mod held;
mod local;
mod progress;

pub(crate) use progress::Meter;

/// Files up to this size go up in one request; larger ones as multipart
/// uploads of parts this size. Memory per file in flight is bounded by
/// `PART_SIZE * MAX_PARTS_IN_FLIGHT`, whatever the file's size.
const PART_SIZE: usize = 8 * 1024 * 1024;
const MAX_PARTS_IN_FLIGHT: usize = 4;

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
            }),
            Location::ObjectStore(url) => {
                let (store, root) = backends::cloud(url.as_str(), url, options)?;
                Ok(Self {
                    store,
                    local: None,
                    root,
                    url: url.as_str().to_owned(),
                    progress: options.progress,
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
        self.store
            .copy(&source.object_path(from), &self.object_path(to))
            .await
            .map_err(|e| self.error(format!("copy {}/{from} to {to}", source.url), e))
    }

    /// Store `data` at `relative`, replacing what was there.
    pub async fn put(&self, relative: &str, data: Bytes) -> Result<(), Error> {
        self.store
            .put(&self.object_path(relative), PutPayload::from(data))
            .await
            .map(drop)
            .map_err(|e| self.error(format!("write {relative}"), e))
    }

    /// The bytes at `relative`, or `None` if there is no such object.
    pub async fn get(&self, relative: &str) -> Result<Option<Bytes>, Error> {
        let path = self.object_path(relative);
        match self.store.get(&path).await {
            Ok(r) => r
                .bytes()
                .await
                .map(Some)
                .map_err(|e| self.error(format!("read {relative}"), e)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(format!("read {relative}"), e)),
        }
    }

    /// Delete the object at `relative`; deleting a missing object is fine.
    pub async fn delete(&self, relative: &str) -> Result<(), Error> {
        match self.store.delete(&self.object_path(relative)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error(format!("delete {relative}"), e)),
        }
    }

    /// Delete every object below `relative`.
    pub async fn delete_all(&self, relative: &str) -> Result<(), Error> {
        let prefix = self.object_path(relative);
        let mut listing = self.store.list(Some(&prefix));
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(|e| self.error(format!("list {relative}"), e))?;
            match self.store.delete(&meta.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.error(format!("delete {}", meta.location), e)),
            }
        }
        Ok(())
    }

    /// The names of the "directories" directly below `relative`.
    pub async fn list_dirs(&self, relative: &str) -> Result<Vec<String>, Error> {
        let prefix = self.object_path(relative);
        let listing = self
            .store
            .list_with_delimiter(Some(&prefix))
            .await
            .map_err(|e| self.error(format!("list {relative}"), e))?;
        Ok(listing
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_owned))
            .collect())
    }

    /// Make the files [`Storage::upload_file`] wrote durable: they survive
    /// a power loss once this returns. A manifest must not be written
    /// before (R11). Object stores and `object_store`'s own local writes
    /// are durable when their call returns, so this only acts on local
    /// storage, whose checkpoint files are written directly and left to
    /// the page cache until one sync of the whole file system, far cheaper
    /// than a sync per file for checkpoints of many files.
    pub async fn sync_uploads(&self) -> Result<(), Error> {
        let Some(dir) = self.local_path().map(Path::to_path_buf) else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || local::sync_file_system(&dir))
            .await
            .map_err(|e| Error::Io {
                path: self.url.clone().into(),
                operation: "sync the file system",
                source: std::io::Error::other(e),
            })?
    }

    /// Stream `file` (of `size` bytes) to `relative`, returning its SHA-256
    /// (`known_sha256` when the caller already hashed it).
    ///
    /// Small files go up in one request; large ones as a multipart upload
    /// whose parts are sent concurrently. Memory use is bounded whatever the
    /// file's size. Fails if the file does not hold exactly `size` bytes
    /// (it changed while being read).
    pub async fn upload_file(
        &self,
        relative: &str,
        file: std::fs::File,
        size: u64,
        known_sha256: Option<String>,
        meter: &Meter,
    ) -> Result<String, Error> {
        let location = self.object_path(relative);
        if let Some(local) = &self.local {
            let target = local
                .path_to_filesystem(&location)
                .map_err(|e| self.error(format!("upload {relative}"), e))?;
            let (shown, meter) = (relative.to_owned(), meter.clone());
            return tokio::task::spawn_blocking(move || {
                local::write_file(file, &shown, &target, size, known_sha256, &meter)
            })
            .await
            .map_err(|e| Error::Io {
                path: relative.into(),
                operation: "write a checkpoint file",
                source: std::io::Error::other(e),
            })?;
        }
        let mut file = tokio::fs::File::from_std(file);
        let mut hasher = FileDigest::new(known_sha256);
        let mut read = 0u64;
        let io_err = |source: std::io::Error| Error::Io {
            path: relative.into(),
            operation: "read a checkpoint file",
            source,
        };
        if size <= PART_SIZE as u64 {
            let mut buf = Vec::with_capacity(size as usize);
            (&mut file)
                .take(size + 1)
                .read_to_end(&mut buf)
                .await
                .map_err(io_err)?;
            read = buf.len() as u64;
            check_size(relative, size, read)?;
            hasher.update(&buf);
            self.store
                .put(&location, PutPayload::from(buf))
                .await
                .map_err(|e| self.error(format!("upload {relative}"), e))?;
            meter.inc(read);
        } else {
            let upload = self
                .store
                .put_multipart(&location)
                .await
                .map_err(|e| self.error(format!("start multipart upload of {relative}"), e))?;
            let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
            let mut buf = vec![0u8; PART_SIZE];
            loop {
                let n = match file.read(&mut buf).await {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = writer.abort().await;
                        return Err(io_err(e));
                    }
                };
                if n == 0 {
                    break;
                }
                read += n as u64;
                hasher.update(&buf[..n]);
                if let Err(e) = writer.wait_for_capacity(MAX_PARTS_IN_FLIGHT).await {
                    return Err(self.error(format!("upload {relative}"), e));
                }
                writer.write(&buf[..n]);
                meter.inc(n as u64);
            }
            if let Err(e) = check_size(relative, size, read) {
                let _ = writer.abort().await;
                return Err(e);
            }
            writer
                .finish()
                .await
                .map_err(|e| self.error(format!("finish upload of {relative}"), e))?;
        }
        Ok(hasher.finish())
    }

    /// Stream the object at `relative` into `out`, returning the number of
    /// bytes and their SHA-256. `shown` names `out` in errors.
    pub async fn download_to(
        &self,
        relative: &str,
        mut out: tokio::fs::File,
        shown: &Path,
        meter: &Meter,
    ) -> Result<(u64, String), Error> {
        let io_err = |source| Error::Io {
            path: shown.to_path_buf(),
            operation: "write a restored checkpoint file",
            source,
        };
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        let mut stream = self.get_stream(relative).await?;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.error(format!("download {relative}"), e))?;
            hasher.update(&chunk);
            size += chunk.len() as u64;
            meter.inc(chunk.len() as u64);
            out.write_all(&chunk).await.map_err(io_err)?;
        }
        out.flush().await.map_err(io_err)?;
        Ok((size, hex::encode(hasher.finalize())))
    }

    /// The size of the object at `relative`, from its metadata.
    pub async fn size(&self, relative: &str) -> Result<u64, Error> {
        self.store
            .head(&self.object_path(relative))
            .await
            .map(|meta| meta.size)
            .map_err(|e| self.error(format!("read the metadata of {relative}"), e))
    }

    /// The size and SHA-256 of the object at `relative`, read as a stream.
    pub async fn digest(&self, relative: &str) -> Result<(u64, String), Error> {
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        let mut stream = self.get_stream(relative).await?;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.error(format!("read {relative}"), e))?;
            hasher.update(&chunk);
            size += chunk.len() as u64;
        }
        Ok((size, hex::encode(hasher.finalize())))
    }

    async fn get_stream(
        &self,
        relative: &str,
    ) -> Result<futures::stream::BoxStream<'static, object_store::Result<Bytes>>, Error> {
        self.store
            .get(&self.object_path(relative))
            .await
            .map(|r| r.into_stream())
            .map_err(|e| self.error(format!("read {relative}"), e))
    }
}

/// A file's SHA-256 as it is uploaded: computed from its bytes, or known
/// beforehand (the caller hashed the file already) and then not computed
/// again.
enum FileDigest {
    Computing(Sha256),
    Known(String),
}

impl FileDigest {
    fn new(known: Option<String>) -> Self {
        known.map_or_else(|| Self::Computing(Sha256::new()), Self::Known)
    }

    fn update(&mut self, bytes: &[u8]) {
        if let Self::Computing(hasher) = self {
            hasher.update(bytes);
        }
    }

    /// The digest, in hex.
    fn finish(self) -> String {
        match self {
            Self::Computing(hasher) => hex::encode(hasher.finalize()),
            Self::Known(hex) => hex,
        }
    }
}

fn check_size(relative: &str, expected: u64, read: u64) -> Result<(), Error> {
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
