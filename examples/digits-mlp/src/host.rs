//! The same model on host tensors (`"kernels": true`): the forward and
//! backward passes as GEMMs and element-wise kernels in the host, at native
//! speed, with the parameters and the optimizer's momentum kept there. The
//! guest still owns the loop, the data and the all-reduce.

use trainhost_guest::tensor::{Activation, Tensor, TensorError};

use crate::data::{CLASSES, PIXELS, Set};
use crate::model::{Layout, Tally};

/// Parameters, momentum and gradients, in the layout's order (w1, b1, w2,
/// b2), and the activations of the last batch.
pub struct HostModel {
    hidden: u32,
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
        Ok(Self {
            hidden: layout.hidden as u32,
            params: load(params)?,
            velocity: load(velocity)?,
            grads: load(&vec![0.0; layout.len()])?,
            batch: None,
        })
    }

    /// Forward over `indexes` of `set`; with `train`, the summed loss's
    /// gradients too, into the gradient tensors.
    pub fn pass(
        &mut self,
        set: &Set,
        indexes: &[usize],
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
        let pixels: Vec<f32> = indexes.iter().flat_map(|&i| set.images[i]).collect();
        let labels: Vec<u32> = indexes.iter().map(|&i| u32::from(set.labels[i])).collect();
        let [w1, b1, w2, b2] = &self.params[..] else {
            unreachable!("four tensors")
        };
        b.x.assign(&pixels)?;
        b.h.gemm(1.0, &b.x, false, w1, false, 0.0)?;
        b.h.add_row(b1)?;
        b.h.activate(Activation::Relu);
        b.z.gemm(1.0, &b.h, false, w2, false, 0.0)?;
        b.z.add_row(b2)?;
        let (loss, correct) = b.z.softmax_cross_entropy(&labels, &mut b.dz, 1.0)?;
        if train {
            let [gw1, gb1, gw2, gb2] = &mut self.grads[..] else {
                unreachable!("four tensors")
            };
            gw2.gemm(1.0, &b.h, true, &b.dz, false, 0.0)?;
            gb2.sum_rows(&b.dz, 0.0)?;
            b.dh.gemm(1.0, &b.dz, false, w2, true, 0.0)?;
            b.dh.activate_backward(&b.h, Activation::Relu)?;
            gw1.gemm(1.0, &b.x, true, &b.dh, false, 0.0)?;
            gb1.sum_rows(&b.dh, 0.0)?;
        }
        Ok(Tally {
            loss,
            correct: u64::from(correct),
        })
    }

    /// The gradients, flat in the layout's order.
    pub fn gradients(&self, flat: &mut Vec<f32>) {
        flat.clear();
        for g in &self.grads {
            flat.extend(g.to_vec());
        }
    }

    /// Take an SGD step with momentum along `flat` (every rank's summed
    /// gradient) times `scale`.
    pub fn step(
        &mut self,
        flat: &[f32],
        scale: f32,
        lr: f32,
        momentum: f32,
    ) -> Result<(), TensorError> {
        let mut offset = 0;
        for ((p, v), g) in self
            .params
            .iter_mut()
            .zip(&mut self.velocity)
            .zip(&mut self.grads)
        {
            let n: usize = g.shape().iter().map(|&d| d as usize).product();
            g.assign(&flat[offset..offset + n])?;
            g.scale(scale);
            p.sgd_momentum(v, g, lr, momentum)?;
            offset += n;
        }
        Ok(())
    }

    /// The parameters and the momentum, flat in the layout's order.
    pub fn state(&self) -> (Vec<f32>, Vec<f32>) {
        let flat = |ts: &[Tensor]| ts.iter().flat_map(Tensor::to_vec).collect();
        (flat(&self.params), flat(&self.velocity))
    }
}
