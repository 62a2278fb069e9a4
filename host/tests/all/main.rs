//! trainhost's integration tests: real guests compiled from source
//! (`tests/guests`, `examples/linear-regression`), real storage, real traps.

mod blocked;
mod burn;
mod cli;
mod cloud;
mod collective;
mod digits;
mod escape;
mod example;
mod failures;
mod fuzz_corpus;
mod hand_over;
#[cfg(not(feature = "mpi"))]
mod launch;
mod launchers;
mod limits;
mod listings;
#[cfg(feature = "mpi")]
mod nodes;
mod outages;
mod owner;
mod persistence;
mod preemption;
mod programs;
mod protocol;
mod python;
mod python_hostile;
mod report;
mod restore;
mod resume;
mod retention;
mod servers;
mod sharing;
mod signing;
mod tensorboard;
mod tensors;
mod util;
mod workdir;
