//! Fuzz target: the AMQP tap's transfer parser and a served link's frames (src/amqp/tap.rs).
//! The checks are in `hubcast::fuzzing::amqp` (src/fuzzing.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hubcast::fuzzing::amqp(data));
