//! One SGD step of a linear least-squares model, the inner loop of a
//! training step: the same source is compiled natively and into the bench
//! guest, so the two timings compare the compilers, not the code.
#![no_std]

/// A batch of `y.len()` rows of `w.len()` features in `x` (row-major).
/// Updates `w` by one step of gradient descent on the mean squared error
/// and returns the batch's loss. `grad` is scratch space of `w.len()`.
pub fn sgd_step(w: &mut [f32], grad: &mut [f32], x: &[f32], y: &[f32], lr: f32) -> f32 {
    let dim = w.len();
    assert_eq!(x.len(), dim * y.len());
    assert_eq!(grad.len(), dim);
    grad.iter_mut().for_each(|g| *g = 0.0);
    let mut loss = 0.0;
    for (row, &target) in x.chunks_exact(dim).zip(y) {
        let pred = dot(row, w);
        let err = pred - target;
        loss += err * err;
        for (g, &xi) in grad.iter_mut().zip(row) {
            *g += err * xi;
        }
    }
    let scale = 2.0 * lr / y.len() as f32;
    for (wi, &g) in w.iter_mut().zip(grad.iter()) {
        *wi -= scale * g;
    }
    loss / y.len() as f32
}

/// A dot product in eight lanes, so that it vectorizes (a single running
/// sum would force the additions into order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

/// Deterministic pseudo-random data for a problem of `rows` × `dim`:
/// features in [-1, 1) and targets from a fixed linear model plus noise.
pub fn problem(rows: usize, dim: usize, seed: u64, x: &mut [f32], y: &mut [f32]) {
    let mut state = seed | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    for r in 0..rows {
        let mut target = 0.0;
        for c in 0..dim {
            let v = next();
            x[r * dim + c] = v;
            target += v * ((c % 7) as f32 - 3.0) * 0.1;
        }
        y[r] = target + 0.01 * next();
    }
}
