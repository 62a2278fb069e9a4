//! Reading checkpoint files back out of storage: streamed into a file
//! with the SHA-256 the manifest is checked against, or, from a local
//! directory, hard-linked and read back once.

use std::path::Path;

use bytes::Bytes;
use futures::StreamExt;
use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use super::transfer::blocking;
use super::{Meter, Storage, local};
use crate::error::Error;

impl Storage {
    /// Stream the object at `relative` into `out`, returning the number of
    /// bytes and their SHA-256. `shown` names `out` in errors.
    pub async fn download_to(
        &self,
        relative: &str,
        out: std::fs::File,
        shown: &Path,
        meter: &Meter,
    ) -> Result<(u64, String), Error> {
        if let Some(local) = &self.local {
            // One blocking task copies and hashes the whole file. Through
            // `object_store` a local read is a blocking-pool round trip per
            // 8 KiB chunk, and each write another: on a busy machine, where
            // every round trip waits for a core, restoring 4 MiB took 35 to
            // 70 ms.
            let source = local
                .path_to_filesystem(&self.object_path(relative))
                .map_err(|e| self.error(format!("download {relative}"), e))?;
            let (shown, meter) = (shown.to_path_buf(), meter.clone());
            let what = relative.to_owned();
            return blocking(relative, "restore a checkpoint file", move || {
                local::copy_file(&source, &what, out, &shown, &meter)
            })
            .await;
        }
        let mut out = tokio::fs::File::from_std(out);
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

    /// Restore the object at `relative` as `target` in `dir` (`shown` in
    /// errors) by hard-linking the stored file, when this storage is a
    /// local directory on the same file system, and hash it by reading it
    /// back. The restored file then shares the stored one's blocks, so the
    /// caller must never write it (the ranks see restored checkpoints
    /// read-only). Returns its size and SHA-256, or `None` when it cannot be
    /// linked (an object store, another file system), for the caller to
    /// copy it instead with [`Storage::download_to`].
    pub async fn link_into(
        &self,
        relative: &str,
        dir: &cap_std::fs::Dir,
        target: &str,
        shown: &Path,
        meter: &Meter,
    ) -> Result<Option<(u64, String)>, Error> {
        let Some(local) = &self.local else {
            return Ok(None);
        };
        let source = local
            .path_to_filesystem(&self.object_path(relative))
            .map_err(|e| self.error(format!("download {relative}"), e))?;
        let dir = dir.try_clone().map_err(|source| Error::Io {
            path: shown.to_path_buf(),
            operation: "open the directory to restore into",
            source,
        })?;
        let (target, shown, meter) = (target.to_owned(), shown.to_path_buf(), meter.clone());
        blocking(relative, "restore a checkpoint file", move || {
            local::link_file(&source, &dir, &target, &shown, &meter)
        })
        .await
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
        let path = self.object_path(relative);
        self.resend
            .run(|| async {
                self.store
                    .get(&path)
                    .await
                    .map(|r| r.into_stream())
                    .map_err(|e| self.error(format!("read {relative}"), e))
            })
            .await
    }
}
