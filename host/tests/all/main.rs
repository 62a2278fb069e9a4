//! trainhost's integration tests: real guests compiled from source
//! (`tests/guests`, `examples/linear-regression`), real storage, real traps.

mod cli;
mod escape;
mod example;
mod failures;
mod preemption;
mod protocol;
mod report;
mod restore;
mod resume;
mod retention;
mod util;
