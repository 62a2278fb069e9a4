//! How an idle executor thread waits before it parks.
//!
//! When every task of a thread waits and one of them said its wait should
//! end soon (a collective round whose other ranks are on their way), the
//! thread may spin for a moment before parking: ranks doing the same work
//! arrive close together, and a round then completes sooner than a parked
//! thread is woken. Spinning is bounded by [`ACTIVE_WAIT`], so a rank
//! waiting on a slow one costs that much CPU at most, and only pays when
//! there is another thread to complete the round: an executor has at most
//! one thread per core, so a spinning thread takes no core a rank needs.
//!
//! Whether spinning pays depends on the machine's load, which changes: on a
//! machine busy with other work, a spinning thread takes the core the
//! thread it waits for needs, and rounds take milliseconds instead of
//! microseconds. The wait therefore keeps score: a spin that saw its wait
//! end counts up, one that ended in parking anyway counts down, and while
//! the score is not positive threads do not spin, trying a spin again
//! every [`PROBE`]th wait (a data-parallel loop has a slow round now and
//! then, where one rank saves a checkpoint, and must not lose its quick
//! rounds to it for the rest of the run).
//!
//! A thread that does not spin still does not park at once: it yields its
//! core, for as long as it would have spun, before parking. On a busy
//! machine the core goes to whatever else wants it, so the wait takes
//! nothing from the other work, yet the thread stays runnable and takes its
//! turn back at the scheduler's pace. A parked thread must be woken
//! instead: with 16 ranks on 2 cores that each carried a busy thread, the
//! executor's two threads woke each other every round, the scheduler put
//! them on one core taking turns, and a round took 26–34 µs; yielding, it
//! took 18–31 µs (medians 26 against 32). On an idle core a yield returns
//! at once, which costs what spinning costs and only while the score says
//! waits are long.

use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long an idle thread spins before parking: long enough for the
/// ranks of a data-parallel step to arrive (they drift apart by tens of
/// microseconds per step), short because under load a spin takes a core
/// from other work. With 50 µs the digits example ran 1.2–1.4× faster on 2
/// ranks than on 1, with 150 µs about 1.6–1.8×. Spinning up to 1 ms helped
/// steps of a millisecond but made 2 ranks sharing their cores with busy
/// threads take 74 µs a round instead of 8.
const ACTIVE_WAIT: Duration = Duration::from_micros(150);
/// Bounds of the score: how many recent successes it remembers.
const SCORE_MAX: i32 = 16;
/// While spinning does not pay, one wait in this many spins anyway.
const PROBE: u32 = 16;

/// Whether idle threads spin, and the score that says whether it pays.
/// Shared by the threads of one executor.
pub(crate) struct IdleWait {
    /// `false` with one thread: nobody else could end the wait.
    spin: bool,
    /// Whether spins have been seeing their wait end lately.
    score: AtomicI32,
    /// Waits that parked at once, counted to probe now and then.
    skipped: AtomicU32,
}

impl IdleWait {
    /// For an executor of `threads` threads.
    pub fn new(threads: usize) -> Self {
        Self::with(threads > 1, SCORE_MAX / 2)
    }

    /// A given choice and score (tests set both).
    pub fn with(spin: bool, score: i32) -> Self {
        Self {
            spin,
            score: AtomicI32::new(score),
            skipped: AtomicU32::new(0),
        }
    }

    /// Spin until `done` or [`ACTIVE_WAIT`] has passed, if spinning has
    /// paid lately (or to find out whether it pays again), and count
    /// whether it paid; else yield the core until then. The caller parks
    /// afterwards unless `done`.
    pub fn wait(&self, done: impl Fn() -> bool) {
        // One thread: nobody else could end the wait.
        if !self.spin {
            return;
        }
        let spin = self.score.load(Ordering::Relaxed) > 0
            || self
                .skipped
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(PROBE);
        let until = Instant::now() + ACTIVE_WAIT;
        while !done() && Instant::now() < until {
            if spin {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if spin {
            let step = if done() { 1 } else { -1 };
            let _ = self
                .score
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                    Some((s + step).clamp(-SCORE_MAX, SCORE_MAX))
                });
        }
    }
}

impl std::fmt::Debug for IdleWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleWait")
            .field("spin", &self.spin)
            .field("score", &self.score.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
impl IdleWait {
    /// Every way of waiting: no spin, spin while it pays, and a score for
    /// which spinning does not pay (threads park at once but for the
    /// probes), for the tests of the executor's users.
    pub fn every_way() -> Vec<Self> {
        vec![
            Self::with(false, SCORE_MAX / 2),
            Self::with(true, SCORE_MAX / 2),
            Self::with(true, -SCORE_MAX),
        ]
    }
}
