//! Write training loops that [trainhost] runs as sandboxed WebAssembly ranks.
//!
//! A training loop is an ordinary Rust function. trainhost compiles it once,
//! starts one sandboxed instance per rank, and does the checkpointing on the
//! host: the loop writes its state into a local directory and calls
//! [`report`]; the host persists the files to storage, and after a restart
//! hands them back through [`get_checkpoint`].
//!
//! ```no_run
//! use serde::Deserialize;
//! use trainhost_guest::{Checkpoint, Metrics};
//!
//! #[derive(Deserialize)]
//! struct Config {
//!     num_epochs: u32,
//! }
//!
//! fn train(config: Config) -> Result<(), Box<dyn std::error::Error>> {
//!     // Resume where the last committed checkpoint left off.
//!     let start = match trainhost_guest::get_checkpoint() {
//!         Some(checkpoint) => {
//!             let epoch = std::fs::read_to_string(checkpoint.path().join("epoch"))?;
//!             epoch.trim().parse::<u32>()? + 1
//!         }
//!         None => 0,
//!     };
//!     for epoch in start..config.num_epochs {
//!         let loss = 1.0 / f64::from(epoch + 1);
//!         let dir = trainhost_guest::scratch_dir().join("checkpoint");
//!         std::fs::create_dir_all(&dir)?;
//!         std::fs::write(dir.join("epoch"), epoch.to_string())?;
//!         // Only rank 0 saves when every rank holds the same model.
//!         let checkpoint = (trainhost_guest::world_rank() == 0)
//!             .then(|| Checkpoint::from_directory(&dir));
//!         trainhost_guest::report(
//!             Metrics::new().with("loss", loss).with("epoch", epoch),
//!             checkpoint,
//!         )?;
//!     }
//!     Ok(())
//! }
//!
//! trainhost_guest::entry!(train);
//! ```
//!
//! Build it as a `cdylib` for `wasm32-wasip2`, in release mode and with
//! SIMD enabled for speed:
//!
//! ```text
//! RUSTFLAGS="-C target-feature=+simd128" cargo build --release --target wasm32-wasip2
//! trainhost run target/wasm32-wasip2/release/my_loop.wasm --workers 2
//! ```
//!
//! or keep the flag in the crate's `.cargo/config.toml`, as the example in
//! trainhost's repository does:
//!
//! ```toml
//! [target.wasm32-wasip2]
//! rustflags = ["-C", "target-feature=+simd128"]
//! ```
//!
//! Without SIMD, element-wise `f32` loops run about 3× slower; a debug
//! build about 30× slower.
//!
//! Ranks combine their work with the collectives in [`collective`]
//! (barrier, broadcast, all-reduce, all-gather): data-parallel training
//! all-reduces its gradients before every step. The heavy maths of a step
//! can run in the host, at native speed and still interruptible, on the
//! host tensors of [`tensor`], and a whole step with one call into the
//! host as a recorded [`program`].
//!
//! [trainhost]: https://github.com/trainhost/trainhost
#![deny(missing_docs)]

pub mod collective;
mod metrics;
pub mod program;
pub mod tensor;

#[doc(hidden)]
pub mod wit;

use std::fmt;
use std::path::{Path, PathBuf};

pub use metrics::{MetricValue, Metrics};

use wit::trainhost::train::{context, session};

/// This rank's index among all ranks of the run, from 0 to
/// [`world_size`]` - 1`.
pub fn world_rank() -> u32 {
    context::world_rank()
}

/// How many ranks the run has.
pub fn world_size() -> u32 {
    context::world_size()
}

/// This rank's index among the ranks on the same host.
pub fn local_rank() -> u32 {
    context::local_rank()
}

/// How many ranks run on this rank's host.
pub fn local_world_size() -> u32 {
    context::local_world_size()
}

/// The index of this rank's host among the hosts of the run.
pub fn node_rank() -> u32 {
    context::node_rank()
}

/// The run's name.
pub fn run_name() -> String {
    context::run_name()
}

/// This rank's private read-write scratch directory. Write checkpoints here
/// before reporting them. It is the working directory when the entry
/// function starts, so relative paths land here. The host removes it when
/// the run ends.
pub fn scratch_dir() -> PathBuf {
    PathBuf::from(context::scratch_dir())
}

/// The loop's configuration as the JSON text given to the run.
pub fn config_json() -> String {
    context::config()
}

/// The loop's configuration, deserialized into `T`.
///
/// ```no_run
/// #[derive(serde::Deserialize)]
/// struct Config { lr: f64 }
/// let config: Config = trainhost_guest::config()?;
/// # Ok::<(), trainhost_guest::Error>(())
/// ```
pub fn config<T: serde::de::DeserializeOwned>() -> Result<T, Error> {
    serde_json::from_str(&context::config()).map_err(|e| Error::Config(e.to_string()))
}

/// A checkpoint: a directory of files, as in Ray Train.
///
/// Create one from a directory you wrote with [`Checkpoint::from_directory`]
/// and pass it to [`report`]; receive the one to resume from with
/// [`get_checkpoint`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    path: PathBuf,
    hand_over: bool,
}

impl Checkpoint {
    /// A checkpoint made of the files under `path`, a directory inside the
    /// sandbox (usually below [`scratch_dir`]).
    pub fn from_directory(path: impl AsRef<Path>) -> Self {
        Self {
            path: path.as_ref().to_path_buf(),
            hand_over: false,
        }
    }

    /// Hand the directory's files over to the host when reported, instead
    /// of lending them (by default the host links the files and gives the
    /// loop a copy of any it writes again before they are persisted; Ray's
    /// `delete_local_checkpoint_after_upload`):
    /// [`report`] moves the directory out of the sandbox in one rename and
    /// returns without reading a byte, however large the checkpoint; the
    /// directory is empty when it returns, whatever became of the report.
    /// Use it when the loop writes every checkpoint afresh. The directory
    /// must be below [`scratch_dir`] (not the scratch directory itself).
    ///
    /// ```no_run
    /// # fn save(dir: &std::path::Path) {}
    /// let dir = trainhost_guest::scratch_dir().join("checkpoint");
    /// std::fs::create_dir_all(&dir)?;
    /// save(&dir);
    /// trainhost_guest::report(
    ///     trainhost_guest::Metrics::new().with("epoch", 1),
    ///     Some(trainhost_guest::Checkpoint::from_directory(&dir).hand_over()),
    /// )?;
    /// assert!(std::fs::read_dir(&dir)?.next().is_none(), "the files are the host's now");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn hand_over(self) -> Self {
        Self {
            hand_over: true,
            ..self
        }
    }

    /// The checkpoint's directory. A restored checkpoint is read-only.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The checkpoint to resume from: the run's latest committed checkpoint, or
/// before the run has committed one, the checkpoint the run was told to
/// resume from. `None` on a fresh start.
pub fn get_checkpoint() -> Option<Checkpoint> {
    session::get_checkpoint().map(Checkpoint::from_directory)
}

/// Whether the host asked the run to stop early (preemption, or the user
/// interrupted it).
///
/// It turns true on every rank right after the same [`report`] returns, so
/// checking it after each report keeps the ranks in step: save a final
/// checkpoint, report it, and return from the entry function. The run can
/// then be resumed under the same name. Ranks that ignore it are stopped
/// after the host's grace period.
///
/// ```no_run
/// # fn save() -> std::path::PathBuf { unimplemented!() }
/// for step in 0.. {
///     trainhost_guest::report(trainhost_guest::Metrics::new().with("step", step), None)?;
///     if trainhost_guest::preemption_requested() {
///         let dir = save();
///         trainhost_guest::report(
///             trainhost_guest::Metrics::new().with("step", step),
///             Some(trainhost_guest::Checkpoint::from_directory(dir)),
///         )?;
///         break;
///     }
/// }
/// # Ok::<(), trainhost_guest::Error>(())
/// ```
pub fn preemption_requested() -> bool {
    session::preemption_requested()
}

/// Report metrics and optionally a checkpoint.
///
/// Every rank must call `report` the same number of times: the call returns
/// once the matching calls of all ranks have arrived and the host has taken
/// the checkpoint's files: by default it copies them to a local snapshot
/// and uploads them while training goes on (on local storage it writes
/// them to their place directly; a failed upload fails the run at the next
/// report or at the end); with the host's `--wait-for-upload`
/// it returns once the checkpoint is committed to storage. The recorded
/// metrics are rank 0's, and count toward its output limit (the host's
/// `--max-output-rate`): report per step or epoch, not per sample. When
/// several ranks pass a checkpoint, the committed checkpoint holds the
/// files of all of them (distributed checkpointing); two ranks may write
/// the same file only with the same bytes.
///
/// When this returns, the checkpoint directory may be deleted, reused or
/// rewritten in place: the host took the files without copying them (hard
/// links), and a file the loop opens for writing before they are persisted
/// is first replaced by a copy of its own. A checkpoint made with
/// [`Checkpoint::hand_over`] is moved instead: `report` then returns with
/// the directory empty.
pub fn report(metrics: impl Into<Metrics>, checkpoint: Option<Checkpoint>) -> Result<(), Error> {
    let metrics = Into::<Metrics>::into(metrics).into_wit();
    let Some(checkpoint) = checkpoint else {
        return session::report(&metrics, None).map_err(Error::from);
    };
    let path = checkpoint.path.to_str().ok_or_else(|| {
        Error::InvalidCheckpoint(format!(
            "checkpoint path {} is not valid UTF-8",
            checkpoint.path.display()
        ))
    })?;
    if checkpoint.hand_over {
        session::report_handing_over(&metrics, path).map_err(Error::from)
    } else {
        session::report(&metrics, Some(path)).map_err(Error::from)
    }
}

/// Why a call into trainhost failed.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// The checkpoint directory was refused (outside the sandbox, not a
    /// directory, holds a symbolic link or special file, reserved name).
    InvalidCheckpoint(String),
    /// The metrics were refused (empty or repeated name, non-numeric score).
    InvalidMetrics(String),
    /// Two ranks wrote the same file with different bytes; nothing was
    /// committed for this report.
    Collision(String),
    /// The run's config could not be deserialized into the requested type.
    Config(String),
}

impl From<session::ReportError> for Error {
    fn from(e: session::ReportError) -> Self {
        match e {
            session::ReportError::InvalidCheckpoint(m) => Error::InvalidCheckpoint(m),
            session::ReportError::InvalidMetrics(m) => Error::InvalidMetrics(m),
            session::ReportError::Collision(m) => Error::Collision(m),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidCheckpoint(m) => write!(f, "checkpoint refused: {m}"),
            Error::InvalidMetrics(m) => write!(f, "metrics refused: {m}"),
            Error::Collision(m) => write!(f, "checkpoint collision: {m}"),
            Error::Config(m) => write!(f, "invalid config: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// Declare the training loop's entry point.
///
/// The function takes the run's config, deserialized into any type that
/// implements `serde::Deserialize` (use `serde_json::Value` to take it as
/// is, or `()` to ignore it), and returns `Result<(), E>` for any error type
/// that implements `Display`. An error fails the run with its message
/// (alternate form, so `anyhow` errors show their whole chain).
///
/// ```no_run
/// fn train(config: serde_json::Value) -> Result<(), String> {
///     println!("rank {} got {config}", trainhost_guest::world_rank());
///     Ok(())
/// }
/// trainhost_guest::entry!(train);
/// ```
#[macro_export]
macro_rules! entry {
    ($train:path) => {
        #[doc(hidden)]
        struct __TrainhostEntry;

        impl $crate::wit::Guest for __TrainhostEntry {
            fn train() -> ::core::result::Result<(), ::std::string::String> {
                $crate::__run_entry($train)
            }
        }

        $crate::wit::export_trainer!(__TrainhostEntry with_types_in $crate::wit);
    };
}

/// Runs the user's entry function; called by [`entry!`]. Not public API.
#[doc(hidden)]
pub fn __run_entry<C, E, F>(train: F) -> Result<(), String>
where
    C: serde::de::DeserializeOwned,
    E: fmt::Display,
    F: FnOnce(C) -> Result<(), E>,
{
    // The host resolves relative checkpoint paths against the scratch
    // directory; make the guest's own relative paths agree.
    let _ = std::env::set_current_dir(scratch_dir());
    let config: C = config().map_err(|e| e.to_string())?;
    train(config).map_err(|e| format!("{e:#}"))
}
