//! The tasks that write an attempt's reports to storage. One writes reports
//! one at a time in report order: each checkpoint committed before the
//! history lines after it are stored (R9, R11, R12). Another deletes what
//! retention drops (R18), so that neither the next commit nor a guest
//! waiting in `report` waits on deletions: the run state no longer names a
//! dropped checkpoint when it is handed over, so a host killed before the
//! deletion leaves a directory the next open removes.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::time::Instant;

use super::queue::{Job, Message, Pending, RecordFailed, Shared};
use crate::ledger::{Committed, Ledger};
use crate::record::CheckpointRecord;

/// While reports keep coming, the history is stored at most this often in
/// the background mode (and at once before a commit, at a flush and at
/// the end). Each write stores the whole file, so a loop reporting
/// thousands of times a second would otherwise keep the writer rewriting
/// it, taking a core from the ranks. A report after a quiet spell is
/// stored at once.
const HISTORY_INTERVAL: Duration = Duration::from_millis(50);

/// And at most this share of the time goes to storing it: after a write
/// that took `t`, the next one waits `t × (HISTORY_SHARE_INVERSE - 1)` if
/// that is longer than [`HISTORY_INTERVAL`]. The file grows with every
/// report, so a fixed interval made a long run's writes cost more and more:
/// two ranks reporting two million times spent twice as long per report
/// as over the first two hundred thousand, the writer rewriting 200 MB
/// every 50 ms on a core of its own.
const HISTORY_SHARE_INVERSE: u32 = 20;

/// When the next periodic write of the history is due, after one that
/// began at `began` and ended at `ended`.
fn next_history_write(began: Instant, ended: Instant) -> Instant {
    let took = ended.saturating_duration_since(began);
    ended + HISTORY_INTERVAL.max(took * (HISTORY_SHARE_INVERSE - 1))
}

/// The writing task: reports in order, each checkpoint committed before the
/// history lines after it are stored.
pub(super) async fn write_reports(
    ledger: Arc<Ledger>,
    world_size: u32,
    mut rx: mpsc::Receiver<Message>,
    dropped: mpsc::UnboundedSender<Vec<CheckpointRecord>>,
    shared: Arc<Shared>,
) {
    let mut writer = Writer {
        ledger,
        world_size,
        dropped,
        shared,
        next_write: None,
    };
    loop {
        let message = match rx.try_recv() {
            Ok(message) => message,
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => {
                // Nothing waiting: store the lines so far in one write,
                // once the interval since the last write has passed.
                if writer.shared.unwritten.load(Ordering::Acquire)
                    && let Some(due) = writer.next_write
                    && let Ok(received) = tokio::time::timeout_at(due, rx.recv()).await
                {
                    match received {
                        Some(message) => message,
                        None => {
                            let _ = writer.store_lines().await;
                            return;
                        }
                    }
                } else {
                    let _ = writer.store_lines().await;
                    match rx.recv().await {
                        Some(message) => message,
                        None => return,
                    }
                }
            }
        };
        match message {
            Message::Flush(tx) => {
                let _ = writer.store_lines().await;
                let _ = tx.send(());
            }
            Message::Unwritten => {}
            Message::Report(mut job) => {
                let done = job.done.take();
                let result = writer.write(*job).await;
                writer.shared.queued.fetch_sub(1, Ordering::AcqRel);
                if let Some(done) = done {
                    let _ = done.send(result);
                }
            }
        }
    }
}

/// The writing task's state.
struct Writer {
    ledger: Arc<Ledger>,
    world_size: u32,
    /// Where dropped checkpoints go to be deleted.
    dropped: mpsc::UnboundedSender<Vec<CheckpointRecord>>,
    shared: Arc<Shared>,
    /// When the history may be stored next without a reason to hurry (see
    /// [`HISTORY_SHARE_INVERSE`]); `None` before the first write.
    next_write: Option<Instant>,
}

impl Writer {
    /// Keep the first failure; nothing is written after it.
    fn fail(&self, e: crate::error::Error) -> RecordFailed {
        self.shared.fail(e.into())
    }

    /// Store the history if lines are waiting.
    async fn write_history(&mut self) -> Result<(), RecordFailed> {
        if let Some(failed) = self.shared.failure() {
            return Err(failed);
        }
        if self.shared.unwritten.swap(false, Ordering::AcqRel) {
            let began = Instant::now();
            let written = self.ledger.write_history().await;
            self.next_write = Some(next_history_write(began, Instant::now()));
            if let Err(e) = written {
                return Err(self.fail(e));
            }
        }
        Ok(())
    }

    /// Store the history if lines are waiting, unless the run stores it
    /// itself after this attempt's failure (`Shared::history_left`).
    async fn store_lines(&mut self) -> Result<(), RecordFailed> {
        if self.shared.history_left.load(Ordering::Acquire) {
            return self.shared.failure().map_or(Ok(()), Err);
        }
        self.write_history().await
    }

    /// Commit the job's checkpoint, if any, and append the report to the
    /// history in memory; the loop stores it.
    async fn write(&mut self, job: Job) -> Result<(), RecordFailed> {
        if let Some(failed) = self.shared.failure() {
            return Err(failed);
        }
        let mut committed = None;
        if let Some(mut pending) = job.checkpoint {
            // Lines of earlier reports go first (R9): a host killed during
            // the commit must not lose them.
            self.write_history().await?;
            let result = self
                .commit(job.report_index, &job.metrics, &mut pending)
                .await;
            let Committed { stats, dropped } = result.map_err(|e| self.shared.fail(e))?;
            tracing::debug!(checkpoint = pending.index, ?stats, "persisted");
            // The deleter ends only after this task, so it is there.
            if !dropped.is_empty() {
                let _ = self.dropped.send(dropped);
            }
            committed = Some(pending.index);
        }
        self.ledger
            .append_report(job.report_index, job.metrics, committed);
        self.shared.unwritten.store(true, Ordering::Release);
        Ok(())
    }
}

impl Writer {
    /// Upload the checkpoint's files, wait for the other nodes' if any, and
    /// commit.
    async fn commit(
        &self,
        report_index: u64,
        metrics: &crate::metrics::Metrics,
        pending: &mut Pending,
    ) -> Result<Committed, RecordFailed> {
        let index = pending.index;
        let clear = pending.remote.is_none();
        let plan = pending.files.plan().await?;
        let mut uploaded = self.ledger.upload(index, plan, clear).await?;
        let mut ranks = plan.ranks.clone();
        if let Some(remote) = pending.remote.take() {
            let waited = tokio::task::spawn_blocking(move || {
                remote.wait(index, &mut uploaded, &mut ranks)?;
                Ok::<_, RecordFailed>((uploaded, ranks))
            })
            .await;
            (uploaded, ranks) = match waited {
                Ok(done) => done?,
                Err(_) => return Err(RecordFailed::Stopped),
            };
        }
        Ok(self
            .ledger
            .commit_uploaded(
                report_index,
                index,
                metrics,
                &ranks,
                self.world_size,
                uploaded,
            )
            .await?)
    }
}

/// The deleting task: checkpoints retention dropped, in the order they
/// were dropped, until the writing task is gone. A failure fails the
/// attempt like any storage failure; what is left is removed when the run
/// is opened next.
pub(super) async fn delete_dropped(
    ledger: Arc<Ledger>,
    mut rx: mpsc::UnboundedReceiver<Vec<CheckpointRecord>>,
    shared: Arc<Shared>,
) {
    while let Some(dropped) = rx.recv().await {
        if let Err(e) = ledger.delete_dropped(&dropped).await {
            shared.fail(e.into());
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_writes_take_a_bounded_share_of_the_time() {
        let began = Instant::now();
        // A quick write: the fixed interval.
        let ended = began + Duration::from_millis(1);
        assert_eq!(next_history_write(began, ended), ended + HISTORY_INTERVAL);
        // A slow one (a large history): 1 part in HISTORY_SHARE_INVERSE.
        let ended = began + Duration::from_millis(100);
        let next = next_history_write(began, ended);
        assert_eq!(
            next - began,
            Duration::from_millis(100) * HISTORY_SHARE_INVERSE
        );
    }
}
