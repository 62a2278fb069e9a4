//! The order of the ledger's whole-file writes, and the ones a restart
//! leaves behind.
//!
//! The run state and the history are each stored whole, from what the
//! ledger holds in memory when the write begins. Each kind of write holds
//! its lock from taking its contents until they are stored, so writes land
//! in the order their contents were taken: an older state never replaces
//! a newer one, and on object stores each write finds the version the one
//! before it left (R27).
//!
//! That lets a failure's record and the history be stored while the next
//! attempt starts ([`Ledger::store_behind`]): a restart waits for the
//! failed attempt's last commit (R21), not for these. On local storage
//! each flush can wait tens of milliseconds for the file system's journal
//! while another process writes to the same disk, and these were six of
//! the thirteen flushes between a failure and the loop running again. If
//! they fail, the next attempt fails with the storage error and the run
//! is not restarted again.

use std::sync::{Arc, Mutex};

use tokio::task::JoinHandle;

use super::Ledger;
use crate::error::Error;
use crate::failure::RunFailure;

/// See the module's description.
#[derive(Debug, Default)]
pub(super) struct Writes {
    /// Held across each write of the run state.
    pub state: tokio::sync::Mutex<()>,
    /// Held across each write of the history (and its event file).
    pub history: tokio::sync::Mutex<()>,
    /// Writes left behind by restarts, still running or done.
    behind: Mutex<Vec<JoinHandle<()>>>,
    /// The first failure of a write left behind.
    failed: Mutex<Option<Arc<Error>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Ledger {
    /// Add `failure` to the run's record in memory; returns how many
    /// failures the run has had. [`Ledger::store_now`] or
    /// [`Ledger::store_behind`] stores it.
    pub fn note_failure(&self, failure: &RunFailure) -> usize {
        let mut inner = self.lock();
        inner.state.failures.push(failure.clone());
        inner.state.failures.len()
    }

    /// Store the run state and the history as they are in memory, and
    /// wait for them (and for any write left behind).
    pub fn store_now(&self) -> Result<(), Arc<Error>> {
        self.handle
            .block_on(async { tokio::try_join!(self.write_state(), self.write_history()) })
            .map_err(Arc::new)?;
        self.finish_behind()
    }

    /// Store the run state and the history as they are in memory, in the
    /// background: the next attempt starts meanwhile. A failure is kept
    /// for [`Ledger::behind_failure`].
    pub fn store_behind(self: &Arc<Self>) {
        let ledger = Arc::clone(self);
        let task = self.handle.spawn(async move {
            if let Err(e) = tokio::try_join!(ledger.write_state(), ledger.write_history()) {
                lock(&ledger.writes.failed).get_or_insert(Arc::new(e));
            }
        });
        lock(&self.writes.behind).push(task);
    }

    /// Why a write left behind failed, if one did.
    pub fn behind_failure(&self) -> Option<Arc<Error>> {
        lock(&self.writes.failed).clone()
    }

    /// Wait for every write left behind; the first failure, if any.
    pub fn finish_behind(&self) -> Result<(), Arc<Error>> {
        let tasks = std::mem::take(&mut *lock(&self.writes.behind));
        for task in tasks {
            if let Err(e) = self.handle.block_on(task)
                && e.is_panic()
            {
                // A bug of the host's own, not a storage failure.
                std::panic::resume_unwind(e.into_panic());
            }
        }
        self.behind_failure().map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Location, Retention, StorageOptions};
    use crate::failure::FailureKind;
    use crate::record::layout;
    use crate::storage::Storage;

    fn failure(i: usize) -> RunFailure {
        RunFailure {
            rank: Some(0),
            kind: FailureKind::Trap,
            message: format!("failure {i}"),
        }
    }

    fn local(dir: &std::path::Path) -> Storage {
        Storage::open(&Location::Local(dir.to_owned()), &StorageOptions::default())
            .unwrap()
            .child("run")
    }

    fn open(rt: &tokio::runtime::Runtime, storage: &Storage) -> Arc<Ledger> {
        Arc::new(super::super::open_for_test(rt, storage, Retention::default(), false).unwrap())
    }

    /// Restarts in quick succession leave writes behind while earlier
    /// ones are still under way: each takes its contents once the one
    /// before has landed, so storage ends with the newest record (and on
    /// an object store, each finds the version the one before left).
    #[test]
    fn writes_left_behind_land_in_order_and_are_waited_for() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let store = Arc::new(crate::storage::held::Held::reads());
        let storage = Storage::from_store(store.clone(), "memory://t").child("run");
        let ledger = open(&rt, &storage);
        store
            .hold_puts_of
            .send_replace(Some(layout::RUN_STATE.into()));
        ledger.note_failure(&failure(0));
        ledger.store_behind();
        let mut held = store.puts_held.subscribe();
        rt.block_on(held.wait_for(|n| *n == 1)).unwrap();
        // The second restart's write, while the first's is held.
        ledger.note_failure(&failure(1));
        ledger.store_behind();
        std::thread::sleep(std::time::Duration::from_millis(100));
        store.hold_puts_of.send_replace(None);
        ledger.finish_behind().unwrap();
        drop(ledger);
        assert_eq!(open(&rt, &storage).snapshot().2, [failure(0), failure(1)]);
    }

    /// A write left behind that fails is kept for the next attempt (whose
    /// recorder reports it), and waiting for it says why.
    #[test]
    fn a_write_left_behind_that_fails_is_kept() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let storage = local(dir.path());
        let ledger = open(&rt, &storage);
        // The run's directory replaced by a file: nothing can be written
        // below it, whoever runs the test.
        let run = dir.path().join("run");
        std::fs::remove_dir_all(&run).unwrap();
        std::fs::write(&run, b"not a directory").unwrap();
        ledger.note_failure(&failure(0));
        ledger.store_behind();
        let e = ledger.finish_behind().unwrap_err();
        assert!(ledger.behind_failure().is_some());
        assert!(e.to_string().contains("storage"), "{e}");
        // Storing now reports it too: the run ends on it.
        assert!(ledger.store_now().is_err());
    }
}
