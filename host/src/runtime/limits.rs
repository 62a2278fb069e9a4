//! Per-rank resource limits, and how a rank that hits one is told apart
//! from one that failed on its own.

use std::fmt;
use std::time::Duration;

/// What each rank may use. Every limit hit fails the run's attempt (and
/// counts toward `max_failures`) with a message naming the limit and the
/// rank.
///
/// ```
/// use std::time::Duration;
/// let limits = trainhost::ResourceLimits {
///     max_memory: Some(512 << 20),
///     stall_timeout: Some(Duration::from_secs(600)),
///     ..trainhost::ResourceLimits::default()
/// };
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceLimits {
    /// Linear memory per rank, in bytes. Default: none beyond wasm32's
    /// 4 GiB.
    pub max_memory: Option<u64>,
    /// A rank that neither reports nor prints for this long, while not
    /// waiting for other ranks in `report`, has stalled (like Ray's worker
    /// health check). Default: none.
    pub stall_timeout: Option<Duration>,
    /// Wall-clock time one attempt (every rank, from start to the last
    /// return) may take. Default: none.
    pub attempt_timeout: Option<Duration>,
    /// Output one rank may write per second, stdout and stderr together,
    /// averaged over a few seconds. Default 1 MiB/s.
    pub max_output_rate: Option<u64>,
    /// Longer output lines are cut to this many bytes, marked as cut (not
    /// a failure). Default 64 KiB.
    pub max_line_bytes: usize,
    /// The largest checkpoint one report may commit, all ranks' files
    /// together; a larger one is refused with an error the guest sees (a
    /// sparse file can claim terabytes). Default: none.
    pub max_checkpoint_bytes: Option<u64>,
}

impl Default for ResourceLimits {
    fn default() -> Self {
        Self {
            max_memory: None,
            stall_timeout: None,
            attempt_timeout: None,
            max_output_rate: Some(1 << 20),
            max_line_bytes: 64 * 1024,
            max_checkpoint_bytes: None,
        }
    }
}

/// How a running rank is stopped when the run must stop it: another rank
/// failed, a limit was hit, or preemption's grace period ran out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Interruption {
    /// Wherever it is. The compiled guest checks for a stop at every
    /// function entry and loop iteration (wasmtime's epoch interruption),
    /// which costs time in tight numeric loops: up to ~5x native on the
    /// SGD step in `BENCHMARKS.md`.
    #[default]
    Anywhere,
    /// Only when it calls the host (`report`, `get-checkpoint`, and the
    /// other trainhost imports). Guest code runs without checks, at native
    /// speed, but a rank that stops calling the host cannot be stopped: the
    /// run waits for it. For guests trusted to report regularly; the limits
    /// that need to stop a busy rank (`stall_timeout`, `attempt_timeout`)
    /// are refused with it.
    AtHostCalls,
}

impl Interruption {
    /// Whether compiled code checks for a stop (wasmtime epochs).
    pub(crate) fn uses_epochs(self) -> bool {
        self == Self::Anywhere
    }
}

/// The error a rank traps with when it hits a limit; its text is the
/// failure's message.
#[derive(Debug)]
pub(crate) struct LimitHit(pub String);

impl fmt::Display for LimitHit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LimitHit {}

/// Bytes for people: `512 MiB`.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 || value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Refuses growing a rank's linear memory past the limit, trapping with a
/// [`LimitHit`] that says so.
#[derive(Debug)]
pub(crate) struct MemoryLimiter {
    pub max: Option<u64>,
}

impl wasmtime::ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        match self.max {
            Some(max) if desired as u64 > max => Err(wasmtime::Error::new(LimitHit(format!(
                "exceeded the memory limit of {} (it asked for {})",
                bytes(max),
                bytes(desired as u64)
            )))),
            _ => Ok(true),
        }
    }

    fn table_growing(
        &mut self,
        _current: usize,
        _desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(true)
    }
}

/// A token bucket for a rank's output: `rate` bytes a second, with a burst
/// of four seconds' worth.
#[derive(Debug)]
pub(crate) struct OutputBudget {
    rate: u64,
    tokens: f64,
    last: std::time::Instant,
}

impl OutputBudget {
    pub fn new(rate: u64) -> Self {
        Self {
            rate,
            tokens: (rate * 4) as f64,
            last: std::time::Instant::now(),
        }
    }

    /// Take `n` bytes; the error when the rank writes faster than allowed.
    pub fn take(&mut self, n: usize) -> Result<(), LimitHit> {
        let now = std::time::Instant::now();
        let refill = now.duration_since(self.last).as_secs_f64() * self.rate as f64;
        self.tokens = (self.tokens + refill).min((self.rate * 4) as f64);
        self.last = now;
        self.tokens -= n as f64;
        if self.tokens < 0.0 {
            return Err(LimitHit(format!(
                "exceeded the output limit of {}/s",
                bytes(self.rate)
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_well() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(64 << 20), "64 MiB");
        assert_eq!(bytes(1536), "1.5 KiB");
    }

    #[test]
    fn the_output_budget_allows_bursts_and_refuses_floods() {
        let mut b = OutputBudget::new(1000);
        assert!(b.take(3000).is_ok(), "within the burst");
        let err = b.take(2000).unwrap_err().to_string();
        assert!(err.contains("output limit of 1000 B/s"), "{err}");
    }
}
