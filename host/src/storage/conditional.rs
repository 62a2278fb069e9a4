//! Conditional writes: the one way two hosts racing for the same object
//! find out which of them won. The lease that says who owns a run
//! (`crate::owner`) uses them unfenced, since they are what the fence is
//! built from; the run's owner writes its record through the fenced
//! [`Storage::create`] and [`Storage::replace`], so that a host that lost
//! the run can neither overwrite a manifest nor a newer run state even if
//! its lease's clock lied.

use bytes::Bytes;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};

use super::Storage;
use crate::error::Error;

/// An object's bytes, the version they were read at, and when the storage
/// server last wrote it (by the server's clock, in milliseconds since the
/// Unix epoch).
#[derive(Debug)]
pub(crate) struct Versioned {
    pub bytes: Bytes,
    pub version: UpdateVersion,
    pub modified_ms: i64,
}

/// What a conditional write expects to find.
#[derive(Debug, Clone)]
pub(crate) enum Claim {
    /// No object at all.
    Create,
    /// The object at exactly this version.
    Update(UpdateVersion),
}

impl Storage {
    /// The object at `relative` with its version, or `None` if there is
    /// none.
    pub async fn get_versioned(&self, relative: &str) -> Result<Option<Versioned>, Error> {
        let path = self.object_path(relative);
        let read = |e| self.error(format!("read {relative}"), e);
        let got = match self.store.get(&path).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(read(e)),
        };
        let meta = got.meta.clone();
        let bytes = got.bytes().await.map_err(read)?;
        Ok(Some(Versioned {
            bytes,
            version: UpdateVersion {
                e_tag: meta.e_tag,
                version: meta.version,
            },
            modified_ms: meta.last_modified.timestamp_millis(),
        }))
    }

    /// Write `data` at `relative` if the object is as `claim` expects.
    /// Returns the new version, or `None` if someone else wrote it first.
    pub async fn put_if(
        &self,
        relative: &str,
        data: Bytes,
        claim: Claim,
    ) -> Result<Option<UpdateVersion>, Error> {
        let mode = match claim {
            Claim::Create => PutMode::Create,
            Claim::Update(version) => PutMode::Update(version),
        };
        let options = PutOptions {
            mode,
            ..Default::default()
        };
        match self
            .store
            .put_opts(&self.object_path(relative), PutPayload::from(data), options)
            .await
        {
            Ok(put) => Ok(Some(UpdateVersion {
                e_tag: put.e_tag,
                version: put.version,
            })),
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => Ok(None),
            Err(e) => Err(self.error(format!("write {relative} if unchanged"), e)),
        }
    }

    /// Write `data` at `relative` unless an object is there already,
    /// through the fence. `false` if another writer's object is there; a
    /// write of this host that landed before a retry counts as done.
    pub async fn create(&self, relative: &str, data: Bytes) -> Result<bool, Error> {
        let put = || self.put_if(relative, data.clone(), Claim::Create);
        if self.write(put).await?.is_some() {
            return Ok(true);
        }
        Ok(self.get(relative).await?.is_some_and(|found| found == data))
    }

    /// Replace the object at `relative` with `data` if it is still at
    /// `version` (the one this host last wrote or read; `None`: there is
    /// no object yet), through the fence. Returns the new version, or
    /// `None` if another writer changed it since. On local storage, which
    /// one live host owns by a lock (R27), the object is replaced as it
    /// is.
    pub async fn replace(
        &self,
        relative: &str,
        data: Bytes,
        version: Option<UpdateVersion>,
    ) -> Result<Option<UpdateVersion>, Error> {
        if self.local.is_some() {
            self.put(relative, data).await?;
            return Ok(Some(UpdateVersion {
                e_tag: None,
                version: None,
            }));
        }
        let claim = match version {
            // GCS matches on the object's generation; a server that left
            // it out of its answers (moto's GCS does; Google's sends it)
            // leaves nothing to match: the lease alone fences the write.
            Some(version) if version.version.is_none() && self.url.starts_with("gs://") => {
                self.put(relative, data).await?;
                return Ok(Some(version));
            }
            Some(version) => Claim::Update(version),
            None => Claim::Create,
        };
        let put = || self.put_if(relative, data.clone(), claim.clone());
        if let Some(version) = self.write(put).await? {
            return Ok(Some(version));
        }
        // A write of this host that landed before a retry reads back as
        // its own bytes.
        Ok(self
            .get_versioned(relative)
            .await?
            .filter(|found| found.bytes == data)
            .map(|found| found.version))
    }

    /// The storage server's clock now, in milliseconds since the Unix
    /// epoch: the modification time of an object written at `relative`
    /// just now (then deleted). Hosts' own clocks may disagree; all hosts
    /// agree on the server's.
    pub async fn server_time_ms(&self, relative: &str) -> Result<i64, Error> {
        let path = self.object_path(relative);
        let clock = |e| {
            self.error(
                format!("read the storage server's clock through {relative}"),
                e,
            )
        };
        self.store
            .put(&path, PutPayload::from_static(b"clock"))
            .await
            .map_err(clock)?;
        let meta = self.store.head(&path).await.map_err(clock)?;
        if let Err(e) = self.store.delete(&path).await {
            tracing::debug!("could not delete {relative}: {e}");
        }
        Ok(meta.last_modified.timestamp_millis())
    }
}
