//! Fuzz target: the HTTP/1.1 request head and chunked body framing (src/http/codec.rs).
//! The checks are in `hubcast::fuzzing::http` (src/fuzzing.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hubcast::fuzzing::http(data));
