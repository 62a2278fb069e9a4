//! A training step's kernel calls, recorded once and run again with one
//! call into the host (WIT `tensors.program`, since
//! `trainhost:train@0.1.7`).
//!
//! Each kernel call costs a crossing into the host (~150 ns from Rust,
//! several µs from Python), and a small model's step is mostly crossings:
//! the digits example's step makes eight kernel calls for ~10 µs of maths.
//! A [`Program`] records the calls once, with the same arguments as the
//! kernels of [`crate::tensor`], and [`Program::run`] makes them all with
//! one call, with the batch's rows as its one argument:
//!
//! ```no_run
//! use trainhost_guest::collective::Op;
//! use trainhost_guest::program::{LayerGrads, Program};
//! use trainhost_guest::tensor::{Activation, Tensor};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let t = |shape: &[u32]| Tensor::zeros(shape);
//! // A data set in the host: 1000 images of 64 values, and their labels.
//! let images = Tensor::uniform(&[1000, 64], 0.0, 1.0, 7)?;
//! let labels: Vec<u32> = (0..1000).map(|i| i % 10).collect();
//! let (w, b) = (Tensor::uniform(&[64, 10], -0.1, 0.1, 1)?, t(&[10])?);
//! let (gw, gb, vw, vb) = (t(&[64, 10])?, t(&[10])?, t(&[64, 10])?, t(&[10])?);
//! let (x, z, dz) = (t(&[32, 64])?, t(&[32, 10])?, t(&[32, 10])?);
//!
//! let mut step = Program::new();
//! step.gather_rows(&x, &images)?; // x = the run's rows of the images
//! step.dense(&z, &x, &w, Some(&b), None)?;
//! step.softmax_cross_entropy(&z, &labels, &dz, 1.0)?;
//! step.dense_backward(&dz, &x, &w, 0.0, LayerGrads { w: &gw, bias: Some(&gb), x: None })?;
//! step.all_reduce(&[&gw, &gb], Op::Sum)?;
//! step.sgd_momentum(&[&w, &b], &[&vw, &vb], &[&gw, &gb], 1.0 / 32.0, 0.1, 0.9)?;
//!
//! let batch: Vec<u32> = (0..32).collect();
//! let losses = step.run(&batch)?; // one call: gather, forward, backward, update
//! let (loss, correct) = losses[0];
//! # Ok(())
//! # }
//! ```
//!
//! Recording checks each call as the kernel would and refuses a bad one
//! (nothing is recorded); a run checks only that its rows fit and that
//! every tensor is still there, then runs each kernel as its own call
//! would, with the same values bit for bit. The tensors stay the
//! caller's: it may read, write, save and all-reduce them between runs,
//! and each kernel reads what its tensors hold when the run reaches it.
//! Hyperparameters are recorded with the call: to change the learning
//! rate, record the step again (as cheap as one step without a program).

use std::fmt;

use crate::collective::{CollectiveError, Op};
use crate::tensor::{Activation, AdamStep, Tensor, TensorError};
use crate::wit::trainhost::train::tensors as wit;

/// Why a [`Program::run`] did not run, or stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProgramError {
    /// The rows do not fit the program (not as many as a recorded
    /// [`Program::gather_rows`] writes or [`Program::softmax_cross_entropy`]
    /// reads, or one past a source's rows or the labels), or a tensor it
    /// names was dropped since it was recorded. Nothing ran.
    Refused(TensorError),
    /// A recorded all-reduce failed: the kernels before it ran, those
    /// after it did not. As [`CollectiveError`] says, return from the
    /// loop unless it is `Invalid`.
    Collective(CollectiveError),
}

impl fmt::Display for ProgramError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProgramError::Refused(e) => e.fmt(f),
            ProgramError::Collective(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ProgramError {}

impl From<wit::ProgramError> for ProgramError {
    fn from(e: wit::ProgramError) -> Self {
        match e {
            wit::ProgramError::Refused(e) => ProgramError::Refused(e.into()),
            wit::ProgramError::Collective(e) => ProgramError::Collective(e.into()),
        }
    }
}

/// Where a recorded [`Program::dense_backward`] writes: the gradient of a
/// layer's weights, and optionally of its bias and of its input (with the
/// activation the input came out of), as [`crate::tensor::DenseGrads`].
#[derive(Debug, Clone, Copy)]
pub struct LayerGrads<'a> {
    /// `[in, out]`, like the weights.
    pub w: &'a Tensor,
    /// `[out]`, like the bias.
    pub bias: Option<&'a Tensor>,
    /// `[rows, in]`, like the input, and the activation the input came
    /// out of (the previous layer's).
    pub x: Option<(&'a Tensor, Option<Activation>)>,
}

/// A recorded sequence of kernel calls on host tensors (see the module's
/// documentation). It and its kernels count against the rank's memory
/// limit, and it holds at most 4096 kernels. [`Program::new`] cannot
/// return an error: a program that does not fit in the memory limit stops
/// the rank.
#[derive(Debug)]
pub struct Program(wit::Program);

impl Default for Program {
    fn default() -> Self {
        Self::new()
    }
}

impl Program {
    /// An empty program.
    pub fn new() -> Self {
        Self(wit::Program::new())
    }

    /// Record [`Tensor::gather_rows`] into `out` from `source`, with the
    /// rows each [`Program::run`] is given: `out` has as many rows as the
    /// run gets.
    pub fn gather_rows(&mut self, out: &Tensor, source: &Tensor) -> Result<(), TensorError> {
        Ok(self.0.gather_rows(&out.0, &source.0)?)
    }

    /// Record [`Tensor::gemm`] into `c`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &mut self,
        c: &Tensor,
        alpha: f32,
        a: &Tensor,
        trans_a: bool,
        b: &Tensor,
        trans_b: bool,
        beta: f32,
    ) -> Result<(), TensorError> {
        Ok(self
            .0
            .gemm(&c.0, alpha, &a.0, trans_a, &b.0, trans_b, beta)?)
    }

    /// Record [`Tensor::axpy`] into `y`.
    pub fn axpy(&mut self, y: &Tensor, alpha: f32, x: &Tensor) -> Result<(), TensorError> {
        Ok(self.0.axpy(&y.0, alpha, &x.0)?)
    }

    /// Record [`Tensor::scale`] of `x`.
    pub fn scale(&mut self, x: &Tensor, alpha: f32) -> Result<(), TensorError> {
        Ok(self.0.scale(&x.0, alpha)?)
    }

    /// Record [`Tensor::add_row`] into `x`.
    pub fn add_row(&mut self, x: &Tensor, row: &Tensor) -> Result<(), TensorError> {
        Ok(self.0.add_row(&x.0, &row.0)?)
    }

    /// Record [`Tensor::sum_rows`] into `out`.
    pub fn sum_rows(&mut self, out: &Tensor, x: &Tensor, beta: f32) -> Result<(), TensorError> {
        Ok(self.0.sum_rows(&out.0, &x.0, beta)?)
    }

    /// Record [`Tensor::activate`] of `x`.
    pub fn activate(&mut self, x: &Tensor, f: Activation) -> Result<(), TensorError> {
        Ok(self.0.activate(&x.0, f)?)
    }

    /// Record [`Tensor::activate_backward`] into `grad`.
    pub fn activate_backward(
        &mut self,
        grad: &Tensor,
        output: &Tensor,
        f: Activation,
    ) -> Result<(), TensorError> {
        Ok(self.0.activate_backward(&grad.0, &output.0, f)?)
    }

    /// Record [`Tensor::dense`] into `out`.
    pub fn dense(
        &mut self,
        out: &Tensor,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        f: Option<Activation>,
    ) -> Result<(), TensorError> {
        Ok(self.0.dense(&out.0, &x.0, &w.0, bias.map(|b| &b.0), f)?)
    }

    /// Record [`crate::tensor::dense_backward`] into `grads`.
    pub fn dense_backward(
        &mut self,
        grad: &Tensor,
        x: &Tensor,
        w: &Tensor,
        beta: f32,
        grads: LayerGrads<'_>,
    ) -> Result<(), TensorError> {
        let (grad_x, x_f) = match grads.x {
            Some((t, f)) => (Some(&t.0), f),
            None => (None, None),
        };
        Ok(self.0.dense_backward(
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

    /// Record [`Tensor::softmax_cross_entropy`] of `logits` into `grad`,
    /// where row k's label is `labels[rows[k]]` for the rows each
    /// [`Program::run`] is given: `labels` holds a label per row of the
    /// data set the rows index (the program keeps a copy). The loss and
    /// count of correct rows are among what the run returns.
    pub fn softmax_cross_entropy(
        &mut self,
        logits: &Tensor,
        labels: &[u32],
        grad: &Tensor,
        grad_scale: f32,
    ) -> Result<(), TensorError> {
        Ok(self
            .0
            .softmax_cross_entropy(&logits.0, labels, &grad.0, grad_scale)?)
    }

    /// Record [`crate::tensor::sgd_momentum`] of every tensor of a model.
    pub fn sgd_momentum(
        &mut self,
        params: &[&Tensor],
        velocity: &[&Tensor],
        grads: &[&Tensor],
        grad_scale: f32,
        lr: f32,
        momentum: f32,
    ) -> Result<(), TensorError> {
        Ok(self.0.sgd_momentum_list(
            &handles(params),
            &handles(velocity),
            &handles(grads),
            grad_scale,
            lr,
            momentum,
        )?)
    }

    /// Record [`Tensor::adam`] on `param`, whose step counts on by
    /// itself: `hyper.step` in the program's first run, one more in each
    /// run after it (a run refused by its checks does not count).
    pub fn adam(
        &mut self,
        param: &Tensor,
        m: &Tensor,
        v: &Tensor,
        grad: &Tensor,
        hyper: AdamStep,
    ) -> Result<(), TensorError> {
        Ok(self.0.adam(&param.0, &m.0, &v.0, &grad.0, hyper)?)
    }

    /// Record [`crate::tensor::all_reduce`] of `tensors`: collective when
    /// the program runs, matched with the other ranks' collective calls
    /// as the call itself is. A tensor listed twice is refused here.
    pub fn all_reduce(&mut self, tensors: &[&Tensor], op: Op) -> Result<(), TensorError> {
        Ok(self.0.all_reduce_list(&handles(tensors), op.into())?)
    }

    /// Run the recorded kernels in order with `rows` for every recorded
    /// [`Program::gather_rows`] and [`Program::softmax_cross_entropy`], in
    /// one call into the host. Returns each recorded softmax
    /// cross-entropy's summed loss and count of correct rows, in the order
    /// they were recorded.
    pub fn run(&mut self, rows: &[u32]) -> Result<Vec<(f64, u32)>, ProgramError> {
        Ok(self.0.run(rows)?)
    }
}

/// The handles of `tensors`, as the bindings take them.
fn handles<'a>(tensors: &[&'a Tensor]) -> Vec<&'a wit::Tensor> {
    tensors.iter().map(|t| &t.0).collect()
}
