//! Fuzz target: see trainhost::fuzzing::manifest.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| trainhost::fuzzing::manifest(data));
