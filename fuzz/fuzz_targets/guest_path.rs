//! Fuzz target: see trainhost::fuzzing::guest_path.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| trainhost::fuzzing::guest_path(data));
