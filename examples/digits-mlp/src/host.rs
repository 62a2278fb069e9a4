//! The same model on host tensors (`"kernels": true`): the forward and
//! backward passes as GEMMs and element-wise kernels in the host, at native
//! speed, with the parameters, the optimizer's momentum and the gradients
//! kept there: the gradients are all-reduced and the checkpoints written
//! and read by the host. The images are copied into the host once
//! ([`HostSet`]) and each minibatch gathered there; the guest owns the loop
//! and the order of the data.

use std::error::Error;
use std::path::Path;

use trainhost_guest::collective::{CollectiveError, Op};
use trainhost_guest::tensor::{self, Activation, DenseGrads, Tensor, TensorError};

use crate::data::{CLASSES, PIXELS, Set};
use crate::model::{Layout, Tally};

/// A set's images as one host tensor (`[images, 64]`), and its labels.
pub struct HostSet {
    images: Tensor,
    labels: Vec<u32>,
}

impl HostSet {
    pub fn new(set: &Set) -> Result<Self, TensorError> {
        let pixels: Vec<f32> = set.images.iter().flatten().copied().collect();
        Ok(Self {
            images: Tensor::from_slice(&[set.len() as u32, PIXELS as u32], &pixels)?,
            labels: set.labels.iter().map(|&l| u32::from(l)).collect(),
        })
    }
}

/// Parameters, momentum and gradients, in the layout's order (w1, b1, w2,
/// b2), and the activations of the last batch.
pub struct HostModel {
    hidden: u32,
    names: [&'static str; 4],
    params: Vec<Tensor>,
    velocity: Vec<Tensor>,
    grads: Vec<Tensor>,
    /// The activations of a batch, kept while batches keep their size.
    batch: Option<Activations>,
}

struct Activations {
    rows: usize,
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
            batch: None,
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

    /// Forward over `indexes` of `set`; with `train`, the summed loss's
    /// gradients too, into the gradient tensors.
    pub fn pass(
        &mut self,
        set: &HostSet,
        indexes: &[u32],
        train: bool,
    ) -> Result<Tally, TensorError> {
        let rows = indexes.len();
        if self.batch.as_ref().is_none_or(|b| b.rows != rows) {
            let r = rows as u32;
            self.batch = Some(Activations {
                rows,
                x: Tensor::zeros(&[r, PIXELS as u32])?,
                h: Tensor::zeros(&[r, self.hidden])?,
                z: Tensor::zeros(&[r, CLASSES as u32])?,
                dz: Tensor::zeros(&[r, CLASSES as u32])?,
                dh: Tensor::zeros(&[r, self.hidden])?,
            });
        }
        let b = self.batch.as_mut().expect("made above");
        let labels: Vec<u32> = indexes.iter().map(|&i| set.labels[i as usize]).collect();
        let [w1, b1, w2, b2] = &self.params[..] else {
            unreachable!("four tensors")
        };
        // One call a layer each way, one for the loss: a call into the host
        // costs more than a small layer's maths.
        let relu = Some(Activation::Relu);
        b.x.gather_rows(&set.images, indexes)?;
        b.h.dense(&b.x, w1, Some(b1), relu)?;
        b.z.dense(&b.h, w2, Some(b2), None)?;
        let (loss, correct) = b.z.softmax_cross_entropy(&labels, &mut b.dz, 1.0)?;
        if train {
            let [gw1, gb1, gw2, gb2] = &mut self.grads[..] else {
                unreachable!("four tensors")
            };
            let grads = DenseGrads {
                w: gw2,
                bias: Some(gb2),
                x: Some((&mut b.dh, relu)),
            };
            tensor::dense_backward(&b.dz, &b.h, w2, 0.0, grads)?;
            let grads = DenseGrads {
                w: gw1,
                bias: Some(gb1),
                x: None,
            };
            tensor::dense_backward(&b.dh, &b.x, w1, 0.0, grads)?;
        }
        Ok(Tally {
            loss,
            correct: u64::from(correct),
        })
    }

    /// Zero gradients: a rank with no share of a batch adds nothing.
    pub fn zero_gradients(&mut self) {
        self.grads.iter_mut().for_each(|g| g.scale(0.0));
    }

    /// Sum every rank's gradients, in the host, in one all-reduce.
    pub fn all_reduce_gradients(&mut self) -> Result<(), CollectiveError> {
        let mut grads: Vec<&mut Tensor> = self.grads.iter_mut().collect();
        tensor::all_reduce(&mut grads, Op::Sum)
    }

    /// Take an SGD step with momentum along the gradients times `scale`,
    /// for every tensor in one call.
    pub fn step(&mut self, scale: f32, lr: f32, momentum: f32) -> Result<(), TensorError> {
        let mut params: Vec<&mut Tensor> = self.params.iter_mut().collect();
        let mut velocity: Vec<&mut Tensor> = self.velocity.iter_mut().collect();
        let grads: Vec<&Tensor> = self.grads.iter().collect();
        tensor::sgd_momentum(&mut params, &mut velocity, &grads, scale, lr, momentum)
    }

    /// The parameters, flat in the layout's order.
    pub fn parameters(&self) -> Vec<f32> {
        self.params.iter().flat_map(Tensor::to_vec).collect()
    }
}
