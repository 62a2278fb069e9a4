//! The `tensors` imports: a rank's host tensors, kept in its own resource
//! table (another rank's handles name nothing here), counted against its
//! memory limit, and the kernels of [`crate::tensor`] called on them.
//!
//! A kernel that writes into one of its arguments takes that tensor out
//! of the table while it runs, so that it can read the others in place;
//! passing the same tensor as output and input, or as two outputs, is
//! refused.
//!
//! Every import of the interface is here, each a few lines over its
//! kernel: they share the table helpers, which is why the file is long.

use smallvec::SmallVec;
use wasmtime::component::{Resource, ResourceTableError};

use super::bindings::trainhost::train::collective::{CollectiveError, ReduceOp};
use super::bindings::trainhost::train::tensors::{self, Activation, AdamStep, TensorError};
use super::rank::{RankState, StoppedByHost};
use crate::tensor::{self as kernels, Tensor, TensorError as Refused};

pub(super) type Answer<T> = wasmtime::Result<Result<T, TensorError>>;

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

fn activation(f: Activation) -> kernels::Activation {
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
    fn new_tensor(
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
        kernel: impl FnOnce(&mut Tensor, &[&Tensor]) -> Result<R, Refused>,
    ) -> Answer<R> {
        self.with_outputs(name, std::slice::from_ref(&out), inputs, |outs, inputs| {
            kernel(&mut outs[0], inputs)
        })
    }

    /// Run `kernel` (`name` in the interface) on the tensors `outs`
    /// (written, in that order) and `inputs` (read). A tensor written must
    /// appear once and not among those read: the call is refused otherwise.
    fn with_outputs<R>(
        &mut self,
        name: &str,
        outs: &[&Resource<Tensor>],
        inputs: &[&Resource<Tensor>],
        kernel: impl FnOnce(&mut [Tensor], &[&Tensor]) -> Result<R, Refused>,
    ) -> Answer<R> {
        self.check_running()?;
        let mut written: Few<u32> = outs.iter().map(|o| o.rep()).collect();
        written.sort_unstable();
        if written.windows(2).any(|w| w[0] == w[1])
            || inputs
                .iter()
                .any(|i| written.binary_search(&i.rep()).is_ok())
        {
            return Ok(Err(TensorError::Invalid(format!(
                "{name}: each tensor it writes must be a tensor of its own, passed once and not also as one it reads"
            ))));
        }
        // Out of the table while the kernel runs; empty tensors stand in,
        // and the table gets them back whatever the kernel did.
        let mut taken = Few::with_capacity(outs.len());
        for out in outs {
            match self.table.get_mut(out) {
                Ok(t) => taken.push(std::mem::replace(t, Tensor::empty())),
                Err(e) => {
                    self.put_back(outs, taken)?;
                    return Err(e.into());
                }
            }
        }
        let result: Result<Result<R, Refused>, ResourceTableError> = (|| {
            let inputs = inputs
                .iter()
                .map(|i| self.table.get(i))
                .collect::<Result<Few<_>, _>>()?;
            Ok(kernel(&mut taken, &inputs))
        })();
        self.put_back(outs, taken)?;
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
        taken: Few<Tensor>,
    ) -> Result<(), ResourceTableError> {
        for (out, t) in outs.iter().zip(taken) {
            *self.table.get_mut(out)? = t;
        }
        Ok(())
    }
}

impl tensors::HostTensor for RankState {
    fn from_list(&mut self, shape: Vec<u32>, data: Vec<f32>) -> Answer<Resource<Tensor>> {
        let s = shape.clone();
        self.new_tensor(&shape, move || Tensor::from_vec(&s, data))
    }

    fn zeros(&mut self, shape: Vec<u32>) -> Answer<Resource<Tensor>> {
        let s = shape.clone();
        self.new_tensor(&shape, move || Tensor::zeros(&s))
    }

    fn uniform(
        &mut self,
        shape: Vec<u32>,
        low: f32,
        high: f32,
        seed: u64,
    ) -> Answer<Resource<Tensor>> {
        let s = shape.clone();
        self.new_tensor(&shape, move || Tensor::uniform(&s, low, high, seed))
    }

    fn shape(&mut self, t: Resource<Tensor>) -> wasmtime::Result<Vec<u32>> {
        let t = self.table.get(&t)?;
        // Every dimension came in as a u32.
        Ok(t.shape().iter().map(|&d| d as u32).collect())
    }

    fn to_list(&mut self, t: Resource<Tensor>) -> wasmtime::Result<Vec<f32>> {
        self.check_running()?;
        Ok(self.table.get(&t)?.values().to_vec())
    }

    fn assign(&mut self, t: Resource<Tensor>, data: Vec<f32>) -> Answer<()> {
        self.with_output("assign", &t, &[], |t, _| t.assign(&data))
    }

    fn drop(&mut self, t: Resource<Tensor>) -> wasmtime::Result<()> {
        let t = self.table.delete(t)?;
        self.memory.give_back_tensor(t.bytes());
        Ok(())
    }
}

impl tensors::Host for RankState {
    fn gemm(
        &mut self,
        c: Resource<Tensor>,
        alpha: f32,
        a: Resource<Tensor>,
        trans_a: bool,
        b: Resource<Tensor>,
        trans_b: bool,
        beta: f32,
    ) -> Answer<()> {
        let attempt = self.attempt.clone();
        let threads = self.kernel_threads;
        self.with_output("gemm", &c, &[&a, &b], |c, ab| {
            let stop = || attempt.is_stopping();
            let (a, b) = (ab[0], ab[1]);
            kernels::gemm(c, alpha, a, trans_a, b, trans_b, beta, threads, &stop)
        })
    }

    fn gather_rows(
        &mut self,
        out: Resource<Tensor>,
        source: Resource<Tensor>,
        rows: Vec<u32>,
    ) -> Answer<()> {
        self.with_output("gather-rows", &out, &[&source], |out, source| {
            kernels::gather_rows(out, source[0], &rows)
        })
    }

    fn axpy(&mut self, y: Resource<Tensor>, alpha: f32, x: Resource<Tensor>) -> Answer<()> {
        self.with_output("axpy", &y, &[&x], |y, x| kernels::axpy(y, alpha, x[0]))
    }

    fn scale(&mut self, x: Resource<Tensor>, alpha: f32) -> wasmtime::Result<()> {
        self.with_output("scale", &x, &[], |x, _| {
            kernels::scale(x, alpha);
            Ok(())
        })?
        .map_err(|e| wasmtime::Error::msg(format!("{e:?}")))
    }

    fn add_row(&mut self, x: Resource<Tensor>, row: Resource<Tensor>) -> Answer<()> {
        self.with_output("add-row", &x, &[&row], |x, row| kernels::add_row(x, row[0]))
    }

    fn sum_rows(&mut self, out: Resource<Tensor>, x: Resource<Tensor>, beta: f32) -> Answer<()> {
        self.with_output("sum-rows", &out, &[&x], |out, x| {
            kernels::sum_rows(out, x[0], beta)
        })
    }

    fn activate(&mut self, x: Resource<Tensor>, f: Activation) -> wasmtime::Result<()> {
        self.with_output("activate", &x, &[], |x, _| {
            kernels::activate(x, activation(f));
            Ok(())
        })?
        .map_err(|e| wasmtime::Error::msg(format!("{e:?}")))
    }

    fn activate_backward(
        &mut self,
        grad: Resource<Tensor>,
        output: Resource<Tensor>,
        f: Activation,
    ) -> Answer<()> {
        self.with_output("activate-backward", &grad, &[&output], |g, y| {
            kernels::activate_backward(g, y[0], activation(f))
        })
    }

    fn dense(
        &mut self,
        out: Resource<Tensor>,
        x: Resource<Tensor>,
        w: Resource<Tensor>,
        bias: Option<Resource<Tensor>>,
        f: Option<Activation>,
    ) -> Answer<()> {
        let attempt = self.attempt.clone();
        let threads = self.kernel_threads;
        let inputs: Few<&Resource<Tensor>> = [&x, &w].into_iter().chain(&bias).collect();
        self.with_output("dense", &out, &inputs, |out, xwb| {
            let stop = || attempt.is_stopping();
            let bias = xwb.get(2).copied();
            kernels::dense(out, xwb[0], xwb[1], bias, f.map(activation), threads, &stop)
        })
    }

    fn dense_backward(
        &mut self,
        grad: Resource<Tensor>,
        x: Resource<Tensor>,
        w: Resource<Tensor>,
        beta: f32,
        grad_w: Resource<Tensor>,
        grad_bias: Option<Resource<Tensor>>,
        grad_x: Option<Resource<Tensor>>,
        x_f: Option<Activation>,
    ) -> Answer<()> {
        let attempt = self.attempt.clone();
        let threads = self.kernel_threads;
        let outs: Few<&Resource<Tensor>> = [&grad_w]
            .into_iter()
            .chain(&grad_bias)
            .chain(&grad_x)
            .collect();
        let (has_bias, has_x) = (grad_bias.is_some(), grad_x.is_some());
        self.with_outputs("dense-backward", &outs, &[&grad, &x, &w], |outs, gxw| {
            let stop = || attempt.is_stopping();
            let [gw, rest @ ..] = outs else {
                unreachable!("grad-w is always written")
            };
            let (gb, rest) = match rest {
                [gb, rest @ ..] if has_bias => (Some(gb), rest),
                rest => (None, rest),
            };
            let gx = match rest {
                [gx] if has_x => Some((gx, x_f.map(activation))),
                _ => None,
            };
            let grads = kernels::DenseGrads {
                w: gw,
                bias: gb,
                x: gx,
            };
            kernels::dense_backward(gxw[0], gxw[1], gxw[2], beta, grads, threads, &stop)
        })
    }

    fn softmax_cross_entropy(
        &mut self,
        logits: Resource<Tensor>,
        labels: Vec<u32>,
        grad: Resource<Tensor>,
        grad_scale: f32,
    ) -> Answer<(f64, u32)> {
        self.with_output("softmax-cross-entropy", &grad, &[&logits], |g, z| {
            kernels::softmax_cross_entropy(z[0], &labels, g, grad_scale)
        })
    }

    fn sgd_momentum(
        &mut self,
        param: Resource<Tensor>,
        velocity: Resource<Tensor>,
        grad: Resource<Tensor>,
        lr: f32,
        momentum: f32,
    ) -> Answer<()> {
        self.with_outputs("sgd-momentum", &[&param, &velocity], &[&grad], |pv, g| {
            let [p, v] = pv else {
                unreachable!("two outputs")
            };
            kernels::sgd_momentum(p, v, g[0], 1.0, lr, momentum)
        })
    }

    fn sgd_momentum_list(
        &mut self,
        params: Vec<Resource<Tensor>>,
        velocity: Vec<Resource<Tensor>>,
        grads: Vec<Resource<Tensor>>,
        grad_scale: f32,
        lr: f32,
        momentum: f32,
    ) -> Answer<()> {
        // Lists of different lengths are refused by the kernel: `v` then
        // holds the velocities, however many there are.
        let n = params.len();
        let outs: Few<&Resource<Tensor>> = params.iter().chain(&velocity).collect();
        let inputs: Few<&Resource<Tensor>> = grads.iter().collect();
        self.with_outputs("sgd-momentum-list", &outs, &inputs, |pv, g| {
            let (p, v) = pv.split_at_mut(n);
            let mut p: Few<&mut Tensor> = p.iter_mut().collect();
            let mut v: Few<&mut Tensor> = v.iter_mut().collect();
            kernels::sgd_momentum_list(&mut p, &mut v, g, grad_scale, lr, momentum)
        })
    }

    fn adam(
        &mut self,
        param: Resource<Tensor>,
        m: Resource<Tensor>,
        v: Resource<Tensor>,
        grad: Resource<Tensor>,
        h: AdamStep,
    ) -> Answer<()> {
        let h = kernels::AdamStep {
            lr: h.lr,
            beta1: h.beta1,
            beta2: h.beta2,
            epsilon: h.epsilon,
            step: h.step,
        };
        self.with_outputs("adam", &[&param, &m, &v], &[&grad], |pmv, g| {
            let [p, m, v] = pmv else {
                unreachable!("three outputs")
            };
            kernels::adam(p, m, v, g[0], h)
        })
    }

    fn save(&mut self, path: String, tensors: Vec<(String, Resource<Tensor>)>) -> Answer<()> {
        self.save_tensors(&path, &tensors)
    }

    fn load(&mut self, path: String) -> Answer<Vec<(String, Resource<Tensor>)>> {
        self.load_tensors(&path)
    }

    async fn all_reduce(
        &mut self,
        t: Resource<Tensor>,
        o: ReduceOp,
    ) -> wasmtime::Result<Result<(), CollectiveError>> {
        self.all_reduce_tensors(std::slice::from_ref(&t), o).await
    }

    async fn all_reduce_list(
        &mut self,
        ts: Vec<Resource<Tensor>>,
        o: ReduceOp,
    ) -> wasmtime::Result<Result<(), CollectiveError>> {
        self.all_reduce_tensors(&ts, o).await
    }

    async fn broadcast(
        &mut self,
        t: Resource<Tensor>,
        root: u32,
    ) -> wasmtime::Result<Result<(), CollectiveError>> {
        self.broadcast_tensor(&t, root).await
    }
}
