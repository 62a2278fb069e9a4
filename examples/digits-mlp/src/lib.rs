//! Data-parallel training of a digit classifier, the way DDP or Horovod
//! train: every rank holds the same model, computes the gradient of its
//! share of each minibatch, and the ranks average their gradients with one
//! all-reduce before every step, so that every rank applies the same
//! update.
//!
//! The data are the UCI handwritten digits (1797 images of 8×8 pixels,
//! `data/digits.csv`, built into the guest), split into training and
//! validation sets with a fixed seed. The model is a multilayer perceptron
//! (64 → `hidden` ReLU units → 10) trained with softmax cross-entropy and
//! SGD with momentum. Each global minibatch of `batch_size` images is dealt
//! out to the ranks (rank r takes every `world_size`-th image from the r-th
//! on); the ranks' gradient sums are all-reduced and divided by the batch
//! size, which gives the whole batch's mean gradient whatever the number of
//! ranks. Runs with 1, 2 or 4 ranks therefore follow the same path up to
//! rounding.
//!
//! After every epoch the ranks all-reduce their loss and accuracy, check
//! that their parameters are bit-identical (an all-gather of a hash of
//! them; the run fails if not), and report `train_loss`,
//! `train_accuracy`, `val_loss`, `val_accuracy` and `samples_per_second`.
//! Every `checkpoint_every` epochs (and after the last) rank 0 saves the
//! weights (`model.safetensors`: `w1`, `b1`, `w2`, `b2`), the momentum
//! (`optimizer.safetensors`) and the epoch (`state.json`) and reports them.
//! On start the loop resumes from `get_checkpoint()`; the data order of an
//! epoch depends only on the seed and the epoch, so a resumed run takes the
//! same steps as one that never stopped.
//!
//! Config (all optional): `num_epochs` (30), `hidden` (64), `batch_size`
//! (32), `lr` (0.1), `momentum` (0.9), `seed` (0), `checkpoint_every` (5),
//! `validation_per_mille` (200), `fail_at_epoch` (none: the last rank
//! panics at that epoch unless the run resumed from a checkpoint, to show
//! recovery), `kernels` (false: with true, the forward and backward passes
//! and the SGD step run as host kernels on host tensors, `host.rs`, whose
//! gradients are all-reduced and whose checkpoints are written and read
//! in the host, each step a recorded program run with one call; same
//! model, same data, same files), `bench_steps` (none:
//! time that many training steps on the first batch and report
//! `step_seconds` instead of training).

mod checkpoint;
mod data;
mod host;
mod model;

use std::error::Error;
use std::time::Instant;

use serde::Deserialize;
use trainhost_guest::collective::{self, Op};
use trainhost_guest::{Checkpoint, Metrics};

use checkpoint::{State, read_state, read_tensors, save, write_tensors};
use data::Set;
use host::{HostModel, HostSet};
use model::{Layout, Tally};

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    num_epochs: u32,
    hidden: usize,
    batch_size: usize,
    lr: f32,
    momentum: f32,
    seed: u64,
    checkpoint_every: u32,
    validation_per_mille: usize,
    fail_at_epoch: Option<u32>,
    kernels: bool,
    bench_steps: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            num_epochs: 30,
            hidden: 64,
            batch_size: 32,
            lr: 0.1,
            momentum: 0.9,
            seed: 0,
            checkpoint_every: 5,
            validation_per_mille: 200,
            fail_at_epoch: None,
            kernels: false,
            bench_steps: None,
        }
    }
}

fn train(config: Config) -> Result<(), Box<dyn Error>> {
    if config.batch_size == 0 || config.hidden == 0 || config.checkpoint_every == 0 {
        return Err("batch_size, hidden and checkpoint_every must be at least 1".into());
    }
    if config.validation_per_mille >= 1000 {
        return Err("validation_per_mille must be below 1000".into());
    }
    let rank = trainhost_guest::world_rank() as usize;
    let world = trainhost_guest::world_size() as usize;
    let (train_set, validation) = data::load(config.seed, config.validation_per_mille)?;
    let layout = Layout {
        hidden: config.hidden,
    };

    let checkpoint = trainhost_guest::get_checkpoint();
    let start = match &checkpoint {
        Some(c) => {
            let state = read_state(c.path(), &layout)?;
            if rank == 0 {
                println!("resuming after epoch {}", state.epoch);
            }
            state.epoch + 1
        }
        None => 0,
    };
    let resumed = start > 0;
    // With `kernels`, the model lives in host tensors, and the host reads
    // and writes its checkpoints (the same files either way).
    let (on_host, params, velocity) = match (&checkpoint, config.kernels) {
        (Some(c), true) => (Some(HostModel::load(c.path(), &layout)?), vec![], vec![]),
        (Some(c), false) => {
            let dir = c.path();
            let params = read_tensors(&dir.join("model.safetensors"), &layout)?;
            let velocity = read_tensors(&dir.join("optimizer.safetensors"), &layout)?;
            (None, params, velocity)
        }
        (None, kernels) => {
            let (params, velocity) = (layout.init(config.seed), vec![0.0; layout.len()]);
            match kernels {
                true => (
                    Some(HostModel::new(&layout, &params, &velocity)?),
                    vec![],
                    vec![],
                ),
                false => (None, params, velocity),
            }
        }
    };
    // The sets' images go to the host once; minibatches are gathered there.
    let mut on_host = match on_host {
        Some(model) => Some(OnHost {
            model,
            train: HostSet::new("train", &train_set)?,
            validation: HostSet::new("validation", &validation)?,
        }),
        None => None,
    };
    let mut in_guest = InGuest {
        params,
        velocity,
        grad: vec![0.0f32; layout.len()],
        hidden: Vec::with_capacity(config.hidden),
    };
    if let Some(steps) = config.bench_steps {
        return bench(
            &mut on_host,
            &mut in_guest,
            &layout,
            &train_set,
            &config,
            steps,
        );
    }

    for epoch in start..config.num_epochs {
        if config.fail_at_epoch == Some(epoch) && !resumed && rank + 1 == world {
            panic!("injected failure at epoch {epoch} (fail_at_epoch)");
        }
        let started = Instant::now();
        let order = data::permutation(
            train_set.len(),
            config.seed.wrapping_add(1 + u64::from(epoch)),
        );
        let mut mine = Tally::default();
        for batch in order.chunks(config.batch_size) {
            let t = match &mut on_host {
                Some(on) => host_step(on, &on_host_batch(batch), &config)?,
                None => guest_step(&mut in_guest, &layout, &train_set, batch, &config)?,
            };
            mine.loss += t.loss;
            mine.correct += t.correct;
        }
        let seconds = started.elapsed().as_secs_f64();
        let val = match &mut on_host {
            Some(on) => {
                in_guest.params = on.model.parameters();
                let share: Vec<u32> = (rank..validation.len())
                    .step_by(world)
                    .map(|i| i as u32)
                    .collect();
                on.model.evaluate(&on.validation, &share)?
            }
            None => evaluate(&layout, &mut in_guest, &validation, rank, world),
        };
        let mut totals = [mine.loss, mine.correct as f64, val.loss, val.correct as f64];
        collective::all_reduce(&mut totals, Op::Sum)?;
        let [train_loss, train_correct, val_loss, val_correct] = totals;
        check_in_sync(&in_guest.params, epoch)?;

        let n = train_set.len() as f64;
        let v = validation.len() as f64;
        let metrics = Metrics::new()
            .with("epoch", epoch)
            .with("train_loss", train_loss / n)
            .with("train_accuracy", train_correct / n)
            .with("val_loss", val_loss / v)
            .with("val_accuracy", val_correct / v)
            .with("samples_per_second", n / seconds);
        if rank == 0 {
            println!(
                "epoch {epoch}: train loss {:.4}, validation loss {:.4}, accuracy {:.2}%",
                train_loss / n,
                val_loss / v,
                100.0 * val_correct / v
            );
        }
        let last = epoch + 1 == config.num_epochs;
        let due = (epoch + 1) % config.checkpoint_every == 0 || last;
        let state = State {
            epoch,
            hidden: config.hidden,
            world_size: world as u32,
        };
        // Every rank holds the same model: rank 0 saves it.
        let save = || -> Result<Option<Checkpoint>, Box<dyn Error>> {
            if rank != 0 {
                return Ok(None);
            }
            let dir = trainhost_guest::scratch_dir().join("checkpoint");
            Ok(Some(save(&dir, &state, |dir| match &on_host {
                Some(on) => Ok(on.model.save(dir)?),
                None => {
                    let m = &in_guest;
                    write_tensors(&dir.join("model.safetensors"), &layout, &m.params)?;
                    write_tensors(&dir.join("optimizer.safetensors"), &layout, &m.velocity)
                }
            })?))
        };
        trainhost_guest::report(metrics.clone(), if due { save()? } else { None })?;

        // Preemption turns true on every rank after the same report.
        if trainhost_guest::preemption_requested() {
            if !due {
                trainhost_guest::report(metrics, save()?)?;
            }
            if rank == 0 {
                println!("preempted after epoch {epoch}; its checkpoint is committed");
            }
            return Ok(());
        }
    }
    Ok(())
}

trainhost_guest::entry!(train);

/// The model in the guest's own memory (without `kernels`): parameters,
/// momentum, and the scratch space of a step.
struct InGuest {
    params: Vec<f32>,
    velocity: Vec<f32>,
    grad: Vec<f32>,
    hidden: Vec<f32>,
}

/// This rank's share of `batch` (every `world_size`-th image from the
/// rank's own on), its gradient sums all-reduced, and one SGD step with
/// momentum along their mean: the same step on every rank.
fn guest_step(
    m: &mut InGuest,
    layout: &Layout,
    set: &Set,
    batch: &[usize],
    config: &Config,
) -> Result<Tally, Box<dyn Error>> {
    let (rank, world) = rank_and_world();
    let mut mine = Tally::default();
    m.grad.fill(0.0);
    for &i in batch.iter().skip(rank).step_by(world) {
        let (image, label) = (&set.images[i], set.labels[i]);
        let t = model::sample(
            layout,
            &m.params,
            image,
            label,
            Some(&mut m.grad),
            &mut m.hidden,
        );
        mine.loss += t.loss;
        mine.correct += t.correct;
    }
    // Sum of every rank's gradient sums, the same bits on every rank.
    collective::all_reduce(&mut m.grad, Op::Sum)?;
    let scale = 1.0 / batch.len() as f32;
    model::sgd_momentum(
        &mut m.params,
        &mut m.velocity,
        &m.grad,
        scale,
        config.lr,
        config.momentum,
    );
    Ok(mine)
}

/// The model on host kernels and the sets' images in host tensors.
struct OnHost {
    model: HostModel,
    train: HostSet,
    validation: HostSet,
}

/// Indexes of a batch as the host's `gather-rows` takes them.
fn on_host_batch(batch: &[usize]) -> Vec<u32> {
    batch.iter().map(|&i| i as u32).collect()
}

/// [`guest_step`] on host kernels, the batch gathered from the training
/// images in the host: one call into the host a step.
fn host_step(on: &mut OnHost, batch: &[u32], config: &Config) -> Result<Tally, Box<dyn Error>> {
    let (rank, world) = rank_and_world();
    let share: Vec<u32> = batch.iter().copied().skip(rank).step_by(world).collect();
    let (lr, momentum) = (config.lr, config.momentum);
    on.model
        .train_step(&on.train, &share, batch.len(), lr, momentum)
}

fn rank_and_world() -> (usize, usize) {
    (
        trainhost_guest::world_rank() as usize,
        trainhost_guest::world_size() as usize,
    )
}

/// Time `steps` training steps on the first `batch_size` images (after
/// one untimed step, which allocates what the others reuse) and report
/// the seconds per step: what the benchmarks compare with the same step
/// run natively.
fn bench(
    on_host: &mut Option<OnHost>,
    in_guest: &mut InGuest,
    layout: &Layout,
    set: &Set,
    config: &Config,
    steps: usize,
) -> Result<(), Box<dyn Error>> {
    let batch: Vec<usize> = (0..config.batch_size.min(set.len())).collect();
    let mut step = || -> Result<Tally, Box<dyn Error>> {
        match on_host {
            Some(on) => host_step(on, &on_host_batch(&batch), config),
            None => guest_step(in_guest, layout, set, &batch, config),
        }
    };
    step()?;
    let started = Instant::now();
    for _ in 0..steps {
        step()?;
    }
    let per_step = started.elapsed().as_secs_f64() / steps.max(1) as f64;
    trainhost_guest::report(Metrics::new().with("step_seconds", per_step), None)?;
    Ok(())
}

/// This rank's share of the validation set's loss and correct predictions;
/// the ranks' shares are summed by the caller.
fn evaluate(layout: &Layout, m: &mut InGuest, set: &Set, rank: usize, world: usize) -> Tally {
    let mut tally = Tally::default();
    for i in (rank..set.len()).step_by(world) {
        let t = model::sample(
            layout,
            &m.params,
            &set.images[i],
            set.labels[i],
            None,
            &mut m.hidden,
        );
        tally.loss += t.loss;
        tally.correct += t.correct;
    }
    tally
}

/// Fail unless every rank holds bit-identical parameters: all-gather a
/// hash of them.
fn check_in_sync(params: &[f32], epoch: u32) -> Result<(), Box<dyn Error>> {
    let hash = params.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, p| {
        (h ^ u64::from(p.to_bits())).wrapping_mul(0x0100_0000_01b3)
    });
    let hashes = collective::all_gather(&hash.to_le_bytes())?;
    if hashes.iter().any(|h| h != &hashes[0]) {
        return Err(format!("the ranks' parameters differ after epoch {epoch}").into());
    }
    Ok(())
}
