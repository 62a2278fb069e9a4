//! Fuzz target: see trainhost::fuzzing::metrics.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| trainhost::fuzzing::metrics(data));
