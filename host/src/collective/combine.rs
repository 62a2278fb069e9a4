//! How an all-reduce combines values: element by element in rank order,
//! a block at a time, so that the result being built stays in the L1
//! cache while every rank's values are added to it. The all-reduce on one
//! host (`reduce.rs`) combines a slice of every rank's buffers at a time;
//! across nodes (`span.rs`) a node's ranks are combined into its partial
//! result, and the nodes' partials into the result. Either way the same
//! values in the same order give the same bits.

use std::mem::MaybeUninit;

use smallvec::SmallVec;

use super::runs::{Buffers, f32_buffers, f64_buffers, s64_buffers};
use super::{Op, Values};

/// Elements combined at a time: the partial result stays in the L1 cache
/// while every rank's slice is added to it.
const BLOCK: usize = 2048;

/// A value all-reduce can combine.
pub(super) trait Element: Copy + Send + Sync + 'static {
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

/// Combine `len` elements from each of `from` in rank order and write the
/// result to each of `to`, a block at a time: in the one buffer of `to`
/// itself if there is one and it holds none of the values after the
/// first (a node's partial across nodes, lent values' shared result),
/// else in a block on the stack copied to each.
///
/// # Safety
/// Every pointer is valid for `len` elements, and nothing else accesses
/// them meanwhile (but for reads of `from` that is not in `to`).
pub(super) unsafe fn combine_stretch<T: Element>(
    from: &[*const T],
    to: &[*mut T],
    len: usize,
    op: Op,
) {
    let (Some(&first), Some(rest)) = (from.first(), from.get(1..)) else {
        return;
    };
    if let [into] = *to
        && !rest.contains(&into.cast_const())
    {
        // SAFETY: passed on from the caller.
        return unsafe { combine_into(first, rest, into, len, op) };
    }
    let ranks = from.len();
    // Not initialized: each block is copied in before it is read.
    let mut block = [const { MaybeUninit::<T>::uninit() }; BLOCK];
    let mut start = 0;
    while start < len {
        let n = BLOCK.min(len - start);
        // SAFETY: within the `len` elements this thread alone accesses;
        // each slice lives only within this block's statement.
        let slice = |p: *const T| unsafe { std::slice::from_raw_parts(p.add(start), n) };
        // SAFETY: the block holds BLOCK ≥ n elements, the first n of
        // which are written here before the slice is formed.
        let acc = unsafe {
            let acc = block.as_mut_ptr().cast::<T>();
            std::ptr::copy_nonoverlapping(first.add(start), acc, n);
            std::slice::from_raw_parts_mut(acc, n)
        };
        fold_all(acc, rest.iter().map(|&p| slice(p)), op);
        if op == Op::Mean {
            divide(acc, ranks);
        }
        for &p in to {
            // SAFETY: as above; no other slice of this block is alive.
            unsafe { std::slice::from_raw_parts_mut(p.add(start), n) }.copy_from_slice(acc);
        }
        start += n;
    }
}

/// [`combine_stretch`] into one buffer that holds none of `rest`: each
/// block of it accumulates the result where it is (`first`'s values
/// copied in, unless `into` is `first`).
///
/// # Safety
/// As for [`combine_stretch`].
unsafe fn combine_into<T: Element>(
    first: *const T,
    rest: &[*const T],
    into: *mut T,
    len: usize,
    op: Op,
) {
    let ranks = rest.len() + 1;
    let mut start = 0;
    while start < len {
        let n = BLOCK.min(len - start);
        // SAFETY: within the `len` elements this thread alone accesses;
        // `into` is none of `rest`, and is read through `first` only
        // before the block is formed, if they are the same.
        let slice = |p: *const T| unsafe { std::slice::from_raw_parts(p.add(start), n) };
        if first != into.cast_const() {
            // SAFETY: as above; the two buffers differ.
            unsafe { std::ptr::copy_nonoverlapping(first.add(start), into.add(start), n) };
        }
        // SAFETY: as above.
        let acc = unsafe { std::slice::from_raw_parts_mut(into.add(start), n) };
        fold_all(acc, rest.iter().map(|&p| slice(p)), op);
        if op == Op::Mean {
            divide(acc, ranks);
        }
        start += n;
    }
}

/// Fold each of `next` into `acc` with `op`, in order: one loop per
/// operation, so that each is compiled to vector code rather than a call
/// per element.
#[inline(always)]
fn fold_all<'a, T: Element>(acc: &mut [T], next: impl Iterator<Item = &'a [T]>, op: Op) {
    for next in next {
        match op {
            Op::Sum | Op::Mean => fold(acc, next, T::sum),
            Op::Min => fold(acc, next, T::min),
            Op::Max => fold(acc, next, T::max),
        }
    }
}

/// `acc[i] = f(acc[i], next[i])`, inlined for each `f`.
#[inline(always)]
fn fold<T: Element>(acc: &mut [T], next: &[T], f: impl Fn(T, T) -> T) {
    for (a, b) in acc.iter_mut().zip(next) {
        *a = f(*a, *b);
    }
}

/// A mean's sums divided by the number of `ranks`.
pub(super) fn divide<T: Element>(sums: &mut [T], ranks: usize) {
    for v in sums {
        *v = T::mean(*v, ranks);
    }
}

/// Combine `parts` (equal types and lengths) element by element in order
/// with `op` (not a mean: its division is the caller's), in one pass, a
/// block at a time as on one host: into the first part the host owns,
/// else into a new buffer. One part the host owns is the result as it is.
/// (Across nodes: a node's ranks into its partial, the nodes' partials
/// into the result.)
///
/// # Safety
/// The loan of every lent part is held.
pub(super) unsafe fn combine_parts(parts: Vec<Values>, op: Op) -> Values {
    // A rank's values in several buffers are joined: they go to other
    // nodes as one.
    let parts: Vec<Values> = parts
        .into_iter()
        .map(|p| match p {
            Values::F32Parts(buffers) => Values::F32(buffers.concat()),
            p => p,
        })
        .collect();
    // SAFETY: passed on from the caller.
    unsafe {
        match parts.first() {
            Some(Values::F64(_)) => combine_buffers(parts, f64_buffers, Values::F64, op),
            Some(Values::S64(_)) => combine_buffers(parts, s64_buffers, Values::S64, op),
            _ => combine_buffers(parts, f32_buffers, Values::F32, op),
        }
    }
}

/// [`combine_parts`] for one element type: `buffers_of` finds a part's
/// buffer (one: they are joined), `wrap` makes a new result a value.
///
/// # Safety
/// As for [`combine_parts`].
unsafe fn combine_buffers<T: Element>(
    mut parts: Vec<Values>,
    buffers_of: fn(&mut Values) -> Buffers<'_, T>,
    wrap: fn(Vec<T>) -> Values,
    op: Op,
) -> Values {
    let mut from: SmallVec<[*const T; 16]> = SmallVec::new();
    // The first part the host owns: the result goes there.
    let mut into = None;
    let mut len = 0;
    for (i, part) in parts.iter_mut().enumerate() {
        match buffers_of(part) {
            Buffers::Own(buffers) => {
                for buffer in buffers {
                    into.get_or_insert(from.len());
                    len = buffer.len();
                    // `as_mut_ptr` forms no reference: the pointer stays
                    // valid while the vector is moved, not resized.
                    from.push(buffer.as_mut_ptr().cast_const());
                }
                debug_assert_eq!(from.len(), i + 1, "one buffer a part");
            }
            Buffers::Lent(ptr, lent) => {
                len = lent;
                from.push(ptr);
            }
        }
    }
    match into {
        Some(i) => {
            if from.len() > 1 {
                // SAFETY: every pointer is to `len` values of a live
                // buffer (a lent one under its loan, the caller), and only
                // this thread accesses them; the result is written into
                // part `i`'s own buffer, block by block after reading it.
                unsafe { combine_stretch(&from, &[from[i].cast_mut()], len, op) };
            }
            parts.swap_remove(i)
        }
        None => {
            let mut result = Vec::with_capacity(len);
            // SAFETY: as above; `result` has room for `len` values, each
            // of which is written before the length is set.
            unsafe {
                combine_stretch(&from, &[result.as_mut_ptr()], len, op);
                result.set_len(len);
            }
            wrap(result)
        }
    }
}
