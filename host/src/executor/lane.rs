//! One executor thread's ready tasks, and how the other threads judge
//! whether that thread keeps up with them.
//!
//! What one thread writes often and another reads lies on cache lines of
//! its own ([`CachePadded`]): the queue, its "holds tasks" flag and the
//! thread's poll count. Packed together, an idle thread watching another
//! thread's lane moved the line between cores at every poll.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Polls run under `catch_unwind` outside these locks, so a poisoned
    // lock only means a panic between two plain statements: the data is
    // still whole.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long a lane may hold ready tasks while its thread begins no poll
/// before another thread that has nothing to do takes them, as that idle
/// thread sees it (the busy threads never read the clock for this); the
/// idle thread looks at the lane's poll count once per this period, so a
/// lane is taken over after one to two periods. A
/// thread that keeps up begins a poll every microsecond or so (a `report`
/// takes about one); one that has not for this long is in a long poll (a
/// guest computing) or set aside by the operating system for other work,
/// which lasts milliseconds.
pub(super) const STEAL_AFTER: Duration = Duration::from_micros(5);

/// The ready tasks of one thread (their home: a task runs on its own
/// thread while that thread keeps up, so that its fiber and memory stay in
/// that core's caches).
pub(super) struct Lane {
    /// Ready tasks, in the order they were queued.
    ready: CachePadded<Mutex<VecDeque<usize>>>,
    /// Whether `ready` holds tasks, read without the lock by idle threads.
    /// Written under the lock and only when it changes, so that a thread
    /// taking its tasks one by one writes nothing the others watch.
    holds: CachePadded<AtomicBool>,
    /// Polls the lane's thread has begun; only that thread writes it.
    pub(super) polls: CachePadded<AtomicU64>,
    /// The thread whose lane this is, once it has called `work`.
    pub(super) owner: OnceLock<CachePadded<Worker>>,
}

impl Lane {
    pub(super) fn new() -> Self {
        Self {
            ready: CachePadded::default(),
            holds: CachePadded::default(),
            polls: CachePadded::default(),
            owner: OnceLock::new(),
        }
    }

    /// Queue `task`.
    pub(super) fn push(&self, task: usize) {
        let mut ready = lock(&self.ready);
        ready.push_back(task);
        self.update(&ready);
    }

    /// Keep `holds` true to `ready`, which the caller has locked.
    fn update(&self, ready: &VecDeque<usize>) {
        let holds = !ready.is_empty();
        // Every write is made under the lock: this read is the last one.
        if self.holds.load(Ordering::Relaxed) != holds {
            self.holds.store(holds, Ordering::SeqCst);
        }
    }

    pub(super) fn holds(&self) -> bool {
        self.holds.load(Ordering::SeqCst)
    }

    pub(super) fn pop(&self) -> Option<usize> {
        if !self.holds() {
            return None;
        }
        let mut ready = lock(&self.ready);
        let task = ready.pop_front();
        self.update(&ready);
        task
    }

    /// Whether another thread should take this lane's tasks now: it holds
    /// some, and its thread began no poll between the caller's last look
    /// at its poll count (`seen`) and now, at least [`STEAL_AFTER`] later.
    /// The count is read once per period at most: each read takes the line
    /// from the core of the thread that writes it at every poll.
    ///
    /// A thread found stalled stays so until it begins a poll: one that the
    /// operating system has set aside does not run for milliseconds, and
    /// each round meanwhile queues tasks on its lane again, which are then
    /// taken at once instead of after another period.
    pub(super) fn stalled(&self, seen: &mut Option<Seen>, now: Instant) -> bool {
        if !self.holds() {
            Seen::forget_unless_stalled(seen);
            return false;
        }
        match seen {
            Some(s) if !s.stalled && now - s.at < STEAL_AFTER => false,
            _ => {
                // A stalled thread writes nothing: reading its count is cheap.
                let polls = self.polls.load(Ordering::Relaxed);
                match seen {
                    Some(s) if s.polls == polls => {
                        s.stalled = true;
                        true
                    }
                    _ => {
                        *seen = Some(Seen {
                            polls,
                            at: now,
                            stalled: false,
                        });
                        false
                    }
                }
            }
        }
    }
}

/// A lane's poll count as an idle thread last read it, and when; and
/// whether the lane's thread was found stalled with that count.
#[derive(Clone, Copy)]
pub(super) struct Seen {
    polls: u64,
    at: Instant,
    stalled: bool,
}

impl Seen {
    /// The lane is empty: what was seen of a thread that keeps up no
    /// longer says anything about the next tasks.
    pub(super) fn forget_unless_stalled(seen: &mut Option<Seen>) {
        if seen.is_some_and(|s| !s.stalled) {
            *seen = None;
        }
    }
}

/// A thread taking part, as the queue wakes it.
pub(super) struct Worker {
    pub(super) thread: Thread,
    /// Set by the thread before it parks; taken by whoever wakes it.
    pub(super) asleep: AtomicBool,
}

impl Worker {
    pub(super) fn wake(&self) {
        if self.asleep.swap(false, Ordering::SeqCst) {
            self.thread.unpark();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(queued: &[usize]) -> Lane {
        let lane = Lane::new();
        queued.iter().for_each(|&t| lane.push(t));
        lane
    }

    #[test]
    fn a_lane_is_stalled_after_a_period_without_a_poll_and_stays_so_until_one() {
        let lane = lane(&[3]);
        let t0 = Instant::now();
        let mut seen = None;
        // First look: the count is noted, nothing is taken.
        assert!(!lane.stalled(&mut seen, t0));
        // Within the period the count is not even read again.
        lane.polls.store(7, Ordering::Relaxed);
        assert!(!lane.stalled(&mut seen, t0 + STEAL_AFTER / 2));
        // A period later the count has moved: the thread keeps up.
        assert!(!lane.stalled(&mut seen, t0 + STEAL_AFTER));
        // Another period without a poll: stalled.
        assert!(lane.stalled(&mut seen, t0 + STEAL_AFTER * 2));
        // The lane empties and fills again while its thread still begins
        // no poll: taken at once, not a period later.
        assert_eq!(lane.pop(), Some(3));
        assert!(!lane.stalled(&mut seen, t0 + STEAL_AFTER * 2));
        lane.push(4);
        assert!(lane.stalled(&mut seen, t0 + STEAL_AFTER * 2));
        // Its thread polls again: it must stall for a whole period anew.
        lane.polls.store(8, Ordering::Relaxed);
        assert!(!lane.stalled(&mut seen, t0 + STEAL_AFTER * 2));
        assert!(!lane.stalled(&mut seen, t0 + STEAL_AFTER * 5 / 2));
        assert!(lane.stalled(&mut seen, t0 + STEAL_AFTER * 3));
    }

    #[test]
    fn what_was_seen_of_a_lane_that_keeps_up_is_forgotten_when_it_empties() {
        // Its thread took every task: the next tasks get a full period,
        // however long ago the count was last seen to move.
        let lane = lane(&[1]);
        let t0 = Instant::now();
        let mut seen = None;
        assert!(!lane.stalled(&mut seen, t0));
        assert_eq!(lane.pop(), Some(1));
        assert!(!lane.stalled(&mut seen, t0 + STEAL_AFTER));
        assert!(seen.is_none());
        lane.push(2);
        assert!(!lane.stalled(&mut seen, t0 + STEAL_AFTER * 10));
        assert!(lane.stalled(&mut seen, t0 + STEAL_AFTER * 11));
    }

    #[test]
    fn holds_follows_the_queue() {
        let lane = lane(&[]);
        assert!(!lane.holds());
        lane.push(1);
        lane.push(2);
        assert!(lane.holds());
        assert_eq!(lane.pop(), Some(1));
        assert!(lane.holds());
        assert_eq!(lane.pop(), Some(2));
        assert!(!lane.holds());
        assert_eq!(lane.pop(), None);
    }
}
