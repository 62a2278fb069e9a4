//! The data-parallel digits classifier of `examples/digits-mlp`, written
//! with burn: a multilayer perceptron (64 → `hidden` ReLU units → 10)
//! trained with Adam on the UCI handwritten digits, using
//! `trainhost-burn` for everything trainhost adds.
//!
//! Every rank seeds burn's generator alike, so the ranks build the same
//! model. Each global minibatch of `batch_size` images is dealt out to the
//! ranks (rank r takes every `world_size`-th image from the r-th on); each
//! rank's loss is scaled so that the mean of the ranks' gradients, which
//! `all_reduce_gradients` computes, is the whole batch's mean gradient
//! whatever the number of ranks. Every rank then takes the same Adam step.
//!
//! After every epoch the ranks sum their loss and accuracy, check that
//! their parameters are bit-identical, and report `train_loss`,
//! `train_accuracy`, `val_loss`, `val_accuracy` and `samples_per_second`;
//! every `checkpoint_every` epochs (and after the last) rank 0 saves the
//! model and the optimizer's state with burn's recorder. On start the loop
//! resumes from `get_checkpoint()`, Adam's moments included, and the data
//! order of an epoch depends only on the seed and the epoch: a resumed run
//! takes the same steps as one that never stopped.
//!
//! Config (all optional): `num_epochs` (15), `hidden` (64), `batch_size`
//! (32), `lr` (0.005), `seed` (0), `checkpoint_every` (5),
//! `validation_per_mille` (200), `fail_at_epoch` (none: the last rank
//! panics halfway through that epoch unless the run resumed from a
//! checkpoint, to show recovery), `bench_steps` (none: time that many
//! training steps on rank 0's share and report `step_seconds` instead of
//! training).

// The data set and its split are the hand-written example's (whose
// weight initialiser burn's replaces).
#[path = "../../digits-mlp/src/data.rs"]
#[allow(dead_code, clippy::len_without_is_empty)]
mod data;
mod model;

use std::error::Error;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{Adam, AdamConfig, GradientsParams, Optimizer};
use burn::tensor::ElementConversion;
use serde::Deserialize;
use trainhost_burn::{Epochs, Flow};
use trainhost_guest::Metrics;
use trainhost_guest::collective::{self, Op};

pub use data::{Set, load};
pub use model::Mlp;

/// burn's CPU backend, with automatic differentiation.
pub type Train = Autodiff<NdArray>;
/// The optimizer, as burn builds it for [`Mlp`].
pub type Optim = OptimizerAdaptor<Adam, Mlp<Train>, Train>;

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    num_epochs: usize,
    hidden: usize,
    batch_size: usize,
    lr: f64,
    seed: u64,
    checkpoint_every: usize,
    validation_per_mille: usize,
    fail_at_epoch: Option<usize>,
    bench_steps: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            num_epochs: 15,
            hidden: 64,
            batch_size: 32,
            lr: 0.005,
            seed: 0,
            checkpoint_every: 5,
            validation_per_mille: 200,
            fail_at_epoch: None,
            bench_steps: None,
        }
    }
}

/// A model and its optimizer, built alike on every rank seeded alike.
pub fn fresh(hidden: usize, seed: u64) -> (Mlp<Train>, Optim) {
    let device = Default::default();
    trainhost_burn::seed::<Train>(&device, seed);
    (Mlp::new(hidden, &device), AdamConfig::new().init())
}

/// Averages the ranks' gradients before a step.
pub type Average =
    fn(GradientsParams, &Mlp<Train>) -> Result<GradientsParams, trainhost_burn::Error>;

/// One training step on this rank's share `mine` of a global batch of
/// `batch_len` images, over `ranks` ranks whose gradients `average`
/// averages: the loss is scaled by `ranks × share / batch`, so that the
/// mean over the ranks of their gradients is the batch's mean gradient.
/// Returns the updated model, the share's summed loss and its correct
/// predictions.
#[allow(clippy::too_many_arguments)]
pub fn step(
    model: Mlp<Train>,
    optim: &mut Optim,
    set: &Set,
    mine: &[usize],
    batch_len: usize,
    ranks: usize,
    lr: f64,
    average: Average,
) -> Result<(Mlp<Train>, f64, usize), trainhost_burn::Error> {
    let device = Default::default();
    let (loss, correct) = model.loss(set, mine, &device);
    let share = mine.len() as f64;
    let summed = loss.clone().into_scalar().elem::<f64>() * share;
    let scaled = loss.mul_scalar(ranks as f64 * share / batch_len as f64);
    let grads = average(
        GradientsParams::from_grads(scaled.backward(), &model),
        &model,
    )?;
    Ok((optim.step(lr, model, grads), summed, correct))
}

/// What a single process does with its gradients: nothing.
pub fn alone(
    grads: GradientsParams,
    _: &Mlp<Train>,
) -> Result<GradientsParams, trainhost_burn::Error> {
    Ok(grads)
}

fn train(config: Config) -> Result<(), Box<dyn Error>> {
    if config.batch_size == 0 || config.hidden == 0 {
        return Err("batch_size and hidden must be at least 1".into());
    }
    if config.validation_per_mille >= 1000 {
        return Err("validation_per_mille must be below 1000".into());
    }
    let rank = trainhost_guest::world_rank() as usize;
    let world = trainhost_guest::world_size() as usize;
    if config.batch_size < world {
        return Err(format!(
            "batch_size {} is below the {world} ranks",
            config.batch_size
        )
        .into());
    }
    let (train_set, validation) = data::load(config.seed, config.validation_per_mille)?;
    if let Some(steps) = config.bench_steps {
        return bench(&config, &train_set, steps);
    }
    let device = Default::default();
    let (model, optim) = fresh(config.hidden, config.seed);
    let restored = trainhost_burn::restore(model, optim, &device)?;
    let resumed = restored.epoch.is_some();
    let (mut model, mut optim) = (restored.model, restored.optimizer);
    if rank == 0
        && let Some(epoch) = restored.epoch
    {
        println!("resuming after epoch {epoch}");
    }
    let epochs = Epochs::new(config.num_epochs).checkpoint_every(config.checkpoint_every);

    for epoch in restored.next_epoch..epochs.total() {
        let started = Instant::now();
        let order = data::permutation(train_set.len(), config.seed.wrapping_add(1 + epoch as u64));
        let batches: Vec<&[usize]> = order
            .chunks(config.batch_size)
            // Every rank needs a share: a last batch smaller than the
            // number of ranks is left out (the same on every rank).
            .filter(|b| b.len() >= world)
            .collect();
        let (mut loss, mut correct) = (0.0, 0);
        for (k, batch) in batches.iter().enumerate() {
            if config.fail_at_epoch == Some(epoch)
                && !resumed
                && rank + 1 == world
                && k == batches.len() / 2
            {
                panic!("injected failure halfway through epoch {epoch} (fail_at_epoch)");
            }
            let mine: Vec<usize> = batch.iter().copied().skip(rank).step_by(world).collect();
            let stepped = step(
                model,
                &mut optim,
                &train_set,
                &mine,
                batch.len(),
                world,
                config.lr,
                trainhost_burn::all_reduce_gradients,
            )?;
            model = stepped.0;
            loss += stepped.1;
            correct += stepped.2;
        }
        let seconds = started.elapsed().as_secs_f64();
        let seen: usize = batches.iter().map(|b| b.len()).sum();
        let (val_loss, val_correct) = evaluate(&model, &validation, rank, world);
        let mut totals = [loss, correct as f64, val_loss, val_correct as f64];
        collective::all_reduce(&mut totals, Op::Sum)?;
        trainhost_burn::check_in_sync(&model)?;

        let [loss, correct, val_loss, val_correct] = totals;
        let (n, v) = (seen as f64, validation.len() as f64);
        if rank == 0 {
            println!(
                "epoch {epoch}: train loss {:.4}, validation loss {:.4}, accuracy {:.2}%",
                loss / n,
                val_loss / v,
                100.0 * val_correct / v
            );
        }
        let metrics = Metrics::new()
            .with("train_loss", loss / n)
            .with("train_accuracy", correct / n)
            .with("val_loss", val_loss / v)
            .with("val_accuracy", val_correct / v)
            .with("samples_per_second", n / seconds);
        if epochs.end(epoch, metrics, &model, &optim)? == Flow::Stop {
            if rank == 0 {
                println!("preempted after epoch {epoch}; its checkpoint is committed");
            }
            break;
        }
    }
    Ok(())
}

trainhost_guest::entry!(train);

/// This rank's share of the validation set's summed loss and correct
/// predictions, without gradients.
fn evaluate(model: &Mlp<Train>, set: &Set, rank: usize, world: usize) -> (f64, usize) {
    let mine: Vec<usize> = (rank..set.len()).step_by(world).collect();
    if mine.is_empty() {
        return (0.0, 0);
    }
    let valid = model.valid();
    let (loss, correct) = valid.loss(set, &mine, &Default::default());
    (
        loss.into_scalar().elem::<f64>() * mine.len() as f64,
        correct,
    )
}

/// Time `steps` training steps on one batch (the step the benchmarks
/// compare with the same code compiled natively, [`time_steps`]) and
/// report the seconds per step.
fn bench(config: &Config, set: &Set, steps: usize) -> Result<(), Box<dyn Error>> {
    let per_step = time_steps(set, config.hidden, config.batch_size, config.lr, steps)?;
    trainhost_guest::report(Metrics::new().with("step_seconds", per_step), None)?;
    Ok(())
}

/// Seconds per training step of one process on a batch of `batch_size`
/// images of `set`, over `steps` steps after a first untimed one.
pub fn time_steps(
    set: &Set,
    hidden: usize,
    batch_size: usize,
    lr: f64,
    steps: usize,
) -> Result<f64, trainhost_burn::Error> {
    let (mut model, mut optim) = fresh(hidden, 0);
    let order = data::permutation(set.len(), 0);
    let batch = &order[..batch_size.min(order.len())];
    // The first step allocates what the others reuse.
    model = step(model, &mut optim, set, batch, batch.len(), 1, lr, alone)?.0;
    let started = Instant::now();
    for _ in 0..steps {
        model = step(model, &mut optim, set, batch, batch.len(), 1, lr, alone)?.0;
    }
    Ok(started.elapsed().as_secs_f64() / steps.max(1) as f64)
}
