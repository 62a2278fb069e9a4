//! Paths of the guest components built from source for the tests.

/// The scripted test guest (`tests/guests`): its config says what each rank
/// does.
pub const TEST_GUEST: &str = env!("TRAINHOST_TEST_GUEST");

/// The linear-regression example (`examples/linear-regression`).
pub const LINEAR_REGRESSION: &str = env!("TRAINHOST_LINEAR_REGRESSION");
