//! The trainer: configuration mirroring Ray Train's config objects, and
//! `fit()`, which runs the ranks and yields the result.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::attempt::{RestoreCache, Session};
use crate::checkpoint::Checkpoint;
use crate::config::{
    Checked, Location, MaxFailures, ResourceLimits, Retention, RunConfig, ScalingConfig,
};
use crate::error::Error;
use crate::ledger::{Ledger, LedgerOptions};
use crate::preemption::Preemption;
use crate::result::TrainResult;
use crate::runtime::output::{OutputSink, TerminalOutput};
use crate::runtime::{
    CompileCache, GuestComponent, RESTORE_GUEST_PATH, RankDirs, RankInfo, RankShared, run_rank,
};
use crate::storage::Storage;
use crate::sync::Syncer;
use std::sync::atomic::{AtomicBool, Ordering};

/// The guest component to run.
///
/// ```
/// use trainhost::GuestSource;
/// let from_file = GuestSource::from("target/wasm32-wasip2/release/my_loop.wasm");
/// let from_bytes = GuestSource::from(vec![0u8; 0]); // e.g. bytes you fetched yourself
/// # let _ = (from_file, from_bytes);
/// ```
#[derive(Debug, Clone)]
pub enum GuestSource {
    /// A `.wasm` file.
    File(PathBuf),
    /// The component's bytes.
    Bytes(Arc<[u8]>),
}

impl From<&Path> for GuestSource {
    fn from(p: &Path) -> Self {
        GuestSource::File(p.to_path_buf())
    }
}

impl From<PathBuf> for GuestSource {
    fn from(p: PathBuf) -> Self {
        GuestSource::File(p)
    }
}

impl From<&str> for GuestSource {
    fn from(p: &str) -> Self {
        GuestSource::File(PathBuf::from(p))
    }
}

impl From<Vec<u8>> for GuestSource {
    fn from(b: Vec<u8>) -> Self {
        GuestSource::Bytes(b.into())
    }
}

impl GuestSource {
    fn shown(&self) -> String {
        match self {
            GuestSource::File(p) => p.display().to_string(),
            GuestSource::Bytes(_) => "<bytes>".into(),
        }
    }

    fn stem(&self) -> String {
        match self {
            GuestSource::File(p) => p
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("trainhost")
                .to_owned(),
            GuestSource::Bytes(_) => "trainhost".into(),
        }
    }
}

/// Builds a [`Trainer`]; every setting has a default except the guest.
///
/// ```no_run
/// use trainhost::{RunConfig, ScalingConfig, Trainer};
///
/// let trainer = Trainer::builder("linear_regression.wasm")
///     .train_loop_config(serde_json::json!({"num_epochs": 5}))
///     .scaling_config(ScalingConfig { num_workers: 2 })
///     .run_config(RunConfig {
///         name: Some("demo".into()),
///         storage_path: "./results".into(),
///         ..RunConfig::default()
///     })
///     .build()?;
/// let result = trainer.fit()?;
/// if let Some(error) = &result.error {
///     eprintln!("run failed: {error}");
/// }
/// println!("latest checkpoint: {:?}", result.checkpoint.map(|c| c.location().to_owned()));
/// # Ok::<(), trainhost::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct TrainerBuilder {
    guest: GuestSource,
    config: serde_json::Value,
    scaling: ScalingConfig,
    run: RunConfig,
    resume_from: Option<String>,
    output: Option<Arc<dyn OutputSink>>,
    preemption: Option<Preemption>,
    compile_cache: Option<PathBuf>,
}

impl TrainerBuilder {
    /// Keep compiled guests in `dir` and load them from there next time,
    /// instead of compiling on every run (see [`crate::default_cache_dir`]
    /// for the CLI's default). Entries are keyed by the guest's bytes, the
    /// wasmtime version and the engine settings; one that does not fit is
    /// compiled again and replaced. The directory holds native code the
    /// host runs: it must be writable only by trusted users. Default: no
    /// cache.
    pub fn compile_cache(mut self, dir: impl Into<PathBuf>) -> Self {
        self.compile_cache = Some(dir.into());
        self
    }

    /// A handle through which the caller can ask the run to stop early
    /// (see [`Preemption`]).
    pub fn preemption(mut self, preemption: Preemption) -> Self {
        self.preemption = Some(preemption);
        self
    }

    /// The loop's config (Ray's `train_loop_config`): any JSON value,
    /// handed unchanged to every rank. Default `{}`.
    pub fn train_loop_config(mut self, config: serde_json::Value) -> Self {
        self.config = config;
        self
    }

    /// How many ranks to run.
    pub fn scaling_config(mut self, scaling: ScalingConfig) -> Self {
        self.scaling = scaling;
        self
    }

    /// Name, storage and timeouts.
    pub fn run_config(mut self, run: RunConfig) -> Self {
        self.run = run;
        self
    }

    /// A committed checkpoint (directory or URL, of any run) that
    /// `get_checkpoint` returns until this run commits its own (Ray's
    /// `resume_from_checkpoint`).
    pub fn resume_from_checkpoint(mut self, location: impl Into<String>) -> Self {
        self.resume_from = Some(location.into());
        self
    }

    /// Where the ranks' stdout and stderr lines go. Default
    /// [`TerminalOutput`]: the host's stdout and stderr, prefixed with the
    /// rank.
    pub fn output(mut self, sink: Arc<dyn OutputSink>) -> Self {
        self.output = Some(sink);
        self
    }

    /// Check the settings and make the trainer.
    pub fn build(self) -> Result<Trainer, Error> {
        self.scaling.check()?;
        let Checked { storage, retention } = self.run.check()?;
        Ok(Trainer {
            storage,
            retention,
            guest: self.guest,
            config: self.config,
            scaling: self.scaling,
            run: self.run,
            resume_from: self.resume_from,
            output: self.output.unwrap_or_else(|| Arc::new(TerminalOutput)),
            preemption: self.preemption.unwrap_or_default(),
            compile_cache: self.compile_cache.map(CompileCache::new),
        })
    }
}

/// Runs a guest component as `num_workers` sandboxed ranks and persists
/// what they report. Make one with [`Trainer::builder`].
#[derive(Debug, Clone)]
pub struct Trainer {
    storage: Location,
    retention: Retention,
    guest: GuestSource,
    config: serde_json::Value,
    scaling: ScalingConfig,
    run: RunConfig,
    resume_from: Option<String>,
    output: Arc<dyn OutputSink>,
    preemption: Preemption,
    compile_cache: Option<CompileCache>,
}

impl Trainer {
    /// Start configuring a trainer for `guest` (a path to a `.wasm`
    /// component, or its bytes).
    pub fn builder(guest: impl Into<GuestSource>) -> TrainerBuilder {
        TrainerBuilder {
            guest: guest.into(),
            config: serde_json::json!({}),
            scaling: ScalingConfig::default(),
            run: RunConfig::default(),
            resume_from: None,
            output: None,
            preemption: None,
            compile_cache: None,
        }
    }

    /// Run the training loop on every rank until all return, or one fails.
    ///
    /// Returns `Err` when the run cannot start (unreadable guest, storage
    /// unreachable, a conflicting run of the same name) and a
    /// [`TrainResult`] otherwise: check its `error` for a run that started
    /// and failed. Blocks the calling thread; from async code, call it
    /// through `tokio::task::spawn_blocking`.
    pub fn fit(&self) -> Result<TrainResult, Error> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::InsideAsyncRuntime);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("trainhost-io")
            .enable_all()
            .build()
            .map_err(|source| Error::Io {
                path: PathBuf::from("<tokio runtime>"),
                operation: "start the async runtime",
                source,
            })?;

        let bytes = match &self.guest {
            GuestSource::File(path) => std::fs::read(path).map_err(|e| Error::Guest {
                path: path.display().to_string(),
                message: "cannot be read".into(),
                source: Some(Box::new(e)),
            })?,
            GuestSource::Bytes(b) => b.to_vec(),
        };
        let started = std::time::Instant::now();
        let (guest, cached) = GuestComponent::compile(
            &bytes,
            &self.guest.shown(),
            self.run.interruption,
            self.compile_cache.as_ref(),
        )?;
        tracing::debug!(elapsed = ?started.elapsed(), cache = ?cached, "guest ready");

        let run_name = self
            .run
            .name
            .clone()
            .unwrap_or_else(|| default_run_name(&self.guest));
        let world_size = self.scaling.num_workers;
        let storage = Storage::open(&self.storage, &self.run.storage_options)?;
        rt.block_on(storage.probe())?;
        let local_run_dir = storage.local_path().map(|p| p.join(&run_name));
        if let (Some(sync), Some(dir)) = (&self.run.sync, &local_run_dir) {
            crate::sync::restore_if_missing(sync, dir, &run_name);
        }
        let run_storage = storage.child(&run_name);
        let config_json = serde_json::to_string(&self.config).expect("JSON values serialize");
        let fingerprint = hex::encode(Sha256::digest(config_json.as_bytes()));
        let ledger = Arc::new(rt.block_on(Ledger::open(
            run_storage.clone(),
            LedgerOptions {
                run_name: &run_name,
                config_fingerprint: &fingerprint,
                world_size,
                retention: self.retention.clone(),
                fresh: self.run.fresh,
            },
            rt.handle().clone(),
        ))?);
        let resume_from = match &self.resume_from {
            Some(location) => {
                Some(rt.block_on(Checkpoint::open_async(location, &self.run.storage_options))?)
            }
            None => None,
        };

        let work = tempfile::Builder::new()
            .prefix("trainhost-")
            .tempdir()
            .map_err(|source| Error::Io {
                path: std::env::temp_dir(),
                operation: "create the run's working directory",
                source,
            })?;
        let restore_root = work.path().join("checkpoints");
        std::fs::create_dir_all(&restore_root).map_err(|source| Error::Io {
            path: restore_root.clone(),
            operation: "create the restore directory",
            source,
        })?;
        let attempt = Attempt {
            guest: &guest,
            ledger: &ledger,
            restore: Arc::new(RestoreCache::new(restore_root.clone(), RESTORE_GUEST_PATH)),
            restore_root: &restore_root,
            work: work.path(),
            resume_from,
            shared: RankShared {
                config_json: config_json.into(),
                run_name: run_name.clone().into(),
                output: Arc::clone(&self.output),
                limits: self.run.limits.clone(),
            },
            world_size,
            background: self.run.persist_in_background,
            handle: rt.handle().clone(),
        };
        tracing::info!(run = %run_storage.url(), ranks = world_size, "starting run");
        let syncer = match (&self.run.sync, local_run_dir) {
            (Some(sync), Some(dir)) => {
                let ledger = Arc::clone(&ledger);
                Some(Syncer::start(sync.clone(), dir, &run_name, move || {
                    ledger.generation()
                }))
            }
            _ => None,
        };

        let max_failures = self.run.failure_config.max_failures;
        let mut error = None;
        let preempted = loop {
            let (failure, preempted) = attempt.run(
                self.run.report_timeout,
                &self.preemption,
                self.run.preemption_grace,
            )?;
            let Some(failure) = failure else {
                break preempted;
            };
            let total = match ledger.record_failure(&failure) {
                Ok(total) => total,
                Err(e) => {
                    // Storage is failing as well; a restart could not
                    // commit anything either. Committed checkpoints stay.
                    tracing::error!(
                        "cannot record the failure in storage ({}); not restarting",
                        crate::error::chain(&e)
                    );
                    error = Some(failure);
                    break preempted;
                }
            };
            if preempted || !max_failures.allows(total) {
                error = Some(failure);
                break preempted;
            }
            let budget = match max_failures {
                MaxFailures::Unlimited => "no limit".to_owned(),
                MaxFailures::Limited(n) => format!("{total} of {n} allowed"),
            };
            tracing::warn!(
                "failure {total} ({budget}): {failure}; restarting every rank from the latest committed checkpoint"
            );
        };
        if let Some(syncer) = syncer
            && let Err(message) = syncer.finish()
        {
            tracing::error!("{message}");
            error.get_or_insert(crate::failure::RunFailure {
                rank: None,
                kind: crate::failure::FailureKind::Storage,
                message,
            });
        }
        if preempted {
            tracing::warn!(run = %run_storage.url(), "the run stopped early on request; run it again with the same name to resume");
        }

        let result = rt.block_on(collect_result(&ledger, run_name, error, preempted))?;
        drop(work);
        Ok(result)
    }
}

/// Everything one attempt of a run needs; each attempt starts every rank
/// afresh from the latest committed checkpoint.
struct Attempt<'a> {
    guest: &'a GuestComponent,
    ledger: &'a Arc<Ledger>,
    restore: Arc<RestoreCache>,
    restore_root: &'a Path,
    work: &'a Path,
    resume_from: Option<Checkpoint>,
    shared: RankShared,
    world_size: u32,
    /// Persist checkpoints in the background (see
    /// [`RunConfig::persist_in_background`]).
    background: bool,
    handle: tokio::runtime::Handle,
}

impl Attempt<'_> {
    /// Run every rank once; returns the attempt's failure, and whether a
    /// stop was requested through `preemption`.
    fn run(
        &self,
        report_timeout: Duration,
        preemption: &Preemption,
        grace: Duration,
    ) -> Result<(Option<crate::failure::RunFailure>, bool), Error> {
        // Fresh scratch directories: nothing of a failed attempt leaks into
        // the next one but what it committed.
        let scratch: Vec<PathBuf> = (0..self.world_size)
            .map(|r| self.work.join(format!("rank-{r}")))
            .collect();
        for dir in &scratch {
            let _ = std::fs::remove_dir_all(dir);
            std::fs::create_dir_all(dir).map_err(|source| Error::Io {
                path: dir.clone(),
                operation: "create a rank's scratch directory",
                source,
            })?;
        }
        let snapshots = self.background.then(|| self.work.join("snapshots"));
        let session = Arc::new(Session::new(
            self.world_size,
            report_timeout,
            Arc::clone(self.ledger),
            snapshots,
            Arc::clone(&self.restore),
            self.resume_from.clone(),
            preemption.clone(),
            self.handle.clone(),
        ));
        let ticker = self.guest.start_ticker();
        let done = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let watcher =
                scope.spawn(|| watch(&session, preemption, grace, &self.shared.limits, &done));
            let handles: Vec<_> = (0..self.world_size)
                .map(|rank| {
                    let info = RankInfo {
                        world_rank: rank,
                        world_size: self.world_size,
                        local_rank: rank,
                        local_world_size: self.world_size,
                        node_rank: 0,
                    };
                    let (guest, shared, session) =
                        (self.guest, self.shared.clone(), Arc::clone(&session));
                    let dirs = RankDirs {
                        scratch: &scratch[rank as usize],
                        restore: self.restore_root,
                    };
                    std::thread::Builder::new()
                        .name(format!("trainhost-rank-{rank}"))
                        .spawn_scoped(scope, move || run_rank(guest, info, shared, dirs, session))
                })
                .collect();
            for (rank, h) in handles.into_iter().enumerate() {
                let joined = h
                    .map_err(|e| e.to_string())
                    .and_then(|h| h.join().map_err(|p| panic_message(p.as_ref())));
                match joined {
                    Ok(outcome) => tracing::debug!(rank, ?outcome, "rank ended"),
                    // A bug in the host, not the guest's doing; the run
                    // fails saying so instead of hanging or vanishing.
                    Err(message) => session.fail(crate::failure::RunFailure {
                        rank: Some(rank as u32),
                        kind: crate::failure::FailureKind::Host,
                        message,
                    }),
                }
            }
            session.finish_recording();
            done.store(true, Ordering::SeqCst);
            watcher.thread().unpark();
            let _ = watcher.join();
        });
        drop(ticker);
        Ok((session.failure(), preemption.is_requested()))
    }
}

/// Watch an attempt from outside the ranks: a stop request and its grace
/// period, the attempt's wall-clock limit, and ranks that stall.
fn watch(
    session: &Session,
    preemption: &Preemption,
    grace: Duration,
    limits: &ResourceLimits,
    done: &AtomicBool,
) {
    const POLL: Duration = Duration::from_millis(10);
    let mut stop_at: Option<std::time::Instant> = None;
    while !done.load(Ordering::SeqCst) {
        session.check_background();
        if preemption.is_requested() && stop_at.is_none() {
            tracing::warn!(
                "stop requested: ranks have {} to report a final checkpoint (request again to stop at once)",
                humantime::format_duration(grace)
            );
            stop_at = Some(std::time::Instant::now() + grace);
        }
        if let Some(at) = stop_at
            && (preemption.is_forced() || std::time::Instant::now() >= at)
        {
            tracing::warn!("stopping the ranks now; committed checkpoints are intact");
            session.stop();
            return;
        }
        if let Some(limit) = limits.attempt_timeout
            && session.elapsed() > limit
        {
            session.fail(crate::failure::RunFailure {
                rank: None,
                kind: crate::failure::FailureKind::Limit,
                message: format!(
                    "the attempt exceeded its wall-clock limit of {}",
                    humantime::format_duration(limit)
                ),
            });
            return;
        }
        if let Some(timeout) = limits.stall_timeout
            && let Some((rank, quiet)) = session.stalled(timeout)
        {
            session.fail(crate::failure::RunFailure {
                rank: Some(rank),
                kind: crate::failure::FailureKind::Limit,
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

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("the host's thread for this rank panicked: {text}")
}

/// `<guest stem>_<UTC start time>`, like Ray's `TorchTrainer_2026-11-21_10-14-00`.
fn default_run_name(guest: &GuestSource) -> String {
    let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let stamp = now
        .trim_end_matches('Z')
        .replace('T', "_")
        .replace(':', "-");
    format!("{}_{stamp}", guest.stem())
}

async fn collect_result(
    ledger: &Ledger,
    run_name: String,
    error: Option<crate::failure::RunFailure>,
    preempted: bool,
) -> Result<TrainResult, Error> {
    let (ranked, history, failures) = ledger.snapshot();
    let mut best = Vec::with_capacity(ranked.len());
    for record in &ranked {
        match Checkpoint::load(ledger.storage().child(&record.dir_name())).await {
            Ok(checkpoint) => best.push((checkpoint, record.metrics.clone())),
            // The run's outcome matters more than this listing; storage
            // that just failed may still be failing.
            Err(e) => tracing::warn!(
                "checkpoint {} is committed but could not be read back for the result: {}",
                record.dir_name(),
                crate::error::chain(&e)
            ),
        }
    }
    let checkpoint = best
        .iter()
        .map(|(c, _)| c)
        .max_by_key(|c| c.index())
        .cloned();
    Ok(TrainResult {
        run_name,
        path: ledger.storage().url().to_owned(),
        checkpoint,
        best_checkpoints: best,
        metrics: history.last().map(|r| r.metrics.clone()),
        metrics_history: history,
        failures: failures.len() as u32,
        failure_history: failures,
        error,
        preempted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_names_carry_the_guest_and_a_sortable_time() {
        let name = default_run_name(&GuestSource::from("dir/linear_regression.wasm"));
        assert!(name.starts_with("linear_regression_20"), "{name}");
        assert!(!name.contains(':'), "{name}");
        crate::config::check_run_name(&name).unwrap();
    }
}
