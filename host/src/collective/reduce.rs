//! All-reduce: combining every rank's buffer in place.
//!
//! Each element of the result is `v0 op v1 op ... op vN-1`, combined in
//! rank order, then divided by N for a mean; whichever thread computes it,
//! the bits are the same. The result is written into every rank's buffer,
//! which the rank then returns: no buffer is allocated for the result. A
//! rank's values may be in several buffers, one after the other (a list of
//! host tensors, [`Values::F32Parts`]); they are combined where they are.
//!
//! Small reductions are done by the thread that completes the round (one
//! wake-up per rank, the latency of a `report`). Larger ones are split into
//! one slice per rank: every rank's thread combines its slice of all the
//! buffers and writes it to all of them (reduce-scatter and all-gather in
//! one pass: each byte of every buffer is read once and written once), then
//! waits for the others' slices. The slices are disjoint, which is what
//! makes the shared writes below sound.

use std::cell::UnsafeCell;
use std::ops::Range;

use smallvec::SmallVec;

use super::latch::Latch;
use super::runs::{Runs, f32_buffers, f64_buffers, s64_buffers};
use super::{Op, Values};
use crate::executor;

/// Below this many bytes per rank, one thread combines everything when
/// ranks share threads: a rank that combines its slice then waits for the
/// others' slices, which costs each rank a second turn on its thread. With
/// 16 ranks on 2 threads, a 16 KiB all-reduce from a guest's list took
/// twice as long split as whole (99-103 against 47-49 µs), a 128 KiB one
/// a tenth less (116-132 against 140-144 µs).
const SPLIT_BYTES: usize = 256 << 10;

/// The same when every rank has a thread of its own (no more ranks than
/// cores): the ranks that arrived first would only wait while the last one
/// combines, so sharing the work pays from smaller sizes. With 2 ranks on
/// 2 cores, splitting took a 32 KiB all-reduce from a guest's list from
/// 5.4-5.9 to 4.8-5.1 µs and a 128 KiB one from 16.0-16.4 to 11.8-12.4
/// µs; at 16 KiB it gained a little, at 8 KiB it lost (2.7-3.6 against
/// 2.6-3.0 µs).
const SPLIT_BYTES_OWN_THREADS: usize = 16 << 10;

/// Elements combined at a time: the partial result stays in the L1 cache
/// while every rank's slice is added to it.
const BLOCK: usize = 2048;

/// Slices start at a multiple of this many elements, so that two threads
/// never write the same cache line.
const ALIGN: usize = 16;

/// A value all-reduce can combine.
pub(super) trait Element: Copy + Default + Send + Sync + 'static {
    fn sum(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    /// `sum / ranks`; only called for floats ([`super::meet`] refuses the
    /// mean of integers).
    fn mean(sum: Self, ranks: usize) -> Self;
}

/// f32 and f64 combine alike.
macro_rules! float_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                a.min(b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                a.max(b)
            }
            #[inline(always)]
            fn mean(sum: Self, ranks: usize) -> Self {
                sum / ranks as $t
            }
        }
    )*};
}

float_element!(f32, f64);

impl Element for i64 {
    #[inline(always)]
    fn sum(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
    #[inline(always)]
    fn min(a: Self, b: Self) -> Self {
        Ord::min(a, b)
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        Ord::max(a, b)
    }
    #[inline(always)]
    fn mean(sum: Self, _ranks: usize) -> Self {
        sum
    }
}

/// Every rank's buffer of one all-reduce, combined in place.
pub(crate) struct Reduction {
    op: Op,
    /// By rank. Each cell is taken by its rank once the result is in it.
    buffers: Box<[UnsafeCell<Values>]>,
    /// Where the buffers' elements are, taken before the reduction is
    /// shared, so that threads combining other slices never form references
    /// to a buffer.
    elements: Elements,
    len: usize,
    /// Split across the ranks: counts the slices still being combined.
    pending: Option<Latch>,
}

/// Where the elements of every rank's buffers are, by type.
enum Elements {
    F32(Runs<f32>),
    F64(Runs<f64>),
    S64(Runs<i64>),
}

// SAFETY: the buffers are only written through `combine_range`, and the
// ranges given to it concurrently are disjoint (one slice per rank, see
// `slice_of`); a rank takes its own buffer out only after every slice is
// written (the latch, or the reduction was complete before it was shared).
// The pointers are to the buffers' heap memory, which moves with no thread.
unsafe impl Sync for Reduction {}
// SAFETY: as for `Sync`; the values themselves are `Send`.
unsafe impl Send for Reduction {}

impl std::fmt::Debug for Reduction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reduction")
            .field("op", &self.op)
            .field("ranks", &self.buffers.len())
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// The size per rank from which the ranks share an all-reduce's work.
fn split_from(ranks: usize) -> usize {
    if executor::threads_for(ranks) >= ranks {
        SPLIT_BYTES_OWN_THREADS
    } else {
        SPLIT_BYTES
    }
}

impl Reduction {
    /// Set up the all-reduce of `values` (by rank; same type and length,
    /// checked by [`super::meet`]). Done at once if it is too small to
    /// split.
    pub fn new(mut values: Vec<Values>, op: Op) -> Self {
        let len = values.first().map_or(0, Values::len);
        let bytes = len * values.first().map_or(0, |v| v.element_size() as usize);
        let ranks = values.len();
        let split = ranks > 1 && bytes >= split_from(ranks);
        let elements = match values.first() {
            Some(Values::F64(_)) => Elements::F64(Runs::new(&mut values, f64_buffers)),
            Some(Values::S64(_)) => Elements::S64(Runs::new(&mut values, s64_buffers)),
            _ => Elements::F32(Runs::new(&mut values, f32_buffers)),
        };
        let reduction = Self {
            op,
            buffers: values.into_iter().map(UnsafeCell::new).collect(),
            elements,
            len,
            pending: split.then(|| Latch::new(ranks)),
        };
        // One rank's values are their own result (R29): nothing to combine.
        if !split && ranks > 1 {
            // SAFETY: not shared yet; this thread is the only one.
            unsafe { reduction.combine_range(0..len) };
        }
        reduction
    }

    /// The elements rank `rank` combines when the work is split.
    fn slice_of(&self, rank: usize) -> Range<usize> {
        let ranks = self.buffers.len();
        let per = self.len.div_ceil(ranks).next_multiple_of(ALIGN);
        let start = (per * rank).min(self.len);
        start..(start + per).min(self.len)
    }

    /// Rank `rank`'s result: its slice combined on this thread if the work
    /// is split, once every slice is.
    pub async fn deliver(&self, rank: usize) -> Values {
        if let Some(pending) = &self.pending {
            // SAFETY: each rank combines only its own slice, and the slices
            // are disjoint.
            unsafe { self.combine_range(self.slice_of(rank)) };
            pending.count_down();
            pending.wait().await;
        }
        // SAFETY: every slice has been written (above, or before the
        // reduction was shared), so no thread uses the element pointers any
        // more; only rank `rank` takes this buffer.
        unsafe { std::mem::replace(&mut *self.buffers[rank].get(), Values::F32(Vec::new())) }
    }

    /// Combine `range` of every buffer and write the result to every
    /// buffer.
    ///
    /// # Safety
    /// No other thread may access `range` of any buffer meanwhile, and no
    /// buffer has been taken.
    unsafe fn combine_range(&self, range: Range<usize>) {
        // SAFETY: passed on from the caller; every run is of a live buffer,
        // and every rank's runs hold `self.len` elements.
        unsafe {
            match &self.elements {
                Elements::F32(p) => combine(p, range, self.op),
                Elements::F64(p) => combine(p, range, self.op),
                Elements::S64(p) => combine(p, range, self.op),
            }
        }
    }
}

/// Combine `range` of every rank's values in `runs` in rank order and
/// write the result back to each: a stretch at a time that lies in one
/// buffer of every rank (all of `range` when each rank has one buffer).
///
/// # Safety
/// Every run is of a live buffer, every rank's runs hold at least
/// `range.end` values, and nothing else accesses `range` of any rank's
/// values meanwhile.
unsafe fn combine<T: Element>(runs: &Runs<T>, range: Range<usize>, op: Op) {
    // The stretch's first element in every rank's buffers.
    let mut ptrs: SmallVec<[*mut T; 16]> = SmallVec::new();
    let mut start = range.start;
    while start < range.end {
        let mut len = range.end - start;
        ptrs.clear();
        for rank in 0..runs.ranks() {
            let (p, contiguous) = runs.at(rank, start);
            ptrs.push(p);
            len = len.min(contiguous);
        }
        // SAFETY: passed on from the caller; `len` elements from each
        // pointer lie in one buffer.
        unsafe { combine_stretch(&ptrs, len, op) };
        start += len;
    }
}

/// Combine `len` elements from each of `ptrs` in rank order and write the
/// result back to each, a block at a time.
///
/// # Safety
/// Every pointer is valid for `len` elements, and nothing else accesses
/// them meanwhile.
unsafe fn combine_stretch<T: Element>(ptrs: &[*mut T], len: usize, op: Op) {
    let ranks = ptrs.len();
    let mut acc = [T::default(); BLOCK];
    let mut start = 0;
    while start < len {
        let n = BLOCK.min(len - start);
        let acc = &mut acc[..n];
        // SAFETY: within the `len` elements this thread alone accesses;
        // each slice lives only within this block's statement.
        let slice = |p: *mut T| unsafe { std::slice::from_raw_parts(p.add(start), n) };
        acc.copy_from_slice(slice(ptrs[0]));
        // One loop per operation, so that each is compiled to vector code
        // rather than a call per element.
        for &p in &ptrs[1..] {
            let next = slice(p);
            match op {
                Op::Sum | Op::Mean => fold(acc, next, T::sum),
                Op::Min => fold(acc, next, T::min),
                Op::Max => fold(acc, next, T::max),
            }
        }
        if op == Op::Mean {
            for a in acc.iter_mut() {
                *a = T::mean(*a, ranks);
            }
        }
        for &p in ptrs {
            // SAFETY: as above; no other slice of this block is alive.
            unsafe { std::slice::from_raw_parts_mut(p.add(start), n) }.copy_from_slice(acc);
        }
        start += n;
    }
}

/// `acc[i] = f(acc[i], next[i])`, inlined for each `f`.
#[inline(always)]
pub(super) fn fold<T: Element>(acc: &mut [T], next: &[T], f: impl Fn(T, T) -> T) {
    for (a, b) in acc.iter_mut().zip(next) {
        *a = f(*a, *b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: every element combined in rank order, one at a time.
    fn reference(inputs: &[Vec<f32>], op: Op) -> Vec<f32> {
        (0..inputs[0].len())
            .map(|i| {
                let mut acc = inputs[0][i];
                for v in &inputs[1..] {
                    acc = match op {
                        Op::Sum | Op::Mean => acc + v[i],
                        Op::Min => acc.min(v[i]),
                        Op::Max => acc.max(v[i]),
                    };
                }
                if op == Op::Mean {
                    acc / inputs.len() as f32
                } else {
                    acc
                }
            })
            .collect()
    }

    fn inputs(ranks: usize, len: usize) -> Vec<Vec<f32>> {
        (0..ranks)
            .map(|r| {
                (0..len)
                    .map(|i| ((i * 7919 + r * 104_729) % 1000) as f32 / 7.0 - 60.0)
                    .collect()
            })
            .collect()
    }

    /// Run the reduction as the ranks do: as tasks of an executor of at
    /// most two threads, so that ranks wait for each other.
    fn run(inputs: &[Vec<f32>], op: Op) -> Vec<Vec<f32>> {
        let values = inputs.iter().cloned().map(Values::F32).collect();
        run_values(values, op)
            .into_iter()
            .map(|v| match v {
                Values::F32(v) => v,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    /// [`run`] of any values; every rank's result, by rank.
    fn run_values(values: Vec<Values>, op: Op) -> Vec<Values> {
        let ranks = values.len();
        let reduction = Reduction::new(values, op);
        let results: Vec<std::sync::Mutex<Option<Values>>> =
            (0..ranks).map(|_| Default::default()).collect();
        let threads = ranks.min(2);
        let idle = crate::executor::IdleWait::new(threads);
        let tasks = (0..ranks).map(|r| {
            let (reduction, results) = (&reduction, &results);
            let task: crate::executor::TaskFuture<'_> = Box::pin(async move {
                *results[r].lock().unwrap() = Some(reduction.deliver(r).await);
            });
            (r, task)
        });
        crate::executor::run(threads, tasks, &idle, |r, m| panic!("rank {r}: {m}"));
        results
            .into_iter()
            .map(|r| r.into_inner().unwrap().expect("every rank delivered"))
            .collect()
    }

    /// `values` cut into buffers of the given lengths (the last one takes
    /// the rest).
    fn cut(values: &[f32], lengths: &[usize]) -> Values {
        let mut rest = values;
        let mut parts = Vec::new();
        for &n in lengths {
            let (part, after) = rest.split_at(n.min(rest.len()));
            parts.push(part.to_vec());
            rest = after;
        }
        parts.push(rest.to_vec());
        Values::F32Parts(parts)
    }

    #[test]
    fn values_in_several_buffers_are_combined_where_they_are() {
        // Ranks cut their values differently (empty buffers included), and
        // may hold them in one buffer; whole and split reductions.
        for (ranks, len) in [(2, 1000), (2, 10_001), (3, 70_001)] {
            for op in [Op::Sum, Op::Mean, Op::Min, Op::Max] {
                let inputs = inputs(ranks, len);
                let want = reference(&inputs, op);
                let cuts: [&[usize]; 3] = [&[0, 4096, 64, 0, 640], &[1, 2049, 2047], &[]];
                let values = inputs
                    .iter()
                    .enumerate()
                    .map(|(r, v)| match r {
                        0 => Values::F32(v.clone()),
                        _ => cut(v, cuts[r % 3]),
                    })
                    .collect();
                for (r, got) in run_values(values, op).into_iter().enumerate() {
                    let lengths: Vec<usize> = match &got {
                        Values::F32(v) => vec![v.len()],
                        Values::F32Parts(parts) => parts.iter().map(Vec::len).collect(),
                        other => panic!("{other:?}"),
                    };
                    let expected = match r {
                        0 => vec![len],
                        _ => match cut(&inputs[r], cuts[r % 3]) {
                            Values::F32Parts(parts) => parts.iter().map(Vec::len).collect(),
                            _ => unreachable!(),
                        },
                    };
                    assert_eq!(lengths, expected, "rank {r} keeps its buffers");
                    let Values::F32(got) = got.into_flat() else {
                        unreachable!()
                    };
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "ranks {ranks} len {len} {op:?} rank {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn split_and_whole_reductions_match_the_reference_bit_for_bit() {
        // Sizes below and above the split (both thresholds: 2 ranks have
        // threads of their own on any machine of 2 cores or more), and
        // lengths that do not divide.
        for (ranks, len) in [
            (1, 10),
            (2, 1000),
            (2, 10_001),
            (3, 70_001),
            (4, 200_003),
            (5, 17),
        ] {
            for op in [Op::Sum, Op::Mean, Op::Min, Op::Max] {
                let inputs = inputs(ranks, len);
                let want = reference(&inputs, op);
                for (r, got) in run(&inputs, op).iter().enumerate() {
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "ranks {ranks} len {len} {op:?} rank {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn slices_cover_every_element_once_on_aligned_starts() {
        let values = (0..3).map(|_| Values::F32(vec![0.0; 100_001])).collect();
        let reduction = Reduction::new(values, Op::Sum);
        let mut next = 0;
        for r in 0..3 {
            let s = reduction.slice_of(r);
            assert_eq!(s.start, next);
            assert_eq!(s.start % ALIGN, 0);
            next = s.end;
        }
        assert_eq!(next, 100_001);
    }
}
