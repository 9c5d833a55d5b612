//! The `data` envelope: `{"deviceId", "timestamp", <exactly one of telemetry |
//! connectionState | deviceTwin | message>}` (reference §2).

use std::sync::Arc;

/// Builds the envelopes of one device message; the shared prefix is written once.
pub struct EnvelopeBuilder {
    prefix: String,
}

impl EnvelopeBuilder {
    pub fn new(device: &str, timestamp: &str) -> Self {
        let mut prefix = String::with_capacity(device.len() + timestamp.len() + 32);
        prefix.push_str("{\"deviceId\":");
        prefix.push_str(&serde_json::to_string(device).expect("strings serialise"));
        prefix.push_str(",\"timestamp\":");
        prefix.push_str(&serde_json::to_string(timestamp).expect("strings serialise"));
        Self { prefix }
    }

    fn with(&self, field: &str, value_len: usize, write: impl FnOnce(&mut String)) -> Arc<str> {
        let mut out = String::with_capacity(self.prefix.len() + field.len() + value_len + 8);
        out.push_str(&self.prefix);
        out.push_str(",\"");
        out.push_str(field);
        out.push_str("\":");
        write(&mut out);
        out.push('}');
        out.into()
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
                out.push_str(&serde_json::to_string(k).expect("strings serialise"));
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn envelopes_are_json_with_exactly_one_discriminator() {
        let b = EnvelopeBuilder::new("dev \"1\"", "2026-01-01T00:00:00.000Z");
        let t: Value = serde_json::from_str(&b.telemetry([("t", "21.5"), ("o", "{\"a\":1}")].into_iter())).unwrap();
        assert_eq!(t, json!({"deviceId":"dev \"1\"","timestamp":"2026-01-01T00:00:00.000Z","telemetry":{"t":21.5,"o":{"a":1}}}));
        let c: Value = serde_json::from_str(&b.connection_state(false)).unwrap();
        assert_eq!(c["connectionState"], json!(false));
        assert_eq!(c.as_object().unwrap().len(), 3);
    }
}
