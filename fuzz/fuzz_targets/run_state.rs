//! Fuzz target: see trainhost::fuzzing::run_state.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| trainhost::fuzzing::run_state(data));
