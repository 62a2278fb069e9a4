//! Asking a running [`crate::Trainer::fit`] to stop early.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A handle to ask a run to stop early, as on preemption: give it to
/// [`crate::TrainerBuilder::preemption`] and call [`Preemption::request`]
/// from any thread (a signal handler's thread, say).
///
/// On request, the ranks see `preemption_requested()` turn true right after
/// their next report, save and report a final checkpoint, and return; the
/// run ends with [`crate::TrainResult::preempted`] set and can be resumed
/// under the same name. Ranks that return without having been told (they
/// never asked) finished their work: the run is not preempted. Ranks still running after the run's preemption
/// grace period, or after [`Preemption::force`], are stopped at once.
/// Committed checkpoints stay intact either way.
///
/// ```no_run
/// use trainhost::{Preemption, Trainer};
///
/// let preemption = Preemption::new();
/// let trainer = Trainer::builder("loop.wasm").preemption(preemption.clone()).build()?;
/// let worker = std::thread::spawn(move || trainer.fit());
/// // ... later, e.g. on SIGTERM:
/// preemption.request();
/// let result = worker.join().unwrap()?;
/// assert!(result.preempted);
/// # Ok::<(), trainhost::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Preemption(Arc<Flags>);

#[derive(Debug, Default)]
struct Flags {
    requested: AtomicBool,
    forced: AtomicBool,
}

impl Preemption {
    /// A handle with nothing requested.
    pub fn new() -> Self {
        Self::default()
    }

    /// Ask the run to checkpoint and stop within its grace period.
    pub fn request(&self) {
        self.0.requested.store(true, Ordering::SeqCst);
    }

    /// Stop the ranks now, without waiting for a final checkpoint.
    pub fn force(&self) {
        self.0.requested.store(true, Ordering::SeqCst);
        self.0.forced.store(true, Ordering::SeqCst);
    }

    /// Whether a stop was requested.
    pub fn is_requested(&self) -> bool {
        self.0.requested.load(Ordering::SeqCst)
    }

    /// Whether an immediate stop was requested.
    pub fn is_forced(&self) -> bool {
        self.0.forced.load(Ordering::SeqCst)
    }
}
