//! Enforcing the per-rank limits of [`crate::ResourceLimits`] inside the
//! engine, and telling a rank that hits one apart from one that failed on
//! its own.

use std::fmt;

use crate::config::human_bytes;

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
                human_bytes(max),
                human_bytes(desired as u64)
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
                human_bytes(self.rate)
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_output_budget_allows_bursts_and_refuses_floods() {
        let mut b = OutputBudget::new(1000);
        assert!(b.take(3000).is_ok(), "within the burst");
        let err = b.take(2000).unwrap_err().to_string();
        assert!(err.contains("output limit of 1000 B/s"), "{err}");
    }
}
