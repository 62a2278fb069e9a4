//! Tensors that live in the host and the kernels that compute on them: the
//! maths of a training step at native speed, for guests that call them
//! through the `tensors` WIT interface.
//!
//! Nothing here knows about ranks or wasm: a [`Tensor`] is a shape and its
//! f32 values, each kernel checks its arguments and returns a
//! [`TensorError`] without changing anything on a bad call, and the long
//! ones ([`gemm()`]) ask a `stop` callback between blocks of work, so that a
//! rank whose run is stopping is not held up by its maths. On x86-64 the
//! kernels treat subnormal values as zero (`subnormals.rs`), so that
//! values decaying towards zero do not slow them down.

pub mod check;
pub(crate) mod file;
mod kernels;
mod layers;
mod pool;
mod random;
mod subnormals;

pub use kernels::{
    Activation, activate, activate_backward, adam, add_row, axpy, gather_rows, gemm, scale,
    sgd_momentum, softmax_cross_entropy, sum_rows,
};
pub use layers::{DenseGrads, dense, dense_backward, sgd_momentum_list};

/// The threads the kernels of one of `local_ranks` ranks on this host may
/// use: an equal share of the cores this process may run on (its CPU
/// affinity and cgroup quota, shared with the job's other processes on
/// this host), at least one. Ranks computing at once then never ask for
/// more threads than there are cores.
pub fn threads_per_rank(local_ranks: u32) -> usize {
    crate::cores::share_of(crate::cores::cores(), local_ranks as usize)
}

/// Why a kernel refused a call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TensorError {
    /// The shapes do not fit the kernel, or the data does not fill them.
    #[error("{0}")]
    Shape(String),
    /// Another argument is out of range.
    #[error("{0}")]
    Invalid(String),
    /// The stop callback said so, between two blocks of work: the result
    /// is incomplete.
    #[error("stopped")]
    Stopped,
}

/// Adam's hyperparameters for one step; `step` counts from 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub epsilon: f32,
    pub step: u32,
}

/// The largest number of dimensions: rank-1 and rank-2 tensors cover the
/// layers of a multilayer perceptron and the im2col form of a convolution.
const MAX_DIMS: usize = 2;

/// An f32 tensor of rank 1 or 2, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl Tensor {
    /// A tensor of `shape` holding `data`.
    pub fn from_vec(shape: &[u32], data: Vec<f32>) -> Result<Self, TensorError> {
        let shape = check_shape(shape)?;
        let n: usize = shape.iter().product();
        if data.len() != n {
            return Err(TensorError::Shape(format!(
                "{} values do not fill a tensor of shape {shape:?} ({n} values)",
                data.len()
            )));
        }
        Ok(Self { shape, data })
    }

    /// A tensor of no values and no dimensions: a stand-in while a kernel
    /// holds the real one.
    pub fn empty() -> Self {
        Self {
            shape: Vec::new(),
            data: Vec::new(),
        }
    }

    /// A tensor of `shape` full of zeros.
    pub fn zeros(shape: &[u32]) -> Result<Self, TensorError> {
        let shape = check_shape(shape)?;
        let n = shape.iter().product();
        Ok(Self {
            shape,
            data: vec![0.0; n],
        })
    }

    /// A tensor of `shape` drawn uniformly from `[low, high)` by a
    /// generator seeded with `seed` (the same values everywhere).
    pub fn uniform(shape: &[u32], low: f32, high: f32, seed: u64) -> Result<Self, TensorError> {
        if !(low.is_finite() && high.is_finite() && low <= high) {
            return Err(TensorError::Invalid(format!(
                "uniform needs finite bounds with low <= high, not [{low}, {high})"
            )));
        }
        let mut t = Self::zeros(shape)?;
        random::fill_uniform(&mut t.data, low, high, seed);
        Ok(t)
    }

    /// The bytes a tensor of `shape` takes, checked before it is made.
    pub fn bytes_for(shape: &[u32]) -> Result<u64, TensorError> {
        let shape = check_shape(shape)?;
        Ok(shape.iter().product::<usize>() as u64 * 4)
    }

    /// How many values the shape holds (also while an exchange holds
    /// them).
    pub fn value_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// The bytes this tensor's values take.
    pub fn bytes(&self) -> u64 {
        self.data.len() as u64 * 4
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The values, row-major.
    pub fn values(&self) -> &[f32] {
        &self.data
    }

    /// Overwrite the values with `data`, which must fill the shape.
    pub fn assign(&mut self, data: &[f32]) -> Result<(), TensorError> {
        if data.len() != self.data.len() {
            return Err(TensorError::Shape(format!(
                "{} values do not fill a tensor of shape {:?} ({} values)",
                data.len(),
                self.shape,
                self.data.len()
            )));
        }
        self.data.copy_from_slice(data);
        Ok(())
    }

    /// The values, taken out for an exchange that gives them back with
    /// [`Tensor::put_values`]; the tensor holds none meanwhile.
    pub fn take_values(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.data)
    }

    /// Put back values of the tensor's size.
    pub fn put_values(&mut self, values: Vec<f32>) -> Result<(), TensorError> {
        let n: usize = self.shape.iter().product();
        if values.len() != n {
            return Err(TensorError::Shape(format!(
                "{} values came back for a tensor of shape {:?}",
                values.len(),
                self.shape
            )));
        }
        self.data = values;
        Ok(())
    }

    /// Zeros in place of values an exchange did not give back.
    pub fn refill_zeros(&mut self) {
        let n: usize = self.shape.iter().product();
        self.data.clear();
        self.data.resize(n, 0.0);
    }

    /// `[rows, cols]` of a rank-2 tensor; `what` names it in the error.
    fn matrix(&self, what: &str) -> Result<(usize, usize), TensorError> {
        match self.shape[..] {
            [rows, cols] => Ok((rows, cols)),
            _ => Err(TensorError::Shape(format!(
                "{what} must be a matrix ([rows, cols]), not of shape {:?}",
                self.shape
            ))),
        }
    }
}

/// A shape with 1 or 2 dimensions whose element count fits memory.
fn check_shape(shape: &[u32]) -> Result<Vec<usize>, TensorError> {
    if shape.is_empty() || shape.len() > MAX_DIMS {
        return Err(TensorError::Shape(format!(
            "a tensor has 1 or 2 dimensions, not {} ({shape:?})",
            shape.len()
        )));
    }
    let n = shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(u64::from(d)))
        .filter(|n| n.checked_mul(4).is_some_and(|b| b <= isize::MAX as u64))
        .ok_or_else(|| TensorError::Shape(format!("shape {shape:?} is too large")))?;
    debug_assert!(usize::try_from(n).is_ok());
    Ok(shape.iter().map(|&d| d as usize).collect())
}

/// The error when `a` and `b`, named so, must have the same shape.
fn same_shape(what_a: &str, a: &Tensor, what_b: &str, b: &Tensor) -> Result<(), TensorError> {
    if a.shape == b.shape {
        Ok(())
    } else {
        Err(TensorError::Shape(format!(
            "{what_a} has shape {:?} and {what_b} {:?}; they must be the same",
            a.shape, b.shape
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked_when_tensors_are_made() {
        assert!(Tensor::from_vec(&[2, 3], vec![0.0; 6]).is_ok());
        let e = Tensor::from_vec(&[2, 3], vec![0.0; 5]).unwrap_err();
        assert!(e.to_string().contains("5 values do not fill"), "{e}");
        assert!(matches!(Tensor::zeros(&[]), Err(TensorError::Shape(_))));
        assert!(matches!(
            Tensor::zeros(&[1, 2, 3]),
            Err(TensorError::Shape(_))
        ));
        let e = Tensor::bytes_for(&[u32::MAX, u32::MAX]).unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        assert_eq!(Tensor::bytes_for(&[3, 5]).unwrap(), 60);
    }

    #[test]
    fn uniform_values_lie_in_their_bounds_and_follow_the_seed() {
        let a = Tensor::uniform(&[1000], -0.5, 0.5, 7).unwrap();
        assert!(a.values().iter().all(|v| (-0.5..0.5).contains(v)));
        let mean = a.values().iter().sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.05, "{mean}");
        assert_eq!(a, Tensor::uniform(&[1000], -0.5, 0.5, 7).unwrap());
        assert_ne!(a, Tensor::uniform(&[1000], -0.5, 0.5, 8).unwrap());
        assert!(Tensor::uniform(&[2], 1.0, 0.0, 0).is_err());
    }
}
