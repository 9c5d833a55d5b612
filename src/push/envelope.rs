//! The `data` envelope: `{"deviceId", "timestamp", <exactly one of telemetry |
//! connectionState | deviceTwin | message>}` (reference §2).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Appends `s` as a JSON string: as it is between quotes when nothing in it needs escaping
/// (telemetry keys, device ids and timestamps almost always), through serde_json otherwise.
/// The check folds over the whole string without stopping early, which the compiler
/// vectorises: it runs for every key, device id and timestamp of every envelope.
pub(crate) fn push_json_str(out: &mut String, s: &str) {
    let plain = s.bytes().fold(true, |plain, b| plain & (b >= 0x20) & (b != b'"') & (b != b'\\'));
    if plain {
        out.reserve(s.len() + 2);
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(s).expect("strings serialise"));
    }
}

/// A bigger scratch string (a large twin or message was just built) is freed, not kept.
const SCRATCH_KEPT: usize = 16 * 1024;

thread_local! {
    /// Where envelopes are written before they are shared (see `EnvelopeBuilder::with`).
    static SCRATCH: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// Builds the envelopes of one device message; the shared prefix is written once.
pub struct EnvelopeBuilder {
    prefix: String,
}

impl EnvelopeBuilder {
    pub fn new(device: &str, timestamp: &str) -> Self {
        let mut prefix = String::with_capacity(device.len() + timestamp.len() + 32);
        prefix.push_str("{\"deviceId\":");
        push_json_str(&mut prefix, device);
        prefix.push_str(",\"timestamp\":");
        push_json_str(&mut prefix, timestamp);
        Self { prefix }
    }

    fn with(&self, field: &str, value_len: usize, write: impl FnOnce(&mut String)) -> Arc<str> {
        // Written in this thread's scratch string, then copied once into the `Arc`: one
        // allocation per envelope, not a `String`'s and then the `Arc`'s.
        SCRATCH.with_borrow_mut(|out| {
            out.clear();
            out.reserve(self.prefix.len() + field.len() + value_len + 8);
            out.push_str(&self.prefix);
            out.push_str(",\"");
            out.push_str(field);
            out.push_str("\":");
            write(out);
            out.push('}');
            let frame = Arc::from(out.as_str());
            if out.capacity() > SCRATCH_KEPT {
                *out = String::new();
            }
            frame
        })
    }

    /// Telemetry with the given `(key, JSON value)` pairs; never call with none.
    pub fn telemetry<'a>(&self, values: impl Iterator<Item = (&'a str, &'a str)> + Clone) -> Arc<str> {
        let len: usize = values.clone().map(|(k, v)| k.len() + v.len() + 4).sum();
        self.with("telemetry", len + 2, |out| {
            out.push('{');
            for (i, (k, v)) in values.enumerate() {
                if i > 0 {
                    out.push(',');
                }
                push_json_str(out, k);
                out.push(':');
                out.push_str(v);
            }
            out.push('}');
        })
    }

    pub fn connection_state(&self, connected: bool) -> Arc<str> {
        self.with("connectionState", 5, |out| out.push_str(if connected { "true" } else { "false" }))
    }

    pub fn device_twin(&self, twin_json: &str) -> Arc<str> {
        self.with("deviceTwin", twin_json.len(), |out| out.push_str(twin_json))
    }

    pub fn message(&self, body_json: &str) -> Arc<str> {
        self.with("message", body_json.len(), |out| out.push_str(body_json))
    }
}

/// Folds an older telemetry envelope of a device into a newer one that replaces it in a queue
/// (conflation): the newer envelope's identity and timestamp, its own keys, then every key
/// only the older one had, so a client that misses the older frame still learns the newest
/// value of every key. Runs only on the slow path (a consumer that is behind); the values are
/// copied as the raw JSON text they were sent as. Anything that is not two telemetry envelopes
/// (never built here) gives the newer frame unchanged.
pub fn merge_telemetry(older: &str, newer: &str) -> Arc<str> {
    let (Ok(old), Ok(new)) = (serde_json::from_str::<Telemetry>(older), serde_json::from_str::<Telemetry>(newer)) else {
        return newer.into();
    };
    let extra: Vec<&(Cow<str>, &RawValue)> =
        old.telemetry.0.iter().filter(|(k, _)| !new.telemetry.0.iter().any(|(n, _)| n == k)).collect();
    if extra.is_empty() {
        return newer.into();
    }
    let device: String = serde_json::from_str(new.device_id.get()).unwrap_or_default();
    let timestamp: String = serde_json::from_str(new.timestamp.get()).unwrap_or_default();
    let values = new.telemetry.0.iter().chain(extra).map(|(k, v)| (k.as_ref(), v.get()));
    EnvelopeBuilder::new(&device, &timestamp).telemetry(values)
}

/// A telemetry envelope read back, values kept as raw JSON.
#[derive(Deserialize)]
struct Telemetry<'a> {
    #[serde(rename = "deviceId", borrow)]
    device_id: &'a RawValue,
    #[serde(borrow)]
    timestamp: &'a RawValue,
    #[serde(borrow)]
    telemetry: Pairs<'a>,
}

/// A JSON object's members in the order they were written.
struct Pairs<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for Pairs<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Pairs<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a telemetry object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Pairs<'a>, M::Error> {
                let mut pairs = Vec::new();
                while let Some(pair) = map.next_entry::<Cow<'de, str>, &'de RawValue>()? {
                    pairs.push(pair);
                }
                Ok(Pairs(pairs))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        for s in ["temperature", "", "a b", "quote\"d", "back\\slash", "tab\there", "nl\n", "\u{1}", "é ✓ 🙂", "\u{7f}"] {
            let mut out = String::new();
            push_json_str(&mut out, s);
            assert_eq!(out, serde_json::to_string(s).unwrap(), "{s:?}");
        }
        // Long strings (the check's vectorised stretch) with the escape at every place.
        for at in [0, 15, 16, 31, 32, 63, 99] {
            for special in ["\"", "\\", "\n"] {
                let mut s = "k".repeat(100);
                s.replace_range(at..at + 1, special);
                let mut out = String::new();
                push_json_str(&mut out, &s);
                assert_eq!(out, serde_json::to_string(&s).unwrap(), "{s:?}");
            }
        }
    }

    #[test]
    fn envelopes_are_json_with_exactly_one_discriminator() {
        let b = EnvelopeBuilder::new("dev \"1\"", "2026-01-01T00:00:00.000Z");
        let t: Value = serde_json::from_str(&b.telemetry([("t", "21.5"), ("o", "{\"a\":1}")].into_iter())).unwrap();
        assert_eq!(t, json!({"deviceId":"dev \"1\"","timestamp":"2026-01-01T00:00:00.000Z","telemetry":{"t":21.5,"o":{"a":1}}}));
        let c: Value = serde_json::from_str(&b.connection_state(false)).unwrap();
        assert_eq!(c["connectionState"], json!(false));
        assert_eq!(c.as_object().unwrap().len(), 3);
    }

    #[test]
    fn a_merged_envelope_keeps_the_newest_value_of_every_key() {
        let old = EnvelopeBuilder::new("d", "2026-01-01T00:00:00.000Z").telemetry([("a", "1"), ("b\"q", "{\"x\":[1]}")].into_iter());
        let new = EnvelopeBuilder::new("d", "2026-01-01T00:00:01.000Z").telemetry([("a", "2"), ("c", "3.50")].into_iter());
        let merged = merge_telemetry(&old, &new);
        assert_eq!(&*merged, r#"{"deviceId":"d","timestamp":"2026-01-01T00:00:01.000Z","telemetry":{"a":2,"c":3.50,"b\"q":{"x":[1]}}}"#);
        // Same keys: the newer frame as it is.
        let same = EnvelopeBuilder::new("d", "t").telemetry([("a", "9")].into_iter());
        // Not a telemetry envelope (never built by the fan-out): the newer frame as it is.
        assert_eq!(merge_telemetry("{\"deviceId\":\"d\"}", &same), same);
        assert_eq!(merge_telemetry(&EnvelopeBuilder::new("d", "t").telemetry([("a", "1")].into_iter()), &same), same);
    }
}
