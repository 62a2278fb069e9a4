//! Each kernel against a plain-Rust reference; the backward kernels
//! against finite differences of their forward functions.

use super::*;

fn t(shape: &[u32], seed: u64) -> Tensor {
    Tensor::uniform(shape, -1.0, 1.0, seed).unwrap()
}

fn never() -> bool {
    false
}

/// `x` as a kernel reads it: a subnormal as zero on x86-64.
fn as_read(x: f32) -> f32 {
    match cfg!(target_arch = "x86_64") && x.is_subnormal() {
        true => 0.0f32.copysign(x),
        false => x,
    }
}

/// `op(x)[i][j]` of a matrix.
fn at(x: &Tensor, trans: bool, i: usize, j: usize) -> f32 {
    let cols = x.shape()[1];
    if trans {
        x.values()[j * cols + i]
    } else {
        x.values()[i * cols + j]
    }
}

#[test]
fn gemm_matches_the_textbook_product_with_every_transposition() {
    let (m, k, n) = (5, 7, 3);
    for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
        let a = if trans_a {
            t(&[k, m], 1)
        } else {
            t(&[m, k], 1)
        };
        let b = if trans_b {
            t(&[n, k], 2)
        } else {
            t(&[k, n], 2)
        };
        let c0 = t(&[m, n], 3);
        let mut c = c0.clone();
        gemm(&mut c, 0.5, &a, trans_a, &b, trans_b, 2.0, 1, &never).unwrap();
        for i in 0..m as usize {
            for j in 0..n as usize {
                let dot: f32 = (0..k as usize)
                    .map(|p| at(&a, trans_a, i, p) * at(&b, trans_b, p, j))
                    .sum();
                let want = 0.5 * dot + 2.0 * c0.values()[i * n as usize + j];
                let got = c.values()[i * n as usize + j];
                // f32 sums of 7 products of values in [-1, 1).
                assert!(
                    (got - want).abs() <= 1e-5,
                    "{trans_a} {trans_b} ({i},{j}): {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn gemm_with_beta_zero_ignores_what_c_held() {
    let (a, b) = (t(&[4, 4], 1), t(&[4, 4], 2));
    let mut c = Tensor::from_vec(&[4, 4], vec![f32::NAN; 16]).unwrap();
    gemm(&mut c, 1.0, &a, false, &b, false, 0.0, 1, &never).unwrap();
    assert!(c.values().iter().all(|v| v.is_finite()));
}

#[test]
fn gemm_refuses_shapes_that_do_not_fit_and_changes_nothing() {
    let (a, b) = (t(&[2, 3], 1), t(&[2, 3], 2));
    let mut c = t(&[2, 2], 3);
    let before = c.clone();
    let e = gemm(&mut c, 1.0, &a, false, &b, false, 0.0, 1, &never).unwrap_err();
    assert!(e.to_string().contains("op(a) is 2×3 and op(b) 2×3"), "{e}");
    assert_eq!(c, before);
    // With b transposed the same tensors fit.
    gemm(&mut c, 1.0, &a, false, &b, true, 0.0, 1, &never).unwrap();
    let e = gemm(&mut c, 1.0, &t(&[6], 1), false, &b, false, 0.0, 1, &never).unwrap_err();
    assert!(e.to_string().contains("a must be a matrix"), "{e}");
}

#[test]
fn blocks_hold_about_the_same_work_and_are_never_thin() {
    assert_eq!(block(10, 10, 10, 1), (10, 10), "little work: one block");
    let (r, c) = block(2048, 512, 512, 1);
    assert_eq!(
        (r, c),
        (1024, 512),
        "whole rows, two blocks of equal height"
    );
    assert!(
        r >= MIN_BLOCK && 2 * r * 512 * 512 <= FLOPS_PER_BLOCK + 2 * 512 * 512,
        "{r}"
    );
    let (r, c) = block(4096, 8192, 4096, 1);
    assert_eq!(
        (r, c),
        (MIN_BLOCK, MIN_BLOCK),
        "a huge inner size: the smallest block"
    );
    let (r, c) = block(100_000, 64, 100_000, 1);
    assert!(
        r == MIN_BLOCK && (MIN_BLOCK..100_000).contains(&c),
        "{r} {c}"
    );
    assert_eq!(block(1, 100_000, 100_000, 1).0, 1);
}

#[test]
fn a_blocked_gemm_equals_one_done_whole() {
    // Enough work for several blocks in both directions, odd sizes.
    let (m, k, n) = (700, 2000, 1100);
    let (rows, cols) = block(m, k, n, 1);
    assert!(rows < m && cols < n, "{rows} {cols}");
    let (a, b) = (t(&[m as u32, k as u32], 1), t(&[k as u32, n as u32], 2));
    let mut blocked = t(&[m as u32, n as u32], 3);
    let mut whole = blocked.clone();
    gemm(&mut blocked, 1.5, &a, false, &b, false, 0.5, 1, &never).unwrap();
    // SAFETY: the shapes above, row-major.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            whole.data.as_mut_ptr(),
            1,
            n as isize,
            true,
            a.data.as_ptr(),
            1,
            k as isize,
            b.data.as_ptr(),
            1,
            n as isize,
            0.5,
            1.5,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    let worst = blocked
        .values()
        .iter()
        .zip(whole.values())
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-4, "{worst}");
}

#[test]
fn threads_share_the_work_and_change_only_the_rounding() {
    let (m, k, n) = (700, 300, 1100);
    let (a, b) = (t(&[m, k], 1), t(&[k, n], 2));
    let mut one = Tensor::zeros(&[m, n]).unwrap();
    let mut two = one.clone();
    gemm(&mut one, 1.0, &a, false, &b, false, 0.0, 1, &never).unwrap();
    gemm(&mut two, 1.0, &a, false, &b, false, 0.0, 2, &never).unwrap();
    let worst = one
        .values()
        .iter()
        .zip(two.values())
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    // Sums of 300 products of values in [-1, 1), added in another order.
    assert!(worst <= 1e-4, "{worst}");
    // A block holds a thread's share of work for each thread.
    let (r, c) = block(2048, 512, 512, 2);
    assert_eq!(c, 512);
    assert!(
        2 * r * 512 * 512 <= 2 * FLOPS_PER_BLOCK + 2 * 512 * 512,
        "{r}"
    );
    assert!(r > block(2048, 512, 512, 1).0, "{r}");
}

/// Subnormal inputs and results are zero in a GEMM on this thread and on
/// the kernels' pool alike, and this thread computes them again after.
#[test]
#[cfg(target_arch = "x86_64")]
fn gemms_treat_subnormals_as_zero_on_every_thread() {
    let tiny = f32::MIN_POSITIVE;
    // 8³ is computed on this thread; 160³ is past the gemm crate's
    // threshold for splitting, and with 2 threads runs on the pool.
    assert!(160usize.pow(3) >= gemm::get_threading_threshold());
    for (n, threads) in [(8u32, 1), (8, 2), (160, 1), (160, 2)] {
        let filled = |v: f32| Tensor::from_vec(&[n, n], vec![v; (n * n) as usize]).unwrap();
        // Subnormal inputs (else the sums would be n × m, normal), then
        // subnormal results (each product and every sum below m).
        let cases = [
            ("inputs", 2.0, tiny / 2.0, 1.0),
            ("results", 1.0, tiny, 1.0 / (4 * n) as f32),
        ];
        for (what, alpha, a, b) in cases {
            let mut c = filled(1.0);
            let (a, b) = (filled(a), filled(b));
            gemm(&mut c, alpha, &a, false, &b, false, 0.0, threads, &never).unwrap();
            let first = c.values()[0];
            assert!(
                c.values().iter().all(|&v| v == 0.0),
                "{what}, {n}³ on {threads}: {first}"
            );
        }
    }
    let product = std::hint::black_box(tiny) * std::hint::black_box(0.5);
    assert_eq!(product, tiny / 2.0);
}

#[test]
fn a_long_gemm_stops_between_blocks_when_asked() {
    // 8192 rows of 512 × 512: ~4 GFLOP, five blocks.
    let (a, b) = (t(&[8192, 512], 1), t(&[512, 512], 2));
    let mut c = Tensor::zeros(&[8192, 512]).unwrap();
    let asked = std::cell::Cell::new(0);
    let stop = || {
        asked.set(asked.get() + 1);
        asked.get() > 2
    };
    let e = gemm(&mut c, 1.0, &a, false, &b, false, 0.0, 1, &stop).unwrap_err();
    assert_eq!(e, TensorError::Stopped);
    assert_eq!(
        asked.get(),
        3,
        "asked before each block, stopped at the third"
    );
}

#[test]
fn gather_rows_copies_the_named_rows_and_refuses_bad_indexes() {
    let source = t(&[5, 3], 1);
    let mut out = Tensor::zeros(&[4, 3]).unwrap();
    gather_rows(&mut out, &source, &[4, 0, 4, 2]).unwrap();
    for (k, r) in [4, 0, 4, 2].into_iter().enumerate() {
        assert_eq!(
            &out.values()[k * 3..k * 3 + 3],
            &source.values()[r * 3..r * 3 + 3]
        );
    }
    let before = out.clone();
    let e = gather_rows(&mut out, &source, &[0, 1, 5, 2]).unwrap_err();
    assert!(
        matches!(&e, TensorError::Invalid(m) if m.contains("rows[2] is 5")),
        "{e:?}"
    );
    assert!(matches!(
        gather_rows(&mut out, &source, &[0, 1]),
        Err(TensorError::Shape(_))
    ));
    assert!(matches!(
        gather_rows(&mut out, &t(&[5, 4], 1), &[0, 1, 2, 3]),
        Err(TensorError::Shape(_))
    ));
    assert_eq!(
        out.values(),
        before.values(),
        "a refused call changes nothing"
    );
}

#[test]
fn the_element_wise_kernels_match_their_definitions() {
    let x = t(&[3, 4], 1);
    let mut y = t(&[3, 4], 2);
    let y0 = y.clone();
    axpy(&mut y, -2.0, &x).unwrap();
    for ((y, y0), x) in y.values().iter().zip(y0.values()).zip(x.values()) {
        assert_eq!(*y, y0 - 2.0 * x);
    }
    assert!(axpy(&mut y, 1.0, &t(&[4, 3], 1)).is_err());
    let row = t(&[4], 3);
    let mut z = x.clone();
    add_row(&mut z, &row).unwrap();
    assert_eq!(z.values()[5], x.values()[5] + row.values()[1]);
    let mut sums = t(&[4], 4);
    let s0 = sums.clone();
    sum_rows(&mut sums, &x, 0.5).unwrap();
    let want: f32 = 0.5 * s0.values()[2] + (0..3).map(|r| x.values()[r * 4 + 2]).sum::<f32>();
    assert!((sums.values()[2] - want).abs() < 1e-6);
    assert!(add_row(&mut z, &t(&[3], 1)).is_err());
    for (f, reference) in [
        (Activation::Relu, (|v: f32| v.max(0.0)) as fn(f32) -> f32),
        (Activation::Tanh, f32::tanh),
        (Activation::Sigmoid, |v: f32| 1.0 / (1.0 + (-v).exp())),
        (Activation::Exp, f32::exp),
    ] {
        let mut a = x.clone();
        activate(&mut a, f);
        for (a, x) in a.values().iter().zip(x.values()) {
            assert_eq!(*a, reference(*x), "{f:?}");
        }
    }
}

/// The gradient `backward` computes against central differences of
/// the loss `sum(w * f(x))`, whose gradient with respect to x is
/// `w * f'(x)`.
#[test]
fn activation_gradients_match_finite_differences() {
    let x = t(&[2, 5], 5);
    let w = t(&[2, 5], 6);
    for f in [
        Activation::Relu,
        Activation::Tanh,
        Activation::Sigmoid,
        Activation::Exp,
    ] {
        let loss = |x: &Tensor| -> f64 {
            let mut y = x.clone();
            activate(&mut y, f);
            y.values()
                .iter()
                .zip(w.values())
                .map(|(y, w)| f64::from(y * w))
                .sum()
        };
        let mut y = x.clone();
        activate(&mut y, f);
        let mut grad = w.clone();
        activate_backward(&mut grad, &y, f).unwrap();
        let h = 1e-3;
        for i in 0..x.values().len() {
            // ReLU has no derivative at 0: stay clear of it.
            if f == Activation::Relu && x.values()[i].abs() < 2.0 * h {
                continue;
            }
            let (mut up, mut down) = (x.clone(), x.clone());
            up.data[i] += h;
            down.data[i] -= h;
            let numeric = (loss(&up) - loss(&down)) / (2.0 * f64::from(h));
            let analytic = f64::from(grad.values()[i]);
            assert!(
                (numeric - analytic).abs() <= 2e-3 * (1.0 + analytic.abs()),
                "{f:?} element {i}: {analytic} vs {numeric}"
            );
        }
    }
}

/// ReLU and its gradient over a tensor long enough for vector loops and
/// their remainders, with the values a vector `max` or compare could get
/// wrong: NaN, infinities, signed zeros and subnormals. The results are
/// the scalar definitions', element by element, of the values as a kernel
/// reads them (subnormals as zero, `subnormals.rs`).
#[test]
fn relu_and_its_gradient_agree_with_the_scalar_definition_on_odd_values() {
    let special = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        f32::MIN_POSITIVE / 2.0,
        -f32::MIN_POSITIVE / 2.0,
        f32::MAX,
        f32::MIN,
    ];
    let n = 67;
    let x: Vec<f32> = (0..n)
        .map(|i| match i % 3 {
            0 => special[(i / 3) % special.len()],
            _ => (i as f32 - 30.0) / 7.0,
        })
        .collect();
    let mut y = Tensor::from_vec(&[n as u32], x.clone()).unwrap();
    activate(&mut y, Activation::Relu);
    for (i, (y, x)) in y.values().iter().zip(&x).enumerate() {
        let want = as_read(*x).max(0.0);
        assert!(*y == want, "element {i}: relu({x}) = {y}, not {want}");
    }
    // A gradient of 1.5 everywhere, through outputs that are the same odd
    // values.
    let mut grad = Tensor::from_vec(&[n as u32], vec![1.5; n]).unwrap();
    let output = Tensor::from_vec(&[n as u32], x.clone()).unwrap();
    activate_backward(&mut grad, &output, Activation::Relu).unwrap();
    for (i, (g, y)) in grad.values().iter().zip(&x).enumerate() {
        let want = if as_read(*y) > 0.0 { 1.5 } else { 0.0 };
        assert_eq!(*g, want, "element {i}: output {y}");
    }
}

#[test]
fn softmax_cross_entropy_loss_accuracy_and_gradient() {
    let logits = t(&[4, 3], 7);
    let labels = [0, 2, 1, 2];
    let mut grad = Tensor::zeros(&[4, 3]).unwrap();
    let (loss, correct) = softmax_cross_entropy(&logits, &labels, &mut grad, 1.0).unwrap();
    let row_loss = |z: &[f32], label: usize| -> f64 {
        let sum: f64 = z.iter().map(|v| f64::from(*v).exp()).sum();
        sum.ln() - f64::from(z[label])
    };
    let reference = |l: &Tensor| -> f64 {
        l.values()
            .chunks(3)
            .zip(labels)
            .map(|(z, y)| row_loss(z, y as usize))
            .sum()
    };
    assert!((loss - reference(&logits)).abs() < 1e-5, "{loss}");
    let predicted = logits
        .values()
        .chunks(3)
        .zip(labels)
        .filter(|(z, y)| z.iter().cloned().fold(f32::NEG_INFINITY, f32::max) == z[*y as usize])
        .count();
    assert_eq!(correct as usize, predicted);
    let h = 1e-3;
    for i in 0..12 {
        let (mut up, mut down) = (logits.clone(), logits.clone());
        up.data[i] += h;
        down.data[i] -= h;
        let numeric = (reference(&up) - reference(&down)) / (2.0 * f64::from(h));
        assert!(
            (numeric - f64::from(grad.values()[i])).abs() < 1e-3,
            "element {i}"
        );
    }
    // Scaled gradients, and labels out of range.
    let mut half = Tensor::zeros(&[4, 3]).unwrap();
    softmax_cross_entropy(&logits, &labels, &mut half, 0.5).unwrap();
    assert!((half.values()[4] - 0.5 * grad.values()[4]).abs() < 1e-7);
    let e = softmax_cross_entropy(&logits, &[0, 3, 1, 2], &mut half, 1.0).unwrap_err();
    assert!(matches!(e, TensorError::Invalid(_)), "{e}");
    assert!(softmax_cross_entropy(&logits, &[0, 1], &mut half, 1.0).is_err());
}

#[test]
fn sgd_with_momentum_steps_like_its_formula() {
    let mut p = t(&[6], 1);
    let mut v = t(&[6], 2);
    let g = t(&[6], 3);
    let (p0, v0) = (p.clone(), v.clone());
    sgd_momentum(&mut p, &mut v, &g, 1.0, 0.1, 0.9).unwrap();
    for i in 0..6 {
        let v1 = 0.9 * v0.values()[i] + g.values()[i];
        assert_eq!(v.values()[i], v1);
        assert_eq!(p.values()[i], p0.values()[i] - 0.1 * v1);
    }
    assert!(sgd_momentum(&mut p, &mut v, &t(&[5], 1), 1.0, 0.1, 0.9).is_err());
}

#[test]
fn adam_follows_kingma_and_ba_over_several_steps() {
    let h = |step| AdamStep {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        step,
    };
    let mut p = t(&[3, 2], 1);
    let (mut m, mut v) = (
        Tensor::zeros(&[3, 2]).unwrap(),
        Tensor::zeros(&[3, 2]).unwrap(),
    );
    // The reference in f64, step by step.
    let mut want: Vec<f64> = p.values().iter().map(|&x| f64::from(x)).collect();
    let (mut rm, mut rv) = (vec![0.0f64; 6], vec![0.0f64; 6]);
    for step in 1..=3u32 {
        let g = t(&[3, 2], 10 + u64::from(step));
        adam(&mut p, &mut m, &mut v, &g, h(step)).unwrap();
        for i in 0..6 {
            let gi = f64::from(g.values()[i]);
            rm[i] = 0.9 * rm[i] + 0.1 * gi;
            rv[i] = 0.999 * rv[i] + 0.001 * gi * gi;
            let mh = rm[i] / (1.0 - 0.9f64.powi(step as i32));
            let vh = rv[i] / (1.0 - 0.999f64.powi(step as i32));
            want[i] -= 0.01 * mh / (vh.sqrt() + 1e-8);
        }
    }
    for (got, want) in p.values().iter().zip(&want) {
        // Three f32 updates of about 0.01 each.
        assert!((f64::from(*got) - want).abs() < 1e-6, "{got} vs {want}");
    }
    // The first step moves every parameter by lr against its gradient's
    // sign, whatever the gradient's size.
    let mut p = Tensor::from_vec(&[3], vec![1.0, 1.0, 1.0]).unwrap();
    let (mut m, mut v) = (Tensor::zeros(&[3]).unwrap(), Tensor::zeros(&[3]).unwrap());
    let g = Tensor::from_vec(&[3], vec![1e-3, -5.0, 200.0]).unwrap();
    adam(&mut p, &mut m, &mut v, &g, h(1)).unwrap();
    for (got, want) in p.values().iter().zip([0.99, 1.01, 0.99]) {
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }
}

#[test]
fn adam_refuses_bad_shapes_and_hyperparameters_and_changes_nothing() {
    let good = AdamStep {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        step: 1,
    };
    let mut p = t(&[4], 1);
    let (mut m, mut v) = (t(&[4], 2), t(&[4], 3));
    let before = (p.clone(), m.clone(), v.clone());
    let e = adam(&mut p, &mut m, &mut v, &t(&[5], 4), good).unwrap_err();
    assert!(
        e.to_string().contains("param has shape [4] and grad [5]"),
        "{e}"
    );
    for bad in [
        AdamStep { step: 0, ..good },
        AdamStep { beta1: 1.0, ..good },
        AdamStep {
            beta2: -0.1,
            ..good
        },
        AdamStep {
            epsilon: 0.0,
            ..good
        },
        AdamStep {
            epsilon: f32::NAN,
            ..good
        },
    ] {
        let e = adam(&mut p, &mut m, &mut v, &t(&[4], 4), bad).unwrap_err();
        assert!(matches!(e, TensorError::Invalid(_)), "{bad:?}: {e}");
    }
    assert_eq!((p, m, v), before);
}
