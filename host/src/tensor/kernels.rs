//! The kernels: what a multilayer perceptron's forward and backward pass
//! and its optimizer step need, on rank-1 and rank-2 tensors. Each checks
//! its arguments before it writes anything.

use super::check;
use super::subnormals::Flushed;
use super::{AdamStep, Tensor, TensorError};

/// Work between two asks of the stop callback in [`gemm()`], per thread:
/// about ten milliseconds on one core (2 flops a multiply-add, ~100
/// GFLOP/s here). Each block packs its operands again, so smaller blocks
/// cost speed: at a fifth of this a 1024³ GEMM took 12% longer than the
/// gemm crate's own single call.
const FLOPS_PER_BLOCK: usize = 1_000_000_000;
/// The fewest rows and columns of `c` a block of [`gemm()`] computes:
/// thinner blocks would read all of `b` for a few rows (a GEMV, bound by
/// memory, not arithmetic). With an enormous inner size a block can take
/// longer than [`FLOPS_PER_BLOCK`]: 256 × 256 outputs of 32768 products
/// each are about 40 ms.
const MIN_BLOCK: usize = 256;

/// An element-wise function whose derivative is a function of its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// max(x, 0).
    Relu,
    /// The hyperbolic tangent.
    Tanh,
    /// 1 / (1 + e^-x).
    Sigmoid,
    /// e^x.
    Exp,
}

/// `c = alpha * op(a) * op(b) + beta * c`, `op` transposing when asked,
/// on up to `threads` threads of the kernels' pool (the gemm crate
/// decides how many a size is worth), subnormals flushed (`subnormals`).
/// Asks `stop` between blocks of `c`; when it says so, returns
/// [`TensorError::Stopped`] with `c` partly computed.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    c: &mut Tensor,
    alpha: f32,
    a: &Tensor,
    trans_a: bool,
    b: &Tensor,
    trans_b: bool,
    beta: f32,
    threads: usize,
    stop: &dyn Fn() -> bool,
) -> Result<(), TensorError> {
    let check::GemmDims {
        m,
        k,
        n,
        a_rs,
        a_cs,
        b_rs,
        b_cs,
    } = check::gemm_dims(c, a, trans_a, b, trans_b)?;
    let several = threads > 1;
    let _flushed = Flushed::new();
    let (block_rows, block_cols) = block(m, k, n, threads.max(1));
    for row in (0..m).step_by(block_rows.max(1)) {
        for col in (0..n).step_by(block_cols.max(1)) {
            if stop() {
                return Err(TensorError::Stopped);
            }
            let (rows, cols) = (block_rows.min(m - row), block_cols.min(n - col));
            let (c, a, b) = (&mut c.data[..], &a.data[..], &b.data[..]);
            // With several threads allowed, `Rayon` whatever the number
            // the pool gives (`Rayon(1)` computes on this thread): the
            // crate then cuts the work the same way.
            let mut block = move |given: usize| {
                let parallelism = match several {
                    true => gemm::Parallelism::Rayon(given.max(1)),
                    false => gemm::Parallelism::None,
                };
                // SAFETY: every pointer stays inside its tensor: rows
                // `row..row + rows` of op(a), columns `col..col + cols` of
                // op(b), and that block of c, walked with the strides of the
                // shapes checked above; c is a tensor of its own (the borrow
                // checker keeps it apart from a and b).
                unsafe {
                    gemm::gemm(
                        rows,
                        cols,
                        k,
                        c.as_mut_ptr().add(row * n + col),
                        1,
                        n as isize,
                        beta != 0.0,
                        a.as_ptr().add(row * a_rs),
                        a_cs as isize,
                        a_rs as isize,
                        b.as_ptr().add(col * b_cs),
                        b_cs as isize,
                        b_rs as isize,
                        beta,
                        alpha,
                        false,
                        false,
                        false,
                        parallelism,
                    );
                }
            };
            // Below the crate's threshold it computes on the calling
            // thread whatever it is allowed; above, on the kernels' threads.
            if several && rows * cols * k >= gemm::get_threading_threshold() {
                super::pool::install(threads, block);
            } else {
                block(threads);
            }
        }
    }
    Ok(())
}

/// The rows and columns of c one block of an `m × k × n` GEMM on
/// `threads` threads computes: all of it when that is little work, else
/// blocks of at most about [`FLOPS_PER_BLOCK`] per thread (the same time
/// between two asks of the stop callback). Whole rows when at least
/// [`MIN_BLOCK`] of them fit, in blocks of equal height (each block reads
/// `b` whole and its rows of `a` once); else [`MIN_BLOCK`] rows and as
/// many columns as fit, never fewer than [`MIN_BLOCK`].
fn block(m: usize, k: usize, n: usize, threads: usize) -> (usize, usize) {
    let per_output = 2 * k.max(1);
    let flops = FLOPS_PER_BLOCK * threads;
    if m * n * per_output <= flops {
        return (m, n);
    }
    let rows_fitting = flops / (n * per_output);
    if rows_fitting >= MIN_BLOCK.min(m) {
        let blocks = m.div_ceil(rows_fitting.max(1));
        return (m.div_ceil(blocks), n);
    }
    let rows = MIN_BLOCK.min(m);
    let cols = (flops / (rows * per_output)).clamp(MIN_BLOCK.min(n), n);
    (rows, cols)
}

/// `y = y + alpha * x`.
pub fn axpy(y: &mut Tensor, alpha: f32, x: &Tensor) -> Result<(), TensorError> {
    check::axpy(y, x)?;
    let _flushed = Flushed::new();
    for (y, x) in y.data.iter_mut().zip(&x.data) {
        *y += alpha * x;
    }
    Ok(())
}

/// `x = alpha * x`.
pub fn scale(x: &mut Tensor, alpha: f32) {
    let _flushed = Flushed::new();
    x.data.iter_mut().for_each(|v| *v *= alpha);
}

/// `out`'s k-th row = row `rows[k]` of `source`.
pub fn gather_rows(out: &mut Tensor, source: &Tensor, rows: &[u32]) -> Result<(), TensorError> {
    check::gather_rows(out, source, rows)?;
    let cols = source.shape[1];
    for (dst, &r) in out.data.chunks_exact_mut(cols.max(1)).zip(rows) {
        let at = r as usize * cols;
        dst.copy_from_slice(&source.data[at..at + cols]);
    }
    Ok(())
}

/// Add `row` to every row of `x`.
pub fn add_row(x: &mut Tensor, row: &Tensor) -> Result<(), TensorError> {
    check::add_row(x, row)?;
    let _flushed = Flushed::new();
    let cols = row.shape[0];
    for x_row in x.data.chunks_exact_mut(cols.max(1)) {
        for (v, r) in x_row.iter_mut().zip(&row.data) {
            *v += r;
        }
    }
    Ok(())
}

/// `out = beta * out + the sum of x's rows`.
pub fn sum_rows(out: &mut Tensor, x: &Tensor, beta: f32) -> Result<(), TensorError> {
    check::sum_rows(out, x)?;
    let _flushed = Flushed::new();
    let cols = out.shape[0];
    scale(out, beta);
    for x_row in x.data.chunks_exact(cols.max(1)) {
        for (o, v) in out.data.iter_mut().zip(x_row) {
            *o += v;
        }
    }
    Ok(())
}

/// `x = f(x)`.
pub fn activate(x: &mut Tensor, f: Activation) {
    let _flushed = Flushed::new();
    // One loop per function, each with its function inlined: through a
    // function pointer every element cost a call, and ReLU did not
    // vectorize (about 1 ns an element, a fifth of the digits example's
    // step with `activate_backward`).
    fn each(data: &mut [f32], f: impl Fn(f32) -> f32) {
        data.iter_mut().for_each(|v| *v = f(*v));
    }
    match f {
        Activation::Relu => each(&mut x.data, |v| v.max(0.0)),
        Activation::Tanh => each(&mut x.data, f32::tanh),
        Activation::Sigmoid => each(&mut x.data, |v| 1.0 / (1.0 + (-v).exp())),
        Activation::Exp => each(&mut x.data, f32::exp),
    }
}

/// `grad = grad * f'`, with `f'` from `output = f(input)`.
pub fn activate_backward(
    grad: &mut Tensor,
    output: &Tensor,
    f: Activation,
) -> Result<(), TensorError> {
    check::activate_backward(grad, output)?;
    let _flushed = Flushed::new();
    // One loop per function, as in `activate`.
    fn each(grad: &mut [f32], output: &[f32], derivative: impl Fn(f32) -> f32) {
        for (g, y) in grad.iter_mut().zip(output) {
            *g *= derivative(*y);
        }
    }
    let (g, y) = (&mut grad.data, &output.data);
    match f {
        Activation::Relu => each(g, y, |y| if y > 0.0 { 1.0 } else { 0.0 }),
        Activation::Tanh => each(g, y, |y| 1.0 - y * y),
        Activation::Sigmoid => each(g, y, |y| y * (1.0 - y)),
        Activation::Exp => each(g, y, |y| y),
    }
    Ok(())
}

/// Softmax cross-entropy of `logits` against `labels`: the summed loss,
/// the rows whose largest logit is their label, and in `grad` the
/// gradient of the summed loss times `grad_scale`.
pub fn softmax_cross_entropy(
    logits: &Tensor,
    labels: &[u32],
    grad: &mut Tensor,
    grad_scale: f32,
) -> Result<(f64, u32), TensorError> {
    check::softmax_cross_entropy(logits, labels, grad)?;
    let _flushed = Flushed::new();
    let classes = logits.shape[1];
    let (mut loss, mut correct) = (0.0f64, 0u32);
    for ((z, g), &label) in logits
        .data
        .chunks_exact(classes.max(1))
        .zip(grad.data.chunks_exact_mut(classes.max(1)))
        .zip(labels)
    {
        let label = label as usize;
        // The first largest logit is the prediction.
        let (best, max) = z
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |(bi, bm), (i, &v)| {
                if v > bm { (i, v) } else { (bi, bm) }
            });
        let mut sum = 0.0f32;
        for (g, &v) in g.iter_mut().zip(z) {
            *g = (v - max).exp();
            sum += *g;
        }
        loss += f64::from(sum.ln() - (z[label] - max));
        for g in g.iter_mut() {
            *g *= grad_scale / sum;
        }
        g[label] -= grad_scale;
        correct += u32::from(best == label);
    }
    Ok((loss, correct))
}

/// SGD with momentum: `velocity = momentum * velocity + grad_scale *
/// grad`, `param = param - lr * velocity`.
pub fn sgd_momentum(
    param: &mut Tensor,
    velocity: &mut Tensor,
    grad: &Tensor,
    grad_scale: f32,
    lr: f32,
    momentum: f32,
) -> Result<(), TensorError> {
    check::sgd_momentum(param, velocity, grad)?;
    let _flushed = Flushed::new();
    for ((p, v), g) in param
        .data
        .iter_mut()
        .zip(&mut velocity.data)
        .zip(&grad.data)
    {
        // The same product as scaling the gradient first (`scale`), so a
        // caller who did that gets the same values.
        *v = momentum * *v + grad_scale * g;
        *p -= lr * *v;
    }
    Ok(())
}

/// Adam: `m = beta1 * m + (1 - beta1) * grad`, `v = beta2 * v + (1 -
/// beta2) * grad^2`, `param -= lr * m' / (sqrt(v') + epsilon)` with the
/// bias-corrected moments `m' = m / (1 - beta1^step)`, `v' = v / (1 -
/// beta2^step)`: Kingma and Ba's algorithm 1, as PyTorch and burn compute
/// it.
pub fn adam(
    param: &mut Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    grad: &Tensor,
    h: AdamStep,
) -> Result<(), TensorError> {
    check::adam(param, m, v, grad, h)?;
    let _flushed = Flushed::new();
    // The corrections in f64: beta^step for large steps underflows f32's
    // precision long before it reaches 0.
    let step = i32::try_from(h.step).unwrap_or(i32::MAX);
    let c1 = (1.0 - f64::from(h.beta1).powi(step)) as f32;
    let c2 = (1.0 - f64::from(h.beta2).powi(step)) as f32;
    for (((p, m), v), g) in param
        .data
        .iter_mut()
        .zip(&mut m.data)
        .zip(&mut v.data)
        .zip(&grad.data)
    {
        *m = h.beta1 * *m + (1.0 - h.beta1) * g;
        *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
        *p -= h.lr * (*m / c1) / ((*v / c2).sqrt() + h.epsilon);
    }
    Ok(())
}

#[cfg(test)]
#[path = "kernels_tests.rs"]
mod tests;
