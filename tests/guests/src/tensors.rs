//! The script's host-tensor steps:
//! - `{"tensor_matmul": [M, K, N], "seed": S}`: `a` (`[M, K]`, seed S) and
//!   `b` (`[K, N]`, seed S + 1) drawn in the host, multiplied there with
//!   `gemm`, and again in the guest from their values; prints
//!   `tensor_matmul: max_error E`
//! - `{"tensor_bad_shape": true}`: a `gemm` whose shapes do not fit;
//!   prints `tensor error: ...`, then `tensor unchanged: true|false`
//! - `{"tensor_hold_mb": N, "count": C}`: makes C tensors of N MiB each and
//!   keeps them until the next such step; prints `tensor_hold: I made` for
//!   each, or `tensor error: ...` at the first refused
//! - `{"tensor_empty": C}`: makes up to C tensors of shape `[0]` and keeps
//!   them until the next such step (or `tensor_hold_mb`); prints
//!   `tensor_empty: K made`, then the error if one was refused
//! - `{"tensor_gemm": N}`: one `gemm` of `[N, 2N] × [2N, N]`; prints
//!   `tensor_gemm: done`
//! - `{"tensor_all_reduce": N, "op": OP}`: the all-reduce of the
//!   collective steps' f32 input, as a host tensor; prints the same line
//!   (`all_reduce: N FNV`)
//! - `{"tensor_all_reduce_list": [N1, N2, ..], "op": OP}`: the same input,
//!   of N1 + N2 + .. values, cut into tensors of those sizes and reduced
//!   with one `all-reduce-list`; prints the same line for the whole
//! - `{"tensor_all_reduce_twice": true}`: one tensor listed twice
//! - `{"tensor_broadcast": N, "root": R}`: a tensor of N values (the
//!   all-reduce input of this rank) replaced by the root's; prints
//!   `tensor_broadcast: FNV`
//! - `{"tensor_save": PATH, "seed": S}`: saves `w` (`[3, 5]`, seed S) and
//!   `b` (`[5]`, seed S + 1) as safetensors; prints `tensor_save: ok`
//! - `{"tensor_load": PATH, "from_checkpoint": BOOL}`: loads PATH (below
//!   the restored checkpoint with `from_checkpoint`); prints
//!   `tensor_load: NAME SHAPE FNV` per tensor
//! - `{"tensor_adam": true}`: one Adam step of `[1, 1, 1]` along `[1e-3,
//!   -5, 200]` with lr 0.01; prints `tensor_adam: [P0, P1, P2]`, then
//!   the error of a raw call passing the same tensor as param and `m`
//! - `{"tensor_subnormal": true}`: `[m / 2, m, 1]` (m: f32's smallest
//!   normal value) halved by the host's `scale`, then the same products
//!   computed in the guest; prints `tensor_subnormal: host BITS guest BITS`
//!   (each value's bits in hex)
//! - `{"tensor_fused": true}`: a two-layer network's forward pass,
//!   backward pass and SGD step on the fused kernels and on the separate
//!   ones, with biases and without; prints `tensor_fused: same VALUES
//!   (bias B)` for each (whether every value matches), then the errors of
//!   raw calls writing one tensor twice, writing one they read, or
//!   passing lists of different lengths
//! - `{"tensor_forged_handle": H}`: scales the tensor whose handle is the
//!   number H, whichever that is; `{"tensor_stale_handle": true}`: scales
//!   a tensor through its handle after dropping it
//!
//! A refused call prints `tensor error: ...` and the script goes on.

use std::cell::RefCell;

use serde_json::{Map, Value};
use trainhost_guest::collective::Op;
use trainhost_guest::tensor::{self, Tensor, TensorError};
use trainhost_guest::wit::trainhost::train::tensors as wit;

thread_local! {
    /// The tensors `tensor_hold_mb` keeps.
    static HELD: RefCell<Vec<Tensor>> = const { RefCell::new(Vec::new()) };
}

fn dims(step: &Map<String, Value>, key: &str) -> Option<Vec<u32>> {
    step.get(key)?
        .as_array()?
        .iter()
        .map(|d| d.as_u64().map(|d| d as u32))
        .collect()
}

/// Run `step` if it is a tensor one; `Ok(false)` if it is not.
pub fn run(step: &Map<String, Value>, rank: u32) -> Result<bool, String> {
    let outcome: Result<(), TensorError> = if let Some(d) = dims(step, "tensor_matmul") {
        let [m, k, n] = d[..] else {
            return Err("tensor_matmul takes [M, K, N]".into());
        };
        let seed = step.get("seed").and_then(Value::as_u64).unwrap_or(0);
        matmul(m, k, n, seed)
    } else if step.contains_key("tensor_bad_shape") {
        bad_shape()
    } else if let Some(mb) = step.get("tensor_hold_mb").and_then(Value::as_u64) {
        let count = step.get("count").and_then(Value::as_u64).unwrap_or(1);
        HELD.with_borrow_mut(Vec::clear);
        (0..count).try_for_each(|i| {
            let t = Tensor::zeros(&[mb as u32 * 1024, 256])?;
            HELD.with_borrow_mut(|held| held.push(t));
            println!("tensor_hold: {i} made");
            Ok(())
        })
    } else if let Some(count) = step.get("tensor_empty").and_then(Value::as_u64) {
        HELD.with_borrow_mut(Vec::clear);
        let made = (0..count).try_for_each(|_| {
            let t = Tensor::zeros(&[0])?;
            HELD.with_borrow_mut(|held| held.push(t));
            Ok(())
        });
        println!("tensor_empty: {} made", HELD.with_borrow(Vec::len));
        made
    } else if let Some(n) = step.get("tensor_gemm").and_then(Value::as_u64) {
        let n = n as u32;
        Tensor::zeros(&[n, 2 * n]).and_then(|a| {
            let b = Tensor::zeros(&[2 * n, n])?;
            let mut c = Tensor::zeros(&[n, n])?;
            c.gemm(1.0, &a, false, &b, false, 0.0)?;
            println!("tensor_gemm: done");
            Ok(())
        })
    } else if let Some(n) = step.get("tensor_all_reduce").and_then(Value::as_u64) {
        let op = crate::collective::op(step.get("op").and_then(Value::as_str).unwrap_or("sum"))?;
        let values: Vec<f32> = (0..n as usize)
            .map(|i| crate::collective::value(rank, i) as f32 / 7.0 - 60.0)
            .collect();
        Tensor::from_slice(&[n as u32], &values).map(|mut t| match t.all_reduce(op) {
            Ok(()) => {
                let bytes: Vec<u8> = t.to_vec().iter().flat_map(|x| x.to_le_bytes()).collect();
                println!("all_reduce: {n} {:016x}", crate::fnv(&bytes));
            }
            Err(e) => println!("collective error: {e}"),
        })
    } else if let Some(sizes) = dims(step, "tensor_all_reduce_list") {
        let op = crate::collective::op(step.get("op").and_then(Value::as_str).unwrap_or("sum"))?;
        all_reduce_list(&sizes, rank, op)
    } else if step.contains_key("tensor_all_reduce_twice") {
        // The raw call: the SDK's `&mut` cannot list a tensor twice.
        wit::Tensor::zeros(&[4])
            .map(|t| {
                let refused = wit::all_reduce_list(&[&t, &t], Op::Sum.into());
                println!("collective error: {refused:?}");
            })
            .map_err(TensorError::from)
    } else if let Some(n) = step.get("tensor_broadcast").and_then(Value::as_u64) {
        let root = step.get("root").and_then(Value::as_u64).unwrap_or(0) as u32;
        let values: Vec<f32> = (0..n as usize)
            .map(|i| crate::collective::value(rank, i) as f32)
            .collect();
        Tensor::from_slice(&[n as u32], &values).map(|mut t| match t.broadcast(root) {
            Ok(()) => println!("tensor_broadcast: {:016x}", fnv_of(&t.to_vec())),
            Err(e) => println!("collective error: {e}"),
        })
    } else if let Some(path) = step.get("tensor_save").and_then(Value::as_str) {
        let seed = step.get("seed").and_then(Value::as_u64).unwrap_or(0);
        Tensor::uniform(&[3, 5], -1.0, 1.0, seed).and_then(|w| {
            let b = Tensor::uniform(&[5], -1.0, 1.0, seed + 1)?;
            tensor::save(path, &[("w", &w), ("b", &b)])?;
            println!("tensor_save: ok");
            Ok(())
        })
    } else if let Some(path) = step.get("tensor_load").and_then(Value::as_str) {
        let path = match step.get("from_checkpoint").and_then(Value::as_bool) {
            Some(true) => match trainhost_guest::get_checkpoint() {
                Some(c) => c.path().join(path),
                None => return Err("tensor_load from_checkpoint: no checkpoint".into()),
            },
            _ => path.into(),
        };
        tensor::load(path).map(|tensors| {
            for (name, t) in tensors {
                println!(
                    "tensor_load: {name} {:?} {:016x}",
                    t.shape(),
                    fnv_of(&t.to_vec())
                );
            }
        })
    } else if step.contains_key("tensor_subnormal") {
        subnormal()
    } else if step.contains_key("tensor_adam") {
        adam()
    } else if step.contains_key("tensor_fused") {
        fused()
    } else if let Some(h) = step.get("tensor_forged_handle").and_then(Value::as_u64) {
        // SAFETY: a handle number the guest makes up; the host decides.
        let forged = unsafe { wit::Tensor::from_handle(h as u32) };
        wit::scale(&forged, 2.0);
        std::mem::forget(forged);
        Ok(())
    } else if step.contains_key("tensor_stale_handle") {
        wit::Tensor::zeros(&[4])
            .map(|t| {
                let handle = t.handle();
                drop(t);
                // SAFETY: as above: the number of a tensor dropped already.
                let stale = unsafe { wit::Tensor::from_handle(handle) };
                wit::scale(&stale, 2.0);
                std::mem::forget(stale);
            })
            .map_err(TensorError::from)
    } else {
        return Ok(false);
    };
    if let Err(e) = outcome {
        println!("tensor error: {e}");
    }
    Ok(true)
}

fn matmul(m: u32, k: u32, n: u32, seed: u64) -> Result<(), TensorError> {
    let a = Tensor::uniform(&[m, k], -1.0, 1.0, seed)?;
    let b = Tensor::uniform(&[k, n], -1.0, 1.0, seed + 1)?;
    let mut c = Tensor::zeros(&[m, n])?;
    c.gemm(1.0, &a, false, &b, false, 0.0)?;
    let (av, bv, cv) = (a.to_vec(), b.to_vec(), c.to_vec());
    let (m, k, n) = (m as usize, k as usize, n as usize);
    let mut max_error = 0f32;
    for i in 0..m {
        for j in 0..n {
            let dot: f32 = (0..k).map(|p| av[i * k + p] * bv[p * n + j]).sum();
            max_error = max_error.max((dot - cv[i * n + j]).abs());
        }
    }
    println!("tensor_matmul: max_error {max_error}");
    Ok(())
}

fn bad_shape() -> Result<(), TensorError> {
    let a = Tensor::from_slice(&[2, 3], &[1.0; 6])?;
    let mut c = Tensor::from_slice(&[2, 2], &[7.0; 4])?;
    let refused = c.gemm(1.0, &a, false, &a, false, 0.0);
    println!("tensor unchanged: {}", c.to_vec() == [7.0; 4]);
    refused
}

fn subnormal() -> Result<(), TensorError> {
    let values = [f32::MIN_POSITIVE / 2.0, f32::MIN_POSITIVE, 1.0];
    let mut t = Tensor::from_slice(&[3], &values)?;
    t.scale(0.5);
    // After the kernel, on the thread that ran it: the guest's own maths.
    let guest = values.map(|v| std::hint::black_box(v) * std::hint::black_box(0.5));
    let bits = |v: &[f32]| {
        let hex: Vec<String> = v.iter().map(|x| format!("{:08x}", x.to_bits())).collect();
        hex.join(",")
    };
    println!(
        "tensor_subnormal: host {} guest {}",
        bits(&t.to_vec()),
        bits(&guest)
    );
    Ok(())
}

fn fnv_of(values: &[f32]) -> u64 {
    let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
    crate::fnv(&bytes)
}

fn all_reduce_list(sizes: &[u32], rank: u32, op: Op) -> Result<(), TensorError> {
    let total: usize = sizes.iter().map(|&n| n as usize).sum();
    let values: Vec<f32> = (0..total)
        .map(|i| crate::collective::value(rank, i) as f32 / 7.0 - 60.0)
        .collect();
    let mut tensors = Vec::new();
    let mut rest = &values[..];
    for &n in sizes {
        tensors.push(Tensor::from_slice(&[n], &rest[..n as usize])?);
        rest = &rest[n as usize..];
    }
    let mut refs: Vec<&mut Tensor> = tensors.iter_mut().collect();
    match tensor::all_reduce(&mut refs, op) {
        Ok(()) => {
            let all: Vec<f32> = tensors.iter().flat_map(Tensor::to_vec).collect();
            println!("all_reduce: {total} {:016x}", fnv_of(&all));
        }
        Err(e) => println!("collective error: {e}"),
    }
    Ok(())
}

fn adam() -> Result<(), TensorError> {
    let mut p = Tensor::from_slice(&[3], &[1.0; 3])?;
    let (mut m, mut v) = (Tensor::zeros(&[3])?, Tensor::zeros(&[3])?);
    let g = Tensor::from_slice(&[3], &[1e-3, -5.0, 200.0])?;
    p.adam(&mut m, &mut v, &g, tensor::AdamStep::new(0.01, 1))?;
    let shown: Vec<String> = p.to_vec().iter().map(|x| format!("{x:.4}")).collect();
    println!("tensor_adam: [{}]", shown.join(", "));
    let raw = wit::Tensor::zeros(&[3])?;
    let aliased = wit::adam(&raw, &raw, &raw, &raw, tensor::AdamStep::new(0.01, 1));
    Err(aliased.expect_err("the host refuses aliases").into())
}

/// Forward, backward and an SGD step of `relu(x · w1 + b1) · w2 + b2`
/// (without `b1` and `b2` unless `bias`), fused or call by call: every
/// tensor the step leaves, flat.
fn two_layers(fused: bool, bias: bool) -> Result<Vec<f32>, TensorError> {
    let t = |shape: &[u32], seed| Tensor::uniform(shape, -1.0, 1.0, seed);
    let (x, labels) = (t(&[6, 5], 1)?, [0, 2, 1, 1, 0, 2]);
    let (mut w1, mut b1, mut w2, mut b2) =
        (t(&[5, 4], 2)?, t(&[4], 3)?, t(&[4, 3], 4)?, t(&[3], 5)?);
    let mut v: Vec<Tensor> = [&w1, &b1, &w2, &b2]
        .iter()
        .map(|p| Tensor::zeros(&p.shape()))
        .collect::<Result<_, _>>()?;
    let (mut h, mut z) = (Tensor::zeros(&[6, 4])?, Tensor::zeros(&[6, 3])?);
    let (mut dz, mut dh) = (Tensor::zeros(&[6, 3])?, Tensor::zeros(&[6, 4])?);
    let (mut gw1, mut gb1) = (Tensor::zeros(&[5, 4])?, Tensor::zeros(&[4])?);
    let (mut gw2, mut gb2) = (Tensor::zeros(&[4, 3])?, Tensor::zeros(&[3])?);
    let relu = tensor::Activation::Relu;
    if fused {
        h.dense(&x, &w1, bias.then_some(&b1), Some(relu))?;
        z.dense(&h, &w2, bias.then_some(&b2), None)?;
        z.softmax_cross_entropy(&labels, &mut dz, 1.0)?;
        let grads = tensor::DenseGrads {
            w: &mut gw2,
            bias: bias.then_some(&mut gb2),
            x: Some((&mut dh, Some(relu))),
        };
        tensor::dense_backward(&dz, &h, &w2, 0.0, grads)?;
        let grads = tensor::DenseGrads {
            w: &mut gw1,
            bias: bias.then_some(&mut gb1),
            x: None,
        };
        tensor::dense_backward(&dh, &x, &w1, 0.0, grads)?;
        let [v1, v2, v3, v4] = &mut v[..] else {
            unreachable!()
        };
        if bias {
            let mut params = [&mut w1, &mut b1, &mut w2, &mut b2];
            let grads = [&gw1, &gb1, &gw2, &gb2];
            tensor::sgd_momentum(&mut params, &mut [v1, v2, v3, v4], &grads, 0.5, 0.1, 0.9)?;
        } else {
            let grads = [&gw1, &gw2];
            tensor::sgd_momentum(
                &mut [&mut w1, &mut w2],
                &mut [v1, v3],
                &grads,
                0.5,
                0.1,
                0.9,
            )?;
        }
    } else {
        h.gemm(1.0, &x, false, &w1, false, 0.0)?;
        if bias {
            h.add_row(&b1)?;
        }
        h.activate(relu);
        z.gemm(1.0, &h, false, &w2, false, 0.0)?;
        if bias {
            z.add_row(&b2)?;
        }
        z.softmax_cross_entropy(&labels, &mut dz, 1.0)?;
        gw2.gemm(1.0, &h, true, &dz, false, 0.0)?;
        dh.gemm(1.0, &dz, false, &w2, true, 0.0)?;
        dh.activate_backward(&h, relu)?;
        gw1.gemm(1.0, &x, true, &dh, false, 0.0)?;
        if bias {
            gb2.sum_rows(&dz, 0.0)?;
            gb1.sum_rows(&dh, 0.0)?;
        }
        let params = [&mut w1, &mut b1, &mut w2, &mut b2];
        for (i, ((p, v), g)) in params
            .into_iter()
            .zip(&mut v)
            .zip([&mut gw1, &mut gb1, &mut gw2, &mut gb2])
            .enumerate()
        {
            // Without biases, `b1`, `b2` and their velocities stay as drawn.
            if bias || i % 2 == 0 {
                g.scale(0.5);
                p.sgd_momentum(v, g, 0.1, 0.9)?;
            }
        }
    }
    Ok([&h, &z, &dz, &dh, &w1, &b1, &w2, &b2]
        .iter()
        .chain(&v.iter().collect::<Vec<_>>())
        .flat_map(|t| t.to_vec())
        .collect())
}

fn fused() -> Result<(), TensorError> {
    for bias in [true, false] {
        let (fused, apart) = (two_layers(true, bias)?, two_layers(false, bias)?);
        println!("tensor_fused: same {} (bias {bias})", fused == apart);
    }
    let raw = |shape: &[u32]| wit::Tensor::zeros(shape);
    let (x, w, g) = (raw(&[2, 3])?, raw(&[3, 3])?, raw(&[2, 3])?);
    let twice = wit::dense_backward(&g, &x, &w, 0.0, &w, None, Some(&x), None);
    let (p, v) = (raw(&[3])?, raw(&[3])?);
    let listed_twice = wit::sgd_momentum_list(&[&p, &p], &[&v, &x], &[&g, &g], 1.0, 0.1, 0.9);
    let read_too = wit::dense(&x, &x, &w, None, None);
    let uneven = wit::sgd_momentum_list(&[&p], &[&v, &x], &[&g], 1.0, 0.1, 0.9);
    for refused in [twice, listed_twice, read_too, uneven] {
        match refused {
            Ok(()) => println!("tensor_fused: not refused"),
            Err(e) => println!("tensor error: {}", TensorError::from(e)),
        }
    }
    Ok(())
}
