//! Moving checkpoint files into storage: streamed, with a running SHA-256
//! that the manifest records, in bounded memory whatever a file's size;
//! and making local writes durable. (Reading them back: `download`.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use object_store::path::Path as ObjectPath;
use object_store::{MultipartUpload, ObjectStoreExt, PutMultipartOptions, PutPayload, UploadPart};
use sha2::{Digest, Sha256};

use super::buffers::{Buffer, PART_SIZE};
use super::digest::{self, FileDigest, Hashed, check_size};
use super::{Meter, Storage, local, signing};
use crate::error::Error;

/// Files up to [`SINGLE_REQUEST_BUFFERS`] × [`PART_SIZE`] go up in one
/// request, signed with the SHA-256 the manifest records (`signing`);
/// larger ones as multipart uploads of parts of [`PART_SIZE`], each part
/// signed with its own SHA-256, computed in the same pass as the file's
/// (`part_digests`). Files are read into the process's
/// pool of buffers (`buffers`), which bounds the bytes in flight, whatever
/// the files' sizes, to 8 buffers of 8 MiB; one file has at most this many
/// parts in flight.
const MAX_PARTS_IN_FLIGHT: usize = 4;

/// The buffers one request may hold: files up to 32 MiB go up in one
/// request, read into that many buffers of the pool and sent as one body,
/// so that they are hashed once, not again part by part. Uploading 8
/// files of 16 MiB to moto over plain HTTP, multipart uploads of 8 MiB
/// parts hashed each file twice, about a third of the process's CPU time.
/// (Before the pool, one fresh 32 MiB buffer a file saved that hash but
/// cost as much again in the kernel zeroing its pages; pooled buffers are
/// already mapped.)
const SINGLE_REQUEST_BUFFERS: usize = 4;

/// The largest file that goes to an object store in one request.
pub(crate) const SINGLE_REQUEST_AT_MOST: u64 = (SINGLE_REQUEST_BUFFERS * PART_SIZE) as u64;

impl Storage {
    /// Make the files [`Storage::upload_file`] wrote (`files`, relative to
    /// this storage) durable: they survive a power loss once this returns.
    /// A manifest must not be written before (R11). Object stores, and
    /// `object_store`'s own local writes, are durable when their call
    /// returns. A local checkpoint file is flushed by the task that wrote
    /// it; this flushes the directories naming them.
    pub async fn sync_uploads(&self, files: Vec<String>) -> Result<(), Error> {
        let Some(local) = &self.local else {
            return Ok(());
        };
        // The names on disk, as `upload_file` wrote them (object_store
        // encodes some characters).
        let paths = files
            .iter()
            .map(|f| {
                local
                    .path_to_filesystem(&self.object_path(f))
                    .map_err(|e| self.error(format!("flush {f}"), e))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let dir = local
            .path_to_filesystem(&self.root)
            .map_err(|e| self.error("flush the checkpoint directory".into(), e))?;
        blocking(&self.url, "flush checkpoint files", move || {
            local::sync_directories(&dir, &paths)
        })
        .await
    }

    /// Whether a file of `size` bytes goes up here as a multipart upload
    /// whose every part is signed with its own SHA-256.
    fn signs_parts(&self, size: u64) -> bool {
        self.local.is_none() && self.signs_payloads && size > SINGLE_REQUEST_AT_MOST
    }

    /// Hash the file at `path` in `dir` (of `size` bytes) before uploading
    /// it here with [`Storage::upload_file`], to look for it among the
    /// files stored already: its SHA-256, and what else the upload would
    /// compute from its bytes (the digest of each part it signs).
    pub async fn hash_for_upload(
        &self,
        dir: Arc<cap_std::fs::Dir>,
        path: String,
        size: u64,
    ) -> Result<Hashed, Error> {
        let parts = self.signs_parts(size);
        let shown = path.clone();
        blocking(&shown, "hash a checkpoint file", move || {
            digest::hash_file(&dir, &path, parts)
        })
        .await
    }

    /// Stream `file` (of `size` bytes) to `relative`, returning its SHA-256
    /// (`known`'s when the caller already hashed it,
    /// [`Storage::hash_for_upload`]).
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
        known: Option<Hashed>,
        meter: &Meter,
    ) -> Result<String, Error> {
        let location = self.object_path(relative);
        if let Some(local) = &self.local {
            let target = local
                .path_to_filesystem(&location)
                .map_err(|e| self.error(format!("upload {relative}"), e))?;
            let (shown, meter, flush) = (relative.to_owned(), meter.clone(), self.flush);
            let known_sha256 = known.map(|k| k.sha256);
            return blocking(relative, "write a checkpoint file", move || {
                local::write_file(file, &shown, &target, size, known_sha256, &meter, flush)
            })
            .await;
        }
        let file = Arc::new(file);
        let mut hasher = match known {
            Some(hashed) => FileDigest::known(hashed),
            None if self.signs_parts(size) => FileDigest::with_parts(),
            None => FileDigest::new(None),
        };
        if size <= SINGLE_REQUEST_AT_MOST {
            let buffers = Buffer::take_many(size.div_ceil(PART_SIZE as u64).max(1) as usize).await;
            let (buffers, read) = read_into(relative, &file, buffers, Some(size)).await?;
            check_size(relative, size, read)?;
            buffers.iter().for_each(|b| hasher.update(b.as_ref()));
            let sha256 = hasher.current().unwrap_or_else(|| {
                let mut sha256 = Sha256::new();
                buffers.iter().for_each(|b| sha256.update(b.as_ref()));
                sha256.finalize().into()
            });
            let (bodies, shares): (Vec<_>, Vec<_>) = buffers.into_iter().map(Buffer::lend).unzip();
            let payload: PutPayload = bodies.into_iter().collect();
            self.write(|| {
                let put = self.store.put(&location, payload.clone());
                signing::known_payload(payload.clone(), sha256, async {
                    put.await
                        .map_err(|e| self.error(format!("upload {relative}"), e))
                })
            })
            .await?;
            drop(shares);
            meter.inc(read);
        } else {
            // Parts are read at their offsets, so that the upload can be
            // made again from the start, with the digest as it was, when
            // the run's lease lapses under it (an outage longer than the
            // lease's margin): the outage then costs time, not the run.
            let start = hasher;
            let across = Multipart::new(meter);
            hasher = self
                .fenced_write(|| {
                    let mut digest = start.clone();
                    across.take_back();
                    let (across, location, file) = (&across, &location, &file);
                    async move {
                        self.upload_parts(relative, location, file, size, &mut digest, across)
                            .await?;
                        Ok(digest)
                    }
                })
                .await?;
        }
        Ok(hasher.finish())
    }

    /// A large file as a multipart upload: parts of [`PART_SIZE`], at most
    /// [`MAX_PARTS_IN_FLIGHT`] sent at once, each counted in `across` as it
    /// is read. On failure the upload is aborted and the first error
    /// returned; the abort's own failure (the store may still be
    /// unreachable) is only logged, since it would hide what went wrong.
    async fn upload_parts(
        &self,
        relative: &str,
        location: &ObjectPath,
        file: &Arc<std::fs::File>,
        size: u64,
        hasher: &mut FileDigest,
        across: &Multipart<'_>,
    ) -> Result<(), Error> {
        if let Some(dropped) = across.take_open() {
            // The run's lease lapsed under the upload before this one and
            // was renewed since: this host still owns the run, and the
            // dropped upload's parts would stay in the store.
            self.abort(dropped, relative, "dropped when the run's lease lapsed")
                .await;
        }
        let parts = PutMultipartOptions::default().with_retry_policy(Arc::new(self.resend.parts()));
        let upload = self
            .resend
            .run(|| async {
                self.store
                    .put_multipart_opts(location, parts.clone())
                    .await
                    .map_err(|e| self.error(format!("start multipart upload of {relative}"), e))
            })
            .await?;
        across.open(upload);
        let sent = self.send_parts(relative, across, file, size, hasher).await;
        let mut upload = across.take_open().expect("opened above");
        let result = match sent {
            // Not sent again: object_store's upload hands its parts over
            // to the first completion, and a second would find none.
            Ok(()) => upload
                .complete()
                .await
                .map(drop)
                .map_err(|e| self.error(format!("finish upload of {relative}"), e)),
            Err(e) => Err(e),
        };
        if result.is_err() {
            self.abort(upload, relative, "that failed").await;
        }
        result
    }

    /// Abort `upload` of `relative` (`what` it is, for the log). Its own
    /// failure (the store may still be unreachable) is only logged: the
    /// store's clean-up of incomplete uploads removes the parts then.
    async fn abort(&self, mut upload: Box<dyn MultipartUpload>, relative: &str, what: &str) {
        if let Err(e) = upload.abort().await {
            tracing::warn!(
                store = %self.url,
                "cannot abort the multipart upload of {relative} {what} ({e}); the store's own clean-up of incomplete uploads will remove its parts"
            );
        }
    }

    /// Read `file` in parts and send each; returns once every part is in.
    async fn send_parts(
        &self,
        relative: &str,
        upload: &Multipart<'_>,
        file: &Arc<std::fs::File>,
        size: u64,
        hasher: &mut FileDigest,
    ) -> Result<(), Error> {
        let part_failed = |e: object_store::Error| self.error(format!("upload {relative}"), e);
        let mut in_flight: FuturesUnordered<UploadPart> = FuturesUnordered::new();
        let mut read = 0u64;
        loop {
            // A buffer, once one is free; meanwhile the parts in flight go
            // on (their buffers may be the ones to come back).
            let buffer = loop {
                if let Some(buffer) = Buffer::try_take() {
                    break buffer;
                }
                match in_flight.next().await {
                    Some(sent) => sent.map_err(part_failed)?,
                    None => break Buffer::take().await,
                }
            };
            let part = read_part(relative, file, read, buffer).await?;
            let len = part.as_ref().len() as u64;
            if len == 0 {
                break;
            }
            read += len;
            let own_sha256 = hasher.part(part.as_ref());
            while in_flight.len() >= MAX_PARTS_IN_FLIGHT {
                if let Some(sent) = in_flight.next().await {
                    sent.map_err(part_failed)?;
                }
            }
            upload.count(len);
            let (body, share) = part.lend();
            let payload = PutPayload::from(body);
            let put = upload.put_part(payload.clone());
            in_flight.push(Box::pin(async move {
                let sent = match own_sha256 {
                    Some(sha256) => signing::known_payload(payload, sha256, put).await,
                    None => put.await,
                };
                drop(share);
                sent
            }));
            if read > size {
                break;
            }
        }
        check_size(relative, size, read)?;
        while let Some(sent) = in_flight.next().await {
            sent.map_err(part_failed)?;
        }
        Ok(())
    }
}

/// What a multipart upload keeps across its attempts (one is made again
/// from the start when the run's lease lapses under it): the bytes it
/// counted into its meter, to take them back, and the upload in flight, to
/// abort it if it is dropped.
struct Multipart<'m> {
    meter: &'m Meter,
    counted: AtomicU64,
    open: Mutex<Option<Box<dyn MultipartUpload>>>,
}

impl<'m> Multipart<'m> {
    fn new(meter: &'m Meter) -> Self {
        Self {
            meter,
            counted: AtomicU64::new(0),
            open: Mutex::new(None),
        }
    }

    /// Count `n` more bytes read.
    fn count(&self, n: u64) {
        self.meter.inc(n);
        self.counted.fetch_add(n, Ordering::Relaxed);
    }

    /// Uncount what was counted so far: the upload starts over.
    fn take_back(&self) {
        self.meter.dec(self.counted.swap(0, Ordering::Relaxed));
    }

    fn open(&self, upload: Box<dyn MultipartUpload>) {
        *self.lock() = Some(upload);
    }

    /// The upload in flight, if any: the one opened last, or one that was
    /// dropped before it completed.
    fn take_open(&self) -> Option<Box<dyn MultipartUpload>> {
        self.lock().take()
    }

    /// Send `payload` as the next part of the upload in flight.
    fn put_part(&self, payload: PutPayload) -> UploadPart {
        self.lock()
            .as_mut()
            .expect("parts are sent while the upload is open")
            .put_part(payload)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Box<dyn MultipartUpload>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Read `file`, from where the last read ended, into `buffers`, a
/// buffer's worth each in turn until one is not filled, on the blocking
/// pool: one copy, from the page cache into memory the pool keeps mapped.
/// Returns the buffers holding bytes (always the first, so that an empty
/// file is one empty body) and how many bytes were read. With `listed`
/// the file should have that many bytes from here: once as many are read,
/// one more byte is read, so that a file that grew reads as longer.
async fn read_into(
    relative: &str,
    file: &Arc<std::fs::File>,
    buffers: Vec<Buffer>,
    listed: Option<u64>,
) -> Result<(Vec<Buffer>, u64), Error> {
    let file = Arc::clone(file);
    let shown = relative.to_owned();
    blocking(relative, "read a checkpoint file", move || {
        use std::io::Read;
        let failed = |source| Error::Io {
            path: shown.clone().into(),
            operation: "read a checkpoint file",
            source,
        };
        let mut read = 0u64;
        let mut filled = Vec::with_capacity(buffers.len());
        for mut buffer in buffers {
            let n = (&*file)
                .take(PART_SIZE as u64)
                .read_to_end(buffer.bytes())
                .map_err(failed)?;
            read += n as u64;
            if n > 0 || filled.is_empty() {
                filled.push(buffer);
            }
            if n < PART_SIZE {
                break;
            }
        }
        if listed.is_some_and(|size| read >= size) {
            read += (&*file).read(&mut [0u8; 1]).map_err(failed)? as u64;
        }
        Ok((filled, read))
    })
    .await
}

/// The part of `file` from `offset` on (a buffer's worth at most, empty
/// at its end), read at that offset: the file's own position is left
/// alone, so a read still running for an upload that was dropped cannot
/// move the next upload's.
async fn read_part(
    relative: &str,
    file: &Arc<std::fs::File>,
    offset: u64,
    mut buffer: Buffer,
) -> Result<Buffer, Error> {
    let file = Arc::clone(file);
    let shown = relative.to_owned();
    blocking(relative, "read a checkpoint file", move || {
        let bytes = buffer.bytes();
        // A buffer holds exactly PART_SIZE bytes (`Buffer::bytes`), so its
        // spare capacity is what is left of a part.
        while bytes.len() < PART_SIZE {
            let at = offset + bytes.len() as u64;
            match rustix::io::pread(&*file, rustix::buffer::spare_capacity(bytes), at) {
                Ok(0) => break,
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    return Err(Error::Io {
                        path: shown.into(),
                        operation: "read a checkpoint file",
                        source: e.into(),
                    });
                }
            }
        }
        Ok(buffer)
    })
    .await
}

/// Run `work` on the blocking pool. A task that did not finish (it
/// panicked, or the runtime is shutting down) is an I/O error on `path`.
pub(super) async fn blocking<T: Send + 'static>(
    path: &str,
    operation: &'static str,
    work: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::Io {
            path: path.into(),
            operation,
            source: std::io::Error::other(e),
        })?
}

#[cfg(test)]
#[path = "transfer_tests.rs"]
mod tests;
