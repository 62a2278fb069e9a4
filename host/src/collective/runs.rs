//! Where each rank's values of an all-reduce are: one buffer, or several
//! taken one after the other ([`Values::F32Parts`], a list of host
//! tensors), as runs of contiguous elements that the combining walks
//! without gathering them.

use smallvec::SmallVec;

use super::Values;

/// Every rank's buffers as runs of contiguous elements: rank `r`'s are
/// `runs[firsts[r]..firsts[r + 1]]`, in the order of its values. Held
/// inline for up to four ranks with a buffer each, so that a small
/// all-reduce among them allocates nothing for it (a first version that
/// allocated these, and wrapped the result in one more vector, made a
/// one-tensor all-reduce of 150 KB between 2 ranks about 0.4 µs slower).
pub(super) struct Runs<T> {
    runs: SmallVec<[Run<T>; 4]>,
    firsts: SmallVec<[usize; 5]>,
}

/// One non-empty buffer of a rank's values.
struct Run<T> {
    ptr: *mut T,
    /// The position of its first element among the rank's values.
    at: usize,
    len: usize,
}

// Not derived: a derive would ask `T: Copy` of the pointer's target.
impl<T> Clone for Run<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Run<T> {}

impl<T> Runs<T> {
    /// The runs of `values` (by rank), whose buffers `buffers_of` gives.
    /// `as_mut_ptr` forms no reference to the elements; the pointers stay
    /// valid while the vectors are moved, not resized.
    pub(super) fn new(values: &mut [Values], buffers_of: fn(&mut Values) -> &mut [Vec<T>]) -> Self {
        let mut runs = SmallVec::with_capacity(values.len());
        let mut firsts = SmallVec::with_capacity(values.len() + 1);
        for v in values {
            firsts.push(runs.len());
            let mut at = 0;
            for buffer in buffers_of(v) {
                if !buffer.is_empty() {
                    runs.push(Run {
                        ptr: buffer.as_mut_ptr(),
                        at,
                        len: buffer.len(),
                    });
                }
                at += buffer.len();
            }
        }
        firsts.push(runs.len());
        Self { runs, firsts }
    }

    pub(super) fn ranks(&self) -> usize {
        self.firsts.len() - 1
    }

    /// Rank `rank`'s element at position `at`, and how many of its
    /// elements lie contiguously from there (that one included).
    ///
    /// # Panics
    /// If `at` is not below the rank's number of values.
    pub(super) fn at(&self, rank: usize, at: usize) -> (*mut T, usize) {
        let runs = &self.runs[self.firsts[rank]..self.firsts[rank + 1]];
        // The runs follow each other without gaps, so the last one that
        // starts at or before `at` holds it.
        let run = runs[runs.partition_point(|r| r.at <= at) - 1];
        let offset = at - run.at;
        assert!(
            offset < run.len,
            "element {at} is past rank {rank}'s values"
        );
        // SAFETY: `offset` is within the run's buffer (checked above).
        (unsafe { run.ptr.add(offset) }, run.len - offset)
    }
}

pub(super) fn f32_buffers(values: &mut Values) -> &mut [Vec<f32>] {
    match values {
        Values::F32(v) => std::slice::from_mut(v),
        Values::F32Parts(parts) => parts,
        _ => unreachable!("types checked by meet"),
    }
}

pub(super) fn f64_buffers(values: &mut Values) -> &mut [Vec<f64>] {
    match values {
        Values::F64(v) => std::slice::from_mut(v),
        _ => unreachable!("types checked by meet"),
    }
}

pub(super) fn s64_buffers(values: &mut Values) -> &mut [Vec<i64>] {
    match values {
        Values::S64(v) => std::slice::from_mut(v),
        _ => unreachable!("types checked by meet"),
    }
}
