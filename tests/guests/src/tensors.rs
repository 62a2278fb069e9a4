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
//! - `{"tensor_gemm": N}`: one `gemm` of `[N, 2N] × [2N, N]`; prints
//!   `tensor_gemm: done`
//! - `{"tensor_all_reduce": N, "op": OP}`: the all-reduce of the
//!   collective steps' f32 input, as a host tensor; prints the same line
//!   (`all_reduce: N FNV`)
//!
//! A refused call prints `tensor error: ...` and the script goes on.

use std::cell::RefCell;

use serde_json::{Map, Value};
use trainhost_guest::tensor::{Tensor, TensorError};

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
