//! The kernels' own threads, for the GEMMs large enough to use several.
//!
//! The gemm crate splits such a GEMM over the threads of rayon's current
//! pool. Rayon's global pool belongs to the whole process (a program
//! embedding the host may run its own work there), and its threads compute
//! subnormals, which the kernels flush ([`super::subnormals`]): a GEMM's
//! values would depend on whether its work was split. This pool's threads
//! flush subnormals for good and run nothing but kernels. (A new thread
//! starts with the floating-point mode of the thread that starts it, and
//! the pool is started by the first GEMM that needs it, inside a kernel:
//! the start handler sets the flags whatever that mode is.)

use std::sync::OnceLock;

/// The pool, one per process, with a thread per core the process may use;
/// `None` when its threads could not be started (logged once).
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let built = rayon::ThreadPoolBuilder::new()
            .num_threads(crate::cores::cores())
            .thread_name(|i| format!("trainhost-kernels-{i}"))
            .start_handler(|_| super::subnormals::flush_for_good())
            .build();
        match built {
            Ok(pool) => Some(pool),
            Err(e) => {
                tracing::warn!(
                    "cannot start the tensor kernels' threads ({e}); GEMMs run on one thread each"
                );
                None
            }
        }
    })
    .as_ref()
}

/// Run `gemm` on this pool, given the number of threads it may use:
/// `threads`, or 1 (on this thread) when the pool could not be started.
/// The gemm crate's parallel loops find the pool's threads from there.
pub(super) fn install<R: Send>(threads: usize, gemm: impl FnOnce(usize) -> R + Send) -> R {
    match pool() {
        Some(pool) => pool.install(|| gemm(threads)),
        None => gemm(1),
    }
}
