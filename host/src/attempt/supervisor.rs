//! What the attempt knows about its ranks' health: the first failure, the
//! stop flag every rank checks, and each rank's last sign of life.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;

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
    /// The same as `stopping`, for ranks that wait for it.
    stop_signal: watch::Sender<bool>,
    started: Instant,
    /// `started` on the clock of [`coarse_ms`].
    started_ms: u64,
    ranks: Vec<RankHealth>,
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
}

impl Supervisor {
    pub fn new(world_size: u32) -> Self {
        Self {
            failure: Mutex::new(None),
            stopping: AtomicBool::new(false),
            stop_signal: watch::Sender::new(false),
            started: Instant::now(),
            started_ms: coarse_ms(),
            ranks: (0..world_size).map(|_| RankHealth::default()).collect(),
        }
    }

    /// Keep `failure` if it is the attempt's first; later ones are only
    /// logged by their cause.
    pub fn record(&self, failure: RunFailure) {
        let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            tracing::error!("{failure}");
            *slot = Some(failure);
        }
    }

    /// Raise the stop flag. Cheap to read: every rank reads it on every
    /// epoch tick.
    pub fn raise_stop(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Wake everything waiting in [`Supervisor::stopped`]; after
    /// [`Supervisor::raise_stop`].
    pub fn announce_stop(&self) {
        self.stop_signal.send_replace(true);
    }

    /// Resolves once the stop is announced.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut signal = self.stop_signal.subscribe();
        async move {
            // An error means the supervisor is gone: nothing to wait for.
            let _ = signal.wait_for(|stopping| *stopping).await;
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
