//! Who owns a run (R27): at most one live host writes a run directory.
//!
//! The run's `trainhost-owner.json` names the owner: process, host, since
//! when. How it is held depends on the storage:
//! - **local**: the owner holds an exclusive `flock` on that file. The OS
//!   releases it with the process, however the process ends, so a killed
//!   host never blocks its run (on a directory every node mounts over NFS,
//!   the NFS lock manager does the same).
//! - **object stores** (and `memory://`): there are no locks, so the owner
//!   holds a lease, renewed while the run lives and fenced: see `lease.rs`.
//!
//! A second start while the owner lives is refused at once, naming it.

mod lease;
mod local;

use std::collections::BTreeSet;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::config::StorageOptions;
use crate::error::Error;
use crate::record::layout;
use crate::storage::Storage;

/// A process that owns (or owned) a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Holder {
    pub host: String,
    pub pid: u32,
    /// When it took the run, RFC 3339 by its own clock.
    pub since: String,
    /// Tells apart two runs of one process (an embedder's) and a reused pid.
    pub token: String,
}

impl Holder {
    fn me() -> Self {
        Self {
            host: rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned(),
            pid: std::process::id(),
            since: layout::now_rfc3339(),
            token: format!("{:016x}", random_u64()),
        }
    }

    /// Whether this is a process of this host that no longer exists, or
    /// an earlier run of this very process that ended without releasing
    /// (its storage was failing).
    fn is_gone_from(&self, host: &str) -> bool {
        if self.host != host {
            return false;
        }
        if self.pid == std::process::id() {
            return !live().contains(&self.token);
        }
        let Some(pid) = i32::try_from(self.pid)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        else {
            return true;
        };
        // EPERM: it exists, as another user's process.
        matches!(
            rustix::process::test_kill_process(pid),
            Err(rustix::io::Errno::SRCH)
        )
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "process {} on {} (its owner since {})",
            self.pid, self.host, self.since
        )
    }
}

/// The tokens of the leases this process holds now.
fn live() -> std::sync::MutexGuard<'static, BTreeSet<String>> {
    static LIVE: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    // A panic while holding it cannot leave the set half-changed.
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// 64 random bits, from the per-process random keys std seeds its hash
/// maps with; enough to tell apart names and tokens made in the same
/// instant.
pub(crate) fn random_u64() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    hasher.finish()
}

/// What to do when a run is in use, for every kind of storage.
const REMEDY: &str = "wait for it to finish or stop it (Ctrl-C commits and exits; a killed process releases the run), or give this run another name (--name)";

/// This host's ownership of a run, held until [`Owner::release`].
pub(crate) struct Owner {
    held: Held,
    /// The run's storage, written only while this host owns it.
    storage: Storage,
}

enum Held {
    Lock(local::Lock),
    Lease(lease::Lease),
    /// A store without conditional writes: nothing can be held.
    Nothing,
}

impl Owner {
    /// Become the owner of the run at `run`, or fail with
    /// [`Error::RunInUse`] naming its live owner. A dead owner's run is
    /// taken over: at once on local storage and for a process of this host
    /// that is gone, else once its lease expired.
    pub async fn acquire(run: &Storage, options: &StorageOptions) -> Result<Self, Error> {
        let me = Holder::me();
        match run.local_path() {
            Some(dir) => {
                let lock = local::Lock::acquire(dir, &me, run.url())?;
                Ok(Self {
                    held: Held::Lock(lock),
                    storage: run.clone(),
                })
            }
            None => match lease::Lease::acquire(run, me, options).await? {
                lease::Acquired::Held(lease) => Ok(Self {
                    storage: run.fenced(lease.fence()),
                    held: Held::Lease(lease),
                }),
                lease::Acquired::Unsupported(e) => {
                    tracing::warn!(
                        "{} cannot write objects conditionally ({}), so this run is not protected against being run by two hosts at once: make sure only one runs it",
                        run.url(),
                        crate::error::chain(&e)
                    );
                    Ok(Self {
                        held: Held::Nothing,
                        storage: run.clone(),
                    })
                }
            },
        }
    }

    /// The run's storage as its owner writes it: fenced on object stores,
    /// so that nothing is written once the lease is lost.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Give the run up: the next start takes it at once.
    pub async fn release(self) {
        match self.held {
            Held::Lock(lock) => drop(lock),
            Held::Lease(lease) => lease.release().await,
            Held::Nothing => {}
        }
    }
}

fn in_use_at(run: &str, holder: String) -> Error {
    Error::RunInUse {
        run: run.to_owned(),
        holder,
        remedy: REMEDY.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_of_this_host_are_gone_when_their_process_or_lease_is() {
        let me = Holder::me();
        let init = Holder {
            pid: 1,
            ..me.clone()
        };
        assert!(
            !init.is_gone_from(&me.host),
            "a live process, another user's"
        );
        let gone = Holder {
            pid: 1 << 30,
            ..me.clone()
        };
        assert!(gone.is_gone_from(&me.host));
        assert!(
            !gone.is_gone_from("another-host"),
            "another host's processes are not ours to judge"
        );
        assert!(
            me.is_gone_from(&me.host),
            "an earlier run of this process that did not release"
        );
        live().insert(me.token.clone());
        assert!(!me.is_gone_from(&me.host), "a lease this process holds");
        live().remove(&me.token);
        assert_ne!(Holder::me().token, me.token);
    }
}
