//! The attempt's watcher: a thread beside the ranks that stops them when a
//! stop is requested and its grace period runs out, when the attempt runs
//! past its wall-clock limit, when a rank stalls, or when writing reports
//! in the background failed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::Shared;
use crate::cluster::wire::Header;
use crate::failure::{FailureKind, RunFailure};

/// How often the watcher looks.
const POLL: Duration = Duration::from_millis(10);

/// Watch `attempt` until `done` is set (the watcher is unparked then).
pub(super) fn watch(attempt: &Shared, done: &AtomicBool) {
    let limits = &attempt.limits;
    let mut stop_at: Option<Instant> = None;
    while !done.load(Ordering::SeqCst) {
        attempt.check_background();
        if let Some(span) = &attempt.span {
            super::span::share_preemption(attempt, span);
        }
        // Another node failed: stop here too, at once (not at the next
        // collective call).
        if let Some(span) = &attempt.span
            && let Some((_, message)) = span.link.take_waiting(
                |_, h| matches!(h, Header::Failed { attempt, .. } if *attempt == span.attempt),
            )
            && let Header::Failed { failure, .. } = message.header
        {
            attempt.fail_here(failure);
            return;
        }
        if attempt.preemption.is_requested() && stop_at.is_none() {
            tracing::warn!(
                "stop requested: ranks have {} to report a final checkpoint (request again to stop at once)",
                humantime::format_duration(attempt.grace)
            );
            stop_at = Some(Instant::now() + attempt.grace);
        }
        if let Some(at) = stop_at
            && (attempt.preemption.is_forced() || Instant::now() >= at)
        {
            tracing::warn!("stopping the ranks now; committed checkpoints are intact");
            attempt.stopped_for_preemption.store(true, Ordering::SeqCst);
            attempt.stop();
            return;
        }
        if let Some(limit) = limits.attempt_timeout
            && attempt.supervisor.elapsed() > limit
        {
            attempt.fail(RunFailure {
                rank: None,
                kind: FailureKind::Limit,
                message: format!(
                    "the attempt exceeded its wall-clock limit of {}",
                    humantime::format_duration(limit)
                ),
            });
            return;
        }
        if let Some(timeout) = limits.stall_timeout
            && let Some((rank, quiet)) = attempt.supervisor.stalled(timeout)
        {
            attempt.fail(RunFailure {
                rank: Some(rank),
                kind: FailureKind::Limit,
                message: format!(
                    "stalled: no report and no output for {} (stall timeout {})",
                    humantime::format_duration(Duration::from_millis(quiet.as_millis() as u64)),
                    humantime::format_duration(timeout)
                ),
            });
            return;
        }
        // Parked, so that the end of the attempt wakes it at once.
        std::thread::park_timeout(POLL);
    }
}
