//! Who gets in: the limits on what a client may take before it has shown any key.
//!
//! - [`descriptors`]: client connections never take the descriptors the process needs. The
//!   connection cap is the open-file limit minus `--fd-reserve` (or `--max-connections` if
//!   lower), counted over every core; accept errors (`EMFILE`) are logged at most once a second
//!   and a spare descriptor lets the loop refuse the waiting connection instead of spinning.
//!
//! The HTTP loop and the Engine.IO transport ask here; this module answers with plain values
//! (a cap), never with HTTP, so it imports nothing above it. Its counters are process-wide
//! atomics touched only when a connection is refused or an accept fails, never on the
//! message path.

pub mod descriptors;

use std::sync::atomic::{AtomicU64, Ordering};

/// What was refused, counted for `GET /metrics`.
pub struct Stats {
    over_cap: AtomicU64,
    accept_descriptors: AtomicU64,
    accept_other: AtomicU64,
}

pub static STATS: Stats = Stats {
    over_cap: AtomicU64::new(0),
    accept_descriptors: AtomicU64::new(0),
    accept_other: AtomicU64::new(0),
};

impl Stats {
    pub fn over_cap(&self) {
        self.over_cap.fetch_add(1, Ordering::Relaxed);
    }

    /// The `GET /metrics` series of this module.
    pub fn series(&self) -> crate::metrics::ExternalSeries {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out: crate::metrics::ExternalSeries = vec![
            (
                "hubcast_connection_cap".into(),
                "Most client connections at once: the open-file limit minus --fd-reserve, or --max-connections if lower.".into(),
                String::new(),
                descriptors::cap_if_known().unwrap_or(0) as u64,
            ),
            (
                "hubcast_connections_open".into(),
                "Client connections open (HTTP and live sockets, Engine.IO polling sessions included).".into(),
                String::new(),
                descriptors::open() as u64,
            ),
            (
                "hubcast_connections_over_cap_total".into(),
                "Client connections accepted over the connection cap: answered 503 (GET /status answered as usual) and closed.".into(),
                String::new(),
                get(&self.over_cap),
            ),
        ];
        let help = "Accepts that failed: kind=\"descriptors\" (EMFILE/ENFILE: the waiting connection is refused), or another error.";
        for (kind, n) in [("descriptors", &self.accept_descriptors), ("other", &self.accept_other)] {
            out.push(("hubcast_accept_errors_total".into(), help.into(), format!("{{kind=\"{kind}\"}}"), get(n)));
        }
        out
    }
}
