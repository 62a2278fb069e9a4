//! Values a rank lends from its guest's memory for the length of one
//! collective call: read where they lie instead of copied into the host.
//!
//! wasmtime hands the host a guest's list of integers as a slice of the
//! guest's memory (`WasmList::as_le_slice`), valid while the guest waits
//! in the call, but a list of floats only as a copy. An f32 all-reduce
//! through `collective-bits` passes the values' bits, so the ranks'
//! buffers are combined where they are: one pass over the data fewer than
//! a lifted list (R33).
//!
//! The memory belongs to the rank's store, which lives on while the call
//! is pending, and the guest cannot run meanwhile, so nothing writes it.
//! But a stopping attempt drops a rank's call wherever it waits (see
//! `runtime/rank.rs`), and its store after it, while another rank's thread
//! may be combining. So every read holds the loan, and the dropped call's
//! [`Lending`] returns it: it waits for the readers that hold it, and a
//! read after that does not happen.

use std::sync::{Arc, RwLock, RwLockReadGuard};

use smallvec::SmallVec;

/// f32 values in a rank's guest memory, lent for one collective call.
pub(crate) struct Lent {
    ptr: *const f32,
    len: usize,
    loan: Arc<Loan>,
}

/// Whether the values are still lent: `true` until the lender's call ends.
#[derive(Debug)]
pub(crate) struct Loan(RwLock<bool>);

/// Held by the lending call for as long as it waits: dropping it (the call
/// returned, or was dropped) returns the loan.
#[derive(Debug)]
pub(crate) struct Lending(Arc<Loan>);

// SAFETY: the values are only read, and only while a reader holds the loan
// (`Loan::hold`), which the lender's `Lending` outlives (see `Lent::new`).
unsafe impl Send for Lent {}
// SAFETY: as for `Send`; nothing is written through the pointer.
unsafe impl Sync for Lent {}

impl Lent {
    /// Lend `values`, until the returned [`Lending`] is dropped.
    ///
    /// # Safety
    /// `values` must stay valid and unwritten until the [`Lending`] is
    /// dropped: the caller drops it before the memory can change (the
    /// guest waits in the call that holds it).
    pub(crate) unsafe fn new(values: &[f32]) -> (Lent, Lending) {
        let loan = Arc::new(Loan(RwLock::new(true)));
        let lent = Lent {
            ptr: values.as_ptr(),
            len: values.len(),
            loan: loan.clone(),
        };
        (lent, Lending(loan))
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The first value: read only while its loan is held ([`Loans::read`]).
    pub(super) fn as_ptr(&self) -> *const f32 {
        self.ptr
    }

    /// A copy of the values in host memory; zeros if the lender's call has
    /// ended (the attempt is stopping, and no rank gets a result).
    pub(crate) fn to_vec(&self) -> Vec<f32> {
        match self.loan.hold() {
            // SAFETY: the loan is held, so the lender's memory is as it
            // was lent (see `new`).
            Some(_held) => unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec(),
            None => vec![0.0; self.len],
        }
    }
}

impl Clone for Lent {
    /// The same loan: reading through either holds it.
    fn clone(&self) -> Self {
        Lent {
            ptr: self.ptr,
            len: self.len,
            loan: self.loan.clone(),
        }
    }
}

impl PartialEq for Lent {
    /// The same values lent: equal values elsewhere are not.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.ptr, other.ptr) && self.len == other.len
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl Loan {
    /// Hold the loan for reading: `None` once it was returned.
    fn hold(&self) -> Option<RwLockReadGuard<'_, bool>> {
        let held = self.0.read().unwrap_or_else(|p| p.into_inner());
        (*held).then_some(held)
    }
}

/// Every loan an exchange reads.
#[derive(Debug, Default)]
pub(super) struct Loans(SmallVec<[Arc<Loan>; 4]>);

impl Loans {
    pub fn push(&mut self, loan: Arc<Loan>) {
        self.0.push(loan);
    }

    /// The loans of every rank's values in `values` that are lent.
    pub fn of(values: &[super::Values]) -> Self {
        let mut loans = Self::default();
        for v in values {
            if let super::Values::F32Lent(lent) = v {
                loans.push(Arc::clone(&lent.loan));
            }
        }
        loans
    }

    /// How many ranks lend their values.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Hold every loan while `read` runs; `None` (and `read` not run) if
    /// any was returned.
    pub fn read<R>(&self, read: impl FnOnce() -> R) -> Option<R> {
        let held: Option<SmallVec<[RwLockReadGuard<'_, bool>; 4]>> =
            self.0.iter().map(|l| l.hold()).collect();
        let held = held?;
        let result = read();
        drop(held);
        Some(result)
    }
}

impl Drop for Lending {
    /// Return the loan, once no reader holds it.
    fn drop(&mut self) {
        *self.0.0.write().unwrap_or_else(|p| p.into_inner()) = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lent_values_are_read_until_the_loan_is_returned() {
        let values = vec![1.5f32, -2.0, 3.25];
        // SAFETY: `values` outlives the lending and is not written.
        let (lent, lending) = unsafe { Lent::new(&values) };
        assert_eq!(lent.to_vec(), values);
        let mut loans = Loans::default();
        loans.push(lent.loan.clone());
        assert_eq!(loans.read(|| 7), Some(7));
        drop(lending);
        assert_eq!(loans.read(|| 7), None, "a returned loan is not read");
        assert_eq!(lent.to_vec(), vec![0.0; 3]);
    }

    /// The lender's call ending waits for a reader that holds the loan.
    #[test]
    fn returning_a_loan_waits_for_its_readers() {
        let values = vec![1.0f32; 4];
        // SAFETY: `values` outlives the lending and is not written.
        let (lent, lending) = unsafe { Lent::new(&values) };
        let mut loans = Loans::default();
        loans.push(lent.loan.clone());
        let (reading, read) = std::sync::mpsc::channel();
        let returned = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                loans.read(|| {
                    reading.send(()).unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    assert!(
                        !returned.load(std::sync::atomic::Ordering::SeqCst),
                        "returned while read"
                    );
                })
            });
            read.recv().unwrap();
            drop(lending);
            returned.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    }
}
