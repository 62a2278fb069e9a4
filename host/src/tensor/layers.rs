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
use super::{Tensor, TensorError, same_shape};

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
    let (rows, inputs) = x.matrix("x")?;
    let outputs = layer_width("dense", w, inputs)?;
    expect_shape("dense", "out", out, &[rows, outputs])?;
    if let Some(b) = bias {
        expect_shape("dense", "bias", b, &[outputs])?;
    }
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
    let (rows, inputs) = x.matrix("x")?;
    let outputs = layer_width("dense-backward", w, inputs)?;
    expect_shape("dense-backward", "grad", grad, &[rows, outputs])?;
    expect_shape("dense-backward", "grad-w", grads.w, &[inputs, outputs])?;
    if let Some(gb) = &grads.bias {
        expect_shape("dense-backward", "grad-bias", gb, &[outputs])?;
    }
    if let Some((gx, _)) = &grads.x {
        same_shape("grad-x", gx, "x", x)?;
    }
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
    if params.len() != velocity.len() || params.len() != grads.len() {
        return Err(TensorError::Shape(format!(
            "sgd-momentum-list: {} params, {} velocities and {} gradients; the lists must be as long",
            params.len(),
            velocity.len(),
            grads.len()
        )));
    }
    for (i, ((p, v), g)) in params.iter().zip(velocity.iter()).zip(grads).enumerate() {
        // The names are formatted only for a refusal: this runs every step.
        if p.shape != v.shape || p.shape != g.shape {
            let at = |what: &str| format!("{what}[{i}]");
            same_shape(&at("params"), p, &at("velocity"), v)?;
            same_shape(&at("params"), p, &at("grads"), g)?;
        }
    }
    for ((p, v), g) in params.iter_mut().zip(velocity.iter_mut()).zip(grads) {
        super::kernels::sgd_momentum(p, v, g, grad_scale, lr, momentum)?;
    }
    Ok(())
}

/// The number of outputs of a layer whose weights are `w`, which must be
/// `[inputs, outputs]`.
fn layer_width(kernel: &str, w: &Tensor, inputs: usize) -> Result<usize, TensorError> {
    match w.matrix("w")? {
        (rows, outputs) if rows == inputs => Ok(outputs),
        (rows, _) => Err(TensorError::Shape(format!(
            "{kernel}: x has {inputs} columns, so w must have {inputs} rows, not {rows}"
        ))),
    }
}

fn expect_shape(kernel: &str, what: &str, t: &Tensor, shape: &[usize]) -> Result<(), TensorError> {
    if t.shape == shape {
        Ok(())
    } else {
        Err(TensorError::Shape(format!(
            "{kernel}: {what} must be of shape {shape:?}, not {:?}",
            t.shape
        )))
    }
}

#[cfg(test)]
#[path = "layers_tests.rs"]
mod tests;
