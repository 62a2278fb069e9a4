//! Paths of the guest components built from source for the tests.

/// The scripted test guest (`tests/guests`): its config says what each rank
/// does.
pub const TEST_GUEST: &str = env!("TRAINHOST_TEST_GUEST");

/// The linear-regression example (`examples/linear-regression`).
pub const LINEAR_REGRESSION: &str = env!("TRAINHOST_LINEAR_REGRESSION");

/// The data-parallel digits classifier (`examples/digits-mlp`).
pub const DIGITS_MLP: &str = env!("TRAINHOST_DIGITS_MLP");

/// The digits classifier written with burn (`examples/digits-burn`).
pub const DIGITS_BURN: &str = env!("TRAINHOST_DIGITS_BURN");

/// The README's guest (`examples/quickstart`).
pub const QUICKSTART: &str = env!("TRAINHOST_QUICKSTART");

/// The benchmarks' guest (`tools/bench/guest`).
pub const BENCH_GUEST: &str = env!("TRAINHOST_BENCH_GUEST");

/// A WASI command (`fn main`), not a trainhost guest.
pub const NOT_A_TRAINER: &str = env!("TRAINHOST_NOT_A_TRAINER");

/// A guest built against an incompatible `trainhost:train` version (0.9.0).
pub const OTHER_WIT: &str = env!("TRAINHOST_OTHER_WIT");

/// A guest built against `trainhost:train@0.1.0`, the package's first
/// release, which every 0.1.x host must run.
pub const WIT_0_1_0: &str = env!("TRAINHOST_WIT_0_1_0");
