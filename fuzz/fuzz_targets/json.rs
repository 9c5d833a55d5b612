//! Fuzz target: the JSON span scanner (src/ingest/json.rs) against serde_json.
//! The checks are in `hubcast::fuzzing::json` (src/fuzzing.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hubcast::fuzzing::json(data));
