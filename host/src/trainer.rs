//! The trainer: configuration mirroring Ray Train's config objects, and
//! `fit()`, which runs the ranks and yields the result.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::Error;
use crate::checkpoint::{Checkpoint, Ledger, RestoreCache, Session};
use crate::result::TrainResult;
use crate::runtime::output::{OutputSink, TerminalOutput};
use crate::runtime::{
    GuestComponent, RESTORE_GUEST_PATH, RankDirs, RankInfo, RankOutcome, RankShared, run_rank,
};
use crate::storage::Storage;

/// The storage used when none is given, as in Ray's `~/ray_results`.
pub const DEFAULT_STORAGE: &str = "./trainhost_results";
/// How long ranks wait for each other in `report` by default.
pub const DEFAULT_REPORT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The guest component to run.
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

/// How many ranks to run (Ray's `ScalingConfig`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScalingConfig {
    /// The number of ranks (Ray's `num_workers`). Default 1.
    pub num_workers: u32,
}

impl Default for ScalingConfig {
    fn default() -> Self {
        Self { num_workers: 1 }
    }
}

/// Where and under which name the run is recorded (Ray's `RunConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    /// The run's name, its directory under `storage_path`. Default:
    /// the guest's file name and the start time, `mnist_2026-11-21_10-14-00`.
    /// Running again with an existing name continues that run.
    pub name: Option<String>,
    /// Where runs are stored: a directory (default
    /// [`DEFAULT_STORAGE`]), `file://`, `memory://`, or an object store URL.
    pub storage_path: String,
    /// How long a rank waits in `report` for the other ranks' matching call
    /// before the run fails naming the missing ranks. Default 30 minutes.
    pub report_timeout: Duration,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            name: None,
            storage_path: DEFAULT_STORAGE.into(),
            report_timeout: DEFAULT_REPORT_TIMEOUT,
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
}

impl TrainerBuilder {
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
        if self.scaling.num_workers == 0 {
            return Err(Error::InvalidConfig(
                "num_workers is 0; a run needs at least one rank".into(),
            ));
        }
        if let Some(name) = &self.run.name {
            check_run_name(name)?;
        }
        if self.run.storage_path.is_empty() {
            return Err(Error::InvalidConfig(
                "storage_path is empty; give a directory or URL".into(),
            ));
        }
        if self.run.report_timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "report_timeout is zero; ranks need time to meet in report".into(),
            ));
        }
        Ok(Trainer {
            guest: self.guest,
            config: self.config,
            scaling: self.scaling,
            run: self.run,
            resume_from: self.resume_from,
            output: self.output.unwrap_or_else(|| Arc::new(TerminalOutput)),
        })
    }
}

fn check_run_name(name: &str) -> Result<(), Error> {
    let bad = name.is_empty()
        || name == "."
        || name == ".."
        || name.starts_with('.')
        || name
            .chars()
            .any(|c| c == '/' || c == '\\' || c.is_control());
    if bad {
        return Err(Error::InvalidConfig(format!(
            "run name {name:?} cannot be a directory name; use letters, digits, '-', '_' and '.' (not first)"
        )));
    }
    Ok(())
}

/// Runs a guest component as `num_workers` sandboxed ranks and persists
/// what they report. Make one with [`Trainer::builder`].
#[derive(Debug, Clone)]
pub struct Trainer {
    guest: GuestSource,
    config: serde_json::Value,
    scaling: ScalingConfig,
    run: RunConfig,
    resume_from: Option<String>,
    output: Arc<dyn OutputSink>,
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
        let guest = GuestComponent::compile(&bytes, &self.guest.shown())?;

        let run_name = self
            .run
            .name
            .clone()
            .unwrap_or_else(|| default_run_name(&self.guest));
        let world_size = self.scaling.num_workers;
        let storage = Storage::open(&self.run.storage_path)?;
        let run_storage = storage.child(&run_name);
        let config_json = serde_json::to_string(&self.config).expect("JSON values serialize");
        let fingerprint = hex::encode(Sha256::digest(config_json.as_bytes()));
        let ledger = Arc::new(rt.block_on(Ledger::open(
            run_storage.clone(),
            &run_name,
            &fingerprint,
            world_size,
            rt.handle().clone(),
        ))?);
        let resume_from = match &self.resume_from {
            Some(location) => Some(rt.block_on(Checkpoint::open_async(location))?),
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
        let mkdir = |p: &Path| {
            std::fs::create_dir_all(p).map_err(|source| Error::Io {
                path: p.to_path_buf(),
                operation: "create a rank directory",
                source,
            })
        };
        let restore_root = work.path().join("checkpoints");
        mkdir(&restore_root)?;
        let scratch: Vec<PathBuf> = (0..world_size)
            .map(|r| work.path().join(format!("rank-{r}")))
            .collect();
        for dir in &scratch {
            mkdir(dir)?;
        }

        let session = Arc::new(Session::new(
            world_size,
            self.run.report_timeout,
            Arc::clone(&ledger),
            Arc::new(RestoreCache::new(restore_root.clone(), RESTORE_GUEST_PATH)),
            resume_from,
            rt.handle().clone(),
        ));
        let shared = RankShared {
            config_json: config_json.into(),
            run_name: run_name.clone().into(),
            output: Arc::clone(&self.output),
        };
        tracing::info!(run = %run_storage.url(), ranks = world_size, "starting run");

        let ticker = guest.start_ticker();
        let outcomes: Vec<RankOutcome> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..world_size)
                .map(|rank| {
                    let info = RankInfo {
                        world_rank: rank,
                        world_size,
                        local_rank: rank,
                        local_world_size: world_size,
                        node_rank: 0,
                    };
                    let (guest, shared, session) = (&guest, shared.clone(), Arc::clone(&session));
                    let dirs = RankDirs {
                        scratch: &scratch[rank as usize],
                        restore: &restore_root,
                    };
                    std::thread::Builder::new()
                        .name(format!("trainhost-rank-{rank}"))
                        .spawn_scoped(scope, move || run_rank(guest, info, shared, dirs, session))
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    let joined = h
                        .map_err(|e| e.to_string())
                        .and_then(|h| h.join().map_err(|p| panic_message(p.as_ref())));
                    joined.unwrap_or_else(|message| {
                        // A bug in the host, not the guest's doing; the run
                        // fails saying so instead of hanging or vanishing.
                        session.fail(crate::RunFailure {
                            rank: Some(rank as u32),
                            kind: crate::FailureKind::Host,
                            message,
                        });
                        RankOutcome::Failed
                    })
                })
                .collect()
        });
        drop(ticker);
        tracing::debug!(?outcomes, "ranks ended");

        let error = session.failure();
        let result = rt.block_on(collect_result(&ledger, run_name, error))?;
        drop(work);
        Ok(result)
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
    error: Option<crate::RunFailure>,
) -> Result<TrainResult, Error> {
    let (records, history, failures) = ledger.snapshot();
    let mut best = Vec::with_capacity(records.len());
    // Newest first: without a score attribute recency ranks best (R14).
    for record in records.iter().rev() {
        let checkpoint = Checkpoint::load(ledger.storage().child(&record.dir_name())).await?;
        best.push((checkpoint, record.metrics.clone()));
    }
    Ok(TrainResult {
        run_name,
        path: ledger.storage().url().to_owned(),
        checkpoint: best.first().map(|(c, _)| c.clone()),
        best_checkpoints: best,
        metrics: history.last().map(|r| r.metrics.clone()),
        metrics_history: history,
        failures,
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_names_must_be_plain_directory_names() {
        for bad in ["", ".", "..", ".hidden", "a/b", "a\\b", "a\nb"] {
            assert!(check_run_name(bad).is_err(), "{bad:?}");
        }
        for good in ["demo", "mnist_2026-11-21_10-14-00", "a.b=c"] {
            assert!(check_run_name(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn default_names_carry_the_guest_and_a_sortable_time() {
        let name = default_run_name(&GuestSource::from("dir/linear_regression.wasm"));
        assert!(name.starts_with("linear_regression_20"), "{name}");
        assert!(!name.contains(':'), "{name}");
        check_run_name(&name).unwrap();
    }
}
