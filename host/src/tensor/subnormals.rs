//! Subnormal floats treated as zero while a kernel runs.
//!
//! Training drives values towards zero: once a model fits its data, the
//! softmax gives the wrong classes probabilities below f32's smallest
//! normal value (about 1.2e-38), and the gradients and the momentum built
//! from them follow. On Intel cores an operation with a subnormal input or
//! result takes a microcode assist of a hundred cycles or more. On a Xeon,
//! the digits example on host kernels trained about 1.6 million samples a
//! second over its first 14 epochs and 0.55 million from its 18th on, two
//! thirds of its time in the SGD step; with subnormals flushed, 1.65
//! million throughout its 60 epochs, to the same losses. TensorFlow runs
//! its CPU kernels with subnormals flushed for the same reason.
//!
//! So each kernel runs with x86's two flags set: DAZ (a subnormal input
//! counts as zero) and FTZ (a subnormal result becomes zero), and puts the
//! thread's previous flags back when it returns or unwinds ([`Flushed`]):
//! the guest's own code runs on the same thread, and WebAssembly computes
//! subnormals as IEEE 754 says. GEMMs that take several threads run on
//! the kernels' own threads ([`super::pool`]), which keep both flags set
//! for good, so that a value never depends on which thread computed it.
//!
//! The flags are read and written by inline assembly, which the optimiser
//! cannot see through and which may touch memory: the kernel's loads of
//! its values and stores of its results stay between the two writes. (Rust
//! and LLVM otherwise assume the default mode, which is why the
//! `_mm_setcsr` intrinsic is deprecated; audio code, which has the same
//! problem with decaying filters, does the same.) On other architectures
//! nothing is changed.

/// MXCSR's "denormals are zero": subnormal inputs read as zero.
#[cfg(target_arch = "x86_64")]
const DAZ: u32 = 1 << 6;
/// MXCSR's "flush to zero": subnormal results written as zero.
#[cfg(target_arch = "x86_64")]
const FTZ: u32 = 1 << 15;

/// Subnormals flushed on this thread until dropped, when the thread's
/// previous mode comes back.
#[must_use = "the flags are put back when this is dropped"]
pub(crate) struct Flushed {
    #[cfg(target_arch = "x86_64")]
    before: u32,
}

impl Flushed {
    /// Flush subnormals on this thread until the value is dropped.
    #[inline]
    pub(crate) fn new() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let before = mxcsr::read();
            if before & (DAZ | FTZ) != DAZ | FTZ {
                mxcsr::write(before | DAZ | FTZ);
            }
            Self { before }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Self {}
    }
}

impl Drop for Flushed {
    #[inline]
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if self.before & (DAZ | FTZ) != DAZ | FTZ {
            mxcsr::write(self.before);
        }
    }
}

/// Flush subnormals on this thread from now on: for the kernels' own
/// threads, which run nothing else.
pub(crate) fn flush_for_good() {
    std::mem::forget(Flushed::new());
}

#[cfg(target_arch = "x86_64")]
mod mxcsr {
    /// The thread's MXCSR.
    #[inline]
    pub(super) fn read() -> u32 {
        let mut value = 0u32;
        // SAFETY: stmxcsr stores the 4-byte register at the address given,
        // a local of that size.
        unsafe {
            std::arch::asm!(
                "stmxcsr [{}]",
                in(reg) &mut value,
                options(nostack, preserves_flags),
            );
        }
        value
    }

    /// Set the thread's MXCSR to `value`, read from it and changed in
    /// the DAZ and FTZ bits only (a reserved bit set would fault).
    #[inline]
    pub(super) fn write(value: u32) {
        // SAFETY: ldmxcsr loads 4 bytes from the address given, a local;
        // `value` is a valid MXCSR (see above). Not `readonly`: the write
        // must stay ordered with the kernel's loads and stores.
        unsafe {
            std::arch::asm!(
                "ldmxcsr [{}]",
                in(reg) &value,
                options(nostack, preserves_flags),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Half of f32's smallest normal value: a subnormal.
    fn subnormal() -> f32 {
        std::hint::black_box(f32::MIN_POSITIVE / 2.0)
    }

    /// A product computed at run time (the optimiser must not fold it).
    fn times(a: f32, b: f32) -> f32 {
        std::hint::black_box(a) * std::hint::black_box(b)
    }

    #[test]
    fn subnormals_are_zero_inside_and_come_back_after() {
        assert!(subnormal() > 0.0 && !subnormal().is_normal());
        assert_eq!(times(subnormal(), 1.0), subnormal());
        {
            let _flushed = Flushed::new();
            if cfg!(target_arch = "x86_64") {
                // Both the input (DAZ) and a result (FTZ) are zero.
                assert_eq!(times(subnormal(), 1.0), 0.0);
                assert_eq!(times(f32::MIN_POSITIVE, 0.5), 0.0);
                // Normal values are untouched.
                assert_eq!(times(f32::MIN_POSITIVE, 2.0), 2.0 * f32::MIN_POSITIVE);
            }
            // Nested: the inner one's drop keeps the outer one's mode.
            drop(Flushed::new());
            if cfg!(target_arch = "x86_64") {
                assert_eq!(times(subnormal(), 1.0), 0.0);
            }
        }
        assert_eq!(times(subnormal(), 1.0), subnormal());
        assert_eq!(times(f32::MIN_POSITIVE, 0.5), subnormal());
    }

    #[test]
    fn the_mode_comes_back_when_a_kernel_panics() {
        let caught = std::panic::catch_unwind(|| {
            let _flushed = Flushed::new();
            panic!("a kernel's bug");
        });
        assert!(caught.is_err());
        assert_eq!(times(subnormal(), 1.0), subnormal());
    }
}
