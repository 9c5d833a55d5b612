//! Property tests of the ingest body parser, on stable Rust with a fixed seed and a time cap
//! (they run in the normal `cargo test`): arbitrary bytes never panic and are classified the
//! way serde_json classifies them; every member of any generated JSON object comes out with its
//! value's exact text (numbers beyond i64/u64/f64 included), which re-parses to the same JSON.

use std::time::{Duration, Instant};

use super::*;

/// Wall-clock budget of each property (a slow machine runs fewer cases, never longer).
const BUDGET: Duration = Duration::from_secs(2);
const SEED: u64 = 0x5EED_1A9E_57B0_D1E5;

fn settings() -> IngestSettings {
    // Keys the generator never produces (it never emits U+1F600), so every member is telemetry.
    IngestSettings {
        custom_timestamp_key: "\u{1F600}ts".into(),
        custom_device_id_key: "\u{1F600}id".into(),
        custom_connection_state_key: "\u{1F600}on".into(),
        connection_state_on_telemetry: true,
    }
}

fn pick<'a>(rng: &mut fastrand::Rng, items: &[&'a str]) -> &'a str {
    items[rng.usize(..items.len())]
}

fn ws(rng: &mut fastrand::Rng) -> &'static str {
    ["", "", "", " ", "\n", "\t ", "\r\n  "][rng.usize(..7)]
}

/// A JSON string literal (with escapes) and the string it denotes.
fn string(rng: &mut fastrand::Rng) -> (String, String) {
    let mut text = String::from("\"");
    let mut value = String::new();
    for _ in 0..rng.usize(..8) {
        match rng.u8(..10) {
            0 => {
                text.push_str("\\\"");
                value.push('"');
            }
            1 => {
                text.push_str("\\\\");
                value.push('\\');
            }
            2 => {
                text.push_str("\\n");
                value.push('\n');
            }
            3 => {
                text.push_str("\\u00e9");
                value.push('é');
            }
            4 => {
                text.push_str("\\ud83d\\ude80"); // a surrogate pair: 🚀
                value.push('🚀');
            }
            5 => {
                text.push('ü');
                value.push('ü');
            }
            _ => {
                let c = rng.alphanumeric();
                text.push(c);
                value.push(c);
            }
        }
    }
    text.push('"');
    (text, value)
}

fn number(rng: &mut fastrand::Rng) -> String {
    match rng.u8(..8) {
        0 => pick(rng, &["18446744073709551616", "1e309", "-1e309", "123456789012345678901234567890", "-0", "-0.0", "1.0", "1E+2", "2.5e-400", "0.000000000000000000000000001"]).to_string(),
        1 => rng.i64(..).to_string(),
        2 => rng.u64(..).to_string(),
        3 => format!("{}.{}", rng.i32(..), rng.u32(..)),
        4 => format!("{}e{}", rng.i16(..), rng.i16(-400..400)),
        5 => "9".repeat(rng.usize(1..60)),
        _ => rng.i32(-1000..1000).to_string(),
    }
}

/// The text of a random JSON value (whitespace inside it included).
fn value(rng: &mut fastrand::Rng, depth: u32) -> String {
    let kind = if depth >= 4 { rng.u8(..5) } else { rng.u8(..7) };
    match kind {
        0 => pick(rng, &["true", "false", "null"]).to_string(),
        1 | 2 => number(rng),
        3 | 4 => string(rng).0,
        5 => {
            let items: Vec<String> = (0..rng.usize(..4)).map(|_| format!("{}{}{}", ws(rng), value(rng, depth + 1), ws(rng))).collect();
            format!("[{}]", if items.is_empty() { ws(rng).to_string() } else { items.join(",") })
        }
        _ => object(rng, depth + 1).0,
    }
}

/// A JSON object's text and its members as (key, value text).
fn object(rng: &mut fastrand::Rng, depth: u32) -> (String, Vec<(String, String)>) {
    let mut members = Vec::new();
    let mut parts = Vec::new();
    for _ in 0..rng.usize(..6) {
        let (key_text, key) = string(rng);
        let v = value(rng, depth);
        parts.push(format!("{}{}{}:{}{}{}", ws(rng), key_text, ws(rng), ws(rng), v, ws(rng)));
        members.push((key, v));
    }
    let text = if parts.is_empty() { format!("{{{}}}", ws(rng)) } else { format!("{{{}}}", parts.join(",")) };
    (text, members)
}

/// Bytes that are sometimes JSON: random bytes, JSON-ish tokens, or a valid object mutated.
fn bytes(rng: &mut fastrand::Rng) -> Vec<u8> {
    match rng.u8(..3) {
        0 => (0..rng.usize(..48)).map(|_| rng.u8(..)).collect(),
        1 => {
            let tokens = ["{", "}", "[", "]", ":", ",", "\"", "\"k\"", "1", "-", "e9", "1e309", "true", "nul", " ", "\\", "\\u", "\u{ff}", "\"\\ud800\""];
            (0..rng.usize(..24)).flat_map(|_| pick(rng, &tokens).as_bytes().to_vec()).collect()
        }
        _ => {
            let mut b = object(rng, 0).0.into_bytes();
            for _ in 0..rng.usize(1..4) {
                if b.is_empty() {
                    break;
                }
                let at = rng.usize(..b.len());
                match rng.u8(..3) {
                    0 => b[at] = rng.u8(..),
                    1 => {
                        b.remove(at);
                    }
                    _ => b.insert(at, rng.u8(..)),
                }
            }
            b
        }
    }
}

#[test]
fn arbitrary_bytes_never_panic_and_are_classified_as_serde_json_reads_them() {
    let mut rng = fastrand::Rng::with_seed(SEED);
    let started = Instant::now();
    let mut cases = 0u32;
    while cases < 200_000 && started.elapsed() < BUDGET {
        cases += 1;
        let body = bytes(&mut rng);
        let reference = serde_json::from_slice::<serde_json::Value>(&body);
        // JSON text is UTF-8 (RFC 8259 §8.1); serde_json's skipping alone does not check that.
        let valid = std::str::from_utf8(&body).is_ok_and(|t| serde_json::from_str::<serde::de::IgnoredAny>(t).is_ok());
        match parse_telemetry_checked(&body, &settings()) {
            Ok(parsed) => {
                assert!(valid, "accepted invalid JSON {:?}", String::from_utf8_lossy(&body));
                if let Ok(serde_json::Value::Object(map)) = &reference {
                    assert!(parsed.values.len() >= map.len(), "{:?}", String::from_utf8_lossy(&body));
                }
            }
            Err(faults::Fault::NotObject) => assert!(valid && !body.trim_ascii_start().starts_with(b"{")),
            Err(fault) => {
                assert_eq!(fault, faults::Fault::NotJson);
                // The one refusal beyond serde_json's skipping: a string escaping a lone UTF-16
                // surrogate has no Unicode text (RFC 8259 §8.2), so such a key cannot be kept.
                let surrogate_escape = body.windows(3).any(|w| w[0] == b'\\' && w[1] == b'u' && (w[2] | 0x20) == b'd');
                assert!(!valid || surrogate_escape, "refused valid JSON {:?}", String::from_utf8_lossy(&body));
            }
        }
        let _ = device_id_in_body(&body, "k");
        let _ = message_json(&body);
    }
    assert!(cases > 100, "only {cases} cases in {BUDGET:?}");
}

#[test]
fn every_member_of_a_json_object_keeps_its_exact_value_text() {
    let mut rng = fastrand::Rng::with_seed(SEED ^ 1);
    let started = Instant::now();
    let mut cases = 0u32;
    while cases < 50_000 && started.elapsed() < BUDGET {
        cases += 1;
        let (text, members) = object(&mut rng, 0);
        let body = format!("{}{text}{}", ws(&mut rng), ws(&mut rng));
        let parsed = parse_telemetry_checked(body.as_bytes(), &settings())
            .unwrap_or_else(|fault| panic!("{fault:?} for {body}"));
        assert_eq!(parsed.values.len(), members.len(), "{body}");
        for ((key, got), (want_key, want)) in parsed.values.iter().zip(&members) {
            assert_eq!(&**key, want_key, "{body}");
            assert_eq!(&**got, want, "value text of {want_key:?} in {body}");
            // Whatever serde_json can read back, it reads back the same.
            if let Ok(expected) = serde_json::from_str::<serde_json::Value>(want) {
                assert_eq!(serde_json::from_str::<serde_json::Value>(got).unwrap(), expected);
            }
        }
        assert_eq!(message_json(body.as_bytes()), body.trim());
    }
    assert!(cases > 100, "only {cases} cases in {BUDGET:?}");
}
