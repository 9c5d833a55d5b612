//! Who gets in: the limits on what a client may take before it has shown any key.
//!
//! - [`descriptors`]: client connections never take the descriptors the process needs. The
//!   connection cap is the open-file limit minus `--fd-reserve` (or `--max-connections` if
//!   lower), counted over every core; accept errors (`EMFILE`) are logged at most once a second
//!   and a spare descriptor lets the loop refuse the waiting connection instead of spinning.
//! - [`rate`]: unauthenticated work (`POST /session`, Engine.IO and WebSocket handshakes) is
//!   rate-limited per client address with a token bucket per core, in a table bounded in
//!   entries (and so in bytes), with the client address read from `X-Forwarded-For` only when
//!   the TCP peer is a trusted proxy ([`rate::client_address`]).
//!
//! The HTTP loop, the Engine.IO transport and the API ask here; this module answers with
//! plain values (a cap, a `Retry-After`), never with HTTP, so it imports nothing above it.
//! Its counters are process-wide atomics touched only when a connection is refused, a
//! handshake limited or an accept fails, never on the message path.

pub mod descriptors;
pub mod rate;

use std::sync::atomic::{AtomicU64, Ordering};

/// What was refused, counted for `GET /metrics`.
pub struct Stats {
    over_cap: AtomicU64,
    accept_descriptors: AtomicU64,
    accept_other: AtomicU64,
    limited: [AtomicU64; rate::Work::ALL.len()],
}

pub static STATS: Stats = Stats {
    over_cap: AtomicU64::new(0),
    accept_descriptors: AtomicU64::new(0),
    accept_other: AtomicU64::new(0),
    limited: [const { AtomicU64::new(0) }; rate::Work::ALL.len()],
};

impl Stats {
    pub fn over_cap(&self) {
        self.over_cap.fetch_add(1, Ordering::Relaxed);
    }

    fn limited(&self, work: rate::Work) {
        self.limited[work as usize].fetch_add(1, Ordering::Relaxed);
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
        let help = "Unauthenticated requests answered 429 by the per-client-address rate limit (--client-rate, --client-burst), by kind of work.";
        for work in rate::Work::ALL {
            let n = get(&self.limited[work as usize]);
            out.push(("hubcast_rate_limited_total".into(), help.into(), format!("{{work=\"{}\"}}", work.name()), n));
        }
        out.push((
            "hubcast_sessions_expired_unused_total".into(),
            "Sessions that never got a grant nor a socket, expired after --unused-session-ttl.".into(),
            String::new(),
            crate::shard::sessions::expired_unused(),
        ));
        out
    }
}
