//! Timestamps: milliseconds since the Unix epoch inside, ISO 8601 (as JavaScript's
//! `Date.toISOString()` prints it) on the wire.

use chrono::{DateTime, SecondsFormat, Utc};

pub type Millis = i64;

pub fn now_millis() -> Millis {
    Utc::now().timestamp_millis()
}

/// `2026-11-23T11:18:14.123Z`
pub fn iso(ms: Millis) -> String {
    DateTime::<Utc>::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Accepts RFC 3339 / ISO 8601 with an offset, or without one (taken as UTC).
pub fn parse_iso(s: &str) -> Option<Millis> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Some(t.timestamp_millis());
    }
    chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S%.f")
        .ok()
        .map(|t| t.and_utc().timestamp_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso_round_trip() {
        let ms = parse_iso("2024-01-02T03:04:05.678Z").unwrap();
        assert_eq!(iso(ms), "2024-01-02T03:04:05.678Z");
        assert_eq!(parse_iso("2024-01-02T03:04:05"), parse_iso("2024-01-02T03:04:05Z"));
        assert_eq!(parse_iso("2024-01-02T05:04:05+02:00"), parse_iso("2024-01-02T03:04:05Z"));
        assert_eq!(parse_iso("yesterday"), None);
    }
}
