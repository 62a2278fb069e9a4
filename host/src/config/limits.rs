//! What each rank may use, and where a running rank can be stopped.

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
    /// averaged over a few seconds. Rank 0's reported metrics count too
    /// (as JSON): the run's history keeps them. Default 1 MiB/s.
    pub max_output_rate: Option<u64>,
    /// Longer output lines are cut to this many bytes, marked as cut (not
    /// a failure). Default 64 KiB.
    pub max_line_bytes: usize,
    /// The largest checkpoint one report may commit, all ranks' files
    /// together; a larger one is refused with an error the guest sees (a
    /// sparse file can claim terabytes). Default: none.
    pub max_checkpoint_bytes: Option<u64>,
    /// Disk one rank's scratch directory may use: its files' allocated
    /// blocks (a sparse file counts what it holds), each file, directory
    /// or link at least 4 KiB (so that the limit also bounds the files a
    /// rank keeps, and the inodes it takes), and on Linux the files it
    /// deleted but holds open. Measured every second
    /// (every 5 at most, for a rank keeping very many files), so a rank
    /// writing fast overshoots it by what it writes between two
    /// measurements; past it, the rank fails. Needs
    /// [`Interruption::Anywhere`], as a rank that stops calling the host
    /// after writing must still be stopped. Default: none.
    pub max_scratch_bytes: Option<u64>,
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
            max_scratch_bytes: None,
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
    /// that need to stop a busy rank (`stall_timeout`, `attempt_timeout`,
    /// `max_scratch_bytes`) are refused with it.
    AtHostCalls,
}

impl Interruption {
    /// Whether compiled code checks for a stop (wasmtime epochs).
    pub(crate) fn uses_epochs(self) -> bool {
        self == Self::Anywhere
    }
}

/// Bytes for people: `512 MiB`.
pub(crate) fn human_bytes(n: u64) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_well() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(64 << 20), "64 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }
}
