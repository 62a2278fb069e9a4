//! Ownership of a run in an object store: a lease.
//!
//! The run's owner file holds the holder, a generation, the lease's timeout
//! and a renewal count. It is created with a conditional put (fails if it
//! exists), taken over with a put conditional on the version that was read,
//! and renewed every quarter of the timeout with a put conditional on the
//! version the last renewal wrote (a failed renewal is tried again
//! sooner). Whichever of two racing hosts writes first wins; the other's
//! condition fails. A holder whose renewal finds another version has been
//! taken over and learns so (the generation says how many times the run
//! changed hands).
//!
//! Expiry is judged by the storage server's clock, which all hosts share:
//! the lease expires `timeout` after the server stored its last renewal.
//! The holder, by its own monotonic clock, counts itself owner only until
//! half the timeout after it sent its last successful renewal; the other
//! half is the margin for writes still in flight. Its writes go through a
//! [`Fence`] that stops them from then on (they wait while the renewal is
//! late, as in a storage outage, and fail once the run was taken over), so
//! a holder that wakes up from a pause (SIGSTOP, a frozen VM) past its
//! lease writes nothing more.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::UpdateVersion;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use super::{Holder, in_use_at};
use crate::config::StorageOptions;
use crate::error::Error;
use crate::record::layout::OWNER;
use crate::storage::{Claim, Fence, Storage};

/// Written and read back to learn the storage server's clock.
const CLOCK: &str = ".trainhost-owner-clock";
/// Rounds of reading and claiming before giving up on a run that several
/// hosts keep claiming at the same moment.
const RACES: usize = 4;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaseFile {
    holder: Holder,
    generation: u64,
    timeout_ms: u64,
    renewals: u64,
    released: bool,
}

impl LeaseFile {
    fn to_bytes(&self) -> Bytes {
        serde_json::to_vec_pretty(self)
            .expect("a lease serializes")
            .into()
    }
}

/// The lease as last written, and the version that write produced.
struct Written {
    file: LeaseFile,
    version: UpdateVersion,
}

/// The outcome of claiming a run.
pub(super) enum Acquired {
    /// The run is this host's.
    Held(Lease),
    /// The store cannot write conditionally (this error says how), so no
    /// lease can be held on it.
    Unsupported(Error),
}

/// Whether `e` says the store has no conditional writes at all.
fn unsupported(e: &Error) -> bool {
    matches!(
        e,
        Error::Storage {
            source: object_store::Error::NotImplemented { .. },
            ..
        }
    )
}

/// A lease this host holds, renewed in the background until released.
pub(super) struct Lease {
    run: Storage,
    fence: Arc<Fence>,
    written: Arc<Mutex<Written>>,
    renewer: JoinHandle<()>,
}

impl Lease {
    pub async fn acquire(
        run: &Storage,
        me: Holder,
        options: &StorageOptions,
    ) -> Result<Acquired, Error> {
        let timeout = options.lease_timeout;
        for _ in 0..RACES {
            let (generation, claim, previous) = match run.get_versioned(OWNER).await? {
                None => (1, Claim::Create, None),
                Some(found) => {
                    let file: LeaseFile = serde_json::from_slice(&found.bytes).map_err(|e| {
                        in_use_at(
                            run.url(),
                            format!(
                                "an unknown owner ({OWNER} is unreadable: {e}; if no host runs it, delete that file)"
                            ),
                        )
                    })?;
                    if file.holder == me && !file.released {
                        // This claim's own write, sent again by the store's
                        // client after its answer was lost (a retried
                        // conditional write finds its first attempt's
                        // version changed): the run is already this
                        // claim's, at the version found.
                        (file.generation, Claim::Update(found.version), None)
                    } else {
                        let why = if file.released {
                            None
                        } else if file.holder.is_gone_from(&me.host) {
                            Some("which is gone")
                        } else {
                            let now = run.server_time_ms(CLOCK).await?;
                            let age_ms = now.saturating_sub(found.modified_ms).max(0) as u64;
                            if age_ms < file.timeout_ms {
                                return Err(in_use_at(
                                    run.url(),
                                    format!(
                                        "{}; its lease was renewed {:.0} s ago and lapses {:.0} s after a renewal, so a host that died frees the run by then",
                                        file.holder,
                                        age_ms as f64 / 1000.0,
                                        file.timeout_ms as f64 / 1000.0
                                    ),
                                ));
                            }
                            Some("whose lease had expired")
                        };
                        let previous = why.map(|why| format!("{}, {why}", file.holder));
                        (file.generation + 1, Claim::Update(found.version), previous)
                    }
                }
            };
            let file = LeaseFile {
                holder: me.clone(),
                generation,
                timeout_ms: timeout.as_millis() as u64,
                renewals: 0,
                released: false,
            };
            let taking_over = matches!(claim, Claim::Update(_));
            let version = match run.put_if(OWNER, file.to_bytes(), claim).await {
                Ok(Some(version)) => version,
                // Another host claimed it between our read and write, or
                // this write landed and its answer was lost: the next read
                // tells which.
                Ok(None) => continue,
                Err(e) if taking_over || unsupported(&e) => return Ok(Acquired::Unsupported(e)),
                Err(e) => return Err(e),
            };
            // Renewals update what was just written: find out now whether
            // this store can (the last step a store without conditional
            // updates fails at; the read before shows it is reachable).
            let mut file = file;
            file.renewals = 1;
            let sent = Instant::now();
            let version = match run
                .put_if(OWNER, file.to_bytes(), Claim::Update(version))
                .await
            {
                Ok(Some(version)) => version,
                Ok(None) => continue,
                Err(e) => return Ok(Acquired::Unsupported(e)),
            };
            if let Some(previous) = previous {
                tracing::warn!(run = %run.url(), "took the run over from {previous}");
            }
            super::live().insert(me.token.clone());
            let fence = Fence::new(sent + timeout / 2);
            let written = Arc::new(Mutex::new(Written { file, version }));
            let renewer = tokio::spawn(renew(
                run.clone(),
                Arc::clone(&fence),
                Arc::clone(&written),
                timeout,
                options.retry_timeout,
            ));
            return Ok(Acquired::Held(Self {
                run: run.clone(),
                fence,
                written,
                renewer,
            }));
        }
        Err(in_use_at(
            run.url(),
            "other hosts starting it at this very moment".to_owned(),
        ))
    }

    pub fn fence(&self) -> Arc<Fence> {
        Arc::clone(&self.fence)
    }

    /// Mark the lease released, so that the next start takes the run at
    /// once. Failing that, the lease lapses by itself.
    pub async fn release(mut self) {
        self.renewer.abort();
        let _ = (&mut self.renewer).await;
        if self.fence.lost().is_some() {
            return;
        }
        let (bytes, version) = {
            let mut w = lock(&self.written);
            w.file.released = true;
            (w.file.to_bytes(), w.version.clone())
        };
        match self.run.put_if(OWNER, bytes, Claim::Update(version)).await {
            Ok(Some(_)) => {}
            Ok(None) => tracing::debug!("the lease changed before it was released"),
            Err(e) => tracing::warn!(
                "could not release the run's lease ({}); another host can take the run over once it lapses",
                crate::error::chain(&e)
            ),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.renewer.abort();
        super::live().remove(&lock(&self.written).file.holder.token);
    }
}

fn lock(written: &Mutex<Written>) -> std::sync::MutexGuard<'_, Written> {
    written.lock().unwrap_or_else(|p| p.into_inner())
}

/// Renew the lease every quarter of `timeout` until it is lost: taken over
/// by another host, or not renewed for `budget` (the storage's retry
/// timeout: the storage was unreachable for longer than a run waits).
///
/// A renewal that fails is tried again after an eighth of that period,
/// not a whole one: writes wait while ownership is unconfirmed (see
/// [`Fence`]), so after an outage they go on as soon as the storage is
/// back, not up to a period later.
async fn renew(
    run: Storage,
    fence: Arc<Fence>,
    written: Arc<Mutex<Written>>,
    timeout: Duration,
    budget: Duration,
) {
    let period = timeout / 4;
    let mut confirmed = Instant::now();
    let mut wait = period;
    loop {
        tokio::time::sleep(wait).await;
        let (mine, bytes, version) = {
            let mut w = lock(&written);
            w.file.renewals += 1;
            (w.file.clone(), w.file.to_bytes(), w.version.clone())
        };
        let sent = Instant::now();
        let put = run.put_if(OWNER, bytes, Claim::Update(version));
        wait = period / 8;
        match tokio::time::timeout(period, put).await {
            Ok(Ok(Some(version))) => {
                lock(&written).version = version;
                fence.extend(sent + timeout / 2);
                confirmed = sent;
                wait = period;
            }
            // The version changed: a renewal whose answer was lost stored
            // it (the next renewal, from that version, confirms the lease),
            // or another host took the run over.
            Ok(Ok(None)) => match taken_over(&run, &mine).await {
                Ok(Ok(version)) => lock(&written).version = version,
                Ok(Err(reason)) => {
                    tracing::error!(run = %run.url(), "{reason}");
                    fence.lose(reason);
                    return;
                }
                Err(e) => {
                    tracing::warn!("cannot read the run's lease: {}", crate::error::chain(&e))
                }
            },
            Ok(Err(e)) => {
                tracing::warn!("cannot renew the run's lease: {}", crate::error::chain(&e))
            }
            Err(_) => tracing::warn!("renewing the run's lease took over {period:?}"),
        }
        if confirmed.elapsed() > budget {
            fence.lose(format!(
                "its lease on the run could not be renewed for {budget:?} (the storage retry timeout)"
            ));
            return;
        }
    }
}

/// After a renewal found the lease at another version: its version if it
/// is still this host's (a renewal whose answer was lost), else why this
/// host lost the run.
async fn taken_over(
    run: &Storage,
    mine: &LeaseFile,
) -> Result<Result<UpdateVersion, String>, Error> {
    let Some(found) = run.get_versioned(OWNER).await? else {
        return Ok(Err(format!("{OWNER} was deleted")));
    };
    Ok(match serde_json::from_slice::<LeaseFile>(&found.bytes) {
        Ok(file) if file.holder == mine.holder && file.generation == mine.generation => {
            Ok(found.version)
        }
        Ok(file) => Err(format!(
            "{} took the run over (generation {}) after this host's lease lapsed",
            file.holder, file.generation
        )),
        Err(e) => Err(format!("{OWNER} was overwritten ({e})")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> Storage {
        Storage::from_store(
            Arc::new(object_store::memory::InMemory::new()),
            "memory://t",
        )
        .child("run")
    }

    fn options(timeout_secs: u64) -> StorageOptions {
        StorageOptions {
            lease_timeout: Duration::from_secs(timeout_secs),
            ..StorageOptions::default()
        }
    }

    fn held(acquired: Result<Acquired, Error>) -> Lease {
        match acquired.unwrap() {
            Acquired::Held(lease) => lease,
            Acquired::Unsupported(e) => panic!("InMemory writes conditionally: {e}"),
        }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    /// A live holder of another host (this host's processes are judged by
    /// whether they exist).
    fn elsewhere() -> Holder {
        Holder {
            host: "elsewhere".into(),
            ..Holder::me()
        }
    }

    #[test]
    fn a_live_lease_refuses_a_second_start_naming_its_holder_and_a_released_one_is_taken_at_once() {
        let rt = rt();
        let run = store();
        let first = held(rt.block_on(Lease::acquire(&run, elsewhere(), &options(30))));
        let Err(e) = rt.block_on(Lease::acquire(&run, Holder::me(), &options(30))) else {
            panic!("a second start is refused");
        };
        let e = e.to_string();
        assert!(
            e.contains("in use by process") && e.contains("on elsewhere"),
            "{e}"
        );
        assert!(e.contains("--name"), "names a remedy: {e}");
        rt.block_on(first.release());
        let second = held(rt.block_on(Lease::acquire(&run, Holder::me(), &options(30))));
        assert_eq!(lock(&second.written).file.generation, 2);
    }

    #[test]
    fn a_claim_whose_answer_was_lost_is_this_hosts_own_not_another_owner() {
        let rt = rt();
        let run = store();
        let me = Holder::me();
        // The claim landed, but its answer was lost and the request sent
        // again found the owner file changed: the store holds this
        // claim's own lease.
        let landed = LeaseFile {
            holder: me.clone(),
            generation: 1,
            timeout_ms: 30_000,
            renewals: 1,
            released: false,
        };
        rt.block_on(run.put_if(OWNER, landed.to_bytes(), Claim::Create))
            .unwrap()
            .unwrap();
        let lease = held(rt.block_on(Lease::acquire(&run, me.clone(), &options(30))));
        let written = lock(&lease.written).file.clone();
        assert_eq!((written.holder, written.generation), (me, 1));
        // Another claim still finds the run in use.
        assert!(
            rt.block_on(Lease::acquire(&run, elsewhere(), &options(30)))
                .is_err()
        );
    }

    #[test]
    fn a_paused_holder_is_taken_over_once_its_lease_lapsed_and_then_writes_nothing() {
        let rt = rt();
        let run = store();
        let paused = held(rt.block_on(Lease::acquire(&run, elsewhere(), &options(2))));
        // Paused: nothing renews its lease.
        paused.renewer.abort();
        let refused = rt.block_on(Lease::acquire(&run, Holder::me(), &options(2)));
        assert!(refused.is_err(), "not lapsed yet");
        std::thread::sleep(Duration::from_millis(2100));
        let next = held(rt.block_on(Lease::acquire(&run, Holder::me(), &options(2))));
        assert_eq!(lock(&next.written).file.generation, 2);
        // It wakes up: its renewal finds the lease taken, and its writes
        // are refused.
        rt.spawn(renew(
            run.clone(),
            paused.fence(),
            Arc::clone(&paused.written),
            Duration::from_secs(2),
            Duration::from_secs(180),
        ));
        let stale = run.fenced(paused.fence());
        let e = rt
            .block_on(stale.put("trainhost-run.json", Bytes::from_static(b"stale")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no longer owns") && e.contains("generation 2"),
            "{e}"
        );
        assert!(
            rt.block_on(run.get("trainhost-run.json"))
                .unwrap()
                .is_none()
        );
        // The new holder's writes go through.
        let owned = run.fenced(next.fence());
        rt.block_on(owned.put("trainhost-run.json", Bytes::from_static(b"new")))
            .unwrap();
    }
}
