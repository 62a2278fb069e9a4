//! What a rank may do with its attempt: the runtime's only view of it.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::task::Waker;

use cap_std::fs::Dir;
use futures::future::Either;

use super::{Aborted, Shared};
use crate::collective::{Call, CollectiveError, Delivered};
use crate::config::{NotAScore, human_bytes};
use crate::failure::RunFailure;
use crate::metrics::Metrics;
use crate::persist::{CaptureError, Collision, HandedOver, Inode, capture};

/// A report the guest gets back as an error; the run goes on, and a
/// refusal before the ranks meet does not count as the rank's report.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refused {
    /// The score attribute is not a number (R17).
    #[error(transparent)]
    Score(#[from] NotAScore),
    /// The checkpoint directory holds something a checkpoint may not.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// The checkpoint is over the size limit.
    #[error("{path} holds {} in {files} files, over the checkpoint limit of {}", human_bytes(*.bytes), human_bytes(*.limit))]
    TooLarge {
        path: String,
        bytes: u64,
        files: usize,
        limit: u64,
    },
    /// Ranks wrote different bytes under one path (R7).
    #[error(transparent)]
    Collision(#[from] Collision),
    /// The directory could not be handed over (`report-handing-over`).
    #[error(transparent)]
    HandOver(Box<dyn std::error::Error + Send + Sync>),
    /// Node 0 refused the report (ranks wrote different bytes under one
    /// path, R7, maybe on different nodes).
    #[error("{0}")]
    Elsewhere(String),
}

/// Moves the directory a guest named (its path as the guest wrote it) out
/// of the rank's sandbox to the host path it is given
/// (`report-handing-over`).
pub(crate) type HandOver<'a> =
    &'a (dyn Fn(&str, &Path) -> Result<(), Box<dyn std::error::Error + Send + Sync>> + Sync);

/// A checkpoint directory a rank reports.
pub(crate) struct Reported<'a> {
    /// The directory, opened inside the rank's sandbox.
    pub dir: Dir,
    /// The path as the guest wrote it.
    pub shown: &'a str,
    /// Set when the guest hands the directory over: called once its files
    /// are listed and accepted, so a refused directory stays where it is.
    pub hand_over: Option<HandOver<'a>>,
    /// The files the rank holds open for writing (see `persist::lend`).
    pub open_for_writing: HashSet<Inode>,
}

/// How a rank ended.
#[derive(Debug)]
pub(crate) enum RankEnd {
    /// `train` returned `Ok` (or the guest exited with status 0).
    Finished,
    /// The rank failed; the attempt fails with it if it is the first.
    Failed(RunFailure),
    /// The rank was stopped because the attempt is stopping.
    Stopped,
}

/// One rank's handle on its attempt. Cheap to clone; every clone speaks for
/// the same rank.
#[derive(Debug, Clone)]
pub(crate) struct RankHandle {
    rank: u32,
    attempt: Arc<Shared>,
}

impl RankHandle {
    pub(super) fn new(rank: u32, attempt: Arc<Shared>) -> Self {
        Self { rank, attempt }
    }

    /// The rank's index in the run.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The rank showed a sign of life (an output line, say).
    pub fn alive(&self) {
        self.attempt.supervisor.alive(self.rank);
    }

    /// Whether any of the ranks' files may be lent to a snapshot now (one
    /// atomic load): when not, a write concerns no snapshot.
    pub fn may_have_lent(&self) -> bool {
        self.attempt.lent.maybe_any()
    }

    /// Resolves once no snapshot is still linking the ranks' files (see
    /// `persist::lend`).
    pub async fn settled(&self) {
        self.attempt.lent.settled().await
    }

    /// The rank is about to open `path` below `dir` for writing: if it is
    /// a file lent to a snapshot, give the rank a copy of its own first
    /// (see `persist::lend`).
    pub fn before_write(
        &self,
        dir: &Dir,
        path: &str,
        follow: bool,
        truncate: bool,
    ) -> std::io::Result<()> {
        self.attempt.lent.before_write(dir, path, follow, truncate)
    }

    /// Whether the rank must stop now. Cheap: read on every epoch tick.
    pub fn is_stopping(&self) -> bool {
        self.attempt.supervisor.is_stopping()
    }

    /// Resolves once the rank must stop, for a rank that waits. It is
    /// polled beside the rank's call at every wake-up, with the same waker
    /// each time: that waker is registered once.
    pub fn stopping(&self) -> impl Future<Output = ()> + Send + 'static {
        let (attempt, rank) = (Arc::clone(&self.attempt), self.rank);
        let mut registered: Option<Waker> = None;
        std::future::poll_fn(move |cx| {
            let fresh = !registered.as_ref().is_some_and(|w| w.will_wake(cx.waker()));
            if fresh {
                registered = Some(cx.waker().clone());
            }
            attempt.supervisor.poll_stopped(rank, fresh, cx)
        })
    }

    /// Refuse metrics the run cannot rank (R17), before anything else of a
    /// report is looked at.
    pub fn check_metrics(&self, metrics: &Metrics) -> Result<(), Refused> {
        Ok(self.attempt.retention.check_metrics(metrics)?)
    }

    /// The rank's part of the next collective report (R6), with the
    /// checkpoint directory the guest named, if any. The directory is
    /// captured (or refused) at once; the future returned completes once
    /// the report is recorded (or committed, in the blocking mode), with a
    /// refusal the guest sees, or `Aborted` if the attempt is stopping. It
    /// borrows nothing of `checkpoint`.
    pub fn report<'h>(
        &'h self,
        metrics: Metrics,
        checkpoint: Option<Reported<'_>>,
    ) -> impl Future<Output = Result<Result<(), Refused>, Aborted>> + use<'h> {
        let capture = match checkpoint {
            None => None,
            Some(reported) => match self.capture(reported) {
                Ok(capture) => Some(capture),
                Err(refused) => return Either::Left(std::future::ready(Ok(Err(refused)))),
            },
        };
        self.attempt.supervisor.count_report(self.rank);
        Either::Right(self.attempt.report(self.rank, metrics, capture))
    }

    fn capture(&self, reported: Reported<'_>) -> Result<crate::persist::Capture, Refused> {
        let Reported {
            dir,
            shown,
            hand_over,
            open_for_writing,
        } = reported;
        // Named by world rank: manifests and collisions speak of those.
        let mut captured = capture(self.attempt.world_rank(self.rank), dir, shown)?;
        captured.open_for_writing = open_for_writing;
        let bytes: u64 = captured.files.iter().map(|(_, size)| size).sum();
        if let Some(limit) = self.attempt.limits.max_checkpoint_bytes
            && bytes > limit
        {
            return Err(Refused::TooLarge {
                path: shown.to_owned(),
                bytes,
                files: captured.files.len(),
                limit,
            });
        }
        if let Some(hand_over) = hand_over {
            // The capture's handle follows the directory where it moves.
            let to = self.attempt.handed_over_path(self.rank);
            hand_over(shown, &to).map_err(Refused::HandOver)?;
            captured.handed_over = Some(HandedOver::new(to));
        }
        Ok(captured)
    }

    /// The rank's part of the next collective call of the `collective`
    /// interface (R29): its result, or why there is none.
    pub async fn collective(&self, call: Call) -> Result<Delivered, CollectiveError> {
        self.attempt.collective(self.rank, call).await
    }

    /// A collective call of a run of one rank that carries no data to
    /// exchange: no round is made, as MPI does nothing for a communicator
    /// of one. It is a sign of life, and is aborted if the attempt is
    /// stopping (R31), as a round would be.
    pub fn collective_alone(&self) -> Result<(), CollectiveError> {
        self.attempt.collective_alone(self.rank)
    }

    /// Whether the rank sees preemption requested: the same answer on
    /// every rank after the same report.
    pub fn preemption_requested(&self) -> bool {
        let reports = self.attempt.supervisor.reports(self.rank);
        self.attempt.preemption_requested(reports)
    }

    /// The guest path of the checkpoint to resume from (R21), or `Aborted`
    /// if it cannot be restored (the attempt fails) or the attempt is
    /// stopping.
    pub fn get_checkpoint(&self) -> Result<Option<String>, Aborted> {
        self.attempt.get_checkpoint(self.rank)
    }

    /// The rank ended, as `how` says.
    pub fn end(self, how: RankEnd) {
        let attempt = &self.attempt;
        attempt.supervisor.ended(self.rank);
        match how {
            RankEnd::Finished => {
                if let Err(violation) = attempt.gate.finish(self.rank as usize) {
                    attempt.fail_protocol(violation);
                }
            }
            RankEnd::Failed(failure) => attempt.fail(failure),
            RankEnd::Stopped => {}
        }
    }
}
