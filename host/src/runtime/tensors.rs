//! The `tensors` imports: each a conversion of its arguments into the
//! host's types over the kernel call of `kernel_calls.rs`.

use wasmtime::component::Resource;

use super::bindings::trainhost::train::collective::{CollectiveError, ReduceOp};
use super::bindings::trainhost::train::tensors::{self, Activation, AdamStep};
use super::collective::op;
use super::kernel_calls::{Answer, activation, adam_step};
use super::rank::RankState;
use crate::tensor::Tensor;

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
        self.call_assign(&t, &data)
    }

    fn drop(&mut self, t: Resource<Tensor>) -> wasmtime::Result<()> {
        let rep = t.rep();
        let t = self.table.delete(t)?;
        self.memory.give_back_tensor(t.bytes());
        self.drops.dropped(rep);
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
        self.call_gemm(&c, alpha, &a, trans_a, &b, trans_b, beta)
    }

    fn gather_rows(
        &mut self,
        out: Resource<Tensor>,
        source: Resource<Tensor>,
        rows: Vec<u32>,
    ) -> Answer<()> {
        self.call_gather_rows(&out, &source, &rows)
    }

    fn axpy(&mut self, y: Resource<Tensor>, alpha: f32, x: Resource<Tensor>) -> Answer<()> {
        self.call_axpy(&y, alpha, &x)
    }

    fn scale(&mut self, x: Resource<Tensor>, alpha: f32) -> wasmtime::Result<()> {
        // Nothing to refuse (the interface has no error for it).
        self.call_scale(&x, alpha)?
            .map_err(|e| wasmtime::Error::msg(format!("{e:?}")))
    }

    fn add_row(&mut self, x: Resource<Tensor>, row: Resource<Tensor>) -> Answer<()> {
        self.call_add_row(&x, &row)
    }

    fn sum_rows(&mut self, out: Resource<Tensor>, x: Resource<Tensor>, beta: f32) -> Answer<()> {
        self.call_sum_rows(&out, &x, beta)
    }

    fn activate(&mut self, x: Resource<Tensor>, f: Activation) -> wasmtime::Result<()> {
        self.call_activate(&x, activation(f))?
            .map_err(|e| wasmtime::Error::msg(format!("{e:?}")))
    }

    fn activate_backward(
        &mut self,
        grad: Resource<Tensor>,
        output: Resource<Tensor>,
        f: Activation,
    ) -> Answer<()> {
        self.call_activate_backward(&grad, &output, activation(f))
    }

    fn dense(
        &mut self,
        out: Resource<Tensor>,
        x: Resource<Tensor>,
        w: Resource<Tensor>,
        bias: Option<Resource<Tensor>>,
        f: Option<Activation>,
    ) -> Answer<()> {
        self.call_dense(&out, &x, &w, bias.as_ref(), f.map(activation))
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
        let (gb, gx) = (grad_bias.as_ref(), grad_x.as_ref());
        self.call_dense_backward(&grad, &x, &w, beta, &grad_w, gb, gx, x_f.map(activation))
    }

    fn softmax_cross_entropy(
        &mut self,
        logits: Resource<Tensor>,
        labels: Vec<u32>,
        grad: Resource<Tensor>,
        grad_scale: f32,
    ) -> Answer<(f64, u32)> {
        self.call_softmax_cross_entropy(&logits, &labels, &grad, grad_scale)
    }

    fn sgd_momentum(
        &mut self,
        param: Resource<Tensor>,
        velocity: Resource<Tensor>,
        grad: Resource<Tensor>,
        lr: f32,
        momentum: f32,
    ) -> Answer<()> {
        self.call_sgd_momentum(&param, &velocity, &grad, lr, momentum)
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
        self.call_sgd_momentum_list(&params, &velocity, &grads, grad_scale, lr, momentum)
    }

    fn adam(
        &mut self,
        param: Resource<Tensor>,
        m: Resource<Tensor>,
        v: Resource<Tensor>,
        grad: Resource<Tensor>,
        h: AdamStep,
    ) -> Answer<()> {
        self.call_adam(&param, &m, &v, &grad, adam_step(h))
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
        self.all_reduce_tensors(std::slice::from_ref(&t), op(o))
            .await
    }

    async fn all_reduce_list(
        &mut self,
        ts: Vec<Resource<Tensor>>,
        o: ReduceOp,
    ) -> wasmtime::Result<Result<(), CollectiveError>> {
        self.all_reduce_tensors(&ts, op(o)).await
    }

    async fn broadcast(
        &mut self,
        t: Resource<Tensor>,
        root: u32,
    ) -> wasmtime::Result<Result<(), CollectiveError>> {
        self.broadcast_tensor(&t, root).await
    }
}
