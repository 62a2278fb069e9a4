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

/// What a tensor or a program costs the host besides its values: its
/// entry in the rank's resource table, the boxed value and a tensor's
/// shape. Counted against the memory limit with the values, so that a
/// guest cannot hold host memory outside the limit in empty tensors or
/// programs (up to [`MAX_ENTRIES`] of them).
pub(crate) const ENTRY_BYTES: u64 = 128;

/// The most tensors and programs a rank holds at once: below the 100 000
/// handles wasmtime lets a store hold (a rank's open files and streams
/// count there too), so that a rank that keeps making them is refused
/// with a message that says so, not trapped by wasmtime's own.
pub(crate) const MAX_ENTRIES: u64 = 90_000;

/// Keeps a rank's linear memory and its host tensors together within the
/// memory limit: growing the linear memory past it traps with a
/// [`LimitHit`] that says so; a tensor that would not fit is refused.
#[derive(Debug)]
pub(crate) struct MemoryLimiter {
    max: Option<u64>,
    /// The linear memory's size, as last grown.
    linear: u64,
    /// The bytes of the rank's host tensors and programs, with their
    /// entries' own ([`ENTRY_BYTES`]), and of its directory listings
    /// (`listing.rs`).
    tensors: u64,
    /// How many tensors and programs the rank holds.
    entries: u64,
}

impl MemoryLimiter {
    pub fn new(max: Option<u64>) -> Self {
        Self {
            max,
            linear: 0,
            tensors: 0,
            entries: 0,
        }
    }

    /// Count a new tensor of `bytes`, or say why it does not fit.
    pub fn take_tensor(&mut self, bytes: u64) -> Result<(), String> {
        self.take_entries("a tensor", 1, bytes)
    }

    /// A tensor of `bytes` was dropped.
    pub fn give_back_tensor(&mut self, bytes: u64) {
        self.give_back_entries(1, bytes);
    }

    /// Count `entries` new entries of the rank's resource table (`what`:
    /// tensors, a program) holding `bytes` in all, each with its
    /// [`ENTRY_BYTES`], or say why they do not fit: in the memory limit, or
    /// among the [`MAX_ENTRIES`] a rank may hold.
    pub fn take_entries(&mut self, what: &str, entries: u64, bytes: u64) -> Result<(), String> {
        let held = self.entries.saturating_add(entries);
        if held > MAX_ENTRIES {
            return Err(format!(
                "{what} would make the rank hold more than {MAX_ENTRIES} tensors and programs at once (it holds {}); drop those it no longer uses",
                self.entries
            ));
        }
        self.count(what, bytes, entries.saturating_mul(ENTRY_BYTES))?;
        self.entries = held;
        Ok(())
    }

    /// `entries` counted by [`Self::take_entries`], holding `bytes` in
    /// all, were dropped.
    pub fn give_back_entries(&mut self, entries: u64, bytes: u64) {
        self.entries = self.entries.saturating_sub(entries);
        self.give_back(bytes.saturating_add(entries.saturating_mul(ENTRY_BYTES)));
    }

    /// Count `bytes` more of what the host keeps for the rank besides its
    /// linear memory (`what`: a program's kernels), with its tensors, or
    /// say why they do not fit.
    pub fn take(&mut self, what: &str, bytes: u64) -> Result<(), String> {
        self.count(what, bytes, 0)
    }

    /// Count `bytes` of `what`, and `beside` bytes the host keeps for it
    /// (what the message names when `what` holds nothing itself).
    fn count(&mut self, what: &str, bytes: u64, beside: u64) -> Result<(), String> {
        let more = bytes.saturating_add(beside);
        let total = self
            .linear
            .saturating_add(self.tensors)
            .saturating_add(more);
        match self.max {
            Some(max) if total > max => Err(format!(
                "{what} of {} would take the rank past its memory limit of {} ({} of linear memory and {} of tensors, programs and directory listings in use)",
                human_bytes(if bytes > 0 { bytes } else { beside }),
                human_bytes(max),
                human_bytes(self.linear),
                human_bytes(self.tensors)
            )),
            _ => {
                self.tensors += more;
                Ok(())
            }
        }
    }

    /// Bytes counted by [`Self::take`] or [`Self::take_entries`] (with
    /// the entries' own) were freed.
    pub fn give_back(&mut self, bytes: u64) {
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
                    format!(
                        ", with {} of host tensors, programs and directory listings",
                        human_bytes(self.tensors)
                    )
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
                "exceeded the output limit of {}/s (--max-output-rate)",
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
        // 272 B of values and the tensor's own 128 B fit; one more byte
        // does not.
        assert!(m.take_tensor(273).is_err());
        m.take_tensor(272).unwrap();
        let e = m.memory_growing(600, 700, None).unwrap_err().to_string();
        assert!(
            e.contains("with 400 B of host tensors, programs and directory listings"),
            "{e}"
        );
        m.give_back_tensor(272);
        assert!(m.memory_growing(600, 1000, None).unwrap());
        assert!(MemoryLimiter::new(None).take_tensor(u64::MAX / 2).is_ok());
    }

    #[test]
    fn tensors_and_programs_are_bounded_in_number_below_wasmtimes_handles() {
        let mut m = MemoryLimiter::new(None);
        m.take_entries("tensors", MAX_ENTRIES, 0).unwrap();
        let e = m.take_tensor(0).unwrap_err();
        assert!(e.contains("more than 90000 tensors and programs"), "{e}");
        m.give_back_tensor(0);
        m.take_tensor(0).unwrap();
        // Wasmtime's own bound, which this one must stay below.
        let store = wasmtime::Store::new(&wasmtime::Engine::default(), ());
        assert!(store.max_component_handles() as u64 >= MAX_ENTRIES + 10_000);
    }

    #[test]
    fn the_output_budget_allows_bursts_and_refuses_floods() {
        let mut b = OutputBudget::new(1000);
        assert!(b.take(3000).is_ok(), "within the burst");
        let err = b.take(2000).unwrap_err().to_string();
        assert!(err.contains("output limit of 1000 B/s"), "{err}");
    }
}
