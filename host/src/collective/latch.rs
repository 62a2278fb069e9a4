//! A count-down latch for the ranks sharing a split all-reduce.
//!
//! The work between the ranks' arrival and the latch is the same size for
//! every rank and cannot be stopped midway, so a wait here is short and
//! needs no timeout or abort. A waiter is a future: ranks sharing an
//! executor thread combine their slices in turn while the others wait (see
//! `crate::executor`), and the last rank wakes exactly the waiting ones.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Poll, Waker};

use crate::executor;

pub(super) struct Latch {
    remaining: AtomicUsize,
    waiting: Mutex<Vec<Waker>>,
}

impl Latch {
    pub fn new(count: usize) -> Self {
        Self {
            remaining: AtomicUsize::new(count),
            waiting: Mutex::new(Vec::new()),
        }
    }

    fn done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    pub fn count_down(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Taken under the lock: a waiter registers under it after
            // seeing work remaining, so none is missed.
            let waiting = std::mem::take(&mut *self.lock());
            for w in waiting {
                w.wake();
            }
        }
    }

    /// Wait until the count reaches zero.
    pub async fn wait(&self) {
        std::future::poll_fn(|cx| {
            if self.done() {
                return Poll::Ready(());
            }
            let mut waiting = self.lock();
            if self.done() {
                return Poll::Ready(());
            }
            if !waiting.iter().any(|w| w.will_wake(cx.waker())) {
                waiting.push(cx.waker().clone());
            }
            executor::waiting_briefly();
            Poll::Pending
        })
        .await
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Waker>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
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
                            futures::executor::block_on(latch.wait());
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
