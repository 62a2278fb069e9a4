//! Each fused kernel against the separate kernels it stands for, bit for
//! bit, and its refusals against a tensor left as it was.

use super::*;
use crate::tensor::{scale, sgd_momentum};

fn t(shape: &[u32], seed: u64) -> Tensor {
    Tensor::uniform(shape, -1.0, 1.0, seed).unwrap()
}

fn never() -> bool {
    false
}

const FUNCTIONS: [Option<Activation>; 5] = [
    None,
    Some(Activation::Relu),
    Some(Activation::Tanh),
    Some(Activation::Sigmoid),
    Some(Activation::Exp),
];

#[test]
fn dense_gives_the_values_of_gemm_add_row_and_activate() {
    let (x, w, b) = (t(&[5, 7], 1), t(&[7, 3], 2), t(&[3], 3));
    for f in FUNCTIONS {
        for bias in [None, Some(&b)] {
            let mut fused = t(&[5, 3], 4);
            dense(&mut fused, &x, &w, bias, f, 1, &never).unwrap();
            let mut apart = t(&[5, 3], 5);
            gemm(&mut apart, 1.0, &x, false, &w, false, 0.0, 1, &never).unwrap();
            if let Some(b) = bias {
                add_row(&mut apart, b).unwrap();
            }
            if let Some(f) = f {
                activate(&mut apart, f);
            }
            assert_eq!(fused, apart, "{f:?}, bias {}", bias.is_some());
        }
    }
}

#[test]
fn dense_refuses_bad_shapes_before_writing() {
    let (x, w, b) = (t(&[5, 7], 1), t(&[7, 3], 2), t(&[3], 3));
    let out0 = t(&[5, 3], 4);
    let cases: [(&Tensor, &Tensor, Tensor, &str); 3] = [
        (&x, &t(&[6, 3], 2), t(&[3], 3), "rows"),
        (&x, &w, t(&[4], 3), "bias"),
        (&t(&[5], 1), &w, b.clone(), "matrix"),
    ];
    for (x, w, bias, says) in cases {
        let mut out = out0.clone();
        let e = dense(&mut out, x, w, Some(&bias), None, 1, &never).unwrap_err();
        assert!(
            matches!(&e, TensorError::Shape(m) if m.contains(says)),
            "{e}"
        );
        assert_eq!(out, out0);
    }
    let mut wrong = t(&[4, 3], 4);
    let e = dense(&mut wrong, &x, &w, Some(&b), None, 1, &never).unwrap_err();
    assert!(e.to_string().contains("out must be of shape [5, 3]"), "{e}");
}

/// The separate calls of a dense layer's backward pass.
#[allow(clippy::too_many_arguments)]
fn backward_apart(
    grad: &Tensor,
    x: &Tensor,
    w: &Tensor,
    beta: f32,
    gw: &mut Tensor,
    gb: &mut Tensor,
    gx: &mut Tensor,
    f: Option<Activation>,
) {
    gemm(gw, 1.0, x, true, grad, false, beta, 1, &never).unwrap();
    sum_rows(gb, grad, beta).unwrap();
    gemm(gx, 1.0, grad, false, w, true, 0.0, 1, &never).unwrap();
    if let Some(f) = f {
        activate_backward(gx, x, f).unwrap();
    }
}

#[test]
fn dense_backward_gives_the_values_of_the_separate_kernels() {
    let (grad, w) = (t(&[5, 3], 1), t(&[7, 3], 2));
    for f in FUNCTIONS {
        // x as the previous layer's activation left it.
        let mut x = t(&[5, 7], 3);
        if let Some(f) = f {
            activate(&mut x, f);
        }
        for beta in [0.0, 1.0, 0.5] {
            let (mut gw, mut gb, mut gx) = (t(&[7, 3], 4), t(&[3], 5), t(&[5, 7], 6));
            let (mut aw, mut ab, mut ax) = (gw.clone(), gb.clone(), gx.clone());
            let grads = DenseGrads {
                w: &mut gw,
                bias: Some(&mut gb),
                x: Some((&mut gx, f)),
            };
            dense_backward(&grad, &x, &w, beta, grads, 1, &never).unwrap();
            backward_apart(&grad, &x, &w, beta, &mut aw, &mut ab, &mut ax, f);
            assert_eq!((gw, gb, gx), (aw, ab, ax), "{f:?}, beta {beta}");
        }
    }
}

#[test]
fn dense_backward_writes_only_what_it_is_given_and_checks_first() {
    let (grad, x, w) = (t(&[5, 3], 1), t(&[5, 7], 2), t(&[7, 3], 3));
    let mut gw = t(&[7, 3], 4);
    let grads = DenseGrads {
        w: &mut gw,
        bias: None,
        x: None,
    };
    dense_backward(&grad, &x, &w, 0.0, grads, 1, &never).unwrap();
    let mut expected = t(&[7, 3], 5);
    gemm(&mut expected, 1.0, &x, true, &grad, false, 0.0, 1, &never).unwrap();
    assert_eq!(gw, expected);

    // A grad-x of the wrong shape: nothing written, the weights' gradient
    // included.
    let (gw0, gb0, gx0) = (t(&[7, 3], 6), t(&[3], 7), t(&[5, 6], 8));
    let (mut gw, mut gb, mut gx) = (gw0.clone(), gb0.clone(), gx0.clone());
    let grads = DenseGrads {
        w: &mut gw,
        bias: Some(&mut gb),
        x: Some((&mut gx, Some(Activation::Relu))),
    };
    let e = dense_backward(&grad, &x, &w, 1.0, grads, 1, &never).unwrap_err();
    assert!(e.to_string().contains("grad-x"), "{e}");
    assert_eq!((gw, gb, gx), (gw0.clone(), gb0, gx0));

    let mut gw = gw0.clone();
    let grads = DenseGrads {
        w: &mut gw,
        bias: None,
        x: None,
    };
    let e = dense_backward(&t(&[4, 3], 1), &x, &w, 1.0, grads, 1, &never).unwrap_err();
    assert!(
        e.to_string().contains("grad must be of shape [5, 3]"),
        "{e}"
    );
    assert_eq!(gw, gw0);
}

#[test]
fn sgd_momentum_list_steps_like_scaling_then_stepping_each_tensor() {
    let shapes: [&[u32]; 3] = [&[4, 3], &[3], &[6]];
    let make = |seed: u64| -> Vec<Tensor> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| t(s, seed * 10 + i as u64))
            .collect()
    };
    let (mut p, mut v, g) = (make(1), make(2), make(3));
    let (mut ap, mut av, mut ag) = (p.clone(), v.clone(), g.clone());
    {
        let mut ps: Vec<&mut Tensor> = p.iter_mut().collect();
        let mut vs: Vec<&mut Tensor> = v.iter_mut().collect();
        let gs: Vec<&Tensor> = g.iter().collect();
        sgd_momentum_list(&mut ps, &mut vs, &gs, 0.25, 0.1, 0.9).unwrap();
    }
    for ((p, v), g) in ap.iter_mut().zip(&mut av).zip(&mut ag) {
        scale(g, 0.25);
        sgd_momentum(p, v, g, 1.0, 0.1, 0.9).unwrap();
    }
    assert_eq!((&p, &v), (&ap, &av));
    assert_eq!(g, make(3), "the gradients are read, not scaled");

    // The last triple does not fit: no tensor is stepped, the first ones
    // included.
    let (p0, v0) = (p.clone(), v.clone());
    let odd = [g[0].clone(), g[1].clone(), t(&[5], 9)];
    let mut ps: Vec<&mut Tensor> = p.iter_mut().collect();
    let mut vs: Vec<&mut Tensor> = v.iter_mut().collect();
    let gs: Vec<&Tensor> = odd.iter().collect();
    let e = sgd_momentum_list(&mut ps, &mut vs, &gs, 1.0, 0.1, 0.9).unwrap_err();
    assert!(e.to_string().contains("grads[2]"), "{e}");
    let e = sgd_momentum_list(&mut ps, &mut vs, &gs[..2], 1.0, 0.1, 0.9).unwrap_err();
    assert!(e.to_string().contains("as long"), "{e}");
    drop((ps, vs));
    assert_eq!((p, v), (p0, v0));
}
