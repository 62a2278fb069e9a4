//! All-reduce: combining every rank's buffer in place.
//!
//! Each element of the result is `v0 op v1 op ... op vN-1`, combined in
//! rank order, then divided by N for a mean; whichever thread computes it,
//! the bits are the same. The result is written into every rank's buffer,
//! which the rank then returns: no buffer is allocated for the result. A
//! rank's values may be in several buffers, one after the other (a list of
//! host tensors, [`Values::F32Parts`]); they are combined where they are.
//! Values lent from a guest's memory ([`Values::F32Lent`]) are only read:
//! the result of the ranks that lent them is written once, into one
//! buffer they share.
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use super::combine::{Element, combine_stretch};
use super::latch::Latch;
use super::lent::Loans;
use super::runs::{Runs, f32_buffers, f64_buffers, s64_buffers};
use super::{Delivered, Op, Values};
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

/// Slices start at a multiple of this many elements, so that two threads
/// never write the same cache line.
const ALIGN: usize = 16;

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
    /// The loans of the ranks whose values are lent, held while combining.
    loans: Loans,
    /// The result of the ranks whose values are lent.
    shared: Option<Shared>,
    /// A slice was not combined: a loan had been returned (its rank's
    /// call was dropped, the attempt is stopping). No rank gets a result.
    spoiled: AtomicBool,
}

/// The result of the ranks whose values are lent: written once (through
/// the pointer [`Runs::share_into`] was given), then shared by them.
struct Shared(Mutex<Sharing>);

struct Sharing {
    /// The buffer being written: its capacity holds the result, its length
    /// is set once every element is.
    buffer: Option<Vec<f32>>,
    result: Option<Arc<Vec<f32>>>,
    /// The lending ranks still to take the result.
    left: usize,
    len: usize,
}

impl Shared {
    /// The result for one lending rank, once every element is written; the
    /// last one takes it out, so that it is freed when the ranks have
    /// lowered it, not with the round.
    fn take(&self) -> Arc<Vec<f32>> {
        let mut sharing = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if sharing.result.is_none() {
            let mut buffer = sharing.buffer.take().unwrap_or_default();
            if buffer.capacity() >= sharing.len {
                // SAFETY: within the capacity, and every element was
                // written (the caller found every slice combined).
                unsafe { buffer.set_len(sharing.len) };
            }
            sharing.result = Some(Arc::new(buffer));
        }
        sharing.left = sharing.left.saturating_sub(1);
        let result = if sharing.left == 0 {
            sharing.result.take()
        } else {
            sharing.result.clone()
        };
        result.unwrap_or_default()
    }
}

/// Where the elements of every rank's buffers are, by type.
enum Elements {
    F32(Runs<f32>),
    F64(Runs<f64>),
    S64(Runs<i64>),
}

// SAFETY: the buffers and the shared result are only written through
// `combine_range`, and the ranges given to it concurrently are disjoint
// (one slice per rank, see `slice_of`); a rank takes its own buffer out,
// or the shared result, only after every slice is written (the latch, or
// the reduction was complete before it was shared). The pointers are to
// the buffers' heap memory, which moves with no thread, and to lent
// values, read only while their loans are held.
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
        let loans = Loans::of(&values);
        let lending = loans.len();
        let mut shared = None;
        let elements = match values.first() {
            Some(Values::F64(_)) => Elements::F64(Runs::new(&mut values, f64_buffers)),
            Some(Values::S64(_)) => Elements::S64(Runs::new(&mut values, s64_buffers)),
            _ => {
                let mut runs = Runs::new(&mut values, f32_buffers);
                if lending > 0 {
                    // Written before it is read, so not zeroed first.
                    let mut buffer = Vec::with_capacity(len);
                    runs.share_into(buffer.as_mut_ptr());
                    shared = Some(Shared(Mutex::new(Sharing {
                        buffer: Some(buffer),
                        result: None,
                        left: lending,
                        len,
                    })));
                }
                Elements::F32(runs)
            }
        };
        let reduction = Self {
            op,
            buffers: values.into_iter().map(UnsafeCell::new).collect(),
            elements,
            len,
            pending: split.then(|| Latch::new(ranks)),
            loans,
            shared,
            spoiled: AtomicBool::new(false),
        };
        // One rank's own values are their own result (R29): nothing to
        // combine. Lent ones are copied into the shared result.
        if !split && (ranks > 1 || lending > 0) {
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
    /// is split, once every slice is. `None` if a slice could not be
    /// combined (a loan was returned).
    pub async fn deliver(&self, rank: usize) -> Option<Delivered> {
        if let Some(pending) = &self.pending {
            // SAFETY: each rank combines only its own slice, and the slices
            // are disjoint.
            unsafe { self.combine_range(self.slice_of(rank)) };
            pending.count_down();
            pending.wait().await;
        }
        // Written before the latch was counted down, or before the
        // reduction was shared.
        if self.spoiled.load(Ordering::Relaxed) {
            return None;
        }
        // SAFETY: every slice has been written (above, or before the
        // reduction was shared), so no thread uses the element pointers any
        // more; only rank `rank` takes this buffer.
        let values =
            unsafe { std::mem::replace(&mut *self.buffers[rank].get(), Values::F32(Vec::new())) };
        Some(match (values, &self.shared) {
            (Values::F32Lent(_), Some(shared)) => Delivered::Shared(shared.take()),
            (values, _) => Delivered::Values(values),
        })
    }

    /// Combine `range` of every rank's values and write the result to
    /// every rank's own buffers and to the shared result; nothing if a
    /// loan was returned (see [`Self::spoiled`]).
    ///
    /// # Safety
    /// No other thread may access `range` of any buffer meanwhile, and no
    /// buffer has been taken.
    unsafe fn combine_range(&self, range: Range<usize>) {
        // SAFETY: passed on from the caller; every run is of a live buffer
        // (a lent one while its loan is held), and every rank's runs hold
        // `self.len` elements, as does the shared result.
        let combined = self.loans.read(|| unsafe {
            match &self.elements {
                Elements::F32(p) => combine(p, range, self.op),
                Elements::F64(p) => combine(p, range, self.op),
                Elements::S64(p) => combine(p, range, self.op),
            }
        });
        if combined.is_none() {
            self.spoiled.store(true, Ordering::Relaxed);
        }
    }
}

/// Combine `range` of every rank's values in `runs` in rank order and
/// write the result to each rank's own buffers and to the shared result:
/// a stretch at a time that lies in one buffer of every rank (all of
/// `range` when each rank has one buffer).
///
/// # Safety
/// Every run is of a live buffer, every rank's runs and the shared result
/// hold at least `range.end` values, and nothing else accesses `range` of
/// any of them meanwhile (lent values may be read).
unsafe fn combine<T: Element>(runs: &Runs<T>, range: Range<usize>, op: Op) {
    // The stretch's first element in every rank's buffers, and where its
    // result goes.
    let mut from: SmallVec<[*const T; 16]> = SmallVec::new();
    let mut to: SmallVec<[*mut T; 16]> = SmallVec::new();
    let mut start = range.start;
    while start < range.end {
        let mut len = range.end - start;
        from.clear();
        to.clear();
        for rank in 0..runs.ranks() {
            let (p, contiguous) = runs.at(rank, start);
            from.push(p.cast_const());
            if runs.written(rank) {
                to.push(p);
            }
            len = len.min(contiguous);
        }
        if let Some(shared) = runs.shared() {
            // SAFETY: `start` is within the shared result (the caller).
            to.push(unsafe { shared.add(start) });
        }
        // SAFETY: passed on from the caller; `len` elements from each
        // pointer lie in one buffer.
        unsafe { combine_stretch(&from, &to, len, op) };
        start += len;
    }
}

#[cfg(test)]
#[path = "reduce_tests.rs"]
mod tests;
