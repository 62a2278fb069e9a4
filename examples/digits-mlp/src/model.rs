//! A multilayer perceptron, 64 → hidden (ReLU) → 10, trained with softmax
//! cross-entropy. Parameters and gradients are flat vectors laid out the
//! same way, so one all-reduce averages every gradient.

use crate::data::{CLASSES, PIXELS, Rng};

/// Where each tensor lies in the flat parameter vector, and its shape.
pub struct Layout {
    pub hidden: usize,
}

impl Layout {
    /// `(name, offset, shape)` of every tensor, in order.
    pub fn tensors(&self) -> [(&'static str, usize, Vec<usize>); 4] {
        let h = self.hidden;
        [
            ("w1", 0, vec![PIXELS, h]),
            ("b1", PIXELS * h, vec![h]),
            ("w2", PIXELS * h + h, vec![h, CLASSES]),
            ("b2", PIXELS * h + h + h * CLASSES, vec![CLASSES]),
        ]
    }

    pub fn len(&self) -> usize {
        let h = self.hidden;
        PIXELS * h + h + h * CLASSES + CLASSES
    }

    /// Initial parameters (uniform Glorot weights, zero biases): the same
    /// on every rank for the same seed.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed ^ 0x5EED);
        let mut params = vec![0.0; self.len()];
        for (name, offset, shape) in self.tensors() {
            if name.starts_with('w') {
                let bound = (6.0 / (shape[0] + shape[1]) as f32).sqrt();
                let n: usize = shape.iter().product();
                for p in &mut params[offset..offset + n] {
                    *p = bound * rng.symmetric();
                }
            }
        }
        params
    }
}

/// The loss and correct predictions of some samples.
#[derive(Default, Clone, Copy)]
pub struct Tally {
    pub loss: f64,
    pub correct: u64,
}

/// Forward (and with `grad`, backward) pass over one sample: adds the
/// sample's loss gradient to `grad`.
pub fn sample(
    layout: &Layout,
    params: &[f32],
    image: &[f32; PIXELS],
    label: u8,
    grad: Option<&mut [f32]>,
    hidden: &mut Vec<f32>,
) -> Tally {
    let h = layout.hidden;
    let [(_, w1, _), (_, b1, _), (_, w2, _), (_, b2, _)] = layout.tensors();
    hidden.clear();
    hidden.extend_from_slice(&params[b1..b1 + h]);
    for (i, x) in image.iter().enumerate() {
        if *x != 0.0 {
            let row = &params[w1 + i * h..w1 + (i + 1) * h];
            for (a, w) in hidden.iter_mut().zip(row) {
                *a += x * w;
            }
        }
    }
    for a in hidden.iter_mut() {
        *a = a.max(0.0);
    }
    let mut logits = [0.0f32; CLASSES];
    logits.copy_from_slice(&params[b2..b2 + CLASSES]);
    for (j, a) in hidden.iter().enumerate() {
        if *a != 0.0 {
            let row = &params[w2 + j * CLASSES..w2 + (j + 1) * CLASSES];
            for (l, w) in logits.iter_mut().zip(row) {
                *l += a * w;
            }
        }
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs = [0.0f32; CLASSES];
    let mut total = 0.0;
    for (p, l) in probs.iter_mut().zip(&logits) {
        *p = (l - max).exp();
        total += *p;
    }
    for p in &mut probs {
        *p /= total;
    }
    let predicted = (0..CLASSES)
        .max_by(|a, b| logits[*a].total_cmp(&logits[*b]))
        .unwrap_or(0);
    let tally = Tally {
        loss: -f64::from(probs[label as usize].max(1e-12).ln()),
        correct: u64::from(predicted == label as usize),
    };
    let Some(grad) = grad else {
        return tally;
    };
    // d loss / d logits = softmax - one-hot.
    let mut dlogits = probs;
    dlogits[label as usize] -= 1.0;
    for (g, d) in grad[b2..b2 + CLASSES].iter_mut().zip(&dlogits) {
        *g += d;
    }
    // Through the second layer: its gradients, and d loss / d hidden (zero
    // where the ReLU was off), kept in `hidden`'s place.
    for (j, a) in hidden.iter_mut().enumerate() {
        if *a == 0.0 {
            continue;
        }
        let w2row = &params[w2 + j * CLASSES..w2 + (j + 1) * CLASSES];
        let mut dhidden = 0.0;
        for ((g, d), w) in grad[w2 + j * CLASSES..w2 + (j + 1) * CLASSES]
            .iter_mut()
            .zip(&dlogits)
            .zip(w2row)
        {
            *g += *a * d;
            dhidden += d * w;
        }
        *a = dhidden;
    }
    let dhidden = &*hidden;
    for (g, d) in grad[b1..b1 + h].iter_mut().zip(dhidden) {
        *g += d;
    }
    // The first layer's gradient is the outer product image × dhidden, a
    // row per pixel.
    for (i, x) in image.iter().enumerate() {
        if *x != 0.0 {
            for (g, d) in grad[w1 + i * h..w1 + (i + 1) * h].iter_mut().zip(dhidden) {
                *g += x * d;
            }
        }
    }
    tally
}

/// One SGD step with momentum: `v = momentum·v + scale·g`, then
/// `p -= lr·v`, for every parameter.
///
/// Every rank makes the whole update after the all-reduce, so its time is
/// not divided by the ranks, and it is written in blocks of 16 for that
/// reason. Wasmtime checks at the head of every loop, on every iteration,
/// whether the host asked the guest to stop (its epoch check), and that
/// check costs a vectorized loop most of its speed (wasmtime issue #7244).
/// The inner loop over a block has a fixed length, so the compiler unrolls
/// it into four SIMD operations each way and only the outer loop keeps the
/// check: once per 16 parameters instead of once per 4. The arithmetic is
/// the same, in the same order, so the bits are too.
pub fn sgd_momentum(
    params: &mut [f32],
    velocity: &mut [f32],
    grad: &[f32],
    scale: f32,
    lr: f32,
    momentum: f32,
) {
    const BLOCK: usize = 16;
    let step = |p: &mut f32, v: &mut f32, g: f32| {
        *v = momentum * *v + g * scale;
        *p -= lr * *v;
    };
    let mut p = params.chunks_exact_mut(BLOCK);
    let mut v = velocity.chunks_exact_mut(BLOCK);
    let mut g = grad.chunks_exact(BLOCK);
    for ((p, v), g) in (&mut p).zip(&mut v).zip(&mut g) {
        for k in 0..BLOCK {
            step(&mut p[k], &mut v[k], g[k]);
        }
    }
    let rest = p.into_remainder().iter_mut().zip(v.into_remainder());
    for ((p, v), g) in rest.zip(g.remainder()) {
        step(p, v, *g);
    }
}
