//! Property tests of the ingest body parser, on stable Rust with a fixed seed and a time cap
//! (they run in the normal `cargo test`): arbitrary and hostile bytes (deep nesting, invalid
//! UTF-8, lone surrogate escapes, bad numbers, trailing garbage) never panic and come out
//! exactly as serde_json reads them ([`oracle`]: the serde_json `RawValue` parse the scanner
//! replaced); every member of any generated JSON object comes out with its value's exact text
//! (numbers beyond i64/u64/f64 included), which re-parses to the same JSON.

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

/// Fragments that JSON readers get wrong: surrogate escapes (paired, lone, half-paired),
/// invalid UTF-8 (overlong, encoded surrogates, beyond U+10FFFF, cut short) next to valid
/// multi-byte text, bad escapes, and numbers at the edge of the grammar.
const HOSTILE: &[&[u8]] = &[
    b"\\ud83d\\ude80", b"\\ud83d", b"\\ude80", b"\\ud83d\\u0041", b"\\ud83dx", b"\\ud83d\\n", b"\\uDBFF\\uDFFF",
    b"\\u00", b"\\u00g0", b"\\/", b"\\a", b"\\", b"\t", b"\x7f",
    b"\xc0\x80", b"\xc2\xa9", b"\xe2\x82", b"\xe2\x82\xac", b"\xed\xa0\x80", b"\xed\x9f\xbf", b"\xef\xbf\xbf",
    b"\xf0\x8f\xbf\xbf", b"\xf0\x9f\x98\x80", b"\xf4\x8f\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\x80",
    b"-", b"-0", b"01", b"-01", b"1.", b".1", b"1e", b"1e+", b"1E-0", b"0e0", b"00", b"1.5e", b"-1.0E+2",
];

/// Bytes that are sometimes JSON: random bytes, JSON-ish tokens, a valid object mutated, a
/// valid object with hostile fragments spliced in, deep nesting, trailing garbage.
fn bytes(rng: &mut fastrand::Rng) -> Vec<u8> {
    match rng.u8(..6) {
        0 => (0..rng.usize(..48)).map(|_| rng.u8(..)).collect(),
        1 => {
            let tokens = ["{", "}", "[", "]", ":", ",", "\"", "\"k\"", "1", "-", "e9", "1e309", "true", "nul", " ", "\\", "\\u", "\u{ff}", "\"\\ud800\""];
            (0..rng.usize(..24)).flat_map(|_| pick(rng, &tokens).as_bytes().to_vec()).collect()
        }
        2 => {
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
        3 => {
            // Hostile fragments inside keys, string values or in place of a number.
            let mut b = Vec::new();
            b.push(b'{');
            for i in 0..rng.usize(1..4) {
                if i > 0 {
                    b.push(b',');
                }
                let fragment = HOSTILE[rng.usize(..HOSTILE.len())];
                match rng.u8(..3) {
                    0 => {
                        b.push(b'"');
                        b.extend_from_slice(fragment);
                        b.extend_from_slice(b"\":1");
                    }
                    1 => {
                        b.extend_from_slice(b"\"k\":\"");
                        b.extend_from_slice(fragment);
                        b.push(b'"');
                    }
                    _ => {
                        b.extend_from_slice(b"\"k\":[");
                        b.extend_from_slice(fragment);
                        b.push(b']');
                    }
                }
            }
            b.push(b'}');
            b
        }
        4 => {
            // Deep nesting, balanced or not, of arrays and objects.
            let depth = rng.usize(1..3000);
            let mut b = b"{\"deep\":".to_vec();
            let opens: Vec<bool> = (0..depth).map(|_| rng.bool()).collect();
            for &object in &opens {
                b.extend_from_slice(if object { b"{\"k\":" } else { b"[" });
            }
            b.extend_from_slice(number(rng).as_bytes());
            let cut = if rng.u8(..4) == 0 { rng.usize(..=depth) } else { 0 };
            for &object in opens.iter().rev().skip(cut) {
                b.push(if object { b'}' } else { b']' });
            }
            b.push(b'}');
            if rng.u8(..8) == 0 {
                let at = rng.usize(..b.len());
                b[at] = pick(rng, &["]", "}", ",", ":", " "]).as_bytes()[0];
            }
            b
        }
        _ => {
            // Trailing garbage after (or instead of) the end of a valid object.
            let mut b = object(rng, 0).0.into_bytes();
            let tail = pick(rng, &["", " ", "\n", "x", "}", "{}", ",", "\u{0}", "\u{feff}", "1", "\"", " {\"a\":1}"]);
            b.extend_from_slice(tail.as_bytes());
            if rng.bool() {
                b.insert(0, pick(rng, &[" ", "\u{feff}", "\t", "x"]).as_bytes()[0]);
            }
            b
        }
    }
}

#[test]
fn arbitrary_and_hostile_bytes_never_panic_and_are_read_exactly_as_serde_json_reads_them() {
    let mut rng = fastrand::Rng::with_seed(SEED);
    let started = Instant::now();
    let mut cases = 0u32;
    let mut objects = 0u32;
    while cases < 200_000 && started.elapsed() < BUDGET {
        cases += 1;
        let body = bytes(&mut rng);
        let shown = String::from_utf8_lossy(&body);
        assert_eq!(is_json(&body), oracle::is_json(&body), "is_json of {shown:?}");
        let expected = oracle::members(&body);
        let got = top_level_members(&body).map(|m| m.into_iter().map(|(k, v)| (k.into_owned(), v.to_owned())).collect::<Vec<_>>());
        assert_eq!(got, expected, "members of {shown:?}");
        objects += u32::from(expected.is_ok());
        match parse_telemetry_checked(&body, &settings()) {
            Ok(parsed) => assert_eq!(parsed.values.len(), expected.as_ref().map_or(usize::MAX, Vec::len)),
            Err(fault) => assert_eq!(Err(&fault), expected.as_ref().map(|_| ())),
        }
        assert_eq!(device_id_in_body(&body, "k").is_some(), expected.as_ref().is_ok_and(|m| m.iter().rev().find(|(k, _)| k == "k").is_some_and(|(_, v)| serde_json::from_str::<String>(v).is_ok())));
        let _ = message_json(&body);
    }
    assert!(cases > 100, "only {cases} cases in {BUDGET:?}");
    assert!(objects > cases / 20, "only {objects} of {cases} cases were objects");
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

#[test]
fn batches_are_split_into_the_items_serde_json_finds() {
    let mut rng = fastrand::Rng::with_seed(SEED ^ 2);
    let started = Instant::now();
    let mut cases = 0u32;
    let mut valid = 0u32;
    while cases < 50_000 && started.elapsed() < BUDGET {
        cases += 1;
        let body = match rng.u8(..3) {
            0 => bytes(&mut rng),
            _ => {
                let mut b = vec![b'['];
                for i in 0..rng.usize(..5) {
                    if i > 0 {
                        b.extend_from_slice(ws(&mut rng).as_bytes());
                        b.push(b',');
                    }
                    b.extend_from_slice(ws(&mut rng).as_bytes());
                    if rng.u8(..4) == 0 {
                        b.extend_from_slice(&bytes(&mut rng));
                    } else {
                        b.extend_from_slice(value(&mut rng, 0).as_bytes());
                    }
                }
                b.extend_from_slice(ws(&mut rng).as_bytes());
                b.push(b']');
                b
            }
        };
        let shown = String::from_utf8_lossy(&body);
        let mut items = Vec::new();
        let scanned = json::for_each_item(&body, |item| {
            items.push(match item {
                json::Item::Object(m) => Ok(m.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>()),
                json::Item::Other(text) => Err(text.to_owned()),
            });
            Ok::<(), ()>(())
        });
        // The items serde_json finds (any JSON text is one item, an array's elements are each one).
        let texts: Option<Vec<String>> = oracle::is_json(&body).then(|| {
            match serde_json::from_slice::<Vec<&serde_json::value::RawValue>>(&body) {
                Ok(elements) => elements.into_iter().map(|e| e.get().to_owned()).collect(),
                Err(_) => vec![String::from_utf8(body.clone()).unwrap().trim_matches([' ', '\n', '\r', '\t']).to_owned()],
            }
        });
        // An item object's keys are decoded, so a lone surrogate escape in one is refused there.
        let expected_ok =
            texts.as_ref().is_some_and(|t| t.iter().all(|t| !t.starts_with('{') || oracle::members(t.as_bytes()).is_ok()));
        assert_eq!(scanned.is_ok(), expected_ok, "{shown:?}");
        let Some(texts) = texts.filter(|_| scanned.is_ok()) else { continue };
        valid += 1;
        assert_eq!(items.len(), texts.len(), "{shown:?}");
        for (item, text) in items.into_iter().zip(texts) {
            match item {
                Ok(members) => assert_eq!(Ok(members), oracle::members(text.as_bytes()), "{shown:?}"),
                Err(other) => {
                    assert_eq!(other, text);
                    assert!(!text.starts_with('{'));
                }
            }
        }
    }
    assert!(cases > 100 && valid > cases / 4, "{valid} valid of {cases} cases in {BUDGET:?}");
}
