//! What the benchmarks run both natively and inside the bench guest: one
//! SGD step of a linear least-squares model (the inner loop of a training
//! step) and its timing procedure, and the checkpoint files they write. One
//! source for both sides, so the timings compare compilers, not code.

use std::hint::black_box;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// A batch of `y.len()` rows of `w.len()` features in `x` (row-major).
/// Updates `w` by one step of gradient descent on the mean squared error
/// and returns the batch's loss. `grad` is scratch space of `w.len()`.
pub fn sgd_step(w: &mut [f32], grad: &mut [f32], x: &[f32], y: &[f32], lr: f32) -> f32 {
    step::<Plain>(w, grad, x, y, lr)
}

/// [`sgd_step`] with every loop over the features written in blocks of 16:
/// the same model and the same result (the per-feature arithmetic is the
/// same, in the same order; the dot product sums 16 lanes instead of 8, so
/// its rounding differs from [`sgd_step`]'s, not between native and guest).
///
/// A guest's loops pay wasmtime's epoch check on every iteration (its
/// interruption; wasmtime issue #7244), and the check costs a vectorized
/// loop most of its speed. An inner loop of fixed length is unrolled into
/// SIMD operations and leaves the check on the outer loop only: once per
/// 16 features instead of once per 4. This is how a guest author can
/// write a hot loop; the benchmarks measure what it recovers.
pub fn sgd_step_blocked(w: &mut [f32], grad: &mut [f32], x: &[f32], y: &[f32], lr: f32) -> f32 {
    step::<Blocked>(w, grad, x, y, lr)
}

/// The step of [`sgd_step`] and [`sgd_step_blocked`], with its loops over
/// the features written as `L` says.
fn step<L: FeatureLoops>(w: &mut [f32], grad: &mut [f32], x: &[f32], y: &[f32], lr: f32) -> f32 {
    let dim = w.len();
    assert_eq!(x.len(), dim * y.len());
    assert_eq!(grad.len(), dim);
    grad.iter_mut().for_each(|g| *g = 0.0);
    let mut loss = 0.0;
    for (row, &target) in x.chunks_exact(dim).zip(y) {
        let pred = L::dot(row, w);
        let err = pred - target;
        loss += err * err;
        L::each(grad, row, |g, xi| *g += err * xi);
    }
    let scale = 2.0 * lr / y.len() as f32;
    L::each(w, grad, |wi, g| *wi -= scale * g);
    loss / y.len() as f32
}

/// How a step's loops over the features are written.
trait FeatureLoops {
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `f(a[i], b[i])` for every feature `i`.
    fn each(a: &mut [f32], b: &[f32], f: impl Fn(&mut f32, f32));
}

/// Loops as one writes them; the dot product in eight lanes, so that it
/// vectorizes (a single running sum would force the additions into order).
struct Plain;

impl FeatureLoops for Plain {
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        dot::<8>(a, b)
    }

    #[inline(always)]
    fn each(a: &mut [f32], b: &[f32], f: impl Fn(&mut f32, f32)) {
        for (x, &y) in a.iter_mut().zip(b) {
            f(x, y);
        }
    }
}

/// Loops over blocks of [`BLOCK`] features, and the dot product in as
/// many lanes.
struct Blocked;

/// Features per block in [`sgd_step_blocked`].
const BLOCK: usize = 16;

impl FeatureLoops for Blocked {
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        dot::<BLOCK>(a, b)
    }

    #[inline(always)]
    fn each(a: &mut [f32], b: &[f32], f: impl Fn(&mut f32, f32)) {
        let (mut ca, mut cb) = (a.chunks_exact_mut(BLOCK), b.chunks_exact(BLOCK));
        for (x, y) in (&mut ca).zip(&mut cb) {
            for i in 0..BLOCK {
                f(&mut x[i], y[i]);
            }
        }
        for (x, &y) in ca.into_remainder().iter_mut().zip(cb.remainder()) {
            f(x, y);
        }
    }
}

/// A dot product summed in `LANES` running sums.
fn dot<const LANES: usize>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
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

/// Which SGD step [`time_sgd`] times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Loops {
    /// [`sgd_step`]: loops as one writes them.
    #[default]
    Plain,
    /// [`sgd_step_blocked`]: loops in blocks of 16.
    Blocked,
}

/// Time `steps` SGD steps on a `batch` × `dim` problem after a warm-up of a
/// tenth as many: nanoseconds per step, and the last batch loss (which the
/// caller compares between native and guest).
pub fn time_sgd(steps: u32, dim: usize, batch: usize, loops: Loops) -> (f64, f32) {
    // A generic function per kernel: each step is a direct call, as it was
    // with one kernel.
    match loops {
        Loops::Plain => time_steps(steps, dim, batch, sgd_step),
        Loops::Blocked => time_steps(steps, dim, batch, sgd_step_blocked),
    }
}

fn time_steps(
    steps: u32,
    dim: usize,
    batch: usize,
    sgd_step: impl Fn(&mut [f32], &mut [f32], &[f32], &[f32], f32) -> f32,
) -> (f64, f32) {
    let (mut x, mut y) = (vec![0.0; dim * batch], vec![0.0; batch]);
    problem(batch, dim, 7, &mut x, &mut y);
    let (mut w, mut grad) = (vec![0.0; dim], vec![0.0; dim]);
    // Warm up caches and the allocator.
    for _ in 0..steps / 10 {
        sgd_step(&mut w, &mut grad, &x, &y, 0.01);
    }
    let started = Instant::now();
    let mut loss = 0.0;
    for _ in 0..steps {
        loss = sgd_step(&mut w, &mut grad, black_box(&x), &y, 0.01);
    }
    (
        started.elapsed().as_nanos() as f64 / f64::from(steps.max(1)),
        loss,
    )
}

/// Write a checkpoint's files below `dir`: for each (count, size) of
/// `layout`, `count` files of `size` pseudo-random bytes drawn from `seed`
/// in `group-N/fNNNNN.bin`.
pub fn write_layout(dir: &Path, layout: &[(u32, u64)], seed: u64) -> std::io::Result<()> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut buf = vec![0u8; 1 << 20];
    for (group, &(count, size)) in layout.iter().enumerate() {
        let sub = dir.join(format!("group-{group}"));
        std::fs::create_dir_all(&sub)?;
        for i in 0..count {
            let mut f = std::fs::File::create(sub.join(format!("f{i:05}.bin")))?;
            let mut left = size;
            while left > 0 {
                let n = left.min(buf.len() as u64) as usize;
                for chunk in buf[..n].chunks_mut(8) {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
                }
                f.write_all(&buf[..n])?;
                left -= n as u64;
            }
        }
    }
    Ok(())
}
