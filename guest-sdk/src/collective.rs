//! Combining the ranks' data: [`barrier`], [`broadcast`], [`all_reduce`],
//! [`all_gather`].
//!
//! Every call here is collective, like [`report`](crate::report): every
//! rank makes the same calls in the same order (reports and collectives
//! counted together), and a call returns once every rank has made it. Calls
//! that do not match fail the run with an error naming the ranks and what
//! each called. Results are the same bits on every rank, and the same from
//! run to run for the same inputs.
//!
//! Data-parallel training averages the gradients of every rank's shard
//! before each step, so that every rank applies the same update:
//!
//! ```no_run
//! use trainhost_guest::collective::{self, Op};
//!
//! # fn gradients_of_my_shard() -> Vec<f32> { vec![] }
//! # fn apply(_: &[f32]) {}
//! # fn step() -> Result<(), collective::CollectiveError> {
//! let mut gradients: Vec<f32> = gradients_of_my_shard();
//! collective::all_reduce(&mut gradients, Op::Mean)?;
//! apply(&gradients);
//! # Ok(())
//! # }
//! ```

use std::fmt;

use crate::wit::trainhost::train::collective as wit;

/// How [`all_reduce`] combines the ranks' values, element by element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The sum (integers wrap around on overflow).
    Sum,
    /// The sum divided by the number of ranks; floats only.
    Mean,
    /// The smallest value (for floats, a NaN loses to a number).
    Min,
    /// The largest value (for floats, a NaN loses to a number).
    Max,
}

impl From<Op> for wit::ReduceOp {
    fn from(op: Op) -> Self {
        match op {
            Op::Sum => wit::ReduceOp::Sum,
            Op::Mean => wit::ReduceOp::Mean,
            Op::Min => wit::ReduceOp::Min,
            Op::Max => wit::ReduceOp::Max,
        }
    }
}

/// Why a collective call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CollectiveError {
    /// The ranks' calls do not match (another operation, type, length or
    /// root), or a rank returned from the loop or never came. The run is
    /// failing with this message: return from the loop.
    Mismatch(String),
    /// The run is stopping (another rank failed, a limit was hit, the run
    /// is preempted): return from the loop. Another call stops the rank.
    Aborted(String),
    /// Every rank made this call and it cannot be carried out (the mean of
    /// integers, a result over the memory limit). The run goes on.
    Invalid(String),
}

impl fmt::Display for CollectiveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CollectiveError::Mismatch(m) => f.write_str(m),
            CollectiveError::Aborted(m) => write!(f, "collective call aborted: {m}"),
            CollectiveError::Invalid(m) => write!(f, "invalid collective call: {m}"),
        }
    }
}

impl std::error::Error for CollectiveError {}

impl From<wit::CollectiveError> for CollectiveError {
    fn from(e: wit::CollectiveError) -> Self {
        match e {
            wit::CollectiveError::Mismatch(m) => CollectiveError::Mismatch(m),
            wit::CollectiveError::Aborted(m) => CollectiveError::Aborted(m),
            wit::CollectiveError::Invalid(m) => CollectiveError::Invalid(m),
        }
    }
}

/// Wait until every rank has called `barrier`.
pub fn barrier() -> Result<(), CollectiveError> {
    Ok(wit::barrier()?)
}

/// Replace `data` on every rank with rank `root`'s `data`. What the other
/// ranks hold before the call is not sent.
pub fn broadcast(data: &mut Vec<u8>, root: u32) -> Result<(), CollectiveError> {
    let sent: &[u8] = if crate::world_rank() == root {
        data
    } else {
        &[]
    };
    *data = wit::broadcast(sent, root)?;
    Ok(())
}

/// Every rank's `data`, in rank order. Ranks may send different lengths.
pub fn all_gather(data: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
    Ok(wit::all_gather(data)?)
}

/// Replace `data` on every rank with the element-wise combination of every
/// rank's `data`. Every rank passes the same number of elements. Works on
/// `f32`, `f64` and `i64` (without [`Op::Mean`]), in a `Vec`, a slice or an
/// array ([`Buffer`]).
///
/// The host reads f32 buffers of 1 MiB or more where they lie in the
/// guest's memory (they cross as their bits, `collective-bits`), smaller
/// ones and f64 and i64 values as a copy (cheaper below that size).
/// The result arrives as a new list in the guest's memory. A `Vec` is
/// replaced by it, without a copy (its capacity becomes its length, and its
/// old allocation is freed); a slice or an array gets the result copied
/// into it, one more pass over the values. For large buffers pass the `Vec`
/// itself (`&mut grads`, not `&mut grads[..]`), or keep the values in host
/// tensors ([`crate::tensor::all_reduce`]), which never cross into the
/// guest. On an error `data` is unchanged.
pub fn all_reduce<B: Buffer + ?Sized>(data: &mut B, op: Op) -> Result<(), CollectiveError> {
    data.all_reduce(op)
}

/// What [`all_reduce`] combines in place: a `Vec`, a slice or an array of a
/// [`Reducible`] type.
pub trait Buffer: sealed::Buffer {
    #[doc(hidden)]
    fn all_reduce(&mut self, op: Op) -> Result<(), CollectiveError>;
}

impl<T: Reducible> Buffer for Vec<T> {
    fn all_reduce(&mut self, op: Op) -> Result<(), CollectiveError> {
        *self = T::combine(self, op)?;
        Ok(())
    }
}

impl<T: Reducible> Buffer for [T] {
    fn all_reduce(&mut self, op: Op) -> Result<(), CollectiveError> {
        let result = T::combine(self, op)?;
        self.copy_from_slice(&result);
        Ok(())
    }
}

impl<T: Reducible, const N: usize> Buffer for [T; N] {
    fn all_reduce(&mut self, op: Op) -> Result<(), CollectiveError> {
        self.as_mut_slice().all_reduce(op)
    }
}

/// A type [`all_reduce`] combines: `f32`, `f64`, `i64`.
pub trait Reducible: Copy + sealed::Sealed {
    /// Every rank's `data` combined, as the host returns it.
    #[doc(hidden)]
    fn combine(data: &[Self], op: Op) -> Result<Vec<Self>, CollectiveError>;
}

mod sealed {
    use super::Reducible;

    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for i64 {}

    pub trait Buffer {}
    impl<T: Reducible> Buffer for Vec<T> {}
    impl<T: Reducible> Buffer for [T] {}
    impl<T: Reducible, const N: usize> Buffer for [T; N] {}
}

macro_rules! reducible {
    ($t:ty, $call:path) => {
        impl Reducible for $t {
            fn combine(data: &[Self], op: Op) -> Result<Vec<Self>, CollectiveError> {
                Ok($call(data, op.into())?)
            }
        }
    };
}

/// From this many bytes, an f32 all-reduce lends the host its values
/// (`collective-bits`) instead of passing them as a list the host copies.
///
/// Lending saves the copy, but the ranks then read each other's guest
/// memory and share one result buffer, handed out across cores, which
/// costs more than the copy below about 1 MiB. Alternating runs,
/// copied against lent, 2 ranks on 2 cores (a cache line's round trip of
/// 77-150 ns): 19 KiB (the digits example's gradients) 4.8-5.0 against
/// 6.7-7.0 µs, 256 KiB 26 against 43-45 µs, 1 MiB 84-104 against 110-112
/// µs, 4 MiB 0.98-1.26 against 0.83-0.91 ms; 4 ranks, 1 MiB 373-471
/// against 183-227 µs. With the cores further apart lending lost more: 4
/// KiB 5.3-6.4 against 9.2 µs, 19 KiB 9.6-10.8 against 18.7-20.4 µs.
const LENT_FROM: usize = 1 << 20;

/// f32 values of 1 MiB or more (`LENT_FROM`) go as their bits: the host
/// reads a list of integers where it lies, and copies a list of floats
/// first.
impl Reducible for f32 {
    fn combine(data: &[Self], op: Op) -> Result<Vec<Self>, CollectiveError> {
        if std::mem::size_of_val(data) < LENT_FROM {
            return Ok(wit::all_reduce_f32(data, op.into())?);
        }
        // SAFETY: u32 has the size and alignment of f32, and every bit
        // pattern is a u32.
        let bits = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u32>(), data.len()) };
        Ok(crate::wit::trainhost::train::collective_bits::all_reduce_f32(bits, op.into())?)
    }
}

reducible!(f64, wit::all_reduce_f64);
reducible!(i64, wit::all_reduce_s64);
