//! What the attempt knows about its ranks' health: the first failure, the
//! stop flag every rank checks, and each rank's last sign of life.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use futures::task::AtomicWaker;

use crate::failure::RunFailure;

/// Milliseconds on a monotonic clock that is cheap to read. Every rank
/// marks itself alive at each report and output line, thousands of times a
/// second, for a stall timeout of seconds: Linux's coarse clock is read
/// from memory without the time-stamp counter and lags the precise one by
/// a scheduler tick at most.
fn coarse_ms() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
        t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
    }
    #[cfg(not(target_os = "linux"))]
    {
        static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        BASE.get_or_init(Instant::now).elapsed().as_millis() as u64
    }
}

/// One attempt's health, shared by its ranks and its watcher.
#[derive(Debug)]
pub(super) struct Supervisor {
    failure: Mutex<Option<RunFailure>>,
    stopping: AtomicBool,
    /// Set once the stop is announced, for ranks that wait for it (each
    /// with its own waker in [`RankHealth::stop_waker`]).
    announced: AtomicBool,
    started: Instant,
    /// `started` on the clock of [`coarse_ms`].
    started_ms: u64,
    /// On cache lines of their own: each rank writes its own several
    /// times a round, and neighbouring ranks run on different threads.
    ranks: Vec<CachePadded<RankHealth>>,
}

/// One rank's health.
#[derive(Debug, Default)]
struct RankHealth {
    /// Milliseconds after the attempt started of its last sign of life (a
    /// report, an output line).
    alive_at: AtomicU64,
    /// Waiting for the other ranks inside a collective call: not stalled.
    waiting: AtomicBool,
    /// Returned, failed or stopped: can no longer stall.
    ended: AtomicBool,
    /// Reports this rank has made in this attempt.
    reports: AtomicU64,
    /// Woken when the stop is announced. A rank's future polls its stop
    /// beside its call of `train` at every wake-up, so this must cost
    /// little: registering here is an atomic swap, where a shared
    /// notification took a lock every time (1–2% of a `report`).
    stop_waker: AtomicWaker,
}

impl Supervisor {
    pub fn new(world_size: u32) -> Self {
        Self {
            failure: Mutex::new(None),
            stopping: AtomicBool::new(false),
            announced: AtomicBool::new(false),
            started: Instant::now(),
            started_ms: coarse_ms(),
            ranks: (0..world_size).map(|_| CachePadded::default()).collect(),
        }
    }

    /// Keep `failure` if it is the attempt's first, and log its headline
    /// (its evidence goes with the restart's log line or the run's error).
    pub fn record(&self, failure: RunFailure) {
        let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            tracing::error!("{}", failure.headline());
            *slot = Some(failure);
        }
    }

    /// Raise the stop flag. Cheap to read: every rank reads it on every
    /// epoch tick.
    pub fn raise_stop(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Wake every rank waiting in [`Supervisor::poll_stopped`]; after
    /// [`Supervisor::raise_stop`].
    pub fn announce_stop(&self) {
        self.announced.store(true, Ordering::Release);
        for rank in &self.ranks {
            rank.stop_waker.wake();
        }
    }

    /// Ready once the stop is announced; rank `rank`'s wait for it. With
    /// `register`, `cx`'s waker is the one to wake; else the one given
    /// before still is.
    pub fn poll_stopped(&self, rank: u32, register: bool, cx: &mut Context<'_>) -> Poll<()> {
        // Registered before the flag is read: an announcement between the
        // two still wakes this waker.
        if register {
            self.ranks[rank as usize].stop_waker.register(cx.waker());
        }
        if self.announced.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Whether every rank must stop now.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// The attempt's first failure.
    pub fn failure(&self) -> Option<RunFailure> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How long this attempt has run.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Rank `rank` showed a sign of life.
    pub fn alive(&self, rank: u32) {
        let now = coarse_ms().saturating_sub(self.started_ms);
        self.ranks[rank as usize]
            .alive_at
            .store(now, Ordering::Relaxed);
    }

    /// Rank `rank` waits for the others (`true`) or runs its own code.
    pub fn waiting(&self, rank: u32, waiting: bool) {
        self.ranks[rank as usize]
            .waiting
            .store(waiting, Ordering::Relaxed);
    }

    /// Rank `rank` ended.
    pub fn ended(&self, rank: u32) {
        self.ranks[rank as usize]
            .ended
            .store(true, Ordering::Relaxed);
    }

    /// Count one report of rank `rank`; returns how many it has made.
    pub fn count_report(&self, rank: u32) -> u64 {
        self.ranks[rank as usize]
            .reports
            .fetch_add(1, Ordering::Relaxed)
            + 1
    }

    /// How many reports rank `rank` has made in this attempt.
    pub fn reports(&self, rank: u32) -> u64 {
        self.ranks[rank as usize].reports.load(Ordering::Relaxed)
    }

    /// A rank that has shown no sign of life for longer than `timeout`
    /// while running its own code, and for how long.
    pub fn stalled(&self, timeout: Duration) -> Option<(u32, Duration)> {
        let now = Duration::from_millis(coarse_ms().saturating_sub(self.started_ms));
        self.ranks.iter().enumerate().find_map(|(r, health)| {
            if health.ended.load(Ordering::Relaxed) || health.waiting.load(Ordering::Relaxed) {
                return None;
            }
            let quiet = now.saturating_sub(Duration::from_millis(
                health.alive_at.load(Ordering::Relaxed),
            ));
            (quiet > timeout).then_some((r as u32, quiet))
        })
    }
}
