//! Collectives between the ranks of one host: barrier, broadcast,
//! all-reduce and all-gather (R29–R33).
//!
//! The attempt's gate matches the k-th call of every rank (see
//! `attempt/gate.rs`); this module says whether the calls agree, and
//! carries out the agreed exchange on the data the ranks brought, without
//! copies beyond the canonical ABI's: each rank's list arrives lifted into
//! host memory, and an all-reduce combines those buffers in place, so each
//! rank's buffer holds the result it returns to be lowered into the guest.
//! An f32 list passed as its bits (`collective-bits`) is not even lifted:
//! it is lent ([`Lent`]) and read where it lies in the guest's memory, and
//! the ranks that lent share one result buffer.
//!
//! A large all-reduce is split between the ranks (each combines one slice
//! of every buffer and writes it to every buffer: reduce-scatter and
//! all-gather in one pass, in parallel on as many threads as the ranks run
//! on) instead of one rank reducing everything.
//! Values are combined in rank order whichever thread combines them, so a
//! result is bit-identical on every rank and from run to run.
//!
//! Across nodes (`span.rs`) each node combines its ranks' values into one
//! partial result (lent values read where they lie) for the exchange
//! between the nodes, and its ranks take the result from [`Reduced`]: the
//! lending ones share it.

mod combine;
mod latch;
mod lent;
mod reduce;
mod reduced;
mod runs;
mod span;

use std::sync::Arc;

pub(crate) use lent::Lent;
pub(crate) use reduce::Reduction;
pub(crate) use reduced::Reduced;
pub(crate) use span::{combine_in_order, exchanged, finish_sum, partial, sums_over_nodes};

/// How an all-reduce combines values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Sum,
    Mean,
    Min,
    Max,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Sum => "sum",
            Op::Mean => "mean",
            Op::Min => "min",
            Op::Max => "max",
        }
    }
}

/// The values a rank brings to an all-reduce, and gets back.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Values {
    F32(Vec<f32>),
    /// f32 values in several buffers, taken as one after the other (a list
    /// of host tensors): combined where they are, so that no rank gathers
    /// them into one buffer and copies the result back. It is an
    /// all-reduce of as many f32 as [`Values::F32`], which may meet it.
    F32Parts(Vec<Vec<f32>>),
    F64(Vec<f64>),
    S64(Vec<i64>),
    /// f32 values in the rank's guest memory, lent for the call (see
    /// [`Lent`]); only a rank's input, never a result.
    F32Lent(Lent),
}

impl Values {
    pub(crate) fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::F32Lent(v) => v.len(),
            Values::F32Parts(parts) => parts.iter().map(Vec::len).sum(),
            Values::F64(v) => v.len(),
            Values::S64(v) => v.len(),
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            Values::F32(_) | Values::F32Parts(_) | Values::F32Lent(_) => "f32",
            Values::F64(_) => "f64",
            Values::S64(_) => "s64",
        }
    }

    /// The values, leaving an empty buffer of their type in their place.
    pub(crate) fn take(&mut self) -> Values {
        let empty = match self {
            Values::F32(_) | Values::F32Lent(_) => Values::F32(Vec::new()),
            Values::F32Parts(_) => Values::F32Parts(Vec::new()),
            Values::F64(_) => Values::F64(Vec::new()),
            Values::S64(_) => Values::S64(Vec::new()),
        };
        std::mem::replace(self, empty)
    }

    pub(crate) fn element_size(&self) -> u64 {
        match self {
            Values::F32(_) | Values::F32Parts(_) | Values::F32Lent(_) => 4,
            Values::F64(_) | Values::S64(_) => 8,
        }
    }
}

/// One rank's collective call, with its data.
#[derive(Debug)]
pub(crate) enum Call {
    Barrier,
    Broadcast { data: Vec<u8>, root: u32 },
    AllReduce { values: Values, op: Op },
    AllGather { data: Vec<u8> },
}

impl Call {
    /// What the call is, for messages: "all-reduce (sum) of 10 f32".
    pub fn describe(&self) -> String {
        match self {
            Call::Barrier => "barrier".into(),
            Call::Broadcast { root, .. } => format!("broadcast from rank {root}"),
            Call::AllReduce { values, op } => all_reduce_text(*op, values.len(), values),
            Call::AllGather { data } => format!("all-gather of {} bytes", data.len()),
        }
    }

    /// Whether the call lends its values (see [`Lent`]): its rank lowers
    /// the result from a buffer the lending ranks share.
    pub fn lends(&self) -> bool {
        matches!(
            self,
            Call::AllReduce {
                values: Values::F32Lent(_),
                ..
            }
        )
    }

    /// [`Self::signature`] as text, to compare calls on several nodes.
    pub fn signature_text(&self) -> String {
        format!("{:?}", self.signature())
    }

    /// What every rank's call must agree on: all of it but for all-gather,
    /// whose ranks may bring different lengths.
    fn signature(&self) -> Signature {
        match self {
            Call::Barrier => Signature::Barrier,
            Call::Broadcast { root, .. } => Signature::Broadcast(*root),
            Call::AllReduce { values, op } => Signature::AllReduce {
                op: *op,
                dtype: values.type_name(),
                len: values.len(),
            },
            Call::AllGather { .. } => Signature::AllGather,
        }
    }
}

/// See [`Call::signature`]: compared for every rank of every round, so it
/// is built without allocating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signature {
    Barrier,
    Broadcast(u32),
    AllReduce {
        op: Op,
        dtype: &'static str,
        len: usize,
    },
    AllGather,
}

/// What a collective call returns to the guest.
#[derive(Debug, PartialEq)]
pub(crate) enum Delivered {
    Done,
    Bytes(Vec<u8>),
    Values(Values),
    /// The result of an all-reduce of f32 lent by this rank, shared with
    /// the other ranks that lent theirs.
    Shared(Arc<Vec<f32>>),
    Pieces(Vec<Vec<u8>>),
}

/// Why a collective call failed, as the guest is told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CollectiveError {
    /// The ranks' calls do not match (R30): the run is failing.
    #[error("{0}")]
    Mismatch(String),
    /// The attempt is stopping (R31).
    #[error("{0}")]
    Aborted(String),
    /// Every rank made this call, and it cannot be carried out (R32).
    #[error("{0}")]
    Invalid(String),
}

/// Why matched calls cannot be carried out.
#[derive(Debug)]
pub(crate) enum Unmet {
    /// The calls differ: a programming error that fails the run.
    Mismatch(String),
    /// The calls agree and cannot be carried out.
    Invalid(String),
}

/// An exchange the ranks agreed on, shared by them until each has taken
/// its result.
// Made once a round and shared in an `Arc`: boxing the all-reduce would
// cost each round a second allocation and save nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Exchange {
    Barrier,
    /// The root's data.
    Broadcast(Vec<u8>),
    AllReduce(Reduction),
    /// Every rank's data, by rank.
    AllGather(Vec<Vec<u8>>),
    /// An all-reduce combined elsewhere (across nodes): every rank of
    /// this node gets this result.
    Reduced(Reduced),
}

/// The largest result a rank can take without a memory limit: a wasm32
/// guest cannot hold more than 4 GiB.
const ADDRESSABLE: u64 = 4 << 30;

/// Check that every rank's call (by rank) agrees, and that the result fits
/// the ranks' memory limit (`max_memory`, R32); then set up the exchange.
/// For an all-reduce too small to be worth splitting, the values are
/// combined here.
pub(crate) fn meet(calls: Vec<Call>, max_memory: Option<u64>) -> Result<Exchange, Unmet> {
    let first = calls[0].signature();
    if calls.iter().any(|c| c.signature() != first) {
        let each: Vec<String> = calls
            .iter()
            .enumerate()
            .map(|(r, c)| format!("rank {r} called {}", c.describe()))
            .collect();
        return Err(Unmet::Mismatch(each.join(", ")));
    }
    let ranks = calls.len() as u64;
    let result_bytes = match &calls[0] {
        Call::Barrier => 0,
        Call::Broadcast { root, .. } => match calls.get(*root as usize) {
            Some(Call::Broadcast { data, .. }) => data.len() as u64,
            _ => {
                return Err(Unmet::Invalid(format!(
                    "broadcast from rank {root}, but the run has ranks 0 to {}",
                    ranks - 1
                )));
            }
        },
        Call::AllReduce { values, .. } => values.len() as u64 * values.element_size(),
        Call::AllGather { .. } => calls
            .iter()
            .map(|c| match c {
                Call::AllGather { data } => data.len() as u64 + 8,
                _ => 0,
            })
            .sum(),
    };
    if let Some(message) = too_large(|| calls[0].describe(), result_bytes, max_memory) {
        return Err(Unmet::Invalid(message));
    }
    Ok(match &calls[0] {
        Call::Barrier => Exchange::Barrier,
        Call::Broadcast { root, .. } => {
            let root = *root as usize;
            let data = calls.into_iter().nth(root).map(|c| match c {
                Call::Broadcast { data, .. } => data,
                _ => Vec::new(),
            });
            Exchange::Broadcast(data.unwrap_or_default())
        }
        Call::AllReduce { op, values } => {
            if *op == Op::Mean && matches!(values, Values::S64(_)) {
                return Err(Unmet::Invalid(
                    "the mean of s64 values is not an s64; all-reduce the sum and divide".into(),
                ));
            }
            let op = *op;
            let values = calls
                .into_iter()
                .map(|c| match c {
                    Call::AllReduce { values, .. } => values,
                    _ => unreachable!("signatures matched"),
                })
                .collect();
            Exchange::AllReduce(Reduction::new(values, op))
        }
        Call::AllGather { .. } => Exchange::AllGather(
            calls
                .into_iter()
                .map(|c| match c {
                    Call::AllGather { data } => data,
                    _ => Vec::new(),
                })
                .collect(),
        ),
    })
}

/// An all-reduce (`op`) of `len` values of the type of `like`, for
/// messages: "all-reduce (sum) of 10 f32".
fn all_reduce_text(op: Op, len: usize, like: &Values) -> String {
    format!("all-reduce ({}) of {len} {}", op.name(), like.type_name())
}

/// Why an all-reduce (`op`) of `len` values of the type of `like` cannot
/// be carried out for its size (R32), if it cannot: [`meet`]'s check, for
/// a round made without the values (one rank leaves them in place).
pub(crate) fn all_reduce_too_large(
    op: Op,
    len: usize,
    like: &Values,
    max_memory: Option<u64>,
) -> Option<String> {
    let text = || all_reduce_text(op, len, like);
    too_large(text, len as u64 * like.element_size(), max_memory)
}

/// Why a result of `bytes` cannot be handed to every rank (R32), if it
/// cannot: over the memory limit (`max_memory`, else a wasm32 guest's
/// 4 GiB). `call` describes the call, only for the message: every round
/// asks, and formatting it each time cost a small all-reduce ~0.1 µs.
pub(crate) fn too_large(
    call: impl FnOnce() -> String,
    bytes: u64,
    max_memory: Option<u64>,
) -> Option<String> {
    let limit = max_memory.unwrap_or(ADDRESSABLE).min(ADDRESSABLE);
    (bytes > limit).then(|| {
        format!(
            "the result of {} would take {} in every rank, over the ranks' memory limit of {} ({}); send less data per call",
            call(),
            crate::config::human_bytes(bytes),
            crate::config::human_bytes(limit),
            if max_memory.is_some_and(|m| m < ADDRESSABLE) {
                "--max-memory"
            } else {
                "a wasm32 guest's address space"
            },
        )
    })
}

impl Exchange {
    /// Rank `rank`'s result: its part of a split all-reduce is done on the
    /// calling thread, which then waits for the other ranks' parts. `None`
    /// if a rank's lent values could not be read (its call was dropped: the
    /// attempt is stopping, see [`Lent`]).
    /// `lent` says whether the rank lent its values ([`Call::lends`]).
    pub async fn deliver(self: Arc<Self>, rank: usize, lent: bool) -> Option<Delivered> {
        Some(match &*self {
            Exchange::Barrier => Delivered::Done,
            Exchange::Broadcast(data) => Delivered::Bytes(data.clone()),
            Exchange::AllGather(pieces) => Delivered::Pieces(pieces.clone()),
            Exchange::AllReduce(reduction) => reduction.deliver(rank).await?,
            Exchange::Reduced(reduced) => reduced.take(lent),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Call {
        Call::AllReduce {
            values: Values::F32(v.to_vec()),
            op: Op::Sum,
        }
    }

    #[test]
    fn calls_that_differ_are_named_rank_by_rank() {
        let calls = vec![
            Call::Broadcast {
                data: vec![1, 2],
                root: 0,
            },
            f32s(&[0.0; 10]),
        ];
        match meet(calls, None) {
            Err(Unmet::Mismatch(m)) => assert_eq!(
                m,
                "rank 0 called broadcast from rank 0, rank 1 called all-reduce (sum) of 10 f32"
            ),
            other => panic!("{other:?}"),
        }
        let lengths = vec![f32s(&[0.0; 3]), f32s(&[0.0; 4])];
        assert!(matches!(meet(lengths, None), Err(Unmet::Mismatch(_))));
        let gathers = vec![
            Call::AllGather { data: vec![1] },
            Call::AllGather { data: vec![] },
        ];
        assert!(meet(gathers, None).is_ok());
    }

    #[test]
    fn results_over_the_memory_limit_are_invalid_on_every_rank() {
        let calls = vec![
            Call::AllGather { data: vec![0; 600] },
            Call::AllGather { data: vec![0; 600] },
        ];
        match meet(calls, Some(1000)) {
            Err(Unmet::Invalid(m)) => assert!(m.contains("--max-memory"), "{m}"),
            other => panic!("{other:?}"),
        }
        let mean = vec![Call::AllReduce {
            values: Values::S64(vec![1]),
            op: Op::Mean,
        }];
        assert!(matches!(meet(mean, None), Err(Unmet::Invalid(_))));
        let root = vec![Call::Broadcast {
            data: vec![],
            root: 3,
        }];
        assert!(matches!(meet(root, None), Err(Unmet::Invalid(_))));
    }
}
