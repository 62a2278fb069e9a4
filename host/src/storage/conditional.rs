//! Conditional writes: the one way two hosts racing for the same object
//! find out which of them won. Only the lease that says who owns a run
//! (`crate::owner`) uses them; they are not fenced, since they are what
//! the fence is built from.

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
