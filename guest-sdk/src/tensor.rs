//! Tensors that live in the host, and kernels that compute on them at
//! native speed while the loop stays in the guest (WIT interface
//! `tensors`, since `trainhost:train@0.1.3`; Adam, [`all_reduce`] of
//! several tensors, [`Tensor::broadcast`], [`save`] and [`load`] since
//! 0.1.4; [`Tensor::gather_rows`] since 0.1.5; the fused
//! [`Tensor::dense`], [`dense_backward`] and [`sgd_momentum`] since 0.1.6;
//! recorded programs, [`crate::program`], since 0.1.7).
//!
//! A [`Tensor`] is f32, row-major, of rank 1 (`[n]`) or 2
//! (`[rows, cols]`). Its values stay in the host: build it from a slice
//! once, run the kernels on it, and read it back only when needed
//! ([`Tensor::to_vec`]). Its bytes, and 128 bytes for the host's own
//! record of it, count against the rank's memory limit with the rank's
//! linear memory; dropping it frees them. A kernel checks
//! its arguments and returns a [`TensorError`] without changing anything
//! on a bad call. A rank whose run is stopping is stopped at its next
//! kernel, and inside a long GEMM within about 10 ms. On x86-64 hosts the
//! kernels read subnormal values (below about 1.2e-38 in magnitude) as
//! zero and write zero for subnormal results, as CPU training kernels
//! commonly do: once a model fits its data, values that decay towards
//! zero would otherwise make its steps about three times slower there.
//! The guest's own arithmetic is unchanged.
//!
//! Kernels write into the tensor they are called on (`&mut self`), so a
//! training step allocates nothing once its tensors exist:
//!
//! ```no_run
//! use trainhost_guest::tensor::{Activation, Tensor};
//!
//! # fn main() -> Result<(), trainhost_guest::tensor::TensorError> {
//! let x = Tensor::from_slice(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?;
//! let w = Tensor::uniform(&[3, 4], -0.5, 0.5, 42)?;
//! let b = Tensor::zeros(&[4])?;
//! let mut h = Tensor::zeros(&[2, 4])?;
//! h.gemm(1.0, &x, false, &w, false, 0.0)?; // h = x · w
//! h.add_row(&b)?;
//! h.activate(Activation::Relu);
//! println!("{:?}", h.to_vec());
//! h.dense(&x, &w, Some(&b), Some(Activation::Relu))?; // the same, one call
//! # Ok(())
//! # }
//! ```
//!
//! Every call into the host costs ~150 ns (lending and checking the
//! handles, the stop check), a good part of a small model's step, so such
//! a step goes fastest on the fused calls: [`Tensor::dense`] for a layer's
//! forward pass, [`dense_backward`] for its backward pass and
//! [`sgd_momentum`] for the whole optimizer step, each with the values the
//! separate kernels give; and a whole step goes fastest as a
//! [`crate::program::Program`], recorded once and run with one call.

use std::fmt;
use std::path::Path;

use crate::collective::{CollectiveError, Op};
use crate::wit::trainhost::train::tensors as wit;

pub use wit::Activation;
/// Adam's hyperparameters for one step ([`Tensor::adam`]);
/// [`AdamStep::new`] fills in the usual betas and epsilon.
pub use wit::AdamStep;

impl AdamStep {
    /// Step `step` (from 1) with learning rate `lr` and the betas and
    /// epsilon of the Adam paper, PyTorch and burn: 0.9, 0.999, 1e-8.
    pub fn new(lr: f32, step: u32) -> Self {
        Self {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            step,
        }
    }
}

/// Why a kernel refused a call. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TensorError {
    /// The shapes do not fit the kernel, or the data does not fill the
    /// shape.
    Shape(String),
    /// The tensor would take the rank past its memory limit.
    OutOfMemory(String),
    /// Another argument is out of range, or a kernel was asked to write a
    /// tensor it also reads.
    Invalid(String),
}

impl fmt::Display for TensorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorError::Shape(m) | TensorError::Invalid(m) => f.write_str(m),
            TensorError::OutOfMemory(m) => write!(f, "out of memory: {m}"),
        }
    }
}

impl std::error::Error for TensorError {}

impl From<wit::TensorError> for TensorError {
    fn from(e: wit::TensorError) -> Self {
        match e {
            wit::TensorError::Shape(m) => TensorError::Shape(m),
            wit::TensorError::OutOfMemory(m) => TensorError::OutOfMemory(m),
            wit::TensorError::Invalid(m) => TensorError::Invalid(m),
        }
    }
}

/// An f32 tensor in the host, of rank 1 or 2, row-major.
#[derive(Debug)]
pub struct Tensor(pub(crate) wit::Tensor);

impl Tensor {
    /// A tensor of `shape` holding `data` (row-major).
    pub fn from_slice(shape: &[u32], data: &[f32]) -> Result<Self, TensorError> {
        Ok(Self(wit::Tensor::from_list(shape, data)?))
    }

    /// A tensor of `shape` full of zeros.
    pub fn zeros(shape: &[u32]) -> Result<Self, TensorError> {
        Ok(Self(wit::Tensor::zeros(shape)?))
    }

    /// A tensor of `shape` drawn uniformly from `[low, high)` by a
    /// generator seeded with `seed`: the same values on every host, so
    /// ranks seeded alike start from the same weights.
    pub fn uniform(shape: &[u32], low: f32, high: f32, seed: u64) -> Result<Self, TensorError> {
        Ok(Self(wit::Tensor::uniform(shape, low, high, seed)?))
    }

    /// The shape.
    pub fn shape(&self) -> Vec<u32> {
        self.0.shape()
    }

    /// A copy of the values, row-major.
    pub fn to_vec(&self) -> Vec<f32> {
        self.0.to_list()
    }

    /// Overwrite the values with `data`, which must fill the shape.
    pub fn assign(&mut self, data: &[f32]) -> Result<(), TensorError> {
        Ok(self.0.assign(data)?)
    }

    /// GEMM: `self = alpha * op(a) * op(b) + beta * self`, where op
    /// transposes its argument when `trans_a` / `trans_b` say so.
    pub fn gemm(
        &mut self,
        alpha: f32,
        a: &Tensor,
        trans_a: bool,
        b: &Tensor,
        trans_b: bool,
        beta: f32,
    ) -> Result<(), TensorError> {
        Ok(wit::gemm(
            &self.0, alpha, &a.0, trans_a, &b.0, trans_b, beta,
        )?)
    }

    /// `self = self + alpha * x` (same shapes).
    pub fn axpy(&mut self, alpha: f32, x: &Tensor) -> Result<(), TensorError> {
        Ok(wit::axpy(&self.0, alpha, &x.0)?)
    }

    /// `self = alpha * self`.
    pub fn scale(&mut self, alpha: f32) {
        wit::scale(&self.0, alpha);
    }

    /// Row k of `self` (`[rows.len(), cols]`) = row `rows[k]` of `source`
    /// (`[n, cols]`): a minibatch taken from a dataset kept in the host,
    /// its values never crossing into the guest. Since 0.1.5.
    pub fn gather_rows(&mut self, source: &Tensor, rows: &[u32]) -> Result<(), TensorError> {
        Ok(wit::gather_rows(&self.0, &source.0, rows)?)
    }

    /// Add `row` (`[cols]`) to every row of `self` (`[rows, cols]`).
    pub fn add_row(&mut self, row: &Tensor) -> Result<(), TensorError> {
        Ok(wit::add_row(&self.0, &row.0)?)
    }

    /// `self = beta * self + the sum of x's rows` (`x`: `[rows, cols]`,
    /// `self`: `[cols]`): a bias's gradient.
    pub fn sum_rows(&mut self, x: &Tensor, beta: f32) -> Result<(), TensorError> {
        Ok(wit::sum_rows(&self.0, &x.0, beta)?)
    }

    /// `self = f(self)`, element by element.
    pub fn activate(&mut self, f: Activation) {
        wit::activate(&self.0, f);
    }

    /// Back through an activation: `self = self * f'`, with `f'` taken
    /// from `output = f(input)`.
    pub fn activate_backward(&mut self, output: &Tensor, f: Activation) -> Result<(), TensorError> {
        Ok(wit::activate_backward(&self.0, &output.0, f)?)
    }

    /// A dense layer's forward pass in one call into the host:
    /// `self = f(x · w + bias)` (`x`: `[rows, in]`, `w`: `[in, out]`,
    /// `bias`: `[out]`, `self`: `[rows, out]`), without the bias or the
    /// function when `None`. The values of [`Tensor::gemm`],
    /// [`Tensor::add_row`] and [`Tensor::activate`]. Since 0.1.6.
    pub fn dense(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        f: Option<Activation>,
    ) -> Result<(), TensorError> {
        Ok(wit::dense(&self.0, &x.0, &w.0, bias.map(|b| &b.0), f)?)
    }

    /// Softmax cross-entropy of these logits (`[rows, classes]`) against
    /// `labels`: the summed loss and the number of rows whose largest
    /// logit is their label; `grad` (the same shape) receives the gradient
    /// of the summed loss times `grad_scale`.
    pub fn softmax_cross_entropy(
        &self,
        labels: &[u32],
        grad: &mut Tensor,
        grad_scale: f32,
    ) -> Result<(f64, u32), TensorError> {
        Ok(wit::softmax_cross_entropy(
            &self.0, labels, &grad.0, grad_scale,
        )?)
    }

    /// SGD with momentum on these parameters: `velocity = momentum *
    /// velocity + grad`, `self = self - lr * velocity`.
    pub fn sgd_momentum(
        &mut self,
        velocity: &mut Tensor,
        grad: &Tensor,
        lr: f32,
        momentum: f32,
    ) -> Result<(), TensorError> {
        Ok(wit::sgd_momentum(
            &self.0,
            &velocity.0,
            &grad.0,
            lr,
            momentum,
        )?)
    }

    /// Adam on these parameters, in place, with its moments `m` and `v`
    /// (zeros before the first step, the same shape):
    /// `m = beta1 * m + (1 - beta1) * grad`,
    /// `v = beta2 * v + (1 - beta2) * grad^2`,
    /// `self = self - lr * m' / (sqrt(v') + epsilon)` with the
    /// bias-corrected `m' = m / (1 - beta1^step)` and
    /// `v' = v / (1 - beta2^step)`.
    pub fn adam(
        &mut self,
        m: &mut Tensor,
        v: &mut Tensor,
        grad: &Tensor,
        hyper: AdamStep,
    ) -> Result<(), TensorError> {
        Ok(wit::adam(&self.0, &m.0, &v.0, &grad.0, hyper)?)
    }

    /// Replace the values with those of rank `root`'s tensor, in place in
    /// the host. Collective, matched with
    /// [`crate::collective::broadcast`] from the same root. Every rank's
    /// tensor must hold as many values as the root's: a rank whose does
    /// not is stopped and the run fails. On an error the values are
    /// unchanged.
    pub fn broadcast(&mut self, root: u32) -> Result<(), CollectiveError> {
        wit::broadcast(&self.0, root).map_err(CollectiveError::from)
    }

    /// The element-wise combination of every rank's tensor, in place in
    /// the host: the values never cross into the guest. Collective like
    /// [`crate::collective::all_reduce`], and matched with its calls (the
    /// k-th collective call of every rank must be an all-reduce of as many
    /// f32 with the same `op`). On an error the tensor holds zeros.
    pub fn all_reduce(&mut self, op: Op) -> Result<(), CollectiveError> {
        wit::all_reduce(&self.0, op.into()).map_err(CollectiveError::from)
    }
}

/// [`Tensor::all_reduce`] of several tensors in one collective call, as
/// one all-reduce of their values one after the other (matched with a list
/// all-reduce of as many f32): one round for all of a model's gradients.
/// A tensor must not be listed twice. On an error every tensor holds zeros.
pub fn all_reduce(tensors: &mut [&mut Tensor], op: Op) -> Result<(), CollectiveError> {
    let handles: Vec<&wit::Tensor> = tensors.iter().map(|t| &t.0).collect();
    wit::all_reduce_list(&handles, op.into()).map_err(CollectiveError::from)
}

/// Where [`dense_backward`] writes: the gradient of a layer's weights,
/// and optionally of its bias and of its input.
#[derive(Debug)]
pub struct DenseGrads<'a> {
    /// `[in, out]`, like the weights.
    pub w: &'a mut Tensor,
    /// `[out]`, like the bias.
    pub bias: Option<&'a mut Tensor>,
    /// `[rows, in]`, like the input, and the activation the input came out
    /// of (the previous layer's), which this gradient is taken back
    /// through: it is then the `grad` of that layer's own backward pass.
    pub x: Option<(&'a mut Tensor, Option<Activation>)>,
}

/// A dense layer's backward pass in one call into the host. `grad`
/// (`[rows, out]`) is the loss's gradient at the layer's `x · w + bias`
/// (after its own activation); writes `grads.w = beta * grads.w + xᵀ ·
/// grad`, `grads.bias = beta * grads.bias + the sum of grad's rows`, and
/// `grads.x = (grad · wᵀ) * f'` with `f'` from the activation `x` came out
/// of. The values of [`Tensor::gemm`], [`Tensor::sum_rows`],
/// [`Tensor::gemm`] and [`Tensor::activate_backward`]. Every shape is
/// checked before anything is written. Since 0.1.6.
///
/// ```no_run
/// # use trainhost_guest::tensor::{Activation, DenseGrads, Tensor, dense_backward};
/// # fn main() -> Result<(), trainhost_guest::tensor::TensorError> {
/// # let t = |s: &[u32]| Tensor::zeros(s);
/// # let (x, h, w1, w2, dz) = (t(&[8, 4])?, t(&[8, 16])?, t(&[4, 16])?, t(&[16, 3])?, t(&[8, 3])?);
/// # let (mut gw1, mut gb1, mut gw2, mut gb2, mut dh) = (t(&[4, 16])?, t(&[16])?, t(&[16, 3])?, t(&[3])?, t(&[8, 16])?);
/// // h = relu(x · w1 + b1), z = h · w2 + b2, dz the loss's gradient at z.
/// let relu = Some(Activation::Relu);
/// let grads = DenseGrads { w: &mut gw2, bias: Some(&mut gb2), x: Some((&mut dh, relu)) };
/// dense_backward(&dz, &h, &w2, 0.0, grads)?;
/// let grads = DenseGrads { w: &mut gw1, bias: Some(&mut gb1), x: None };
/// dense_backward(&dh, &x, &w1, 0.0, grads)?;
/// # Ok(())
/// # }
/// ```
pub fn dense_backward(
    grad: &Tensor,
    x: &Tensor,
    w: &Tensor,
    beta: f32,
    grads: DenseGrads<'_>,
) -> Result<(), TensorError> {
    let (grad_x, x_f) = match grads.x {
        Some((t, f)) => (Some(&t.0), f),
        None => (None, None),
    };
    Ok(wit::dense_backward(
        &grad.0,
        &x.0,
        &w.0,
        beta,
        &grads.w.0,
        grads.bias.map(|b| &b.0),
        grad_x,
        x_f,
    )?)
}

/// [`Tensor::sgd_momentum`] of every tensor of a model in one call into
/// the host, each gradient times `grad_scale` (where a sum over a batch
/// becomes a mean): `velocity[i] = momentum * velocity[i] + grad_scale *
/// grads[i]`, `params[i] = params[i] - lr * velocity[i]`. The gradients
/// are not changed. Every triple is checked before any is written; a
/// tensor written must appear once and not among the gradients. Since
/// 0.1.6.
pub fn sgd_momentum(
    params: &mut [&mut Tensor],
    velocity: &mut [&mut Tensor],
    grads: &[&Tensor],
    grad_scale: f32,
    lr: f32,
    momentum: f32,
) -> Result<(), TensorError> {
    let params: Vec<&wit::Tensor> = params.iter().map(|t| &t.0).collect();
    let velocity: Vec<&wit::Tensor> = velocity.iter().map(|t| &t.0).collect();
    let grads: Vec<&wit::Tensor> = grads.iter().map(|t| &t.0).collect();
    Ok(wit::sgd_momentum_list(
        &params, &velocity, &grads, grad_scale, lr, momentum,
    )?)
}

/// Write `tensors` under their names into the safetensors file `path`
/// (f32, little-endian; readable by the `safetensors` crate, PyTorch's
/// `safetensors.torch.load_file` and [`load`]). The host writes the file
/// from its own memory: a large model costs what writing the file costs.
/// `path` is below the scratch directory ([`crate::scratch_dir`]), usually
/// in the checkpoint directory about to be reported; the file appears whole
/// or not at all. Names must be distinct and non-empty.
pub fn save(path: impl AsRef<Path>, tensors: &[(&str, &Tensor)]) -> Result<(), TensorError> {
    let path = utf8(path.as_ref())?;
    let named: Vec<(String, &wit::Tensor)> =
        tensors.iter().map(|(n, t)| (n.to_string(), &t.0)).collect();
    Ok(wit::save(path, &named)?)
}

/// Every tensor of the safetensors file `path` (in the scratch directory
/// or a restored checkpoint, [`crate::get_checkpoint`]), by name in the
/// file's order, as new host tensors. Each must be f32 of rank 1 or 2;
/// their bytes count against the memory limit before any is read.
pub fn load(path: impl AsRef<Path>) -> Result<Vec<(String, Tensor)>, TensorError> {
    let path = utf8(path.as_ref())?;
    Ok(wit::load(path)?
        .into_iter()
        .map(|(n, t)| (n, Tensor(t)))
        .collect())
}

fn utf8(path: &Path) -> Result<&str, TensorError> {
    path.to_str().ok_or_else(|| {
        TensorError::Invalid(format!(
            "{} is not UTF-8; name files in UTF-8",
            path.display()
        ))
    })
}
