//! Fuzz target: the store's frames and records on every start-up path (src/store/format.rs).
//! The checks are in `hubcast::fuzzing::store` (src/fuzzing.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hubcast::fuzzing::store(data));
