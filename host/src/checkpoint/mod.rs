//! Checkpoints as the user sees them: opened from storage by their
//! manifest, verified, and copied to local directories (R26). Reading a
//! checkpoint never changes it.

mod listing;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cap_std::ambient_authority;
use cap_std::fs::Dir;
use futures::{StreamExt, TryStreamExt};

pub use listing::{committed_checkpoints, committed_checkpoints_with, stored_history};

use crate::config::{Location, StorageOptions};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::record::{self, Manifest};
use crate::storage::Storage;

/// How many files are downloaded or verified at once.
const CONCURRENT_FILES: usize = 8;

/// What may be done with a restored checkpoint's files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// They may be changed: every file is a copy of its own.
    Writable,
    /// They are only ever read (the ranks see restored checkpoints
    /// read-only): a file of local storage on the same file system is
    /// hard-linked instead of copied, so restoring it writes nothing and
    /// takes no space.
    ReadOnly,
}

/// A committed checkpoint in storage (R26).
///
/// Open one by location with [`Checkpoint::open`], or take one from a
/// [`crate::TrainResult`]. Reading it never changes it.
///
/// ```no_run
/// let checkpoint = trainhost::Checkpoint::open("./trainhost_results/my-run/checkpoint_000004")?;
/// println!("loss at commit: {:?}", checkpoint.metrics().get("loss"));
/// let dir = checkpoint.to_directory("./restored")?;
/// # Ok::<(), trainhost::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Checkpoint {
    storage: Storage,
    manifest: Arc<Manifest>,
}

impl Checkpoint {
    /// Open the committed checkpoint at `location` (a directory or a
    /// storage URL of a `checkpoint_NNNNNN` directory). Fails unless its
    /// manifest exists and is readable. Object stores are configured from
    /// the environment; see [`Checkpoint::open_with`] for more. Blocks;
    /// from async code use [`Checkpoint::open_async`].
    pub fn open(location: &str) -> Result<Self, Error> {
        Self::open_with(location, &StorageOptions::default())
    }

    /// [`Checkpoint::open`] with storage options (endpoint, credentials,
    /// retries).
    pub fn open_with(location: &str, options: &StorageOptions) -> Result<Self, Error> {
        block_on(Self::open_async(location, options))
    }

    /// [`Checkpoint::open_with`] for async callers.
    pub async fn open_async(location: &str, options: &StorageOptions) -> Result<Self, Error> {
        Self::load(Storage::open(&Location::parse(location)?, options)?).await
    }

    pub(crate) async fn load(storage: Storage) -> Result<Self, Error> {
        let manifest = record::read_manifest(&storage).await?;
        Ok(Self {
            storage,
            manifest: Arc::new(manifest),
        })
    }

    /// Where the checkpoint is stored (a directory or URL).
    pub fn location(&self) -> &str {
        self.storage.url()
    }

    /// The checkpoint's index in its run.
    pub fn index(&self) -> u64 {
        self.manifest.checkpoint_index
    }

    /// The metrics it was reported with.
    pub fn metrics(&self) -> &Metrics {
        &self.manifest.metrics
    }

    /// Its manifest: files with sizes and checksums, contributing ranks,
    /// report index, commit time.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Check that every file in storage matches the manifest's size and
    /// SHA-256.
    pub fn verify(&self) -> Result<(), Error> {
        block_on(self.verify_async())
    }

    /// [`Checkpoint::verify`] for async callers.
    pub async fn verify_async(&self) -> Result<(), Error> {
        futures::stream::iter(&self.manifest.files)
            .map(|f| async move {
                let (size, sha) = self.storage.digest(&f.path).await?;
                self.check(&f.path, f.size, &f.sha256, size, &sha)
            })
            .buffer_unordered(CONCURRENT_FILES)
            .try_collect::<()>()
            .await
    }

    fn check(
        &self,
        path: &str,
        size: u64,
        sha: &str,
        got_size: u64,
        got_sha: &str,
    ) -> Result<(), Error> {
        if size != got_size {
            return Err(Error::Verification {
                location: self.location().to_owned(),
                reason: format!("{path} holds {got_size} bytes, the manifest says {size}"),
            });
        }
        if sha != got_sha {
            return Err(Error::Verification {
                location: self.location().to_owned(),
                reason: format!("{path} has SHA-256 {got_sha}, the manifest says {sha}"),
            });
        }
        Ok(())
    }

    /// Copy the checkpoint's files into `dest`, verifying each against the
    /// manifest, and return `dest`. `dest` must not exist or be an empty
    /// directory. The files are downloaded beside `dest` and moved into
    /// place only once all of them verified, so a failure leaves no
    /// partial `dest`.
    pub fn to_directory(&self, dest: impl AsRef<Path>) -> Result<PathBuf, Error> {
        block_on(self.to_directory_async(dest.as_ref()))
    }

    /// [`Checkpoint::to_directory`] for async callers.
    pub async fn to_directory_async(&self, dest: &Path) -> Result<PathBuf, Error> {
        let io = |path: &Path, operation, source| Error::Io {
            path: path.to_path_buf(),
            operation,
            source,
        };
        if let Ok(mut entries) = std::fs::read_dir(dest) {
            if entries.next().is_some() {
                return Err(Error::InvalidConfig(format!(
                    "{} is not empty; restore a checkpoint into a new or empty directory",
                    dest.display()
                )));
            }
        } else if dest.exists() {
            return Err(Error::InvalidConfig(format!(
                "{} exists and is not a directory",
                dest.display()
            )));
        }
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent)
            .map_err(|e| io(&parent, "create the directory to restore into", e))?;
        let staging = tempfile::Builder::new()
            .prefix(".trainhost-restore-")
            .tempdir_in(&parent)
            .map_err(|e| io(&parent, "create a staging directory", e))?;
        self.download_into(staging.path(), Access::Writable).await?;
        if dest.exists() {
            std::fs::remove_dir(dest).map_err(|e| io(dest, "replace the empty directory", e))?;
        }
        let staged = staging.keep();
        std::fs::rename(&staged, dest)
            .map_err(|e| io(dest, "move the restored checkpoint into place", e))?;
        Ok(dest.to_path_buf())
    }

    /// The checkpoint as a local directory: the storage directory itself
    /// (verified) when storage is local, else a verified download into a
    /// temporary directory that is removed when the returned value drops.
    pub fn as_directory(&self) -> Result<CheckpointDir, Error> {
        if let Some(path) = self.storage.local_path() {
            self.verify()?;
            return Ok(CheckpointDir {
                path: path.to_path_buf(),
                _temp: None,
            });
        }
        let temp = tempfile::Builder::new()
            .prefix("trainhost-checkpoint-")
            .tempdir()
            .map_err(|e| Error::Io {
                path: std::env::temp_dir(),
                operation: "create a temporary directory",
                source: e,
            })?;
        block_on(self.download_into(temp.path(), Access::Writable))?;
        Ok(CheckpointDir {
            path: temp.path().to_path_buf(),
            _temp: Some(temp),
        })
    }

    /// Download every file into the existing empty directory `root`,
    /// verifying each, as `access` allows.
    pub(crate) async fn download_into(&self, root: &Path, access: Access) -> Result<(), Error> {
        let dir = Dir::open_ambient_dir(root, ambient_authority()).map_err(|source| Error::Io {
            path: root.to_path_buf(),
            operation: "open the directory to restore into",
            source,
        })?;
        let dir = &dir;
        let meter = self.storage.meter(
            self.manifest.total_bytes(),
            format!(
                "↓ {}",
                self.location().rsplit('/').next().unwrap_or_default()
            ),
        );
        let meter = &meter;
        let result = futures::stream::iter(&self.manifest.files)
            .map(|f| async move {
                let shown = root.join(&f.path);
                let io = |source| Error::Io {
                    path: shown.clone(),
                    operation: "create a restored checkpoint file",
                    source,
                };
                if let Some((parent, _)) = f.path.rsplit_once('/') {
                    dir.create_dir_all(parent).map_err(io)?;
                }
                if access == Access::ReadOnly
                    && let Some((size, sha)) = self
                        .storage
                        .link_into(&f.path, dir, &f.path, &shown, meter)
                        .await?
                {
                    return self.check(&f.path, f.size, &f.sha256, size, &sha);
                }
                let file = dir.create(&f.path).map_err(io)?.into_std();
                let (size, sha) = self
                    .storage
                    .download_to(&f.path, file, &shown, meter)
                    .await?;
                self.check(&f.path, f.size, &f.sha256, size, &sha)
            })
            .buffer_unordered(CONCURRENT_FILES)
            .try_collect::<()>()
            .await;
        meter.finish();
        result
    }
}

/// A checkpoint as a local directory; see [`Checkpoint::as_directory`].
///
/// ```no_run
/// let checkpoint = trainhost::Checkpoint::open("s3://bucket/runs/demo/checkpoint_000004")?;
/// let dir = checkpoint.as_directory()?; // downloaded and verified
/// let weights = std::fs::read(dir.path().join("model.safetensors"))?;
/// // the download is removed when `dir` drops
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct CheckpointDir {
    path: PathBuf,
    _temp: Option<tempfile::TempDir>,
}

impl CheckpointDir {
    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for CheckpointDir {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

/// Run `fut` to completion on a small runtime of its own. The blocking
/// conveniences of the public API use this.
pub(crate) fn block_on<T>(fut: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Error::InsideAsyncRuntime);
    }
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| Error::Io {
            path: PathBuf::from("<tokio runtime>"),
            operation: "start an async runtime",
            source,
        })?
        .block_on(fut)
}
