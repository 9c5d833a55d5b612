//! Counters of device messages that could not be used, one per kind of fault.
//!
//! A bad message never stops a source or a core: it is counted here and skipped (or, for a
//! body that is not a JSON object, kept only for `d2cMessages`). The first occurrence of each
//! kind is logged at `warn` with an example, later ones only at `verbose`, so a device that
//! sends garbage ten times a second cannot flood the log. The counters are process-wide
//! atomics, written from the AMQP thread and from the cores; an operations endpoint can read
//! them with [`FAULTS`]`.snapshot()`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What was wrong with a device message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// No device id in the annotations, the application properties or the body.
    NoDeviceId,
    /// A device id longer than [`crate::config::MAX_DEVICE_ID_LEN`].
    DeviceIdTooLong,
    /// A body larger than `maxMessageBytes`: dropped unread.
    Oversized,
    /// A body that is not JSON (telemetry: reaches `d2cMessages` only, as base64).
    NotJson,
    /// A JSON body that is not an object (telemetry: reaches `d2cMessages` only).
    NotObject,
    /// An `iothub-message-source` hubcast does not use (`digitalTwinChangeEvents`, …).
    UnsupportedSource,
    /// A message at or before a partition's last position, sent again by the broker: skipped.
    Redelivered,
    /// A twin change with no whole twin to merge into (IoT Hub configured), whose hub read
    /// failed: not pushed, since a change alone is not a twin.
    TwinUnavailable,
}

impl Fault {
    pub const ALL: [Fault; Fault::COUNT] = [
        Fault::NoDeviceId,
        Fault::DeviceIdTooLong,
        Fault::Oversized,
        Fault::NotJson,
        Fault::NotObject,
        Fault::UnsupportedSource,
        Fault::Redelivered,
        Fault::TwinUnavailable,
    ];
    pub const COUNT: usize = 8;

    /// Stable name, for logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Fault::NoDeviceId => "no_device_id",
            Fault::DeviceIdTooLong => "device_id_too_long",
            Fault::Oversized => "oversized",
            Fault::NotJson => "not_json",
            Fault::NotObject => "not_object",
            Fault::UnsupportedSource => "unsupported_source",
            Fault::Redelivered => "redelivered",
            Fault::TwinUnavailable => "twin_unavailable",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    fn explain(self) -> &'static str {
        match self {
            Fault::NoDeviceId => {
                "a device message has no device id (annotation iothub-connection-device-id, property deviceId, or the customDeviceIdKey in its body); it is skipped"
            }
            Fault::DeviceIdTooLong => "a device message names a device id longer than 128 bytes; it is skipped",
            Fault::Oversized => "a device message body is larger than maxMessageBytes; it is skipped",
            Fault::NotJson => {
                "a device message body is not JSON; it is not stored as telemetry (d2cMessages subscribers get it as {\"base64\": …})"
            }
            Fault::NotObject => {
                "a device message body is JSON but not an object; it is not stored as telemetry (d2cMessages subscribers get it as is)"
            }
            Fault::UnsupportedSource => "a device message has an iothub-message-source hubcast does not use; it is skipped",
            Fault::Redelivered => "the event stream sent a message again that was already delivered; it is skipped",
            Fault::TwinUnavailable => {
                "a twin change could not be pushed: no whole twin was known and reading it from the IoT Hub failed; \
                 a change alone is never pushed as the twin, the next change is tried again"
            }
        }
    }
}

/// One counter and one "already logged" flag per [`Fault`].
pub struct Faults {
    counts: [AtomicU64; Fault::COUNT],
    logged: [AtomicBool; Fault::COUNT],
}

/// The process-wide fault counters.
pub static FAULTS: Faults = Faults::new();

impl Faults {
    const fn new() -> Self {
        Self {
            counts: [const { AtomicU64::new(0) }; Fault::COUNT],
            logged: [const { AtomicBool::new(false) }; Fault::COUNT],
        }
    }

    /// Counts one fault; logs the first of its kind at `warn`, the others at `verbose`.
    pub fn record(&self, fault: Fault, device: Option<&str>, detail: &str) {
        let i = fault.index();
        let n = self.counts[i].fetch_add(1, Ordering::Relaxed) + 1;
        if !self.logged[i].swap(true, Ordering::Relaxed) {
            tracing::warn!(
                fault = fault.name(),
                device = device.unwrap_or("-"),
                detail,
                "{} (logged once; later ones are counted)",
                fault.explain()
            );
        } else {
            tracing::debug!(fault = fault.name(), device = device.unwrap_or("-"), detail, count = n, "device message fault");
        }
    }

    pub fn count(&self, fault: Fault) -> u64 {
        self.counts[fault.index()].load(Ordering::Relaxed)
    }

    /// Every counter, by name.
    pub fn snapshot(&self) -> [(&'static str, u64); Fault::COUNT] {
        Fault::ALL.map(|f| (f.name(), self.count(f)))
    }

    /// The counters as `GET /metrics` series: `hubcast_ingest_faults_total{kind="…"}`.
    pub fn series(&self) -> crate::metrics::ExternalSeries {
        self.snapshot()
            .into_iter()
            .map(|(kind, n)| {
                (
                    "hubcast_ingest_faults_total".to_string(),
                    "Device messages that could not be used, by kind of fault.".to_string(),
                    format!("{{kind=\"{kind}\"}}"),
                    n,
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_counted_by_kind() {
        let faults = Faults::new();
        faults.record(Fault::NotJson, Some("d"), "first");
        faults.record(Fault::NotJson, Some("d"), "second");
        faults.record(Fault::Oversized, None, "big");
        assert_eq!(faults.count(Fault::NotJson), 2);
        assert_eq!(faults.count(Fault::Oversized), 1);
        assert_eq!(faults.count(Fault::NoDeviceId), 0);
        assert!(faults.snapshot().contains(&("not_json", 2)));
    }
}
