//! The `tensors` imports: a rank's host tensors, kept in its own resource
//! table (another rank's handles name nothing here), counted against its
//! memory limit, and the kernels of [`crate::tensor`] called on them.
//!
//! A kernel that writes into one of its arguments takes that tensor out
//! of the table while it runs, so that it can read the others in place;
//! passing the same tensor as output and input is refused.

use wasmtime::component::{Resource, ResourceTableError};

use super::bindings::trainhost::train::collective::{CollectiveError, ReduceOp};
use super::bindings::trainhost::train::tensors::{self, Activation, AdamStep, TensorError};
use super::rank::{RankState, StoppedByHost};
use crate::tensor::{self as kernels, Tensor, TensorError as Refused};

pub(super) type Answer<T> = wasmtime::Result<Result<T, TensorError>>;

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

    /// Run `kernel` on the tensor `out` (written) and `inputs` (read).
    fn with_output<R>(
        &mut self,
        out: &Resource<Tensor>,
        inputs: &[&Resource<Tensor>],
        kernel: impl FnOnce(&mut Tensor, &[&Tensor]) -> Result<R, Refused>,
    ) -> Answer<R> {
        self.check_running()?;
        if inputs.iter().any(|i| i.rep() == out.rep()) {
            return Ok(Err(TensorError::Invalid(
                "the tensor a kernel writes cannot also be one it reads".into(),
            )));
        }
        // Out of the table while the kernel runs; an empty tensor stands
        // in, and the table gets it back whatever the kernel did.
        let mut taken = std::mem::replace(self.table.get_mut(out)?, Tensor::empty());
        let result: Result<Result<R, Refused>, ResourceTableError> = (|| {
            let inputs = inputs
                .iter()
                .map(|i| self.table.get(i))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(kernel(&mut taken, &inputs))
        })();
        *self.table.get_mut(out)? = taken;
        match result? {
            Ok(r) => Ok(Ok(r)),
            Err(Refused::Stopped) => Err(wasmtime::Error::new(StoppedByHost)),
            Err(e) => Ok(Err(refused(e))),
        }
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
        self.with_output(&t, &[], |t, _| t.assign(&data))
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
        self.with_output(&c, &[&a, &b], |c, ab| {
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
        self.with_output(&out, &[&source], |out, source| {
            kernels::gather_rows(out, source[0], &rows)
        })
    }

    fn axpy(&mut self, y: Resource<Tensor>, alpha: f32, x: Resource<Tensor>) -> Answer<()> {
        self.with_output(&y, &[&x], |y, x| kernels::axpy(y, alpha, x[0]))
    }

    fn scale(&mut self, x: Resource<Tensor>, alpha: f32) -> wasmtime::Result<()> {
        self.with_output(&x, &[], |x, _| {
            kernels::scale(x, alpha);
            Ok(())
        })?
        .map_err(|e| wasmtime::Error::msg(format!("{e:?}")))
    }

    fn add_row(&mut self, x: Resource<Tensor>, row: Resource<Tensor>) -> Answer<()> {
        self.with_output(&x, &[&row], |x, row| kernels::add_row(x, row[0]))
    }

    fn sum_rows(&mut self, out: Resource<Tensor>, x: Resource<Tensor>, beta: f32) -> Answer<()> {
        self.with_output(&out, &[&x], |out, x| kernels::sum_rows(out, x[0], beta))
    }

    fn activate(&mut self, x: Resource<Tensor>, f: Activation) -> wasmtime::Result<()> {
        self.with_output(&x, &[], |x, _| {
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
        self.with_output(&grad, &[&output], |g, y| {
            kernels::activate_backward(g, y[0], activation(f))
        })
    }

    fn softmax_cross_entropy(
        &mut self,
        logits: Resource<Tensor>,
        labels: Vec<u32>,
        grad: Resource<Tensor>,
        grad_scale: f32,
    ) -> Answer<(f64, u32)> {
        self.with_output(&grad, &[&logits], |g, z| {
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
        self.check_running()?;
        if velocity.rep() == param.rep() || velocity.rep() == grad.rep() {
            return Ok(Err(TensorError::Invalid(
                "sgd-momentum: velocity must be a tensor of its own, not param or grad".into(),
            )));
        }
        // Two outputs: velocity out of the table too while param is
        // written.
        let mut v = std::mem::replace(self.table.get_mut(&velocity)?, Tensor::empty());
        let result = self.with_output(&param, &[&grad], |p, g| {
            kernels::sgd_momentum(p, &mut v, g[0], lr, momentum)
        });
        *self.table.get_mut(&velocity)? = v;
        result
    }

    fn adam(
        &mut self,
        param: Resource<Tensor>,
        m: Resource<Tensor>,
        v: Resource<Tensor>,
        grad: Resource<Tensor>,
        h: AdamStep,
    ) -> Answer<()> {
        self.check_running()?;
        let outputs = [param.rep(), m.rep(), v.rep()];
        if outputs.contains(&grad.rep())
            || outputs[0] == outputs[1]
            || outputs[0] == outputs[2]
            || outputs[1] == outputs[2]
        {
            return Ok(Err(TensorError::Invalid(
                "adam: param, m, v and grad must be four different tensors".into(),
            )));
        }
        let h = kernels::AdamStep {
            lr: h.lr,
            beta1: h.beta1,
            beta2: h.beta2,
            epsilon: h.epsilon,
            step: h.step,
        };
        // Three outputs: the moments out of the table too while param is
        // written.
        let mut m_t = std::mem::replace(self.table.get_mut(&m)?, Tensor::empty());
        let mut v_t = std::mem::replace(self.table.get_mut(&v)?, Tensor::empty());
        let result = self.with_output(&param, &[&grad], |p, g| {
            kernels::adam(p, &mut m_t, &mut v_t, g[0], h)
        });
        *self.table.get_mut(&m)? = m_t;
        *self.table.get_mut(&v)? = v_t;
        result
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
