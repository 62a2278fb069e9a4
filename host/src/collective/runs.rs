//! Where each rank's values of an all-reduce are: one buffer, or several
//! taken one after the other ([`Values::F32Parts`], a list of host
//! tensors), as runs of contiguous elements that the combining walks
//! without gathering them; and where the result goes: into the buffers of
//! the ranks that own theirs, and into one shared buffer for those whose
//! values are lent ([`Values::F32Lent`]), which are only read.

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
    /// By rank: whether the result is written into its buffers (not for
    /// lent values).
    written: SmallVec<[bool; 4]>,
    /// The shared result of the ranks whose values are lent: `len`
    /// elements from here, if any rank's are.
    shared: Option<*mut T>,
}

/// A rank's values: buffers of its own, or values lent (read only).
pub(super) enum Buffers<'a, T> {
    Own(&'a mut [Vec<T>]),
    Lent(*const T, usize),
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
    pub(super) fn new(
        values: &mut [Values],
        buffers_of: fn(&mut Values) -> Buffers<'_, T>,
    ) -> Self {
        let mut runs = SmallVec::with_capacity(values.len());
        let mut firsts = SmallVec::with_capacity(values.len() + 1);
        let mut written = SmallVec::with_capacity(values.len());
        for v in values {
            firsts.push(runs.len());
            match buffers_of(v) {
                Buffers::Own(buffers) => {
                    written.push(true);
                    let mut at = 0;
                    for buffer in buffers {
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
                Buffers::Lent(ptr, len) => {
                    written.push(false);
                    if len > 0 {
                        runs.push(Run {
                            // Never written: `written` says so.
                            ptr: ptr.cast_mut(),
                            at: 0,
                            len,
                        });
                    }
                }
            }
        }
        firsts.push(runs.len());
        Self {
            runs,
            firsts,
            written,
            shared: None,
        }
    }

    /// Write the result of the ranks whose values are lent from `ptr`
    /// (room for as many elements as a rank's values).
    pub(super) fn share_into(&mut self, ptr: *mut T) {
        self.shared = Some(ptr);
    }

    /// The shared result's first element, if any rank's values are lent.
    pub(super) fn shared(&self) -> Option<*mut T> {
        self.shared
    }

    /// Whether rank `rank`'s buffers receive the result.
    pub(super) fn written(&self, rank: usize) -> bool {
        self.written[rank]
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

pub(super) fn f32_buffers(values: &mut Values) -> Buffers<'_, f32> {
    match values {
        Values::F32(v) => Buffers::Own(std::slice::from_mut(v)),
        Values::F32Parts(parts) => Buffers::Own(parts),
        Values::F32Lent(lent) => Buffers::Lent(lent.as_ptr(), lent.len()),
        _ => unreachable!("types checked by meet"),
    }
}

pub(super) fn f64_buffers(values: &mut Values) -> Buffers<'_, f64> {
    match values {
        Values::F64(v) => Buffers::Own(std::slice::from_mut(v)),
        _ => unreachable!("types checked by meet"),
    }
}

pub(super) fn s64_buffers(values: &mut Values) -> Buffers<'_, i64> {
    match values {
        Values::S64(v) => Buffers::Own(std::slice::from_mut(v)),
        _ => unreachable!("types checked by meet"),
    }
}
