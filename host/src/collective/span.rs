//! Collectives whose ranks live on several nodes: what a node sends for
//! its ranks, and how the nodes' parts are combined.
//!
//! An all-reduce is hierarchical, as Horovod's is: each node combines its
//! own ranks' buffers in rank order into one partial result. A partial of
//! at most [`EXCHANGED_BYTES`] then travels to every node with the round's
//! calls, and each node combines them all in node order itself, the same
//! operations on the same values, so the result is bit-identical
//! everywhere without a further message. A larger sum or mean is summed
//! over the nodes by MPI's own all-reduce (the same result on every node,
//! bracketed as the MPI library does), and a larger min or max is
//! combined by node 0 in node order, once. A mean is summed throughout
//! and divided once, by the number of all ranks.
//!
//! A node's partial is made in one pass over its ranks' values, as on one
//! host, with values lent from the guests' memory read where they lie: it
//! is the only copy the node makes of them before they travel.

use super::combine::{combine_parts, divide};
use super::lent::Loans;
use super::{Op, Values};

/// How a node's partial result is combined: a mean is a sum until the end.
fn partial_op(op: Op) -> Op {
    if op == Op::Mean { Op::Sum } else { op }
}

/// Combine `parts` (equal types and lengths, in host memory: other nodes'
/// partial results and this node's) in order with `op`, then divide a
/// mean by `ranks`.
pub(crate) fn combine_in_order(parts: Vec<Values>, op: Op, ranks: usize) -> Values {
    // Nothing lent comes here; were it, it would be copied first.
    let parts = parts
        .into_iter()
        .map(|p| match p {
            Values::F32Lent(_) => p.into_flat(),
            p => p,
        })
        .collect();
    // SAFETY: no part is lent.
    let mut combined = unsafe { combine_parts(parts, partial_op(op)) };
    if op == Op::Mean {
        match &mut combined {
            Values::F32(v) => divide(v, ranks),
            Values::F64(v) => divide(v, ranks),
            Values::S64(v) => divide(v, ranks),
            // Not made by `combine_parts`.
            Values::F32Parts(_) | Values::F32Lent(_) => {}
        }
    }
    combined
}

/// The result of a sum over the nodes: a mean divided by `ranks`.
pub(crate) fn finish_sum(summed: Values, op: Op, ranks: usize) -> Values {
    combine_in_order(vec![summed], op, ranks)
}

/// Combine one node's ranks into its partial result (a mean stays a sum),
/// in one pass over their values. Lent values are read where they lie, so
/// the result is the only copy made: `None` if a rank's were returned
/// (its call was dropped: the attempt is stopping).
pub(crate) fn partial(values: Vec<Values>, op: Op) -> Option<Values> {
    let loans = Loans::of(&values);
    // SAFETY: every lent part is read while its loan is held.
    loans.read(|| unsafe { combine_parts(values, partial_op(op)) })
}

/// The largest partial all-reduce result (in bytes) that a node sends
/// every other node with its calls. Below it a round's latency is its
/// messages': one exchange between the nodes instead of node 0's matching
/// and its answer before the data moves. A 4 KiB sum across 2 nodes took
/// 3.3 µs a round exchanged, against 5.5 µs matched first and summed by
/// MPI (2.2 µs for a bare `MPI_Allreduce`). Past MPI's eager size (MPICH
/// over shared memory here: between 4 and 8 KiB; others send up to 16 or
/// 64 KiB eagerly) each message waits for its peer to take it, and 8 KiB
/// took 8.0 µs exchanged against 5.9 µs through MPI's all-reduce, which
/// also moves each byte fewer times the more nodes there are.
pub(crate) const EXCHANGED_BYTES: u64 = 4 << 10;

/// Whether an all-reduce of `len` elements of `element_size` bytes
/// travels in the nodes' calls (see [`EXCHANGED_BYTES`]).
pub(crate) fn exchanged(len: usize, element_size: u64) -> bool {
    len as u64 * element_size <= EXCHANGED_BYTES
}

/// Whether an all-reduce with `op` of `len` elements of `element_size`
/// bytes is summed over the nodes by the transport's all-reduce rather
/// than combined where the partial results meet. Min and max never are:
/// their comparisons are trainhost's own (NaN included); MPI's differ.
pub(crate) fn sums_over_nodes(op: Op, len: usize, element_size: u64) -> bool {
    matches!(op, Op::Sum | Op::Mean)
        && !exchanged(len, element_size)
        && len <= crate::cluster::MAX_SUMMED
}

impl Values {
    /// The values in one buffer of the host's: [`Values::F32Parts`]
    /// joined, [`Values::F32Lent`] copied. What goes between nodes is one
    /// buffer; the combining across nodes copies the values anyway.
    pub(crate) fn into_flat(self) -> Values {
        match self {
            Values::F32Parts(parts) => Values::F32(parts.concat()),
            Values::F32Lent(lent) => Values::F32(lent.to_vec()),
            other => other,
        }
    }

    /// The values as little-endian bytes, appended to `out` (a message
    /// being framed, to send to another node).
    pub(crate) fn write_le_bytes(&self, out: &mut Vec<u8>) {
        match self {
            Values::F32(v) => write_bytes(v, f32::to_le_bytes, out),
            Values::F32Parts(parts) => {
                for part in parts {
                    write_bytes(part, f32::to_le_bytes, out);
                }
            }
            Values::F32Lent(lent) => write_bytes(&lent.to_vec(), f32::to_le_bytes, out),
            Values::F64(v) => write_bytes(v, f64::to_le_bytes, out),
            Values::S64(v) => write_bytes(v, i64::to_le_bytes, out),
        }
    }

    /// Values of the same type as `like` from little-endian `bytes`, in
    /// one buffer; `None` if the length does not fit the type.
    pub(crate) fn from_le_bytes(like: &Values, bytes: &[u8]) -> Option<Values> {
        Some(match like {
            Values::F32(_) | Values::F32Parts(_) | Values::F32Lent(_) => {
                Values::F32(from_bytes(bytes, f32::from_le_bytes)?)
            }
            Values::F64(_) => Values::F64(from_bytes(bytes, f64::from_le_bytes)?),
            Values::S64(_) => Values::S64(from_bytes(bytes, i64::from_le_bytes)?),
        })
    }
}

/// A plain number type whose every bit pattern is a value.
trait Plain: Copy + Default {}
impl Plain for f32 {}
impl Plain for f64 {}
impl Plain for i64 {}

/// `values` as little-endian bytes, appended to `out`: one copy of their
/// memory on a little-endian machine (64 MiB element by element took ~10×
/// as long).
fn write_bytes<T: Plain, const N: usize>(values: &[T], each: fn(T) -> [u8; N], out: &mut Vec<u8>) {
    if cfg!(target_endian = "little") {
        // SAFETY: T is a plain number of N bytes without padding; its
        // memory is its little-endian bytes.
        out.extend_from_slice(unsafe {
            std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
        });
    } else {
        out.extend(values.iter().flat_map(|v| each(*v)));
    }
}

/// Numbers from little-endian `bytes`, `None` if they do not divide.
fn from_bytes<T: Plain, const N: usize>(bytes: &[u8], each: fn([u8; N]) -> T) -> Option<Vec<T>> {
    if !bytes.len().is_multiple_of(N) {
        return None;
    }
    if cfg!(target_endian = "little") {
        let len = bytes.len() / N;
        let mut out = Vec::<T>::with_capacity(len);
        // SAFETY: `out` has room for exactly `bytes.len()` bytes of plain
        // numbers, for which every bit pattern is a value, so once they
        // are copied its first `len` elements are initialized; the two
        // buffers do not overlap. (Not zeroed first: that was a pass more
        // over every byte.)
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                out.as_mut_ptr().cast::<u8>(),
                bytes.len(),
            );
            out.set_len(len);
        }
        Some(out)
    } else {
        Some(
            bytes
                .chunks_exact(N)
                .map(|c| each(c.try_into().expect("N bytes")))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Lent;

    #[test]
    fn a_mean_is_summed_across_nodes_and_divided_once() {
        let node = |a: f32, b: f32| {
            partial(vec![Values::F32(vec![a]), Values::F32(vec![b])], Op::Mean).unwrap()
        };
        let result = combine_in_order(vec![node(1.0, 2.0), node(3.0, 6.0)], Op::Mean, 4);
        assert_eq!(result, Values::F32(vec![3.0]));
        // A node whose ranks hold their values in several buffers.
        let parts = partial(
            vec![
                Values::F32Parts(vec![vec![1.0], vec![2.0, 3.0]]),
                Values::F32(vec![10.0, 20.0, 30.0]),
            ],
            Op::Sum,
        );
        assert_eq!(parts, Some(Values::F32(vec![11.0, 22.0, 33.0])));
        let max = combine_in_order(
            vec![Values::S64(vec![1, 9]), Values::S64(vec![5, 2])],
            Op::Max,
            2,
        );
        assert_eq!(max, Values::S64(vec![5, 9]));
    }

    /// A node's partial is the same bits whether its ranks' values are
    /// lent, owned or in several buffers, and is written into the first
    /// buffer the host owns, if any.
    #[test]
    fn a_partial_reads_lent_values_as_it_reads_owned_ones() {
        let rank = |r: usize, len: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * 7919 + r * 104_729) % 1000) as f32 / 7.0 - 60.0)
                .collect()
        };
        for ranks in 1..=4 {
            for len in [0, 5, 3000] {
                let inputs: Vec<Vec<f32>> = (0..ranks).map(|r| rank(r, len)).collect();
                for op in [Op::Sum, Op::Mean, Op::Min, Op::Max] {
                    // The reference: one element at a time, in rank order.
                    let expected: Vec<f32> = (0..len)
                        .map(|i| {
                            inputs[1..].iter().fold(inputs[0][i], |a, v| match op {
                                Op::Sum | Op::Mean => a + v[i],
                                Op::Min => a.min(v[i]),
                                Op::Max => a.max(v[i]),
                            })
                        })
                        .collect();
                    let owned: Vec<Values> = inputs.iter().cloned().map(Values::F32).collect();
                    assert_eq!(
                        partial(owned, op),
                        Some(Values::F32(expected.clone())),
                        "{ranks} owned, {len}, {op:?}"
                    );
                    // SAFETY: `inputs` outlive the lendings and are not
                    // written.
                    let lent: Vec<_> = inputs.iter().map(|v| unsafe { Lent::new(v) }).collect();
                    let all_lent = lent
                        .iter()
                        .map(|(l, _)| Values::F32Lent(l.clone()))
                        .collect();
                    assert_eq!(
                        partial(all_lent, op),
                        Some(Values::F32(expected.clone())),
                        "{ranks} lent, {len}, {op:?}"
                    );
                    // Lent, owned and cut alternately: the result goes
                    // into the first owned buffer.
                    let mut first_owned = None;
                    let mixed = inputs
                        .iter()
                        .enumerate()
                        .map(|(r, v)| match r % 3 {
                            0 => Values::F32Lent(lent[r].0.clone()),
                            1 => {
                                let v = v.clone();
                                first_owned.get_or_insert(v.as_ptr());
                                Values::F32(v)
                            }
                            _ => {
                                let (a, b) = v.split_at(v.len() / 3);
                                Values::F32Parts(vec![a.to_vec(), b.to_vec()])
                            }
                        })
                        .collect();
                    let mixed = partial(mixed, op);
                    assert_eq!(
                        mixed,
                        Some(Values::F32(expected.clone())),
                        "{ranks} mixed, {len}, {op:?}"
                    );
                    if let (Some(Values::F32(result)), Some(at)) = (mixed, first_owned) {
                        assert_eq!(result.as_ptr(), at, "written in place");
                    }
                }
            }
        }
        // One rank's own values are the partial as they are.
        let values = vec![2.5f32; 100];
        let at = values.as_ptr();
        match partial(vec![Values::F32(values)], Op::Sum) {
            Some(Values::F32(v)) => assert_eq!(v.as_ptr(), at),
            other => panic!("{other:?}"),
        }
    }

    /// Values whose lender's call ended are not read: no partial.
    #[test]
    fn a_partial_of_returned_values_is_none() {
        let values = vec![1.0f32; 64];
        // SAFETY: `values` outlive the lending and are not written.
        let (lent, lending) = unsafe { Lent::new(&values) };
        drop(lending);
        let parts = vec![Values::F32(vec![1.0; 64]), Values::F32Lent(lent)];
        assert_eq!(partial(parts, Op::Sum), None);
    }

    #[test]
    fn values_cross_the_wire_unchanged() {
        for v in [
            Values::F32(vec![1.5, -0.0, f32::NAN]),
            Values::F64(vec![2.25, f64::INFINITY]),
            Values::S64(vec![i64::MIN, 7]),
        ] {
            let mut bytes = Vec::new();
            v.write_le_bytes(&mut bytes);
            let back = Values::from_le_bytes(&v, &bytes).unwrap();
            assert_eq!(format!("{back:?}"), format!("{v:?}"));
        }
        // Several buffers go as one, and come back as one.
        let parts = Values::F32Parts(vec![vec![1.5], vec![], vec![-2.0, 3.0]]);
        let mut bytes = vec![7];
        parts.write_le_bytes(&mut bytes);
        assert_eq!(bytes[0], 7, "appended");
        let back = Values::from_le_bytes(&parts, &bytes[1..]).unwrap();
        assert_eq!(back, Values::F32(vec![1.5, -2.0, 3.0]));
        assert!(Values::from_le_bytes(&Values::F64(vec![]), &[0; 5]).is_none());
    }
}
