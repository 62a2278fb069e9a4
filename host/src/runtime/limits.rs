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

/// Keeps a rank's linear memory and its host tensors together within the
/// memory limit: growing the linear memory past it traps with a
/// [`LimitHit`] that says so; a tensor that would not fit is refused.
#[derive(Debug)]
pub(crate) struct MemoryLimiter {
    max: Option<u64>,
    /// The linear memory's size, as last grown.
    linear: u64,
    /// The bytes of the rank's host tensors.
    tensors: u64,
}

impl MemoryLimiter {
    pub fn new(max: Option<u64>) -> Self {
        Self {
            max,
            linear: 0,
            tensors: 0,
        }
    }

    /// Count `bytes` more of host tensors, or say why they do not fit.
    pub fn take_tensor(&mut self, bytes: u64) -> Result<(), String> {
        self.take("a tensor", bytes)
    }

    /// Count `bytes` more of what the host keeps for the rank besides its
    /// linear memory (`what`: a tensor, a program's kernels), with its
    /// tensors, or say why they do not fit.
    pub fn take(&mut self, what: &str, bytes: u64) -> Result<(), String> {
        let total = self.linear + self.tensors + bytes;
        match self.max {
            Some(max) if total > max => Err(format!(
                "{what} of {} would take the rank past its memory limit of {} ({} of linear memory and {} of tensors in use)",
                human_bytes(bytes),
                human_bytes(max),
                human_bytes(self.linear),
                human_bytes(self.tensors)
            )),
            _ => {
                self.tensors += bytes;
                Ok(())
            }
        }
    }

    /// A tensor (or what else [`Self::take`] counted) of `bytes` was
    /// dropped.
    pub fn give_back_tensor(&mut self, bytes: u64) {
        self.tensors = self.tensors.saturating_sub(bytes);
    }
}

impl wasmtime::ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let desired = desired as u64;
        match self.max {
            Some(max) if desired + self.tensors > max => {
                let tensors = if self.tensors > 0 {
                    format!(", with {} of host tensors", human_bytes(self.tensors))
                } else {
                    String::new()
                };
                Err(wasmtime::Error::new(LimitHit(format!(
                    "exceeded the memory limit of {} (it asked for {}{tensors})",
                    human_bytes(max),
                    human_bytes(desired)
                ))))
            }
            _ => {
                self.linear = desired;
                Ok(true)
            }
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
    fn linear_memory_and_tensors_share_the_limit() {
        use wasmtime::ResourceLimiter;
        let mut m = MemoryLimiter::new(Some(1000));
        assert!(m.memory_growing(0, 600, None).unwrap());
        let e = m.take_tensor(500).unwrap_err();
        assert!(e.contains("memory limit of 1000 B"), "{e}");
        m.take_tensor(400).unwrap();
        let e = m.memory_growing(600, 700, None).unwrap_err().to_string();
        assert!(e.contains("with 400 B of host tensors"), "{e}");
        m.give_back_tensor(400);
        assert!(m.memory_growing(600, 1000, None).unwrap());
        assert!(MemoryLimiter::new(None).take_tensor(u64::MAX / 2).is_ok());
    }

    #[test]
    fn the_output_budget_allows_bursts_and_refuses_floods() {
        let mut b = OutputBudget::new(1000);
        assert!(b.take(3000).is_ok(), "within the burst");
        let err = b.take(2000).unwrap_err().to_string();
        assert!(err.contains("output limit of 1000 B/s"), "{err}");
    }
}
