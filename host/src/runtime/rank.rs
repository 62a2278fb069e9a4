//! One rank: its store data and running it. The imports it calls are
//! answered in `session`, `collective` and `tensors`.

use std::path::Path;
use std::sync::{Arc, Mutex};

use futures::future::Either;
use wasmtime::component::ResourceTable;
use wasmtime::{Store, UpdateDeadline};
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::GuestComponent;
use super::limits::{LimitHit, MemoryLimiter, OutputBudget};
use super::listing::Lists;
use super::output::{OutputSink, RankOutputLimits, RankStream, Stream};
use super::sandbox::{RESTORE_GUEST_PATH, SCRATCH_GUEST_PATH, Sandbox};
use super::trap;
use super::writes::{OpenFiles, OpenForWriting, WatchesWrites};
use crate::attempt::{RankEnd, RankHandle};
use crate::config::ResourceLimits;
use crate::failure::{FailureKind, RunFailure};

/// Where a rank sits in the run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RankInfo {
    pub world_rank: u32,
    pub world_size: u32,
    pub local_rank: u32,
    pub local_world_size: u32,
    pub node_rank: u32,
}

/// What every rank of a run shares, beyond its attempt.
#[derive(Debug, Clone)]
pub(crate) struct RankShared {
    pub config_json: Arc<str>,
    pub run_name: Arc<str>,
    pub output: Arc<dyn OutputSink>,
    pub limits: ResourceLimits,
}

impl std::fmt::Debug for dyn OutputSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OutputSink")
    }
}

/// The data of one rank's store.
pub(crate) struct RankState {
    wasi: WasiCtx,
    pub(super) table: ResourceTable,
    pub(super) info: RankInfo,
    pub(super) shared: RankShared,
    pub(super) sandbox: Sandbox,
    pub(super) attempt: RankHandle,
    /// The threads this rank's kernels may use: its share of the host's
    /// cores (see `crate::tensor::threads_per_rank`).
    pub(super) kernel_threads: usize,
    pub(super) memory: MemoryLimiter,
    /// A collective call told the guest that the run is stopping.
    pub(super) told_to_stop: bool,
    /// The files the guest opened for writing (see `writes`).
    pub(super) writers: OpenForWriting,
    /// The files and directories it holds open, within its share.
    pub(super) open: OpenFiles,
    /// How often each slot of `table` lost its tensor (see `program`).
    pub(super) drops: Drops,
    /// The output budget its stdout and stderr share, which rank 0's
    /// reported metrics draw on too (R58).
    pub(super) output: Arc<RankOutputLimits>,
    /// Bytes of rank 0's reported metrics not yet taken from `output`.
    pub(super) metrics_owed: usize,
}

/// How often each slot of a rank's resource table lost its tensor. A
/// recorded program names its tensors by slot and count, so that a tensor
/// made later in the slot of one dropped is not taken for it.
#[derive(Debug, Default)]
pub(super) struct Drops(Vec<u32>);

impl Drops {
    /// The count of the slot `rep`.
    pub fn of(&self, rep: u32) -> u32 {
        self.0.get(rep as usize).copied().unwrap_or(0)
    }

    /// The tensor in slot `rep` was dropped.
    pub fn dropped(&mut self, rep: u32) {
        let at = rep as usize;
        if at >= self.0.len() {
            self.0.resize(at + 1, 0);
        }
        self.0[at] = self.0[at].wrapping_add(1);
    }
}

/// A rank's sandbox could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("cannot preopen the {what} directory: {source}")]
struct PreopenFailed {
    what: &'static str,
    #[source]
    source: Box<dyn std::error::Error + Send + Sync>,
}

/// The trap that stops a rank because its attempt is stopping.
#[derive(Debug)]
pub(super) struct StoppedByHost;

impl std::fmt::Display for StoppedByHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped: the run is failing")
    }
}

impl std::error::Error for StoppedByHost {}

impl WasiView for RankState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl WatchesWrites for RankState {
    fn attempt(&self) -> &RankHandle {
        &self.attempt
    }
    fn open_for_writing(&mut self) -> &mut OpenForWriting {
        &mut self.writers
    }

    fn open_files(&mut self) -> &mut OpenFiles {
        &mut self.open
    }
}

impl Lists for RankState {
    fn memory(&mut self) -> &mut MemoryLimiter {
        &mut self.memory
    }
}

/// Host directories of one rank.
pub(crate) struct RankDirs<'a> {
    pub scratch: &'a Path,
    pub restore: &'a Path,
}

/// Run one rank to completion, and tell its attempt how it ended.
///
/// The rank is a future polled by the attempt's executor, inside the run's
/// I/O runtime: guest code runs inside its `poll`, and where the guest
/// waits (in WASI, or for the other ranks in a collective call) the future
/// is pending and the thread runs other ranks.
pub(crate) async fn run_rank(
    guest: &GuestComponent,
    info: RankInfo,
    shared: RankShared,
    dirs: RankDirs<'_>,
    attempt: RankHandle,
) {
    let rank = info.world_rank;
    attempt.alive();
    let output_limits = Arc::new(RankOutputLimits {
        budget: Mutex::new(shared.limits.max_output_rate.map(OutputBudget::new)),
        max_line: shared.limits.max_line_bytes,
        on_line: {
            let attempt = attempt.clone();
            Box::new(move || attempt.alive())
        },
    });
    let stdout = RankStream::new(
        rank,
        Stream::Stdout,
        Arc::clone(&shared.output),
        Arc::clone(&output_limits),
    );
    let stderr = RankStream::new(
        rank,
        Stream::Stderr,
        Arc::clone(&shared.output),
        Arc::clone(&output_limits),
    );
    let streams = Streams {
        stdout: &stdout,
        stderr: &stderr,
        limits: output_limits,
    };
    let ended = match build_state(info, shared, &dirs, attempt.clone(), streams) {
        Ok(state) => run_train(guest, state, attempt.stopping()).await,
        Err(e) => Ended::Other(RankEnd::Failed(RunFailure {
            rank: Some(rank),
            kind: FailureKind::Trap,
            message: e.to_string(),
        })),
    };
    stdout.finish();
    stderr.finish();
    let end = match ended {
        Ended::Trapped(e) => RankEnd::Failed(RunFailure {
            rank: Some(rank),
            kind: FailureKind::Trap,
            message: trap::describe(&e, &stderr.tail()),
        }),
        Ended::Other(end) => end,
    };
    attempt.end(end);
}

/// A rank's two output streams and the limits they share.
struct Streams<'a> {
    stdout: &'a RankStream,
    stderr: &'a RankStream,
    limits: Arc<RankOutputLimits>,
}

fn build_state(
    info: RankInfo,
    shared: RankShared,
    dirs: &RankDirs<'_>,
    attempt: RankHandle,
    streams: Streams<'_>,
) -> Result<RankState, PreopenFailed> {
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(streams.stdout.clone())
        .stderr(streams.stderr.clone())
        .env("TMPDIR", SCRATCH_GUEST_PATH)
        .env("HOME", SCRATCH_GUEST_PATH);
    // A file system call (open, read, write, sync of the rank's own files)
    // runs on the rank's thread instead of a trip through tokio's blocking
    // pool and back: on a busy machine each trip waits for a core twice, and
    // WASI reads a file 64 KiB a call (restoring 4 MiB took 64 trips). Such
    // a call ends when the disk answers; a stop takes effect when it has
    // (R34).
    wasi.allow_blocking_current_thread(true);
    let preopen = |what| {
        move |e: wasmtime::Error| PreopenFailed {
            what,
            source: e.into_boxed_dyn_error(),
        }
    };
    let mount = |what| {
        move |e: std::io::Error| PreopenFailed {
            what,
            source: Box::new(e),
        }
    };
    wasi.preopened_dir(dirs.scratch, SCRATCH_GUEST_PATH, FsPerms::ReadWrite)
        .map_err(preopen("scratch"))?;
    wasi.preopened_dir(dirs.restore, RESTORE_GUEST_PATH, FsPerms::ReadOnly)
        .map_err(preopen("restore"))?;
    let mut sandbox = Sandbox::new(SCRATCH_GUEST_PATH);
    sandbox
        .mount(SCRATCH_GUEST_PATH, dirs.scratch)
        .map_err(mount("scratch"))?;
    sandbox
        .mount(RESTORE_GUEST_PATH, dirs.restore)
        .map_err(mount("restore"))?;
    Ok(RankState {
        wasi: wasi.build(),
        table: ResourceTable::new(),
        info,
        memory: MemoryLimiter::new(shared.limits.max_memory),
        shared,
        sandbox,
        attempt,
        kernel_threads: crate::tensor::threads_per_rank(info.local_world_size),
        told_to_stop: false,
        writers: OpenForWriting::default(),
        open: OpenFiles::new(info.world_rank, info.local_world_size),
        drops: Drops::default(),
        output: streams.limits,
        metrics_owed: 0,
    })
}

/// How `train` ended, before a trap of the guest's own is described.
enum Ended {
    /// Described once the rank's stderr is complete (see `trap.rs`).
    Trapped(wasmtime::Error),
    Other(RankEnd),
}

/// Instantiate and call `train` until it returns or `stopping` resolves;
/// how the rank ended.
///
/// Where the guest waits in WASI (a sleep, a poll on a clock) the call is
/// pending. When the attempt stops, the call is dropped, which unwinds the
/// guest from where it waits. A guest computing is stopped by the epoch
/// check (or, without epochs, at its next call to the host); one waiting
/// for the other ranks in a collective call by the gate.
async fn run_train(
    guest: &GuestComponent,
    state: RankState,
    stopping: impl Future<Output = ()>,
) -> Ended {
    let train = std::pin::pin!(call_train(guest, state));
    match futures::future::select(train, std::pin::pin!(stopping)).await {
        Either::Left((end, _)) => end,
        // The call is dropped at the end of this arm.
        Either::Right(((), _)) => Ended::Other(RankEnd::Stopped),
    }
}

/// Instantiate and call `train`; how the rank ended.
async fn call_train(guest: &GuestComponent, state: RankState) -> Ended {
    let rank = state.info.world_rank;
    let fail = |kind, message| {
        Ended::Other(RankEnd::Failed(RunFailure {
            rank: Some(rank),
            kind,
            message,
        }))
    };
    let mut store = Store::new(guest.engine(), state);
    store.limiter(|s| &mut s.memory);
    // Checked on every epoch tick: a rank computing while another failed is
    // interrupted instead of running on (gang stop, R19). Without epochs a
    // rank stops at its next call to the host. A rank that goes on yields
    // its thread, so that ranks sharing it take turns (R34).
    if guest.interruption().uses_epochs() {
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(|ctx| {
            Ok(if ctx.data().attempt.is_stopping() {
                UpdateDeadline::Interrupt
            } else {
                UpdateDeadline::Yield(1)
            })
        });
    }
    let result = async {
        let trainer = guest.pre().instantiate_async(&mut store).await?;
        trainer.call_train(&mut store).await
    }
    .await;
    match result {
        Ok(Ok(())) => Ended::Other(RankEnd::Finished),
        Ok(Err(message)) => fail(FailureKind::GuestError, message),
        // Both are the host's doing: only a stopping attempt interrupts a
        // rank, or stops it in an import.
        Err(e) if e.downcast_ref::<StoppedByHost>().is_some() => Ended::Other(RankEnd::Stopped),
        Err(e) if e.downcast_ref::<LimitHit>().is_some() => {
            let hit = e
                .downcast_ref::<LimitHit>()
                .map(ToString::to_string)
                .unwrap_or_default();
            fail(FailureKind::Limit, hit)
        }
        Err(e) if e.downcast_ref::<wasmtime::Trap>() == Some(&wasmtime::Trap::Interrupt) => {
            Ended::Other(RankEnd::Stopped)
        }
        Err(e) => match e.downcast_ref::<wasmtime_wasi::I32Exit>() {
            Some(exit) if exit.0 == 0 => Ended::Other(RankEnd::Finished),
            Some(exit) => fail(FailureKind::Exit, format!("exit status {}", exit.0)),
            // Described once the rank's stderr is complete.
            None => Ended::Trapped(e),
        },
    }
}
