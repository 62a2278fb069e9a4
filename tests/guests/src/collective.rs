//! The script's collective steps:
//! - `{"barrier": true}`: prints `barrier ok`
//! - `{"broadcast": TEXT, "root": R}`: prints `broadcast: TEXT` (root's)
//! - `{"all_gather": TEXT}`: prints `all_gather: T0|T1|..`; with
//!   `"bytes": N`, N bytes are sent instead of TEXT
//! - `{"all_reduce": "f32" | "f64" | "s64", "len": N, "op": OP}`: reduces
//!   [`value`]s of this rank; prints `all_reduce: N FNV` (FNV-1a of the
//!   result's little-endian bytes). `"into": "slice"` or `"array"` (N = 4)
//!   passes the values as a slice or an array instead of a `Vec`; on an
//!   error the values must be unchanged. `"into": "list"` (f32) calls
//!   `collective.all-reduce-f32`, whose list the host copies, and
//!   `"bits"` `collective-bits.all-reduce-f32`, whose list it reads in
//!   place, whatever the size (the SDK's `all_reduce` picks one by size).
//! - `{"collective_until_stopped": true}`: barriers until one fails, prints
//!   the error, then calls once more (which stops the rank), or prints
//!   `never stopped` after 30 s;
//!   `"tensor"` instead of `true` makes the calls all-reduces of a host
//!   tensor
//!
//! A failed call prints `collective error: ...` and the script goes on.

use serde_json::{Map, Value};
use trainhost_guest::collective::{self, CollectiveError, Op, Reducible};

/// Element `i` of `rank`'s all-reduce input, as the tests compute it.
pub fn value(rank: u32, i: usize) -> i64 {
    ((i * 7919 + rank as usize * 104_729) % 1000) as i64
}

pub fn op(name: &str) -> Result<Op, String> {
    Ok(match name {
        "sum" => Op::Sum,
        "mean" => Op::Mean,
        "min" => Op::Min,
        "max" => Op::Max,
        other => return Err(format!("unknown op {other}")),
    })
}

/// Run `step` if it is a collective one; `Ok(false)` if it is not.
pub fn run(
    step: &Map<String, Value>,
    rank: u32,
    text: impl Fn(&str) -> Option<String>,
) -> Result<bool, String> {
    let outcome: Result<String, CollectiveError> = if step.contains_key("barrier") {
        collective::barrier().map(|()| "barrier ok".into())
    } else if let Some(t) = text("broadcast") {
        let root = step.get("root").and_then(Value::as_u64).unwrap_or(0) as u32;
        let mut data = t.into_bytes();
        collective::broadcast(&mut data, root)
            .map(|()| format!("broadcast: {}", String::from_utf8_lossy(&data)))
    } else if let Some(t) = text("all_gather") {
        // `"bytes": N` sends N bytes instead of the text.
        let data = match step.get("bytes").and_then(Value::as_u64) {
            Some(n) => vec![b'x'; n as usize],
            None => t.into_bytes(),
        };
        collective::all_gather(&data).map(|pieces| {
            let texts: Vec<String> = pieces
                .iter()
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect();
            format!("all_gather: {}", texts.join("|"))
        })
    } else if let Some(dtype) = step.get("all_reduce").and_then(Value::as_str) {
        let len = step.get("len").and_then(Value::as_u64).unwrap_or(0) as usize;
        let op = op(step.get("op").and_then(Value::as_str).unwrap_or("sum"))?;
        let into = step.get("into").and_then(Value::as_str).unwrap_or("vec");
        let bytes: Result<Vec<u8>, CollectiveError> = match dtype {
            "f32" => {
                let v: Vec<f32> = (0..len)
                    .map(|i| value(rank, i) as f32 / 7.0 - 60.0)
                    .collect();
                let reduced = match into {
                    "list" => trainhost_guest::wit::trainhost::train::collective::all_reduce_f32(
                        &v,
                        op.into(),
                    )
                    .map_err(CollectiveError::from),
                    "bits" => {
                        let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
                        trainhost_guest::wit::trainhost::train::collective_bits::all_reduce_f32(
                            &bits,
                            op.into(),
                        )
                        .map_err(CollectiveError::from)
                    }
                    _ => reduce_into(v, into, op)?,
                };
                reduced.map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            "f64" => {
                let v: Vec<f64> = (0..len)
                    .map(|i| value(rank, i) as f64 / 7.0 - 60.0)
                    .collect();
                reduce_into(v, into, op)?.map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            "s64" => {
                let v: Vec<i64> = (0..len)
                    .map(|i| (value(rank, i) - 500) * (i64::MAX / 600))
                    .collect();
                reduce_into(v, into, op)?.map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            other => return Err(format!("unknown dtype {other}")),
        };
        bytes.map(|b| format!("all_reduce: {len} {:016x}", super::fnv(&b)))
    } else if let Some(how) = step.get("collective_until_stopped") {
        let mut t = trainhost_guest::tensor::Tensor::zeros(&[4]).map_err(|e| e.to_string())?;
        let mut call = || match how.as_str() {
            Some("tensor") => t.all_reduce(Op::Sum),
            _ => collective::barrier(),
        };
        // Bounded, so that a host that never stops the calls fails the
        // test instead of hanging it.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let error = loop {
            match call() {
                Err(e) => break e,
                Ok(()) if std::time::Instant::now() > until => {
                    println!("never stopped");
                    return Ok(true);
                }
                Ok(()) => {}
            }
        };
        println!("collective error: {error}");
        let again = call();
        // Not reached: the call above stops the rank.
        println!("called again: {again:?}");
        return Ok(true);
    } else {
        return Ok(false);
    };
    match outcome {
        Ok(line) => println!("{line}"),
        Err(e) => println!("collective error: {e}"),
    }
    Ok(true)
}

/// All-reduce `v` passed as `into` says (a `Vec`, a slice or an array of
/// 4), checking that an error leaves it unchanged.
fn reduce_into<T: Reducible + PartialEq + std::fmt::Debug>(
    mut v: Vec<T>,
    into: &str,
    op: Op,
) -> Result<Result<Vec<T>, CollectiveError>, String> {
    let before = v.clone();
    let outcome = match into {
        "vec" => collective::all_reduce(&mut v, op),
        "slice" => collective::all_reduce(v.as_mut_slice(), op),
        "array" => {
            let array: &mut [T; 4] = v
                .as_mut_slice()
                .try_into()
                .map_err(|_| format!("\"into\": \"array\" takes 4 values, not {}", before.len()))?;
            collective::all_reduce(array, op)
        }
        other => return Err(format!("unknown into {other}")),
    };
    match outcome {
        Ok(()) => Ok(Ok(v)),
        Err(e) if v == before => Ok(Err(e)),
        Err(e) => Err(format!(
            "the values changed although the all-reduce failed: {e}"
        )),
    }
}
