//! A count-down latch for the ranks sharing a split all-reduce.
//!
//! The work between the ranks' arrival and the latch is the same size for
//! every rank and runs on host threads that cannot be stopped midway, so a
//! wait here is short and needs no timeout or abort: a waiter spins (or
//! yields, when ranks outnumber cores) for a moment, then parks until the
//! last rank wakes exactly the parked threads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a waiter waits actively before parking.
const ACTIVE_WAIT: Duration = Duration::from_micros(50);

/// The cores this process may use, read once: `available_parallelism`
/// reads the cgroup's limits from files each time it is called, which
/// costs more than a small collective.
pub(crate) fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

pub(super) struct Latch {
    remaining: AtomicUsize,
    parked: Mutex<Vec<Thread>>,
    /// Whether waiters spin (every rank has a core) or yield.
    spin: bool,
}

impl Latch {
    pub fn new(count: usize) -> Self {
        Self {
            remaining: AtomicUsize::new(count),
            parked: Mutex::new(Vec::new()),
            spin: count <= cores(),
        }
    }

    fn done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    pub fn count_down(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Taken under the lock: a waiter registers under it after
            // seeing work remaining, so none is missed.
            let parked = std::mem::take(&mut *self.lock());
            for t in parked {
                t.unpark();
            }
        }
    }

    /// Wait until the count reaches zero.
    pub fn wait(&self) {
        let until = Instant::now() + ACTIVE_WAIT;
        while !self.done() && Instant::now() < until {
            if self.spin {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        {
            let mut parked = self.lock();
            if self.done() {
                return;
            }
            parked.push(std::thread::current());
        }
        // Woken spuriously or not: the count says.
        while !self.done() {
            std::thread::park();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Thread>> {
        self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_waiter_leaves_once_all_counted_down() {
        for ranks in [1, 2, 8] {
            for _ in 0..200 {
                let latch = Arc::new(Latch::new(ranks));
                let threads: Vec<_> = (0..ranks)
                    .map(|_| {
                        let latch = Arc::clone(&latch);
                        std::thread::spawn(move || {
                            latch.count_down();
                            latch.wait();
                            assert!(latch.done());
                        })
                    })
                    .collect();
                for t in threads {
                    t.join().unwrap();
                }
            }
        }
    }
}
