//! What each kernel checks of its arguments, apart from its arithmetic:
//! a kernel runs its check before it writes anything, and a recorded
//! program runs the same check when the kernel is recorded (the shapes of
//! tensors never change), so that its runs check only what their rows
//! change.

use std::ops::Deref;

use super::{AdamStep, Tensor, TensorError, same_shape};

/// The sizes and strides of a GEMM: `op(a)` is `m × k`, `op(b)` `k × n`.
pub(super) struct GemmDims {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub a_rs: usize,
    pub a_cs: usize,
    pub b_rs: usize,
    pub b_cs: usize,
}

/// `gemm`: `c` is `op(a) · op(b)`'s shape, with equal inner sizes.
pub fn gemm(
    c: &Tensor,
    a: &Tensor,
    trans_a: bool,
    b: &Tensor,
    trans_b: bool,
) -> Result<(), TensorError> {
    gemm_dims(c, a, trans_a, b, trans_b).map(|_| ())
}

pub(super) fn gemm_dims(
    c: &Tensor,
    a: &Tensor,
    trans_a: bool,
    b: &Tensor,
    trans_b: bool,
) -> Result<GemmDims, TensorError> {
    let (ar, ac) = a.matrix("a")?;
    let (br, bc) = b.matrix("b")?;
    let (cr, cc) = c.matrix("c")?;
    // op(a) is m × k, op(b) is k × n; the strides say how to walk them.
    let (m, k, a_rs, a_cs) = if trans_a {
        (ac, ar, 1, ac)
    } else {
        (ar, ac, ac, 1)
    };
    let (k2, n, b_rs, b_cs) = if trans_b {
        (bc, br, 1, bc)
    } else {
        (br, bc, bc, 1)
    };
    if k != k2 || cr != m || cc != n {
        return Err(TensorError::Shape(format!(
            "gemm: op(a) is {m}×{k} and op(b) {k2}×{n}, so c must be {m}×{n} with equal inner sizes; c is {cr}×{cc}"
        )));
    }
    Ok(GemmDims {
        m,
        k,
        n,
        a_rs,
        a_cs,
        b_rs,
        b_cs,
    })
}

/// `axpy`: the same shapes.
pub fn axpy(y: &Tensor, x: &Tensor) -> Result<(), TensorError> {
    same_shape("y", y, "x", x)
}

/// `gather-rows` of rows not known yet: `out` is a matrix with `source`'s
/// columns. Returns `out`'s rows (how many indexes it takes) and
/// `source`'s (the bound of every index).
pub fn gather_shapes(out: &Tensor, source: &Tensor) -> Result<(usize, usize), TensorError> {
    let (n, cols) = source.matrix("source")?;
    match out.shape[..] {
        [rows, c] if c == cols => Ok((rows, n)),
        _ => Err(TensorError::Shape(format!(
            "gather-rows: a source with {cols} columns needs out of shape [rows, {cols}], not {:?}",
            out.shape
        ))),
    }
}

/// `gather-rows`: `out` has a row per index, each index below `source`'s
/// rows.
pub fn gather_rows(out: &Tensor, source: &Tensor, rows: &[u32]) -> Result<(), TensorError> {
    let (n, cols) = source.matrix("source")?;
    if out.shape != [rows.len(), cols] {
        return Err(TensorError::Shape(format!(
            "gather-rows: {} rows of a source with {cols} columns need out of shape [{}, {cols}], not {:?}",
            rows.len(),
            rows.len(),
            out.shape
        )));
    }
    match first_not_below(rows, n) {
        None => Ok(()),
        Some(k) => Err(TensorError::Invalid(format!(
            "gather-rows: rows[{k}] is {}, and the source has {n} rows",
            rows[k]
        ))),
    }
}

/// Where the first of `indexes` not below `n` is, if one is.
pub fn first_not_below(indexes: &[u32], n: usize) -> Option<usize> {
    indexes.iter().position(|&i| i as usize >= n)
}

/// `add-row`: `row` has `x`'s columns.
pub fn add_row(x: &Tensor, row: &Tensor) -> Result<(), TensorError> {
    let (_, cols) = x.matrix("x")?;
    if row.shape != [cols] {
        return Err(TensorError::Shape(format!(
            "add-row: x has {cols} columns, so row must be of shape [{cols}], not {:?}",
            row.shape
        )));
    }
    Ok(())
}

/// `sum-rows`: `out` has `x`'s columns.
pub fn sum_rows(out: &Tensor, x: &Tensor) -> Result<(), TensorError> {
    let (_, cols) = x.matrix("x")?;
    if out.shape != [cols] {
        return Err(TensorError::Shape(format!(
            "sum-rows: x has {cols} columns, so out must be of shape [{cols}], not {:?}",
            out.shape
        )));
    }
    Ok(())
}

/// `activate-backward`: the same shapes.
pub fn activate_backward(grad: &Tensor, output: &Tensor) -> Result<(), TensorError> {
    same_shape("grad", grad, "output", output)
}

/// `softmax-cross-entropy` of labels not known yet: `logits` is a matrix
/// and `grad` its shape. Returns the rows and the classes.
pub fn softmax_shapes(logits: &Tensor, grad: &Tensor) -> Result<(usize, usize), TensorError> {
    let (rows, classes) = logits.matrix("logits")?;
    same_shape("grad", grad, "logits", logits)?;
    Ok((rows, classes))
}

/// `softmax-cross-entropy`: a label per row of `logits`, each below its
/// classes.
pub fn softmax_cross_entropy(
    logits: &Tensor,
    labels: &[u32],
    grad: &Tensor,
) -> Result<(), TensorError> {
    let (rows, classes) = softmax_shapes(logits, grad)?;
    if labels.len() != rows {
        return Err(TensorError::Shape(format!(
            "softmax-cross-entropy: {} labels for {rows} rows of logits",
            labels.len()
        )));
    }
    labels_below(labels, classes)
}

/// Every label below `classes`.
pub fn labels_below(labels: &[u32], classes: usize) -> Result<(), TensorError> {
    match first_not_below(labels, classes) {
        None => Ok(()),
        Some(row) => Err(TensorError::Invalid(format!(
            "softmax-cross-entropy: the label of row {row} is {}, not below the {classes} classes",
            labels[row]
        ))),
    }
}

/// `sgd-momentum`: the same shapes.
pub fn sgd_momentum(param: &Tensor, velocity: &Tensor, grad: &Tensor) -> Result<(), TensorError> {
    same_shape("param", param, "velocity", velocity)?;
    same_shape("param", param, "grad", grad)
}

/// `sgd-momentum-list`: lists of one length, each triple of one shape.
pub fn sgd_momentum_list<P, V, G>(
    params: &[P],
    velocity: &[V],
    grads: &[G],
) -> Result<(), TensorError>
where
    P: Deref<Target = Tensor>,
    V: Deref<Target = Tensor>,
    G: Deref<Target = Tensor>,
{
    if params.len() != velocity.len() || params.len() != grads.len() {
        return Err(TensorError::Shape(format!(
            "sgd-momentum-list: {} params, {} velocities and {} gradients; the lists must be as long",
            params.len(),
            velocity.len(),
            grads.len()
        )));
    }
    for (i, ((p, v), g)) in params.iter().zip(velocity).zip(grads).enumerate() {
        // The names are formatted only for a refusal: this runs every step.
        if p.shape != v.shape || p.shape != g.shape {
            let at = |what: &str| format!("{what}[{i}]");
            same_shape(&at("params"), p, &at("velocity"), v)?;
            same_shape(&at("params"), p, &at("grads"), g)?;
        }
    }
    Ok(())
}

/// `adam`: the same shapes, a step from 1, betas in [0, 1) and a positive
/// epsilon.
pub fn adam(
    param: &Tensor,
    m: &Tensor,
    v: &Tensor,
    grad: &Tensor,
    h: AdamStep,
) -> Result<(), TensorError> {
    same_shape("param", param, "m", m)?;
    same_shape("param", param, "v", v)?;
    same_shape("param", param, "grad", grad)?;
    let unit = |b: f32| (0.0..1.0).contains(&b);
    let usable =
        h.step > 0 && unit(h.beta1) && unit(h.beta2) && h.epsilon.is_finite() && h.epsilon > 0.0;
    if !usable {
        return Err(TensorError::Invalid(format!(
            "adam: step counts from 1 and needs 0 <= beta1, beta2 < 1 and epsilon > 0, not step {}, beta1 {}, beta2 {}, epsilon {}",
            h.step, h.beta1, h.beta2, h.epsilon
        )));
    }
    Ok(())
}

/// `dense`: `x` `[rows, in]`, `w` `[in, out]`, `out` `[rows, out]` and
/// `bias` `[out]`.
pub fn dense(
    out: &Tensor,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<(), TensorError> {
    let (rows, inputs) = x.matrix("x")?;
    let outputs = layer_width("dense", w, inputs)?;
    expect_shape("dense", "out", out, &[rows, outputs])?;
    if let Some(b) = bias {
        expect_shape("dense", "bias", b, &[outputs])?;
    }
    Ok(())
}

/// `dense-backward`: as `dense`, with `grad` `[rows, out]`, `grad_w`
/// `w`'s shape, `grad_bias` `[out]` and `grad_x` `x`'s shape.
pub fn dense_backward(
    grad: &Tensor,
    x: &Tensor,
    w: &Tensor,
    grad_w: &Tensor,
    grad_bias: Option<&Tensor>,
    grad_x: Option<&Tensor>,
) -> Result<(), TensorError> {
    let (rows, inputs) = x.matrix("x")?;
    let outputs = layer_width("dense-backward", w, inputs)?;
    expect_shape("dense-backward", "grad", grad, &[rows, outputs])?;
    expect_shape("dense-backward", "grad-w", grad_w, &[inputs, outputs])?;
    if let Some(gb) = grad_bias {
        expect_shape("dense-backward", "grad-bias", gb, &[outputs])?;
    }
    if let Some(gx) = grad_x {
        same_shape("grad-x", gx, "x", x)?;
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
