//! Run machine-learning training loops compiled to WebAssembly components,
//! one sandboxed instance per rank, with the checkpointing done on the host.
//!
//! trainhost gives WASI training loops Ray Train's checkpoint contract: the
//! loop writes its state to a local directory and calls `report(metrics,
//! checkpoint)`; the host persists the files to storage and commits them
//! with a manifest of checksums, and `get_checkpoint()` hands the latest
//! committed checkpoint back. Each rank is its own wasmtime instance that
//! sees only its scratch directory, the checkpoint it restores from
//! (read-only), its config and the trainhost imports.
//!
//! Guests are written with the `trainhost-guest` crate. To run one from
//! your own program:
//!
//! ```no_run
//! use trainhost::{RunConfig, ScalingConfig, Trainer};
//!
//! let result = Trainer::builder("linear_regression.wasm")
//!     .train_loop_config(serde_json::json!({"num_epochs": 5}))
//!     .scaling_config(ScalingConfig { num_workers: 2 })
//!     .run_config(RunConfig {
//!         name: Some("demo".into()),
//!         ..RunConfig::default()
//!     })
//!     .build()?
//!     .fit()?;
//! match &result.error {
//!     None => println!("done; last metrics {:?}", result.metrics),
//!     Some(e) => eprintln!("failed: {e}"),
//! }
//! for (checkpoint, metrics) in &result.best_checkpoints {
//!     println!("{} {metrics}", checkpoint.location());
//! }
//! # Ok::<(), trainhost::Error>(())
//! ```
//!
//! The behaviour promised, rule by rule, is in the project's `SEMANTICS`
//! rules, cited throughout as R1..R28, and in the repository's
//! `SEMANTICS.md`, which continues them from R29 (collectives).
//!
//! # Features
//!
//! - `cli` (default): the `trainhost` command line. An embedder depends on
//!   the library with `default-features = false`.
//! - `mpi`: runs over several hosts, one trainhost per node under
//!   `mpiexec` or `srun` (the `mpi` crate over the system's MPI; building
//!   needs its headers and libclang).
//! - `bench`, `fuzzing`: entry points for the repository's benchmark suite
//!   and fuzz targets; not a public API.
#![deny(missing_docs)]

mod alloc;
mod attempt;
#[cfg(feature = "bench")]
#[doc(hidden)]
pub mod bench;
mod checkpoint;
mod cluster;
mod collective;
mod config;
mod cores;
mod error;
mod executor;
mod failure;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod ledger;
mod metrics;
mod owner;
mod persist;
mod preemption;
mod record;
mod result;
mod runtime;
mod storage;
mod sync;
mod tensor;
mod trainer;

pub use alloc::HugePageAllocator;
pub use checkpoint::{
    Checkpoint, CheckpointDir, committed_checkpoints, committed_checkpoints_with, stored_history,
};
pub use config::{
    CheckpointConfig, DEFAULT_PREEMPTION_GRACE, DEFAULT_REPORT_TIMEOUT, DEFAULT_STORAGE,
    DEFAULT_SYNC_PERIOD, FailureConfig, Interruption, MaxFailures, ResourceLimits, RunConfig,
    ScalingConfig, ScoreOrder, StorageOptions, SyncConfig,
};
pub use error::Error;
pub use failure::{FailureKind, RunFailure};
pub use metrics::{InvalidMetrics, MetricValue, Metrics};
pub use preemption::Preemption;
pub use record::{CheckpointRecord, FileEntry, Manifest, ReportRecord};
pub use result::TrainResult;
pub use runtime::GuestSource;
pub use runtime::cache::default_cache_dir;
pub use runtime::output::{OutputSink, Stream, TerminalOutput};
pub use trainer::{Trainer, TrainerBuilder};
