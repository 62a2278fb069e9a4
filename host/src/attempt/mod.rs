//! One attempt of a run: a gang of ranks started together, supervised
//! together, and stopped together (R19).
//!
//! The attempt owns what its ranks share: the collective calls (the gate
//! in `gate.rs` that matches them, `round.rs` that runs a round: a report
//! through the recorder that writes reports to storage in `recorder.rs` and
//! `writer.rs`, or an exchange of data between the ranks), the restorer that hands out the
//! checkpoint to resume from (`restore.rs`), the preemption latch, and the
//! supervision of the gang (`supervisor.rs`: the first failure, the stop
//! flag, each rank's liveness; `watch.rs`: the thread that enforces the
//! attempt's time limits, stalls and the preemption grace period;
//! `scratch.rs`: the one that measures the ranks' scratch directories).
//!
//! The runtime sees none of this: each rank gets a [`RankHandle`], which
//! offers exactly the calls a rank makes (report, get a checkpoint, ask
//! about preemption, show a sign of life, end).
//!
//! **Stopping.** Every reason to stop the gang enters through one door,
//! `Shared::fail` (or `Shared::stop`, without a failure): it keeps the
//! attempt's first failure, raises the flag that running guests check on
//! every epoch tick, and wakes every rank blocked in a collective call. A
//! rank's own trap or error comes in through its [`RankHandle`]; the
//! watcher's limits, the preemption grace period and a storage failure of
//! the recorder through the watcher thread, which holds the attempt's
//! shared state beside the ranks.
//!
//! When a run spans several hosts (`span.rs`), each node's attempt is one
//! part of the job's: its gate's leader takes every round to node 0, and a
//! failure enters `Shared::fail` as on one host and is sent to every other
//! node, whose watcher takes it off the link and fails its own part
//! (`Shared::fail_here`), releasing ranks waiting for a round as the gate
//! releases them.

mod calls;
mod gate;
mod handle;
mod queue;
mod recorder;
mod restore;
mod round;
mod scratch;
mod settle;
mod shards;
mod shipper;
mod span;
mod supervisor;
mod watch;
mod writer;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::runtime::Handle;

/// A file's identity (device, inode), as `Reported` lists the files a rank
/// holds open for writing.
pub(crate) use crate::persist::Inode;
pub(crate) use gate::Aborted;
pub(crate) use handle::{HandOver, RankEnd, RankHandle, Refused, Reported};
pub(crate) use restore::RestoreCache;

use gate::ReportGate;
use recorder::Recorder;
use restore::Restorer;
use round::{Arrival, Outcome};
use shipper::Shipper;
use supervisor::Supervisor;

use crate::checkpoint::Checkpoint;
use crate::cluster::{Layout, Link};
use crate::config::ResourceLimits;
use crate::config::Retention;
use crate::executor::{self, IdleWait, Pool, TaskFuture};
use crate::failure::{FailureKind, RunFailure};
use crate::ledger::Ledger;
use crate::persist::{Lent, Snapshots};
use crate::preemption::Preemption;
use crate::storage::Storage;

/// What one attempt needs.
#[derive(Debug)]
pub(crate) struct AttemptSetup {
    /// The ranks on this host.
    pub world_size: u32,
    /// The other nodes, when the run spans several hosts.
    pub span: Option<Span>,
    /// How long a rank waits in `report` for the others.
    pub report_timeout: Duration,
    pub records: Records,
    /// Where checkpoints are copied so that `report` returns before they
    /// are uploaded; `None` to return once committed.
    pub snapshots: Option<PathBuf>,
    /// Where directories the ranks hand over (`report-handing-over`) are
    /// moved: on the file system of the ranks' scratch directories.
    pub handed_over: PathBuf,
    /// The run's local copies of restored checkpoints, kept across attempts.
    pub restore: Arc<RestoreCache>,
    pub resume_from: Option<Checkpoint>,
    pub preemption: Preemption,
    /// How long the ranks have to checkpoint once preemption is requested.
    pub grace: Duration,
    pub limits: ResourceLimits,
    pub handle: Handle,
}

/// Where an attempt's reports are recorded.
#[derive(Debug)]
pub(crate) enum Records {
    /// On this host, in the run's ledger: a run on one host, or node 0.
    Here(Arc<Ledger>),
    /// On node 0, by a node that follows it: the ranks here report
    /// metrics and checkpoint files, which this node persists into the
    /// run's directory `run` (node 0 commits them); they restore `resume`
    /// (node 0's choice) if any.
    Elsewhere(Box<Following>),
}

/// What a node that follows node 0 records with (see [`Records`]).
#[derive(Debug)]
pub(crate) struct Following {
    pub retention: Retention,
    pub resume: Option<Checkpoint>,
    /// The run's directory in storage.
    pub run: Storage,
}

/// The nodes of a run over several hosts, as an attempt sees them.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub link: Arc<Link>,
    pub layout: Layout,
    /// The attempt's number, the same on every node: messages of another
    /// attempt are not this one's.
    pub attempt: u64,
}

/// How an attempt ended.
#[derive(Debug)]
pub(crate) struct Ended {
    /// Its first failure, if it failed.
    pub failure: Option<RunFailure>,
    /// Whether a stop was requested (preemption), whatever came of it.
    pub stop_requested: bool,
    /// Whether the ranks stopped early because of it: a rank was told
    /// (`preemption-requested` returned true) or the grace period ran out.
    /// Ranks that never heard of the request and returned finished their
    /// work.
    pub preempted: bool,
}

/// One attempt; see the module's description.
#[derive(Debug)]
pub(crate) struct Attempt {
    shared: Arc<Shared>,
}

/// Shared by the ranks and the watcher of one attempt.
#[derive(Debug)]
struct Shared {
    world_size: u32,
    supervisor: Supervisor,
    gate: ReportGate<Arrival, Outcome>,
    /// `None` on a node that follows node 0.
    recorder: Option<Recorder>,
    /// On a node that follows node 0: persists its ranks' files.
    shipper: Option<Shipper>,
    restorer: Restorer,
    retention: Retention,
    span: Option<Span>,
    preemption: Preemption,
    grace: Duration,
    limits: ResourceLimits,
    handle: Handle,
    /// See [`AttemptSetup::handed_over`].
    handed_over: PathBuf,
    /// The ranks' files lent to snapshots.
    lent: Arc<Lent>,
    /// Directories handed over so far, to name the next one.
    handed_over_count: AtomicU64,
    /// Reports completed in this attempt.
    completed: AtomicU64,
    /// Once preemption is requested: the number of completed reports after
    /// which every rank sees `preemption-requested` true.
    preempt_after: OnceLock<u64>,
    /// A rank was told that preemption is requested.
    preemption_told: AtomicBool,
    /// The watcher stopped the ranks when the grace period ran out.
    stopped_for_preemption: AtomicBool,
    /// The other nodes know that a stop was requested.
    preemption_shared: AtomicBool,
}

impl Attempt {
    pub fn new(setup: AttemptSetup) -> Self {
        let AttemptSetup {
            world_size,
            span,
            report_timeout,
            records,
            snapshots,
            handed_over,
            restore,
            resume_from,
            preemption,
            grace,
            limits,
            handle,
        } = setup;
        // The guest files the ranks' snapshots hold: every rank's writes
        // check it (see `persist::lend`).
        let lent = Arc::new(Lent::default());
        let snapshots = snapshots.map(|root| Snapshots {
            root,
            lent: Arc::clone(&lent),
        });
        // Every node's ranks, for manifests.
        let job_size = span.as_ref().map_or(world_size, |s| s.layout.world_size());
        let (recorder, shipper) = match (&records, &span) {
            (Records::Here(ledger), _) => (
                Some(Recorder::start(
                    Arc::clone(ledger),
                    job_size,
                    snapshots,
                    handle.clone(),
                )),
                None,
            ),
            (Records::Elsewhere(following), Some(span)) => (
                None,
                Some(Shipper::new(
                    following.run.clone(),
                    snapshots,
                    Arc::clone(&span.link),
                    span.attempt,
                    handle.clone(),
                )),
            ),
            (Records::Elsewhere(_), None) => (None, None),
        };
        Self {
            shared: Arc::new(Shared {
                world_size,
                supervisor: Supervisor::new(world_size),
                gate: ReportGate::new(world_size as usize, report_timeout)
                    .numbered_from(span.as_ref().map_or(0, |s| s.layout.world_rank(0)) as usize),
                recorder,
                shipper,
                retention: match &records {
                    Records::Here(ledger) => ledger.retention().clone(),
                    Records::Elsewhere(following) => following.retention.clone(),
                },
                restorer: match records {
                    Records::Here(ledger) => Restorer::new(restore, ledger, resume_from),
                    Records::Elsewhere(following) => Restorer::given(restore, following.resume),
                },
                span,
                preemption,
                grace,
                limits,
                handle,
                handed_over,
                lent,
                handed_over_count: AtomicU64::new(0),
                completed: AtomicU64::new(0),
                preempt_after: OnceLock::new(),
                preemption_told: AtomicBool::new(false),
                stopped_for_preemption: AtomicBool::new(false),
                preemption_shared: AtomicBool::new(false),
            }),
        }
    }

    /// Run every rank (`rank` makes the future of one, given its handle)
    /// and supervise them until all have ended; then write what they
    /// reported. Returns how the attempt ended. `scratch` holds the ranks'
    /// scratch directories (by local rank), measured against the scratch
    /// limit.
    ///
    /// The ranks run as tasks on at most one thread per core
    /// (`crate::executor`), rank `r` on thread `r % threads` while that
    /// thread keeps up and on another when it does not, each thread
    /// inside the run's I/O runtime so that WASI's timers and file
    /// operations find it.
    pub fn run<'r>(
        self,
        scratch: &[PathBuf],
        rank: impl Fn(RankHandle) -> TaskFuture<'r>,
    ) -> Ended {
        let shared = &self.shared;
        let done = AtomicBool::new(false);
        let ranks = shared.world_size as usize;
        let threads = executor::threads_for(ranks);
        let idle = IdleWait::new(threads);
        let pool = Pool::new(
            (0..ranks as u32).map(|r| (r, rank(RankHandle::new(r, Arc::clone(shared))))),
            threads,
            &idle,
        );
        std::thread::scope(|scope| {
            let watcher = scope.spawn(|| watch::watch(shared, &done));
            let ended = &done;
            let measurer = shared
                .limits
                .max_scratch_bytes
                .map(|limit| scope.spawn(move || scratch::watch(shared, scratch, limit, ended)));
            // The scope waits for every rank before a panic here goes on:
            // stop them, or a rank asleep would keep the host up forever.
            let _stop_on_unwind = StopOnUnwind(shared);
            let spawned: Vec<_> = (0..threads)
                .filter_map(|t| {
                    let pool = &pool;
                    let thread = std::thread::Builder::new()
                        .name(format!("trainhost-ranks-{t}"))
                        .spawn_scoped(scope, move || {
                            let _io = shared.handle.enter();
                            // A bug in the host, not the guest's doing: the
                            // run fails saying so instead of hanging.
                            pool.work(|r, panic| {
                                shared.fail(RunFailure {
                                    rank: Some(r),
                                    kind: FailureKind::Host,
                                    message: format!(
                                        "the host panicked running this rank: {panic}"
                                    ),
                                })
                            });
                        });
                    // Failed at once, so that the ranks stop: the threads
                    // that did start run them to their end.
                    thread
                        .map_err(|e| {
                            shared.fail(RunFailure {
                                rank: None,
                                kind: FailureKind::Host,
                                message: format!("cannot start a host thread for ranks: {e}"),
                            })
                        })
                        .ok()
                })
                .collect();
            for thread in spawned {
                if let Err(panic) = thread.join() {
                    shared.fail(RunFailure {
                        rank: None,
                        kind: FailureKind::Host,
                        message: format!(
                            "a host thread running ranks panicked: {}",
                            executor::panic_message(panic.as_ref())
                        ),
                    });
                }
            }
            shared.finish_recording();
            done.store(true, Ordering::SeqCst);
            watcher.thread().unpark();
            let _ = watcher.join();
            if let Some(measurer) = measurer {
                measurer.thread().unpark();
                let _ = measurer.join();
            }
        });
        let stop_requested = shared.preemption.is_requested();
        Ended {
            failure: shared.supervisor.failure(),
            stop_requested,
            preempted: stop_requested
                && (shared.preemption_told.load(Ordering::SeqCst)
                    || shared.stopped_for_preemption.load(Ordering::SeqCst)),
        }
    }
}

/// Stops every rank when dropped during a panic.
struct StopOnUnwind<'a>(&'a Shared);

impl Drop for StopOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.stop();
        }
    }
}

impl Shared {
    /// A new host path for a directory `rank` hands over, in a directory
    /// that exists.
    fn handed_over_path(&self, rank: u32) -> PathBuf {
        // A failure shows when the directory is moved there.
        let _ = std::fs::create_dir_all(&self.handed_over);
        let n = self.handed_over_count.fetch_add(1, Ordering::Relaxed);
        self.handed_over.join(format!("rank-{rank}-{n}"))
    }

    /// Fail the attempt (the first failure is the one kept) and stop every
    /// rank, on every node.
    fn fail(&self, failure: RunFailure) {
        if let Some(span) = &self.span
            && self.supervisor.failure().is_none()
        {
            span::tell_failure(&span.link, span.attempt, &failure);
        }
        self.fail_here(failure);
    }

    /// Fail the attempt on this node only: another node failed it.
    fn fail_here(&self, failure: RunFailure) {
        self.supervisor.record(failure);
        if let Some(recorder) = &self.recorder {
            // Before the task stores the history after the failed
            // attempt's last commit: the run stores it with the failure's
            // record, beside the next attempt's start.
            recorder.leave_history();
        }
        self.stop();
    }

    /// Stop every rank without a failure (preemption's grace ran out).
    fn stop(&self) {
        self.supervisor.raise_stop();
        self.gate.abort();
        // Last: a rank waiting in a collective call is dropped where it
        // waits once this fires, so the gate's answer must be there first
        // for the guest to see it (its next call then stops it).
        self.supervisor.announce_stop();
    }

    /// Fail the attempt with a storage failure of the recorder.
    fn fail_recording(&self, failed: queue::RecordFailed) {
        self.fail(RunFailure {
            rank: None,
            kind: FailureKind::Storage,
            message: failed.to_string(),
        });
    }

    /// Whether a rank that has made `reports` reports in this attempt sees
    /// preemption requested.
    fn preemption_requested(&self, reports: u64) -> bool {
        let told = self
            .preempt_after
            .get()
            .is_some_and(|after| reports >= *after);
        if told {
            self.preemption_told.store(true, Ordering::SeqCst);
        }
        told
    }

    /// The guest path of the checkpoint to resume from (R21).
    fn get_checkpoint(&self, rank: u32) -> Result<Option<String>, Aborted> {
        self.supervisor.alive(rank);
        // A checkpoint reported earlier in this attempt may still be on its
        // way to storage; it is the latest once committed.
        if let Some(Err(failed)) = self.recorder.as_ref().map(Recorder::flush) {
            self.fail_recording(failed);
            return Err(Aborted);
        }
        self.handle.block_on(self.restorer.resolve()).map_err(|e| {
            self.fail(RunFailure {
                rank: Some(rank),
                kind: FailureKind::Restore,
                message: e.to_string(),
            });
            Aborted
        })
    }

    /// Fail the attempt if writing reports (or this node's checkpoint
    /// files) in the background failed, so that ranks stop without
    /// waiting for their next report.
    fn check_background(&self) {
        let failed = (self.recorder.as_ref().and_then(Recorder::failure))
            .or_else(|| self.shipper.as_ref().and_then(Shipper::failure));
        if let Some(failed) = failed {
            self.fail_recording(failed);
        }
    }

    /// The world rank of this node's rank `local`.
    fn world_rank(&self, local: u32) -> u32 {
        self.span
            .as_ref()
            .map_or(local, |span| span.layout.world_rank(local))
    }

    /// Write every report recorded in this attempt to storage; a failure
    /// to do so fails the attempt. Called once the ranks have ended.
    fn finish_recording(&self) {
        let finished = (self.recorder.as_ref().map(Recorder::finish))
            .or_else(|| self.shipper.as_ref().map(Shipper::finish));
        if let Some(Err(failed)) = finished {
            if self.supervisor.failure().is_some() {
                tracing::error!("writing reports to storage failed as well: {failed}");
            }
            self.fail_recording(failed);
        }
    }
}
