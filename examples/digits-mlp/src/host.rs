//! The same model on host tensors (`"kernels": true`): the forward and
//! backward passes as GEMMs and element-wise kernels in the host, at native
//! speed, with the parameters, the optimizer's momentum and the gradients
//! kept there: the gradients are all-reduced and the checkpoints written
//! and read by the host. The images are copied into the host once
//! ([`HostSet`]) and each minibatch gathered there; the guest owns the loop
//! and the order of the data. A step's kernel calls are recorded once as a
//! [`Program`] and run with one call into the host a step: the example's
//! small step is mostly the cost of crossing into the host, not maths.

use std::error::Error;
use std::path::Path;

use trainhost_guest::collective::Op;
use trainhost_guest::program::{LayerGrads, Program};
use trainhost_guest::tensor::{self, Activation, Tensor, TensorError};

use crate::data::{CLASSES, PIXELS, Set};
use crate::model::{Layout, Tally};

/// A set's images as one host tensor (`[images, 64]`), and its labels;
/// `name` tells the programs recorded on one set from another's.
pub struct HostSet {
    name: &'static str,
    images: Tensor,
    labels: Vec<u32>,
}

impl HostSet {
    pub fn new(name: &'static str, set: &Set) -> Result<Self, TensorError> {
        let pixels: Vec<f32> = set.images.iter().flatten().copied().collect();
        Ok(Self {
            name,
            images: Tensor::from_slice(&[set.len() as u32, PIXELS as u32], &pixels)?,
            labels: set.labels.iter().map(|&l| u32::from(l)).collect(),
        })
    }
}

/// Parameters, momentum and gradients, in the layout's order (w1, b1, w2,
/// b2), and the steps recorded so far.
pub struct HostModel {
    hidden: u32,
    names: [&'static str; 4],
    params: Vec<Tensor>,
    velocity: Vec<Tensor>,
    grads: Vec<Tensor>,
    /// A program for each kind of step taken: a training step of a full
    /// batch and of the last, shorter one, and the validation pass.
    steps: Vec<Recorded>,
}

/// What a recorded step does: the set it gathers from, its rows, and
/// for a training step the global batch and the SGD hyperparameters.
#[derive(Clone, Copy, PartialEq)]
struct StepKind {
    set: &'static str,
    rows: usize,
    train: Option<(usize, u32, u32)>,
}

/// A recorded step and the activations its program writes.
struct Recorded {
    kind: StepKind,
    program: Program,
    /// Named by the program: kept as long as it is.
    _activations: Activations,
}

struct Activations {
    x: Tensor,
    h: Tensor,
    z: Tensor,
    dz: Tensor,
    dh: Tensor,
}

impl HostModel {
    /// The model with `params` and `velocity` laid out as `layout` says.
    pub fn new(layout: &Layout, params: &[f32], velocity: &[f32]) -> Result<Self, TensorError> {
        let load = |flat: &[f32]| -> Result<Vec<Tensor>, TensorError> {
            layout
                .tensors()
                .into_iter()
                .map(|(_, offset, shape)| {
                    let n: usize = shape.iter().product();
                    let shape: Vec<u32> = shape.iter().map(|&d| d as u32).collect();
                    Tensor::from_slice(&shape, &flat[offset..offset + n])
                })
                .collect()
        };
        Self::with(layout, load(params)?, load(velocity)?)
    }

    /// The model with these parameters and momentum, in the layout's
    /// order, and zero gradients.
    fn with(
        layout: &Layout,
        params: Vec<Tensor>,
        velocity: Vec<Tensor>,
    ) -> Result<Self, TensorError> {
        let grads = params
            .iter()
            .map(|p| Tensor::zeros(&p.shape()))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            hidden: layout.hidden as u32,
            names: layout.tensors().map(|(name, _, _)| name),
            params,
            velocity,
            grads,
            steps: Vec::new(),
        })
    }

    /// The model a checkpoint's `model.safetensors` and
    /// `optimizer.safetensors` hold (written by [`HostModel::save`] or by
    /// the guest's own code: the same files), read by the host.
    pub fn load(dir: &Path, layout: &Layout) -> Result<Self, Box<dyn Error>> {
        let read = |file: &str| -> Result<Vec<Tensor>, Box<dyn Error>> {
            let path = dir.join(file);
            let mut found = tensor::load(&path)?;
            layout
                .tensors()
                .into_iter()
                .map(|(name, _, shape)| {
                    let shape: Vec<u32> = shape.iter().map(|&d| d as u32).collect();
                    let at = found
                        .iter()
                        .position(|(n, t)| n == name && t.shape() == shape)
                        .ok_or_else(|| {
                            format!("{}: no tensor {name} of shape {shape:?}", path.display())
                        })?;
                    Ok(found.swap_remove(at).1)
                })
                .collect()
        };
        Ok(Self::with(
            layout,
            read("model.safetensors")?,
            read("optimizer.safetensors")?,
        )?)
    }

    /// Write the parameters (`model.safetensors`) and the momentum
    /// (`optimizer.safetensors`) into `dir`, from the host.
    pub fn save(&self, dir: &Path) -> Result<(), TensorError> {
        let params: Vec<(&str, &Tensor)> = self.names.into_iter().zip(&self.params).collect();
        let velocity: Vec<(&str, &Tensor)> = self.names.into_iter().zip(&self.velocity).collect();
        tensor::save(dir.join("model.safetensors"), &params)?;
        tensor::save(dir.join("optimizer.safetensors"), &velocity)
    }

    /// Forward over `indexes` of `set`: the loss and correct predictions.
    pub fn evaluate(&mut self, set: &HostSet, indexes: &[u32]) -> Result<Tally, Box<dyn Error>> {
        let kind = StepKind {
            set: set.name,
            rows: indexes.len(),
            train: None,
        };
        self.run(set, kind, indexes)
    }

    /// This rank's share (`indexes`) of a global batch of `batch` images:
    /// forward and backward over it, the gradients summed over the ranks
    /// in one all-reduce, and one SGD step with momentum along their mean.
    pub fn train_step(
        &mut self,
        set: &HostSet,
        indexes: &[u32],
        batch: usize,
        lr: f32,
        momentum: f32,
    ) -> Result<Tally, Box<dyn Error>> {
        let scale = 1.0 / batch as f32;
        if indexes.is_empty() {
            // A rank with no share of a batch adds nothing to its sum.
            self.grads.iter_mut().for_each(|g| g.scale(0.0));
            let mut grads: Vec<&mut Tensor> = self.grads.iter_mut().collect();
            tensor::all_reduce(&mut grads, Op::Sum)?;
            let mut params: Vec<&mut Tensor> = self.params.iter_mut().collect();
            let mut velocity: Vec<&mut Tensor> = self.velocity.iter_mut().collect();
            let grads: Vec<&Tensor> = self.grads.iter().collect();
            tensor::sgd_momentum(&mut params, &mut velocity, &grads, scale, lr, momentum)?;
            return Ok(Tally::default());
        }
        let kind = StepKind {
            set: set.name,
            rows: indexes.len(),
            train: Some((batch, lr.to_bits(), momentum.to_bits())),
        };
        self.run(set, kind, indexes)
    }

    /// Run the program of `kind` on `indexes`, recorded first if this is
    /// the first step of its kind.
    fn run(
        &mut self,
        set: &HostSet,
        kind: StepKind,
        indexes: &[u32],
    ) -> Result<Tally, Box<dyn Error>> {
        let at = match self.steps.iter().position(|s| s.kind == kind) {
            Some(at) => at,
            None => {
                let recorded = self.record(set, kind)?;
                self.steps.push(recorded);
                self.steps.len() - 1
            }
        };
        let losses = self.steps[at].program.run(indexes)?;
        let (loss, correct) = losses[0];
        Ok(Tally {
            loss,
            correct: u64::from(correct),
        })
    }

    /// Record a step of `kind`: the batch gathered, one call a layer each
    /// way (as when the kernels are called one by one, the fused ones), the
    /// loss, and for training the all-reduce and the SGD step.
    fn record(&self, set: &HostSet, kind: StepKind) -> Result<Recorded, TensorError> {
        let r = kind.rows as u32;
        let a = Activations {
            x: Tensor::zeros(&[r, PIXELS as u32])?,
            h: Tensor::zeros(&[r, self.hidden])?,
            z: Tensor::zeros(&[r, CLASSES as u32])?,
            dz: Tensor::zeros(&[r, CLASSES as u32])?,
            dh: Tensor::zeros(&[r, self.hidden])?,
        };
        let [w1, b1, w2, b2] = &self.params[..] else {
            unreachable!("four tensors")
        };
        let relu = Some(Activation::Relu);
        let mut p = Program::new();
        p.gather_rows(&a.x, &set.images)?;
        p.dense(&a.h, &a.x, w1, Some(b1), relu)?;
        p.dense(&a.z, &a.h, w2, Some(b2), None)?;
        p.softmax_cross_entropy(&a.z, &set.labels, &a.dz, 1.0)?;
        if let Some((batch, lr, momentum)) = kind.train {
            let [gw1, gb1, gw2, gb2] = &self.grads[..] else {
                unreachable!("four tensors")
            };
            let grads = LayerGrads {
                w: gw2,
                bias: Some(gb2),
                x: Some((&a.dh, relu)),
            };
            p.dense_backward(&a.dz, &a.h, w2, 0.0, grads)?;
            let grads = LayerGrads {
                w: gw1,
                bias: Some(gb1),
                x: None,
            };
            p.dense_backward(&a.dh, &a.x, w1, 0.0, grads)?;
            let grads: Vec<&Tensor> = self.grads.iter().collect();
            p.all_reduce(&grads, Op::Sum)?;
            let params: Vec<&Tensor> = self.params.iter().collect();
            let velocity: Vec<&Tensor> = self.velocity.iter().collect();
            let (lr, momentum) = (f32::from_bits(lr), f32::from_bits(momentum));
            p.sgd_momentum(&params, &velocity, &grads, 1.0 / batch as f32, lr, momentum)?;
        }
        Ok(Recorded {
            kind,
            program: p,
            _activations: a,
        })
    }

    /// The parameters, flat in the layout's order.
    pub fn parameters(&self) -> Vec<f32> {
        self.params.iter().flat_map(Tensor::to_vec).collect()
    }
}
