//! How a rank waits in the gate before it parks.
//!
//! A waiter may wait actively for a short while before parking, since ranks
//! doing the same work arrive close together and a round then completes
//! sooner than a parked thread is woken: it spins when every rank has a
//! core of its own, and yields its core to the ranks still on their way
//! when ranks outnumber cores. Both are bounded by [`ACTIVE_WAIT`], so a
//! rank waiting on a slow one costs that much CPU at most.
//!
//! Whether waiting actively pays depends on the machine's load, which
//! changes: on a machine busy with other work, a spinning rank takes the
//! core the rank it waits for needs, and a yielding one hands its core to
//! the other work for a whole time slice, so rounds take milliseconds
//! instead of microseconds. The gate therefore keeps score: an active wait
//! that saw its round complete counts up, one that ended in parking anyway
//! counts down, and while the score is not positive waiters park at once,
//! trying an active wait again now and then. How much a failure counts and
//! how often a parked gate tries again depend on what a failure costs: a
//! yield in vain gives a core away for a whole time slice, so yielding
//! needs a clear record and is retried rarely; a spin in vain costs the
//! spinning core only, so spinning goes on while at least half the spins
//! pay and is retried soon (a data-parallel loop has a slow round now and
//! then, where one rank saves a checkpoint, and must not lose its quick
//! rounds to it for the rest of the run).

use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a waiter waits actively before parking: long enough for the
/// ranks of a data-parallel step to arrive (they drift apart by tens of
/// microseconds per step), short because under load a spin takes a core
/// from other work and a yield may hand it away for a time slice. With
/// 50 µs the digits example ran 1.2–1.4× faster on 2 ranks than on 1, and
/// 16 ranks on 2 cores took 89 µs a round; with 150 µs about 1.6–1.8× and
/// 40–55 µs. Spinning up to 1 ms helped steps of a millisecond but made 2
/// ranks sharing their cores with busy threads take 74 µs a round instead
/// of 8.
const ACTIVE_WAIT: Duration = Duration::from_micros(150);
/// Bounds of the score: how many recent successes it remembers.
const SCORE_MAX: i32 = 16;

/// How a waiter waits actively.
#[derive(Debug, Clone, Copy)]
pub(super) enum Active {
    /// Busy-wait: every rank can have its own core.
    Spin,
    /// Give the core to another thread: the rank that will complete the
    /// round may be waiting for one.
    Yield,
}

impl Active {
    /// What a failed active wait costs the score (a success counts 1).
    fn failure(self) -> i32 {
        match self {
            Active::Spin => 1,
            Active::Yield => 8,
        }
    }

    /// While active waiting does not pay, one wait in this many tries it.
    fn probe(self) -> u32 {
        match self {
            Active::Spin => 16,
            Active::Yield => 256,
        }
    }
}

/// The gate's choice of active waiting, and its score.
pub(super) struct ActiveWait {
    /// How waiters wait before parking (`None` with one rank).
    how: Option<Active>,
    /// Whether active waits have been seeing their round complete lately.
    score: AtomicI32,
    /// Waits that parked at once, counted to probe now and then.
    skipped: AtomicU32,
}

impl ActiveWait {
    pub fn new(ranks: usize) -> Self {
        let how = match ranks {
            1 => None,
            n if n <= crate::collective::cores() => Some(Active::Spin),
            _ => Some(Active::Yield),
        };
        Self::with(how, SCORE_MAX / 2)
    }

    /// A given way of waiting with a given score (tests set both).
    pub fn with(how: Option<Active>, score: i32) -> Self {
        Self {
            how,
            score: AtomicI32::new(score),
            skipped: AtomicU32::new(0),
        }
    }

    /// How this wait should wait actively, if at all: while active waits
    /// have paid lately, and now and then to find out whether they pay
    /// again.
    pub fn choose(&self) -> Option<Active> {
        self.how.filter(|how| {
            self.score.load(Ordering::Relaxed) > 0
                || self
                    .skipped
                    .fetch_add(1, Ordering::Relaxed)
                    .is_multiple_of(how.probe())
        })
    }

    /// Wait actively as `how` says until `done` or [`ACTIVE_WAIT`] has
    /// passed, and count whether it paid.
    pub fn wait(&self, how: Active, done: impl Fn() -> bool) {
        let until = Instant::now() + ACTIVE_WAIT;
        while !done() && Instant::now() < until {
            match how {
                Active::Spin => std::hint::spin_loop(),
                Active::Yield => std::thread::yield_now(),
            }
        }
        let step = if done() { 1 } else { -how.failure() };
        let _ = self
            .score
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                Some((s + step).clamp(-SCORE_MAX, SCORE_MAX))
            });
    }
}

impl std::fmt::Debug for ActiveWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActiveWait")
            .field("how", &self.how)
            .field("score", &self.score.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
impl ActiveWait {
    /// Every way of waiting, with a score for which active waiting pays
    /// and one for which it does not (waiters park at once but for the
    /// probes), for the gate's tests.
    pub fn every_way() -> Vec<(Option<Active>, i32)> {
        vec![
            (None, SCORE_MAX / 2),
            (Some(Active::Spin), SCORE_MAX / 2),
            (Some(Active::Yield), SCORE_MAX / 2),
            (Some(Active::Spin), -SCORE_MAX),
            (Some(Active::Yield), -SCORE_MAX),
        ]
    }
}
