//! The trainer: a guest and its settings, shaped like Ray Train's
//! `Trainer` (a builder whose every setting has a default), and `fit()`,
//! which runs it (`fit.rs`).

mod fit;
mod follow;
mod gang;
mod nodes;
mod workdir;

use std::path::PathBuf;
use std::sync::Arc;

use crate::config::{Checked, Location, Retention, RunConfig, ScalingConfig};
use crate::error::Error;
use crate::preemption::Preemption;
use crate::result::TrainResult;
use crate::runtime::output::{OutputSink, TerminalOutput};
use crate::runtime::{CompileCache, GuestSource};

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
        fit::fit(self)
    }
}
