//! Checkpoints of a burn model, its optimizer and, if the loop has one, its
//! learning rate scheduler, written by burn's recorders into the rank's
//! scratch directory and read back from `get_checkpoint()`.
//!
//! A checkpoint directory holds `model.mpk`, `optimizer.mpk`,
//! `scheduler.mpk` (when saved with one) and `trainhost-burn.json` (the
//! epoch, and what else was saved). The records are burn's named
//! MessagePack at full precision: `Module::load_file` with a
//! `NamedMpkFileRecorder<FullPrecisionSettings>` reads the model outside
//! trainhost too.

use std::fs;
use std::path::{Path, PathBuf};

use burn::lr_scheduler::LrScheduler;
use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder, RecorderError};
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};
use trainhost_guest::Checkpoint;

use crate::Error;

/// The recorder of every record here. Full precision: a resumed run must
/// continue from the very values it stopped at.
type Files = NamedMpkFileRecorder<FullPrecisionSettings>;

/// Record names; the recorder adds `.mpk`.
const MODEL: &str = "model";
const OPTIMIZER: &str = "optimizer";
const SCHEDULER: &str = "scheduler";
/// What this crate says about the checkpoint.
const STATE: &str = "trainhost-burn.json";
/// Where in the scratch directory checkpoints are written.
const DIR: &str = "burn-checkpoint";

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct State {
    /// The last epoch the checkpoint has seen through.
    epoch: usize,
    /// Whether `scheduler.mpk` was saved.
    scheduler: bool,
}

/// Save `model` and `optimizer`, after `epoch` (counted from 0), into the
/// rank's scratch directory, replacing the previous checkpoint there; the
/// result is for `trainhost_guest::report`.
pub fn save<B, M, O>(model: &M, optimizer: &O, epoch: usize) -> Result<Checkpoint, Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    write::<B, M, O, f64>(&default_dir(), model, optimizer, None, epoch)
}

/// [`save`], with the learning rate scheduler's state too.
pub fn save_with_scheduler<B, M, O, S>(
    model: &M,
    optimizer: &O,
    scheduler: &S,
    epoch: usize,
) -> Result<Checkpoint, Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
    S: LrScheduler,
{
    write(&default_dir(), model, optimizer, Some(scheduler), epoch)
}

/// What [`restore`] hands back: the model and optimizer (and scheduler)
/// as the latest committed checkpoint left them, or as given when the run
/// has none.
#[derive(Debug)]
pub struct Restored<M, O, S = ()> {
    pub model: M,
    pub optimizer: O,
    pub scheduler: S,
    /// The epoch the checkpoint was saved after; `None` on a fresh start.
    pub epoch: Option<usize>,
    /// The epoch to train next: 0 on a fresh start.
    pub next_epoch: usize,
}

/// Load the model and optimizer state of the run's latest committed
/// checkpoint (`trainhost_guest::get_checkpoint()`) into `model` and
/// `optimizer`, built as for a fresh start, on `device`. Without a
/// checkpoint they come back unchanged.
pub fn restore<B, M, O>(model: M, optimizer: O, device: &B::Device) -> Result<Restored<M, O>, Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let Some(checkpoint) = trainhost_guest::get_checkpoint() else {
        return Ok(fresh(model, optimizer, ()));
    };
    let (model, optimizer, state) = read(checkpoint.path(), model, optimizer, device)?;
    Ok(Restored {
        model,
        optimizer,
        scheduler: (),
        epoch: Some(state.epoch),
        next_epoch: state.epoch + 1,
    })
}

/// [`restore`], with the learning rate scheduler, which the checkpoint must
/// hold ([`save_with_scheduler`]).
pub fn restore_with_scheduler<B, M, O, S>(
    model: M,
    optimizer: O,
    scheduler: S,
    device: &B::Device,
) -> Result<Restored<M, O, S>, Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
    S: LrScheduler,
{
    let Some(checkpoint) = trainhost_guest::get_checkpoint() else {
        return Ok(fresh(model, optimizer, scheduler));
    };
    let dir = checkpoint.path();
    let (model, optimizer, state) = read(dir, model, optimizer, device)?;
    if !state.scheduler {
        return Err(Error::Checkpoint(format!(
            "{} holds no scheduler state; it was saved with `save`, not `save_with_scheduler`",
            dir.display()
        )));
    }
    let path = dir.join(SCHEDULER);
    let record = Files::new()
        .load::<S::Record<B>>(path.clone(), device)
        .map_err(|e| record_error(&path, e))?;
    Ok(Restored {
        model,
        optimizer,
        scheduler: scheduler.load_record::<B>(record),
        epoch: Some(state.epoch),
        next_epoch: state.epoch + 1,
    })
}

fn fresh<M, O, S>(model: M, optimizer: O, scheduler: S) -> Restored<M, O, S> {
    Restored {
        model,
        optimizer,
        scheduler,
        epoch: None,
        next_epoch: 0,
    }
}

fn default_dir() -> PathBuf {
    trainhost_guest::scratch_dir().join(DIR)
}

/// Write a checkpoint into `dir`, emptied first.
pub(crate) fn write<B, M, O, S>(
    dir: &Path,
    model: &M,
    optimizer: &O,
    scheduler: Option<&S>,
    epoch: usize,
) -> Result<Checkpoint, Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
    S: LrScheduler,
{
    let io = |source| Error::Io {
        path: dir.to_path_buf(),
        source,
    };
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
        _ => {}
    }
    fs::create_dir_all(dir).map_err(io)?;
    let files = Files::new();
    let path = dir.join(MODEL);
    model
        .clone()
        .save_file(path.clone(), &files)
        .map_err(|e| record_error(&path, e))?;
    let path = dir.join(OPTIMIZER);
    Recorder::<B>::record(&files, optimizer.to_record(), path.clone())
        .map_err(|e| record_error(&path, e))?;
    if let Some(scheduler) = scheduler {
        let path = dir.join(SCHEDULER);
        Recorder::<B>::record(&files, scheduler.to_record::<B>(), path.clone())
            .map_err(|e| record_error(&path, e))?;
    }
    let state = State {
        epoch,
        scheduler: scheduler.is_some(),
    };
    let path = dir.join(STATE);
    let json = serde_json::to_vec(&state).expect("a plain struct serializes");
    fs::write(&path, json).map_err(|source| Error::Io { path, source })?;
    Ok(Checkpoint::from_directory(dir))
}

/// Read the model, optimizer and state [`write`] put into `dir`.
pub(crate) fn read<B, M, O>(
    dir: &Path,
    model: M,
    optimizer: O,
    device: &B::Device,
) -> Result<(M, O, State), Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let path = dir.join(STATE);
    let state = match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice::<State>(&bytes)
            .map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::Checkpoint(format!(
                "{} has no {STATE}; restore reads checkpoints that trainhost_burn::save wrote",
                dir.display()
            )));
        }
        Err(source) => return Err(Error::Io { path, source }),
    };
    let files = Files::new();
    let path = dir.join(MODEL);
    let model = model
        .load_file(path.clone(), &files, device)
        .map_err(|e| record_error(&path, e))?;
    let path = dir.join(OPTIMIZER);
    let record = Recorder::<B>::load::<O::Record>(&files, path.clone(), device)
        .map_err(|e| record_error(&path, e))?;
    Ok((model, optimizer.load_record(record), state))
}

fn record_error(path: &Path, e: RecorderError) -> Error {
    Error::Record {
        path: path.with_extension("mpk"),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::lr_scheduler::exponential::ExponentialLrSchedulerConfig;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{AdamConfig, GradientsParams};
    use burn::tensor::Tensor;

    use super::*;
    use crate::parameters_digest;

    type B = Autodiff<NdArray>;

    fn fresh(seed: u64) -> (Linear<B>, impl Optimizer<Linear<B>, B>) {
        let device = Default::default();
        crate::seeded_init(&device, seed, |device| {
            (
                LinearConfig::new(3, 2).init(device),
                AdamConfig::new().init(),
            )
        })
    }

    fn step<O: Optimizer<Linear<B>, B>>(model: Linear<B>, optim: &mut O) -> Linear<B> {
        let x = Tensor::<B, 2>::ones([4, 3], &Default::default());
        let grads =
            GradientsParams::from_grads(model.forward(x).powi_scalar(2).mean().backward(), &model);
        optim.step(0.1, model, grads)
    }

    #[test]
    fn a_restored_model_and_optimizer_take_the_same_next_step() {
        let dir = tempfile::tempdir().unwrap();
        let (model, mut optim) = fresh(1);
        let model = step(step(model, &mut optim), &mut optim);
        write::<B, _, _, f64>(dir.path(), &model, &optim, None, 4).unwrap();

        // Built as a fresh start would, with other initial weights.
        let (other, other_optim) = fresh(2);
        let (restored, mut restored_optim, state) =
            read::<B, _, _>(dir.path(), other, other_optim, &Default::default()).unwrap();
        assert_eq!(state.epoch, 4);
        assert!(!state.scheduler);
        assert_eq!(
            parameters_digest(&restored).unwrap(),
            parameters_digest(&model).unwrap()
        );
        // Adam's moments came back too: the next steps are the same bits.
        let expected = step(model, &mut optim);
        let continued = step(restored, &mut restored_optim);
        assert_eq!(
            parameters_digest(&continued).unwrap(),
            parameters_digest(&expected).unwrap()
        );
    }

    #[test]
    fn the_scheduler_is_saved_with_the_model() {
        let dir = tempfile::tempdir().unwrap();
        let (model, optim) = fresh(1);
        let mut scheduler = ExponentialLrSchedulerConfig::new(1.0, 0.5).init().unwrap();
        for _ in 0..3 {
            scheduler.step();
        }
        write::<B, _, _, _>(dir.path(), &model, &optim, Some(&scheduler), 0).unwrap();
        let path = dir.path().join(SCHEDULER);
        let fresh = ExponentialLrSchedulerConfig::new(1.0, 0.5).init().unwrap();
        let record = Recorder::<B>::load(&Files::new(), path, &Default::default()).unwrap();
        let mut restored = fresh.load_record::<B>(record);
        assert_eq!(restored.step(), scheduler.step());
    }

    #[test]
    fn a_directory_not_written_here_is_refused_naming_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let (model, optim) = fresh(1);
        let Err(e) = read::<B, _, _>(dir.path(), model, optim, &Default::default()) else {
            panic!("read a directory without {STATE}");
        };
        assert!(matches!(e, Error::Checkpoint(_)), "{e:?}");
        assert!(e.to_string().contains(STATE), "{e}");
    }
}
