//! Train [burn] models in trainhost.
//!
//! What Ray Train's `RayTrainReportCallback` gives Lightning and
//! Transformers, for burn's training loops compiled to a trainhost guest:
//!
//! - **Checkpoints through burn's recorders.** [`save`] writes the model
//!   and the optimizer state (and [`save_with_scheduler`] the learning
//!   rate scheduler's) into the rank's scratch directory with burn's
//!   `NamedMpkFileRecorder` at full precision, plus the epoch, and returns
//!   the [`Checkpoint`](trainhost_guest::Checkpoint) to report. [`restore`]
//!   loads them back from `get_checkpoint()` after a restart or a rerun.
//!   burn's own record format rather than safetensors: it is what burn
//!   users load with `Module::load_file`, it is the only format burn has
//!   for optimizer and scheduler state (Adam's moments), and at full
//!   precision a resumed run continues bit for bit.
//! - **Reports at a chosen frequency.** An [`Epochs`] reports every
//!   epoch's metrics and saves a checkpoint every `n` epochs (and after
//!   the last), and stops the loop with a final checkpoint when the run is
//!   preempted.
//! - **Data-parallel training.** [`all_reduce_gradients`] averages the
//!   gradients of every rank with one all-reduce before each optimizer
//!   step; with equal initial parameters ([`seed`] every rank alike) every
//!   rank then takes the same step, which [`check_in_sync`] verifies.
//!   [`Shard`] deals a burn dataset out to the ranks.
//!
//! burn-train's `Learner` is not usable in a guest: burn-train 0.21 does
//! not build for `wasm32-wasip2` (its log file appender, tracing-appender,
//! makes symbolic links, which WASI's standard library lacks), and its
//! learner runs metric processing and the metric store on threads of
//! their own, which a WASI component cannot start. A hand-written burn
//! loop with these functions does what the learner's checkpointer and
//! logger would.
//!
//! ```no_run
//! use burn::backend::{Autodiff, NdArray};
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::{AdamConfig, GradientsParams, Optimizer};
//! use burn::tensor::Tensor;
//! use trainhost_burn::{Epochs, Flow};
//! use trainhost_guest::Metrics;
//!
//! type B = Autodiff<NdArray>;
//!
//! fn train(_config: serde_json::Value) -> Result<(), trainhost_burn::Error> {
//!     let device = Default::default();
//!     trainhost_burn::seed::<B>(&device, 42);
//!     let model = LinearConfig::new(4, 1).init::<B>(&device);
//!     let optim = AdamConfig::new().init::<B, Linear<B>>();
//!     // The latest committed checkpoint, if the run has one.
//!     let resumed = trainhost_burn::restore(model, optim, &device)?;
//!     let (mut model, mut optim) = (resumed.model, resumed.optimizer);
//!     let epochs = Epochs::new(10).checkpoint_every(2);
//!     for epoch in resumed.next_epoch..epochs.total() {
//!         let x = Tensor::<B, 2>::ones([8, 4], &device);
//!         let loss = model.forward(x).powi_scalar(2).mean();
//!         let grads = GradientsParams::from_grads(loss.backward(), &model);
//!         let grads = trainhost_burn::all_reduce_gradients(grads, &model)?;
//!         model = optim.step(1e-3, model, grads);
//!         let metrics = Metrics::new().with("loss", f64::from(loss.into_scalar()));
//!         if epochs.end(epoch, metrics, &model, &optim)? == Flow::Stop {
//!             break;
//!         }
//!     }
//!     Ok(())
//! }
//! trainhost_guest::entry!(train);
//! ```

mod checkpoint;
mod epochs;
mod error;
mod parallel;
#[cfg(feature = "dataset")]
mod shard;

pub use checkpoint::{Restored, restore, restore_with_scheduler, save, save_with_scheduler};
pub use epochs::{Epochs, Flow};
pub use error::Error;
pub use parallel::{all_reduce_gradients, check_in_sync, parameters_digest, seed};
#[cfg(feature = "dataset")]
pub use shard::Shard;

/// Burn's backends keep one random generator per process and draw a
/// parameter's initial values at its first use, not when the module is built.
/// Tests that seed the generator and build a model therefore hold this lock
/// until every parameter has been read once (the digest reads them all);
/// otherwise a test on another thread can reseed or draw halfway through.
#[cfg(test)]
pub(crate) fn seeded_init<B: burn::tensor::backend::Backend, M: burn::module::Module<B>, T>(
    device: &B::Device,
    seed: u64,
    init: impl FnOnce(&B::Device) -> (M, T),
) -> (M, T) {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _held = LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    parallel::seed::<B>(device, seed);
    let (model, rest) = init(device);
    parameters_digest(&model).expect("a freshly built model's parameters are readable");
    (model, rest)
}
