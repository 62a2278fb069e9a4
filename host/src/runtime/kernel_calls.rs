//! The kernels of [`crate::tensor`] called on a rank's host tensors, kept
//! in its own resource table (another rank's handles name nothing here)
//! and counted against its memory limit: what the `tensors` imports
//! (`tensors.rs`) and a recorded program's runs (`program.rs`) both call.
//!
//! A kernel that writes into one of its arguments takes that tensor out
//! of the table while it runs, so that it can read the others in place;
//! passing the same tensor as output and input, or as two outputs, is
//! refused.

use smallvec::SmallVec;
use wasmtime::component::{Resource, ResourceTableError};

use super::bindings::trainhost::train::tensors::{Activation, AdamStep, TensorError};
use super::rank::{RankState, StoppedByHost};
use crate::tensor::{self as kernels, Tensor, TensorError as Refused};

pub(super) type Answer<T> = wasmtime::Result<Result<T, TensorError>>;

/// Whether the run is stopping, for a long kernel to poll.
type Stop<'a> = &'a dyn Fn() -> bool;

/// The tensors (or handles) of one kernel call: up to eight (a four-tensor
/// model's parameters and velocities) without allocating.
pub(super) type Few<T> = SmallVec<[T; 8]>;

pub(super) fn refused(e: Refused) -> TensorError {
    match e {
        Refused::Shape(m) => TensorError::Shape(m),
        Refused::Invalid(m) => TensorError::Invalid(m),
        // `with_output` turns a stopped kernel into the stopping trap
        // before errors get here.
        Refused::Stopped => TensorError::Invalid("stopped: the run is stopping".into()),
    }
}

/// The refusal of a call of `name` that would write a tensor twice or
/// write one it also reads (tensors by their handles' numbers).
pub(super) fn aliased(
    name: &str,
    mut written: Few<u32>,
    mut read: impl Iterator<Item = u32>,
) -> Option<TensorError> {
    written.sort_unstable();
    let twice = written.windows(2).any(|w| w[0] == w[1]);
    (twice || read.any(|r| written.binary_search(&r).is_ok())).then(|| {
        TensorError::Invalid(format!(
            "{name}: each tensor it writes must be a tensor of its own, passed once and not also as one it reads"
        ))
    })
}

pub(super) fn adam_step(h: AdamStep) -> kernels::AdamStep {
    kernels::AdamStep {
        lr: h.lr,
        beta1: h.beta1,
        beta2: h.beta2,
        epsilon: h.epsilon,
        step: h.step,
    }
}

pub(super) fn activation(f: Activation) -> kernels::Activation {
    match f {
        Activation::Relu => kernels::Activation::Relu,
        Activation::Tanh => kernels::Activation::Tanh,
        Activation::Sigmoid => kernels::Activation::Sigmoid,
        Activation::Exp => kernels::Activation::Exp,
    }
}

impl RankState {
    /// Trap if the run is stopping: a rank stops at its next kernel call.
    pub(super) fn check_running(&self) -> wasmtime::Result<()> {
        if self.told_to_stop || self.attempt.is_stopping() {
            return Err(wasmtime::Error::new(StoppedByHost));
        }
        Ok(())
    }

    /// Make a tensor of `shape` with `make`, within the memory limit.
    pub(super) fn new_tensor(
        &mut self,
        shape: &[u32],
        make: impl FnOnce() -> Result<Tensor, Refused>,
    ) -> Answer<Resource<Tensor>> {
        self.check_running()?;
        let bytes = match Tensor::bytes_for(shape) {
            Ok(b) => b,
            Err(e) => return Ok(Err(refused(e))),
        };
        if let Err(m) = self.memory.take_tensor(bytes) {
            return Ok(Err(TensorError::OutOfMemory(m)));
        }
        match make() {
            Ok(t) => Ok(Ok(self.table.push(t)?)),
            Err(e) => {
                self.memory.give_back_tensor(bytes);
                Ok(Err(refused(e)))
            }
        }
    }

    /// Run `kernel` (`name` in the interface) on the tensor `out`
    /// (written) and `inputs` (read).
    fn with_output<R>(
        &mut self,
        name: &str,
        out: &Resource<Tensor>,
        inputs: &[&Resource<Tensor>],
        kernel: impl FnOnce(&mut Tensor, &[&Tensor], Stop) -> Result<R, Refused>,
    ) -> Answer<R> {
        self.with_outputs(
            name,
            std::slice::from_ref(&out),
            inputs,
            |outs, inputs, stop| kernel(&mut outs[0], inputs, stop),
        )
    }

    /// Run `kernel` (`name` in the interface) on the tensors `outs`
    /// (written, in that order) and `inputs` (read). A tensor written must
    /// appear once and not among those read: the call is refused otherwise.
    /// A long kernel polls the [`Stop`] it is given.
    fn with_outputs<R>(
        &mut self,
        name: &str,
        outs: &[&Resource<Tensor>],
        inputs: &[&Resource<Tensor>],
        kernel: impl FnOnce(&mut [Tensor], &[&Tensor], Stop) -> Result<R, Refused>,
    ) -> Answer<R> {
        self.check_running()?;
        let written = outs.iter().map(|o| o.rep()).collect();
        if let Some(e) = aliased(name, written, inputs.iter().map(|i| i.rep())) {
            return Ok(Err(e));
        }
        // Out of the table while the kernel runs; empty tensors stand in,
        // and the table gets them back whatever the kernel did.
        let mut taken = Few::with_capacity(outs.len());
        for out in outs {
            match self.table.get_mut(out) {
                Ok(t) => taken.push(std::mem::replace(t, Tensor::empty())),
                Err(e) => {
                    self.put_back(outs, &mut taken)?;
                    return Err(e.into());
                }
            }
        }
        let result: Result<Result<R, Refused>, ResourceTableError> = (|| {
            let inputs = inputs
                .iter()
                .map(|i| self.table.get(i))
                .collect::<Result<Few<_>, _>>()?;
            // Borrowed beside the table, not cloned: a clone of the
            // attempt's handle per call showed in the step's profile.
            let attempt = &self.attempt;
            Ok(kernel(&mut taken, &inputs, &|| attempt.is_stopping()))
        })();
        self.put_back(outs, &mut taken)?;
        match result? {
            Ok(r) => Ok(Ok(r)),
            Err(Refused::Stopped) => Err(wasmtime::Error::new(StoppedByHost)),
            Err(e) => Ok(Err(refused(e))),
        }
    }

    /// Return the tensors [`Self::with_outputs`] took to their places.
    fn put_back(
        &mut self,
        outs: &[&Resource<Tensor>],
        taken: &mut Few<Tensor>,
    ) -> Result<(), ResourceTableError> {
        // Drained in place: moving a `Few` of tensors moves 400 bytes.
        for (out, t) in outs.iter().zip(taken.drain(..)) {
            *self.table.get_mut(out)? = t;
        }
        Ok(())
    }
}

/// Each kernel called on a rank's tensors, as the import of its name and a
/// recorded program's run call it: tensors by handle, arguments in the
/// host's types.
impl RankState {
    /// `tensor.assign`: the values replaced by `data`.
    pub(super) fn call_assign(&mut self, t: &Resource<Tensor>, data: &[f32]) -> Answer<()> {
        self.with_output("assign", t, &[], |t, _, _| t.assign(data))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn call_gemm(
        &mut self,
        c: &Resource<Tensor>,
        alpha: f32,
        a: &Resource<Tensor>,
        trans_a: bool,
        b: &Resource<Tensor>,
        trans_b: bool,
        beta: f32,
    ) -> Answer<()> {
        let threads = self.kernel_threads;
        self.with_output("gemm", c, &[a, b], |c, ab, stop| {
            let (a, b) = (ab[0], ab[1]);
            kernels::gemm(c, alpha, a, trans_a, b, trans_b, beta, threads, stop)
        })
    }

    pub(super) fn call_gather_rows(
        &mut self,
        out: &Resource<Tensor>,
        source: &Resource<Tensor>,
        rows: &[u32],
    ) -> Answer<()> {
        self.with_output("gather-rows", out, &[source], |out, source, _| {
            kernels::gather_rows(out, source[0], rows)
        })
    }

    pub(super) fn call_axpy(
        &mut self,
        y: &Resource<Tensor>,
        alpha: f32,
        x: &Resource<Tensor>,
    ) -> Answer<()> {
        self.with_output("axpy", y, &[x], |y, x, _| kernels::axpy(y, alpha, x[0]))
    }

    pub(super) fn call_scale(&mut self, x: &Resource<Tensor>, alpha: f32) -> Answer<()> {
        self.with_output("scale", x, &[], |x, _, _| {
            kernels::scale(x, alpha);
            Ok(())
        })
    }

    pub(super) fn call_add_row(
        &mut self,
        x: &Resource<Tensor>,
        row: &Resource<Tensor>,
    ) -> Answer<()> {
        self.with_output("add-row", x, &[row], |x, row, _| {
            kernels::add_row(x, row[0])
        })
    }

    pub(super) fn call_sum_rows(
        &mut self,
        out: &Resource<Tensor>,
        x: &Resource<Tensor>,
        beta: f32,
    ) -> Answer<()> {
        self.with_output("sum-rows", out, &[x], |out, x, _| {
            kernels::sum_rows(out, x[0], beta)
        })
    }

    pub(super) fn call_activate(
        &mut self,
        x: &Resource<Tensor>,
        f: kernels::Activation,
    ) -> Answer<()> {
        self.with_output("activate", x, &[], |x, _, _| {
            kernels::activate(x, f);
            Ok(())
        })
    }

    pub(super) fn call_activate_backward(
        &mut self,
        grad: &Resource<Tensor>,
        output: &Resource<Tensor>,
        f: kernels::Activation,
    ) -> Answer<()> {
        self.with_output("activate-backward", grad, &[output], |g, y, _| {
            kernels::activate_backward(g, y[0], f)
        })
    }

    pub(super) fn call_dense(
        &mut self,
        out: &Resource<Tensor>,
        x: &Resource<Tensor>,
        w: &Resource<Tensor>,
        bias: Option<&Resource<Tensor>>,
        f: Option<kernels::Activation>,
    ) -> Answer<()> {
        let threads = self.kernel_threads;
        let inputs: Few<&Resource<Tensor>> = [x, w].into_iter().chain(bias).collect();
        self.with_output("dense", out, &inputs, |out, xwb, stop| {
            let bias = xwb.get(2).copied();
            kernels::dense(out, xwb[0], xwb[1], bias, f, threads, stop)
        })
    }

    /// `dense-backward`: writes `grad_w`, and `grad_bias` and `grad_x`
    /// when given.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn call_dense_backward(
        &mut self,
        grad: &Resource<Tensor>,
        x: &Resource<Tensor>,
        w: &Resource<Tensor>,
        beta: f32,
        grad_w: &Resource<Tensor>,
        grad_bias: Option<&Resource<Tensor>>,
        grad_x: Option<&Resource<Tensor>>,
        x_f: Option<kernels::Activation>,
    ) -> Answer<()> {
        let threads = self.kernel_threads;
        let outs: Few<&Resource<Tensor>> = [grad_w]
            .into_iter()
            .chain(grad_bias)
            .chain(grad_x)
            .collect();
        let (has_bias, has_x) = (grad_bias.is_some(), grad_x.is_some());
        self.with_outputs("dense-backward", &outs, &[grad, x, w], |outs, gxw, stop| {
            let [gw, rest @ ..] = outs else {
                unreachable!("grad-w is always written")
            };
            let (gb, rest) = match rest {
                [gb, rest @ ..] if has_bias => (Some(gb), rest),
                rest => (None, rest),
            };
            let gx = match rest {
                [gx] if has_x => Some((gx, x_f)),
                _ => None,
            };
            let grads = kernels::DenseGrads {
                w: gw,
                bias: gb,
                x: gx,
            };
            kernels::dense_backward(gxw[0], gxw[1], gxw[2], beta, grads, threads, stop)
        })
    }

    pub(super) fn call_softmax_cross_entropy(
        &mut self,
        logits: &Resource<Tensor>,
        labels: &[u32],
        grad: &Resource<Tensor>,
        grad_scale: f32,
    ) -> Answer<(f64, u32)> {
        self.with_output("softmax-cross-entropy", grad, &[logits], |g, z, _| {
            kernels::softmax_cross_entropy(z[0], labels, g, grad_scale)
        })
    }

    pub(super) fn call_sgd_momentum(
        &mut self,
        param: &Resource<Tensor>,
        velocity: &Resource<Tensor>,
        grad: &Resource<Tensor>,
        lr: f32,
        momentum: f32,
    ) -> Answer<()> {
        self.with_outputs("sgd-momentum", &[param, velocity], &[grad], |pv, g, _| {
            let [p, v] = pv else {
                unreachable!("two outputs")
            };
            kernels::sgd_momentum(p, v, g[0], 1.0, lr, momentum)
        })
    }

    pub(super) fn call_sgd_momentum_list(
        &mut self,
        params: &[Resource<Tensor>],
        velocity: &[Resource<Tensor>],
        grads: &[Resource<Tensor>],
        grad_scale: f32,
        lr: f32,
        momentum: f32,
    ) -> Answer<()> {
        // Lists of different lengths are refused by the kernel: `v` then
        // holds the velocities, however many there are.
        let n = params.len();
        let outs: Few<&Resource<Tensor>> = params.iter().chain(velocity).collect();
        let inputs: Few<&Resource<Tensor>> = grads.iter().collect();
        self.with_outputs("sgd-momentum-list", &outs, &inputs, |pv, g, _| {
            let (p, v) = pv.split_at_mut(n);
            let mut p: Few<&mut Tensor> = p.iter_mut().collect();
            let mut v: Few<&mut Tensor> = v.iter_mut().collect();
            kernels::sgd_momentum_list(&mut p, &mut v, g, grad_scale, lr, momentum)
        })
    }

    pub(super) fn call_adam(
        &mut self,
        param: &Resource<Tensor>,
        m: &Resource<Tensor>,
        v: &Resource<Tensor>,
        grad: &Resource<Tensor>,
        h: kernels::AdamStep,
    ) -> Answer<()> {
        self.with_outputs("adam", &[param, m, v], &[grad], |pmv, g, _| {
            let [p, m, v] = pmv else {
                unreachable!("three outputs")
            };
            kernels::adam(p, m, v, g[0], h)
        })
    }
}
