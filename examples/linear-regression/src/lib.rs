//! Ray Train's checkpointing example, ported to a trainhost guest.
//!
//! A 4 → 1 linear model is trained with Adam on mean squared error over
//! synthetic data, one full-batch step per epoch. Every `checkpoint_freq`
//! epochs the loop saves the weights (safetensors), the optimizer state and
//! the epoch into its scratch directory and reports `loss` and `epoch`
//! with it. On start it resumes from `get_checkpoint()`.
//!
//! Two checkpointing styles, as in Ray's guide:
//! - default (DDP style): every rank holds the same model, so rank 0 alone
//!   saves `model.safetensors` and `optimizer.safetensors`;
//! - `"sharded": true` (distributed checkpointing): the parameters are
//!   split across ranks, and each rank saves its own slice as
//!   `model-rank={rank}.safetensors`; trainhost merges the ranks' files into
//!   one checkpoint.
//!
//! Config (all optional): `num_epochs` (5), `checkpoint_freq` (1), `lr`
//! (0.05), `num_samples` (100), `seed` (0), `sharded` (false),
//! `fail_at_epoch` (none: panic at that epoch unless resumed from a
//! checkpoint, to show crash recovery), `fail_every` (0: none; panic at
//! the first multiple of it once an attempt has run that many epochs, so
//! that, with `checkpoint_freq` at most `fail_every`, every attempt
//! commits a checkpoint before it fails and a run with `--max-failures
//! -1` gets to the end), `padding_mb` (0: extra MiB saved
//! with every checkpoint, standing in for a larger model), `hand_over`
//! (false: hand each checkpoint directory over to the host instead of
//! letting it copy the files; the loop writes every checkpoint afresh).
//!
//! On preemption (`preemption_requested()`, e.g. after SIGTERM to the
//! host) the loop makes sure the epoch it just finished is checkpointed,
//! then returns; running the same command again resumes after it.
//!
//! Every rank trains on the whole (identical, seeded) data set, so the
//! ranks' models stay identical without communicating; the example is about
//! checkpointing (both styles, preemption, hand-over). `examples/digits-mlp`
//! shows data-parallel training, with gradients all-reduced every step.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use trainhost_guest::{Checkpoint, Metrics};

/// The number of input features.
const FEATURES: usize = 4;
/// Weights then bias, flattened: the unit that shards split.
const PARAMS: usize = FEATURES + 1;

#[derive(Deserialize)]
#[serde(default)]
struct Config {
    num_epochs: u32,
    checkpoint_freq: u32,
    lr: f32,
    num_samples: usize,
    seed: u64,
    sharded: bool,
    fail_at_epoch: Option<u32>,
    /// Fail at a multiple of this many epochs once an attempt has run as
    /// many (0: never). The crash campaign uses it for kills that land in
    /// restarts.
    fail_every: u32,
    /// Extra MiB saved with every checkpoint, standing in for a larger
    /// model (benchmarks and the crash campaign use it).
    padding_mb: u32,
    /// Hand checkpoint directories over instead of having them copied.
    hand_over: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            num_epochs: 5,
            checkpoint_freq: 1,
            lr: 0.05,
            num_samples: 100,
            seed: 0,
            sharded: false,
            fail_at_epoch: None,
            fail_every: 0,
            padding_mb: 0,
            hand_over: false,
        }
    }
}

/// What a checkpoint says besides the tensors.
#[derive(Serialize, Deserialize)]
struct Meta {
    epoch: u32,
    step: u64,
    world_size: u32,
}

/// Parameters and Adam's state, flattened the same way.
struct State {
    params: [f32; PARAMS],
    exp_avg: [f32; PARAMS],
    exp_avg_sq: [f32; PARAMS],
    step: u64,
}

fn train(config: Config) -> Result<(), Box<dyn std::error::Error>> {
    if config.checkpoint_freq == 0 {
        return Err("checkpoint_freq must be at least 1".into());
    }
    let rank = trainhost_guest::world_rank();
    let (x, y) = dataset(config.num_samples, config.seed);

    let (mut state, start_epoch) = match trainhost_guest::get_checkpoint() {
        Some(checkpoint) => {
            let (state, meta) = load(checkpoint.path())?;
            println!(
                "resuming from {} after epoch {}",
                checkpoint.path().display(),
                meta.epoch
            );
            (state, meta.epoch + 1)
        }
        None => (State::init(config.seed), 0),
    };
    let resumed = start_epoch > 0;

    for epoch in start_epoch..config.num_epochs {
        if config.fail_at_epoch == Some(epoch) && !resumed {
            panic!("injected failure at epoch {epoch} (fail_at_epoch)");
        }
        if config.fail_every > 0
            && epoch % config.fail_every == 0
            && epoch >= start_epoch + config.fail_every
        {
            panic!("injected failure at epoch {epoch} (fail_every)");
        }
        let loss = state.adam_step(&x, &y, config.lr);
        if rank == 0 {
            println!("epoch {epoch}: loss {loss:.6}");
        }

        let dir = trainhost_guest::scratch_dir().join("checkpoint");
        let should_checkpoint =
            epoch % config.checkpoint_freq == 0 || epoch + 1 == config.num_epochs;
        // DDP style: the model is the same everywhere, rank 0 saves it.
        // Sharded: every rank saves its own slice.
        let saves = config.sharded || rank == 0;
        let my_checkpoint = || -> Result<Option<Checkpoint>, Box<dyn std::error::Error>> {
            if saves {
                let saved = save(&dir, &state, epoch, config.sharded, config.padding_mb)?;
                Ok(Some(if config.hand_over {
                    saved.hand_over()
                } else {
                    saved
                }))
            } else {
                Ok(None)
            }
        };
        let metrics = Metrics::new().with("loss", loss).with("epoch", epoch);
        let checkpoint = if should_checkpoint {
            my_checkpoint()?
        } else {
            None
        };
        trainhost_guest::report(metrics.clone(), checkpoint)?;

        // Preemption turns true on every rank after the same report, so all
        // ranks take this branch together.
        if trainhost_guest::preemption_requested() {
            if !should_checkpoint {
                trainhost_guest::report(metrics, my_checkpoint()?)?;
            }
            if rank == 0 {
                println!("preempted after epoch {epoch}; its checkpoint is committed");
            }
            return Ok(());
        }
    }
    Ok(())
}

/// Write this rank's checkpoint of `state` after `epoch` into `dir`.
fn save(
    dir: &Path,
    state: &State,
    epoch: u32,
    sharded: bool,
    padding_mb: u32,
) -> Result<Checkpoint, Box<dyn std::error::Error>> {
    let rank = trainhost_guest::world_rank();
    let world = trainhost_guest::world_size();
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    if sharded {
        save_shard(dir, state, rank, world)?;
    } else {
        save_full(dir, state)?;
    }
    // In sharded mode every rank writes identical meta.json bytes;
    // trainhost accepts identical files from several ranks.
    let meta = Meta {
        epoch,
        step: state.step,
        world_size: world,
    };
    fs::write(dir.join("meta.json"), serde_json::to_vec(&meta)?)?;
    if padding_mb > 0 {
        // Different bytes every epoch, as real weights would be.
        let byte = (epoch % 251) as u8;
        fs::write(
            dir.join(format!("padding-rank={rank}.bin")),
            vec![byte; padding_mb as usize * 1024 * 1024],
        )?;
    }
    Ok(Checkpoint::from_directory(dir))
}

trainhost_guest::entry!(train);

impl State {
    fn init(seed: u64) -> Self {
        // Small random weights, as nn.Linear initializes them.
        let mut rng = Rng::new(seed ^ 0x5eed);
        let bound = 1.0 / (FEATURES as f32).sqrt();
        let mut params = [0.0; PARAMS];
        for p in &mut params {
            *p = (rng.uniform() * 2.0 - 1.0) * bound;
        }
        Self {
            params,
            exp_avg: [0.0; PARAMS],
            exp_avg_sq: [0.0; PARAMS],
            step: 0,
        }
    }

    /// One full-batch Adam step on MSE; returns the loss before the step.
    fn adam_step(&mut self, x: &[[f32; FEATURES]], y: &[f32], lr: f32) -> f32 {
        const BETA1: f32 = 0.9;
        const BETA2: f32 = 0.999;
        const EPS: f32 = 1e-8;
        let n = x.len() as f32;
        let mut grad = [0.0f32; PARAMS];
        let mut loss = 0.0f32;
        for (xi, yi) in x.iter().zip(y) {
            let pred: f32 = xi.iter().zip(&self.params).map(|(a, w)| a * w).sum::<f32>()
                + self.params[FEATURES];
            let err = pred - yi;
            loss += err * err;
            for (g, a) in grad.iter_mut().zip(xi) {
                *g += 2.0 * err * a / n;
            }
            grad[FEATURES] += 2.0 * err / n;
        }
        self.step += 1;
        let t = self.step as i32;
        #[expect(
            clippy::needless_range_loop,
            reason = "Adam updates four parallel arrays; indexing reads like the algorithm"
        )]
        for i in 0..PARAMS {
            self.exp_avg[i] = BETA1 * self.exp_avg[i] + (1.0 - BETA1) * grad[i];
            self.exp_avg_sq[i] = BETA2 * self.exp_avg_sq[i] + (1.0 - BETA2) * grad[i] * grad[i];
            let m_hat = self.exp_avg[i] / (1.0 - BETA1.powi(t));
            let v_hat = self.exp_avg_sq[i] / (1.0 - BETA2.powi(t));
            self.params[i] -= lr * m_hat / (v_hat.sqrt() + EPS);
        }
        loss / n
    }
}

/// `num_samples` inputs from N(0, 1) and targets from a fixed linear
/// function plus noise, the same on every rank for a given seed.
fn dataset(num_samples: usize, seed: u64) -> (Vec<[f32; FEATURES]>, Vec<f32>) {
    const TRUE_W: [f32; FEATURES] = [0.5, -1.0, 2.0, 0.1];
    const TRUE_B: f32 = 0.3;
    let mut rng = Rng::new(seed);
    let mut x = Vec::with_capacity(num_samples);
    let mut y = Vec::with_capacity(num_samples);
    for _ in 0..num_samples {
        let mut xi = [0.0f32; FEATURES];
        for v in &mut xi {
            *v = rng.normal();
        }
        let target =
            xi.iter().zip(TRUE_W).map(|(a, w)| a * w).sum::<f32>() + TRUE_B + 0.1 * rng.normal();
        x.push(xi);
        y.push(target);
    }
    (x, y)
}

fn tensor_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn floats(view: &TensorView<'_>) -> Result<Vec<f32>, String> {
    if view.dtype() != Dtype::F32 {
        return Err(format!("expected f32 tensor, found {:?}", view.dtype()));
    }
    Ok(view
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn write_tensors(
    path: &Path,
    tensors: &[(&str, Vec<usize>, Vec<u8>)],
) -> Result<(), Box<dyn std::error::Error>> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, data)| {
            Ok((
                (*name).to_owned(),
                TensorView::new(Dtype::F32, shape.clone(), data)?,
            ))
        })
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    fs::write(
        path,
        safetensors::serialize(views, None::<HashMap<String, String>>)?,
    )?;
    Ok(())
}

/// DDP style: the whole model and optimizer, saved by rank 0.
fn save_full(dir: &Path, s: &State) -> Result<(), Box<dyn std::error::Error>> {
    write_tensors(
        &dir.join("model.safetensors"),
        &[
            (
                "weight",
                vec![1, FEATURES],
                tensor_bytes(&s.params[..FEATURES]),
            ),
            ("bias", vec![1], tensor_bytes(&s.params[FEATURES..])),
        ],
    )?;
    write_tensors(
        &dir.join("optimizer.safetensors"),
        &[
            ("exp_avg", vec![PARAMS], tensor_bytes(&s.exp_avg)),
            ("exp_avg_sq", vec![PARAMS], tensor_bytes(&s.exp_avg_sq)),
        ],
    )
}

/// The slice of the flattened parameters rank `rank` of `world` owns.
fn shard_range(rank: u32, world: u32) -> std::ops::Range<usize> {
    let (rank, world) = (rank as usize, world as usize);
    let per = PARAMS.div_ceil(world);
    (rank * per).min(PARAMS)..((rank + 1) * per).min(PARAMS)
}

/// Distributed checkpointing: each rank saves the parameters and optimizer
/// state of its own slice.
fn save_shard(
    dir: &Path,
    s: &State,
    rank: u32,
    world: u32,
) -> Result<(), Box<dyn std::error::Error>> {
    let r = shard_range(rank, world);
    write_tensors(
        &dir.join(format!("model-rank={rank}.safetensors")),
        &[
            ("param", vec![r.len()], tensor_bytes(&s.params[r.clone()])),
            (
                "exp_avg",
                vec![r.len()],
                tensor_bytes(&s.exp_avg[r.clone()]),
            ),
            ("exp_avg_sq", vec![r.len()], tensor_bytes(&s.exp_avg_sq[r])),
        ],
    )
}

/// Load either checkpoint style.
fn load(dir: &Path) -> Result<(State, Meta), Box<dyn std::error::Error>> {
    let meta: Meta = serde_json::from_slice(&fs::read(dir.join("meta.json"))?)?;
    let mut state = State {
        params: [0.0; PARAMS],
        exp_avg: [0.0; PARAMS],
        exp_avg_sq: [0.0; PARAMS],
        step: meta.step,
    };
    if dir.join("model.safetensors").exists() {
        let model = fs::read(dir.join("model.safetensors"))?;
        let model = SafeTensors::deserialize(&model)?;
        state.params[..FEATURES].copy_from_slice(&floats(&model.tensor("weight")?)?);
        state.params[FEATURES..].copy_from_slice(&floats(&model.tensor("bias")?)?);
        let opt = fs::read(dir.join("optimizer.safetensors"))?;
        let opt = SafeTensors::deserialize(&opt)?;
        state
            .exp_avg
            .copy_from_slice(&floats(&opt.tensor("exp_avg")?)?);
        state
            .exp_avg_sq
            .copy_from_slice(&floats(&opt.tensor("exp_avg_sq")?)?);
    } else {
        // Reassemble the slices every rank saved; the world size that wrote
        // them decides the slicing, whatever ours is now.
        for rank in 0..meta.world_size {
            let r = shard_range(rank, meta.world_size);
            let bytes = fs::read(dir.join(format!("model-rank={rank}.safetensors")))?;
            let shard = SafeTensors::deserialize(&bytes)?;
            state.params[r.clone()].copy_from_slice(&floats(&shard.tensor("param")?)?);
            state.exp_avg[r.clone()].copy_from_slice(&floats(&shard.tensor("exp_avg")?)?);
            state.exp_avg_sq[r].copy_from_slice(&floats(&shard.tensor("exp_avg_sq")?)?);
        }
    }
    Ok((state, meta))
}

/// xorshift64*, with Box-Muller for normals: deterministic and small.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(f32::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }
}
