//! Fuzz target: WebSocket frames and Engine.IO / Socket.IO packets (src/transport).
//! The checks are in `hubcast::fuzzing::engine_io` (src/fuzzing.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hubcast::fuzzing::engine_io(data));
