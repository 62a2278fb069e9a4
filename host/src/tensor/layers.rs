//! Fused kernels: a dense layer's forward and backward pass, and an
//! optimizer step over every tensor of a model, each one call for what
//! several kernels of `super::kernels` do one after the other.
//!
//! They exist for the guest's sake: a call into the host costs ~150 ns
//! from Rust and ~2–3 µs from Python (lending the handles, checking them,
//! taking the outputs out of the rank's table), and a step of the digits
//! example made 22 of them for ~15 µs of arithmetic. Each is built from
//! the same kernels in the same order, so its values are the ones the
//! separate calls give, bit for bit; what it adds is that every shape is
//! checked before anything is written.

use super::kernels::{Activation, activate, activate_backward, add_row, gemm, sum_rows};
use super::subnormals::Flushed;
use super::{Tensor, TensorError, check};

/// `out = f(x * w + bias)`, without the bias or the function when they
/// are `None`: `gemm`, `add_row` and `activate`.
pub fn dense(
    out: &mut Tensor,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    f: Option<Activation>,
    threads: usize,
    stop: &dyn Fn() -> bool,
) -> Result<(), TensorError> {
    check::dense(out, x, w, bias)?;
    // Set once for the kernels below, which then find it set.
    let _flushed = Flushed::new();
    gemm(out, 1.0, x, false, w, false, 0.0, threads, stop)?;
    if let Some(b) = bias {
        add_row(out, b)?;
    }
    if let Some(f) = f {
        activate(out, f);
    }
    Ok(())
}

/// Where [`dense_backward`] writes: the weights' gradient, and optionally
/// the bias's and the input's (with the activation `x` came out of).
#[derive(Debug)]
pub struct DenseGrads<'a> {
    /// `[in, out]`, like the weights.
    pub w: &'a mut Tensor,
    /// `[out]`, like the bias.
    pub bias: Option<&'a mut Tensor>,
    /// `[rows, in]`, like the input, and the activation the input came
    /// out of.
    pub x: Option<(&'a mut Tensor, Option<Activation>)>,
}

/// From `grad`, the gradient at `x * w + bias`: `grads.w = beta * grads.w
/// + xᵀ * grad`, `grads.bias = beta * grads.bias + the sum of grad's rows`,
/// `grads.x = (grad * wᵀ) * f'` with `f'` from `x = f(...)`: `gemm`,
/// `sum_rows`, `gemm` and `activate_backward`.
pub fn dense_backward(
    grad: &Tensor,
    x: &Tensor,
    w: &Tensor,
    beta: f32,
    grads: DenseGrads<'_>,
    threads: usize,
    stop: &dyn Fn() -> bool,
) -> Result<(), TensorError> {
    let grad_x = grads.x.as_ref().map(|(gx, _)| &**gx);
    check::dense_backward(grad, x, w, grads.w, grads.bias.as_deref(), grad_x)?;
    // Set once for the kernels below, which then find it set.
    let _flushed = Flushed::new();
    gemm(grads.w, 1.0, x, true, grad, false, beta, threads, stop)?;
    if let Some(gb) = grads.bias {
        sum_rows(gb, grad, beta)?;
    }
    if let Some((gx, f)) = grads.x {
        gemm(gx, 1.0, grad, false, w, true, 0.0, threads, stop)?;
        if let Some(f) = f {
            activate_backward(gx, x, f)?;
        }
    }
    Ok(())
}

/// One step of `sgd_momentum` for every `(param,
/// velocity, grad)`, each gradient times `grad_scale`; every triple's
/// shapes are checked before any is written.
pub fn sgd_momentum_list(
    params: &mut [&mut Tensor],
    velocity: &mut [&mut Tensor],
    grads: &[&Tensor],
    grad_scale: f32,
    lr: f32,
    momentum: f32,
) -> Result<(), TensorError> {
    check::sgd_momentum_list(params, velocity, grads)?;
    // Set once for the kernels below, which then find it set.
    let _flushed = Flushed::new();
    for ((p, v), g) in params.iter_mut().zip(velocity.iter_mut()).zip(grads) {
        super::kernels::sgd_momentum(p, v, g, grad_scale, lr, momentum)?;
    }
    Ok(())
}

#[cfg(test)]
#[path = "layers_tests.rs"]
mod tests;
