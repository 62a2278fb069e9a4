//! One rank: its store data, the WIT imports it calls, and running it.

use std::path::Path;
use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime::{Store, UpdateDeadline};
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::GuestComponent;
use super::bindings::trainhost::train::{context, session};
use super::limits::{self, LimitHit, MemoryLimiter, OutputBudget};
use super::output::{OutputSink, RankOutputLimits, RankStream, Stream};
use super::sandbox::{RESTORE_GUEST_PATH, SCRATCH_GUEST_PATH, Sandbox};
use crate::attempt::{Aborted, ReportRefused, Session};
use crate::config::ResourceLimits;
use crate::failure::{FailureKind, RunFailure};
use crate::metrics::{MetricValue, Metrics};
use std::sync::Mutex;

/// Where a rank sits in the run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RankInfo {
    pub world_rank: u32,
    pub world_size: u32,
    pub local_rank: u32,
    pub local_world_size: u32,
    pub node_rank: u32,
}

/// What every rank of a run shares, beyond the session.
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
    table: ResourceTable,
    info: RankInfo,
    shared: RankShared,
    sandbox: Sandbox,
    session: Arc<Session>,
    memory: MemoryLimiter,
    /// How many times this rank's `report` reached the gate.
    reports: u64,
}

/// The trap that stops a rank because the run is failing elsewhere.
#[derive(Debug)]
struct StoppedByHost;

impl std::fmt::Display for StoppedByHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped: the run is failing")
    }
}

impl std::error::Error for StoppedByHost {}

/// How a rank ended.
#[derive(Debug)]
pub(crate) enum RankOutcome {
    /// `train` returned `Ok`.
    Finished,
    /// This rank failed; the failure is the session's if it was the first.
    Failed,
    /// This rank was stopped because the run failed elsewhere.
    Stopped,
}

impl WasiView for RankState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl context::Host for RankState {
    fn world_rank(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.world_rank)
    }
    fn world_size(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.world_size)
    }
    fn local_rank(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.local_rank)
    }
    fn local_world_size(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.local_world_size)
    }
    fn node_rank(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.node_rank)
    }
    fn config(&mut self) -> wasmtime::Result<String> {
        Ok(self.shared.config_json.to_string())
    }
    fn run_name(&mut self) -> wasmtime::Result<String> {
        Ok(self.shared.run_name.to_string())
    }
    fn scratch_dir(&mut self) -> wasmtime::Result<String> {
        Ok(SCRATCH_GUEST_PATH.to_owned())
    }
}

impl session::Host for RankState {
    fn report(
        &mut self,
        metrics: Vec<session::Metric>,
        checkpoint: Option<String>,
    ) -> wasmtime::Result<Result<(), session::ReportError>> {
        use session::ReportError;
        // Refusals before the gate do not count as this rank's report: the
        // guest may fix the call and make it again.
        let metrics = match Metrics::from_pairs(metrics.into_iter().map(|m| {
            let value = match m.value {
                session::MetricValue::Integer(v) => MetricValue::Integer(v),
                session::MetricValue::Float(v) => MetricValue::Float(v),
                session::MetricValue::Text(v) => MetricValue::Text(v),
                session::MetricValue::Boolean(v) => MetricValue::Boolean(v),
            };
            (m.name, value)
        })) {
            Ok(m) => m,
            Err(msg) => return Ok(Err(ReportError::InvalidMetrics(msg))),
        };
        if let Err(msg) = self.session.check_metrics(&metrics) {
            return Ok(Err(ReportError::InvalidMetrics(msg)));
        }
        let capture = match checkpoint {
            None => None,
            Some(path) => {
                let captured = self
                    .sandbox
                    .open_dir(&path)
                    .and_then(|dir| crate::persist::capture(self.info.world_rank, dir, &path))
                    .and_then(|c| {
                        let total: u64 = c.files.iter().map(|(_, size)| size).sum();
                        match self.shared.limits.max_checkpoint_bytes {
                            Some(max) if total > max => Err(format!(
                                "{path} holds {} in {} files, over the checkpoint limit of {}",
                                limits::bytes(total),
                                c.files.len(),
                                limits::bytes(max)
                            )),
                            _ => Ok(c),
                        }
                    });
                match captured {
                    Ok(c) => Some(c),
                    Err(msg) => return Ok(Err(ReportError::InvalidCheckpoint(msg))),
                }
            }
        };
        self.reports += 1;
        match self.session.report(self.info.world_rank, metrics, capture) {
            Ok(Ok(())) => Ok(Ok(())),
            Ok(Err(ReportRefused::Collision(msg))) => Ok(Err(ReportError::Collision(msg))),
            Err(Aborted) => Err(wasmtime::Error::new(StoppedByHost)),
        }
    }

    fn preemption_requested(&mut self) -> wasmtime::Result<bool> {
        Ok(self.session.preemption_requested(self.reports))
    }

    fn get_checkpoint(&mut self) -> wasmtime::Result<Option<String>> {
        self.session
            .get_checkpoint(self.info.world_rank)
            .map_err(|Aborted| wasmtime::Error::new(StoppedByHost))
    }
}

/// Host directories of one rank.
pub(crate) struct RankDirs<'a> {
    pub scratch: &'a Path,
    pub restore: &'a Path,
}

/// Run one rank to completion on the calling thread.
pub(crate) fn run_rank(
    guest: &GuestComponent,
    info: RankInfo,
    shared: RankShared,
    dirs: RankDirs<'_>,
    session: Arc<Session>,
) -> RankOutcome {
    let rank = info.world_rank;
    session.touch(rank);
    let output_limits = Arc::new(RankOutputLimits {
        budget: Mutex::new(shared.limits.max_output_rate.map(OutputBudget::new)),
        max_line: shared.limits.max_line_bytes,
        on_line: {
            let session = Arc::clone(&session);
            Box::new(move || session.touch(rank))
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
        output_limits,
    );
    let outcome = match build_state(info, shared, &dirs, Arc::clone(&session), &stdout, &stderr) {
        Ok(state) => call_train(guest, state),
        Err(message) => Err(Ended::Failed(RunFailure {
            rank: Some(rank),
            kind: FailureKind::Trap,
            message,
        })),
    };
    stdout.finish();
    stderr.finish();
    session.ended(rank);
    match outcome {
        Ok(reports) => {
            session.finish(rank, reports);
            RankOutcome::Finished
        }
        Err(Ended::Stopped) => RankOutcome::Stopped,
        Err(Ended::Failed(mut failure)) => {
            let tail = stderr.tail();
            if failure.kind == FailureKind::Trap && !tail.is_empty() {
                failure.message = format!(
                    "{}\nlast lines of its stderr:\n  {}",
                    failure.message,
                    tail.join("\n  ")
                );
            }
            session.fail(failure);
            RankOutcome::Failed
        }
    }
}

/// Why `train` did not return `Ok`.
enum Ended {
    /// The host stopped the rank because the run failed elsewhere.
    Stopped,
    /// The rank itself failed.
    Failed(RunFailure),
}

fn build_state(
    info: RankInfo,
    shared: RankShared,
    dirs: &RankDirs<'_>,
    session: Arc<Session>,
    stdout: &RankStream,
    stderr: &RankStream,
) -> Result<RankState, String> {
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(stdout.clone())
        .stderr(stderr.clone())
        .env("TMPDIR", SCRATCH_GUEST_PATH)
        .env("HOME", SCRATCH_GUEST_PATH);
    let mount_err =
        |what: &str, e: &dyn std::fmt::Display| format!("cannot preopen the {what} directory: {e}");
    wasi.preopened_dir(dirs.scratch, SCRATCH_GUEST_PATH, FsPerms::ReadWrite)
        .map_err(|e| mount_err("scratch", &e))?;
    wasi.preopened_dir(dirs.restore, RESTORE_GUEST_PATH, FsPerms::ReadOnly)
        .map_err(|e| mount_err("restore", &e))?;
    let mut sandbox = Sandbox::new(SCRATCH_GUEST_PATH);
    sandbox
        .mount(SCRATCH_GUEST_PATH, dirs.scratch)
        .map_err(|e| mount_err("scratch", &e))?;
    sandbox
        .mount(RESTORE_GUEST_PATH, dirs.restore)
        .map_err(|e| mount_err("restore", &e))?;
    Ok(RankState {
        wasi: wasi.build(),
        table: ResourceTable::new(),
        info,
        memory: MemoryLimiter {
            max: shared.limits.max_memory,
        },
        shared,
        sandbox,
        session,
        reports: 0,
    })
}

/// Instantiate and call `train`; `Ok(reports)` when it returned `Ok`.
fn call_train(guest: &GuestComponent, state: RankState) -> Result<u64, Ended> {
    let rank = state.info.world_rank;
    let fail = |kind, message| {
        Ended::Failed(RunFailure {
            rank: Some(rank),
            kind,
            message,
        })
    };
    let mut store = Store::new(guest.engine(), state);
    store.limiter(|s| &mut s.memory);
    // Checked on every epoch tick: a rank computing while another failed is
    // interrupted instead of running on (gang stop, R19). Without epochs a
    // rank stops at its next call to the host.
    if guest.interruption().uses_epochs() {
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(|ctx| {
            Ok(if ctx.data().session.is_aborted() {
                UpdateDeadline::Interrupt
            } else {
                UpdateDeadline::Continue(1)
            })
        });
    }
    let result = guest
        .pre()
        .instantiate(&mut store)
        .and_then(|trainer| trainer.call_train(&mut store));
    match result {
        Ok(Ok(())) => Ok(store.data().reports),
        Ok(Err(message)) => Err(fail(FailureKind::GuestError, message)),
        // Both are the host's doing: only an aborting run interrupts a
        // rank, or stops it in an import.
        Err(e) if e.downcast_ref::<StoppedByHost>().is_some() => Err(Ended::Stopped),
        Err(e) if e.downcast_ref::<LimitHit>().is_some() => {
            let hit = e
                .downcast_ref::<LimitHit>()
                .map(ToString::to_string)
                .unwrap_or_default();
            Err(fail(FailureKind::Limit, hit))
        }
        Err(e) if e.downcast_ref::<wasmtime::Trap>() == Some(&wasmtime::Trap::Interrupt) => {
            Err(Ended::Stopped)
        }
        Err(e) => match e.downcast_ref::<wasmtime_wasi::I32Exit>() {
            Some(exit) if exit.0 == 0 => Ok(store.data().reports),
            Some(exit) => Err(fail(FailureKind::Exit, format!("exit status {}", exit.0))),
            // `{:#}`: the trap and the guest's wasm backtrace. Not `{:?}`,
            // which with RUST_BACKTRACE set also symbolizes the host's own
            // stack: noise for the user, and ~100 ms on every failure.
            None => Err(fail(FailureKind::Trap, format!("{e:#}"))),
        },
    }
}
