//! The cores this process's ranks may use: one owner for the count that
//! the executor's threads (`crate::executor`) and the tensor kernels'
//! threads (`crate::tensor::threads_per_rank`) are both sized by.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The cores this process may run on (its CPU affinity and cgroup quota),
/// read once: `available_parallelism` reads the cgroup's limits from files
/// each time it is called, which costs more than a small collective.
pub(crate) fn host_cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// How many processes of the job run on this host, this one among them.
static HOST_PROCESSES: AtomicUsize = AtomicUsize::new(1);

/// `processes` of the job (this one among them) run on this host and
/// share its cores: each takes an equal share for its ranks' threads and
/// kernels, as MPI jobs share a host's cores between their processes. With
/// 2 ranks on each of 2 processes on 2 cores, a thread per rank in each
/// process put 4 threads on the 2 cores, and all-reduces of a list across
/// the processes took 25–32 µs a round for 4 KiB and 0.80–0.94 ms for
/// 1 MiB, against 14–17 µs and 0.57–0.78 ms with one thread each
/// (alternating runs).
pub(crate) fn share(processes: usize) {
    HOST_PROCESSES.store(processes.max(1), Ordering::Relaxed);
}

/// The cores this process's ranks may use: its share of
/// [`host_cores`] (see [`share`]), at least one.
pub(crate) fn cores() -> usize {
    share_of(host_cores(), HOST_PROCESSES.load(Ordering::Relaxed))
}

/// One sharer's part of `cores` split equally among `sharers` (the
/// processes on a host, or the ranks in one): at least one.
pub(crate) fn share_of(cores: usize, sharers: usize) -> usize {
    (cores / sharers.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_on_a_host_share_its_cores() {
        assert_eq!(share_of(8, 1), 8);
        assert_eq!(share_of(8, 2), 4);
        // Left over cores are not handed out: no process gets more than
        // its share.
        assert_eq!(share_of(8, 3), 2);
        // More processes than cores: each still runs.
        assert_eq!(share_of(2, 4), 1);
        assert_eq!(share_of(2, 0), 2);
    }
}
