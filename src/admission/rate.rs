//! Per-client-address token buckets for the work anyone may ask for without a key.
//!
//! `POST /session` needs no key (browsers call it, as with ux4iot), nor does an Engine.IO
//! handshake or a WebSocket upgrade; each makes state that lives for a while (a session until
//! `--unused-session-ttl`, a socket). Each client address gets a token bucket: `--client-burst`
//! tokens, refilled at `--client-rate` per second; one unit of [`Work`] takes a token; without
//! one the answer is 429 with `Retry-After` (the seconds until a token is back).
//!
//! Defaults (50 per second, a burst of 500): an office of a few hundred people behind one NAT
//! opening their dashboards at nine, each page making a session and a Socket.IO handshake, is
//! absorbed by the burst and refilled within seconds; one address alone makes at most
//! 50 × `--unused-session-ttl` (60 s) + 500 = 3,500 unused sessions at any time, far below
//! `--max-sessions`, where the issue saw one connection make 200,000 in 4.7 s.
//!
//! The table lives per core (no lock, no cross-core message): each core holds its share of
//! the limit (rate and burst divided by the cores, rounded up). The kernel spreads a client's
//! connections over the cores, so a client opening many gets about the whole limit, and one
//! on a single keep-alive connection gets its core's share.
//!
//! Bounds: at most [`TABLE_ENTRIES`] addresses per core, in two generations of half that
//! each: a lookup moves an address into the current generation; when the current one is full,
//! the previous is dropped whole (the addresses not seen for a whole generation: idle ones)
//! and the current becomes the previous. A dropped address starts again with a full bucket,
//! which is what an idle one would have had anyway. An entry is a key and a bucket (about
//! 40 bytes, 64 with the map's overhead): under 4 MiB per core. IPv6 clients are keyed by
//! their /64 (one host gets a whole /64, so its addresses count as one).
//!
//! The client address: the TCP peer, unless the peer is one of `--trusted-proxies`; then
//! `X-Forwarded-For` is read from the right (the hop the trusted proxy added last), skipping
//! trusted proxies, and the first other address is the client. From any other peer the header
//! is ignored (anyone can write it).

use std::cell::RefCell;
use std::net::{IpAddr, Ipv6Addr};
use std::time::{Duration, Instant};

use crate::app::Core;
use crate::config::TrustedProxy;

/// Addresses a core's table holds at most (two generations of half this each).
pub const TABLE_ENTRIES: usize = 65_536;

/// Unauthenticated work that takes a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// `POST /session`.
    Session,
    /// An Engine.IO handshake (polling, or a Socket.IO WebSocket without a polling sid).
    EngineIo,
    /// A plain WebSocket upgrade (`/ws`).
    WebSocket,
}

impl Work {
    pub const ALL: [Work; 3] = [Work::Session, Work::EngineIo, Work::WebSocket];

    pub fn name(self) -> &'static str {
        match self {
            Work::Session => "session",
            Work::EngineIo => "engineio",
            Work::WebSocket => "websocket",
        }
    }
}

#[derive(Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// One core's buckets (module docs: bounds and eviction).
pub struct RateTable {
    current: hashbrown::HashMap<IpAddr, Bucket>,
    previous: hashbrown::HashMap<IpAddr, Bucket>,
    generation: usize,
    /// Tokens per second, and the bucket's size, of this core's share.
    rate: f64,
    burst: f64,
}

impl RateTable {
    /// A table for one core of `cores`, with the whole process's `rate` (0: no limit) and
    /// `burst`, holding at most `entries` addresses.
    pub fn new(rate: f64, burst: u64, cores: usize, entries: usize) -> Self {
        let cores = cores.max(1) as u64;
        Self {
            current: Default::default(),
            previous: Default::default(),
            generation: (entries / 2).max(1),
            rate: rate / cores as f64,
            burst: burst.div_ceil(cores).max(1) as f64,
        }
    }

    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes a token for `client`; `Err(wait)` when there is none, with the time until one is back.
    pub fn take(&mut self, client: IpAddr, now: Instant) -> Result<(), Duration> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let key = key_of(client);
        let bucket = self.current.remove(&key).or_else(|| self.previous.remove(&key));
        let mut bucket = bucket.unwrap_or(Bucket { tokens: self.burst, at: now });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * self.rate).min(self.burst);
        bucket.at = now;
        let result = if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::try_from_secs_f64((1.0 - bucket.tokens) / self.rate).unwrap_or(Duration::MAX))
        };
        if self.current.len() >= self.generation {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(key, bucket);
        result
    }
}

/// The bucket key of an address: IPv4 (an IPv4-mapped IPv6 address too) as it is, IPv6 by /64.
fn key_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// The client a request comes from (module docs).
pub fn client_address(peer: IpAddr, headers: &http::HeaderMap, trusted: &[TrustedProxy]) -> IpAddr {
    let is_trusted = |ip: IpAddr| trusted.iter().any(|p| p.contains(ip));
    if !is_trusted(peer) {
        return peer;
    }
    let hops: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .collect();
    let mut client = peer;
    for hop in hops.iter().rev() {
        let Some(ip) = parse_hop(hop) else { return client };
        client = ip;
        if !is_trusted(ip) {
            break;
        }
    }
    client
}

/// `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`, `[2001:db8::1]:5678`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse() {
        return Some(ip);
    }
    if let Some(rest) = hop.strip_prefix('[') {
        return rest.split(']').next()?.parse().ok();
    }
    hop.rsplit_once(':').and_then(|(ip, _)| ip.parse().ok())
}

/// This core's table, made from the settings on first use ([`Core::ext`]).
#[derive(Default)]
struct Limiter(RefCell<Option<RateTable>>);

/// Takes a token for the client of a request (`peer`: the TCP peer; `None`: not limited);
/// `Err(seconds)` is the `Retry-After` of the 429 to answer instead.
pub fn admit(core: &Core, peer: Option<IpAddr>, headers: &http::HeaderMap, work: Work) -> Result<(), u64> {
    let c = &core.settings.config;
    let Some(peer) = peer else { return Ok(()) };
    if c.client_rate <= 0.0 {
        return Ok(());
    }
    let client = client_address(peer, headers, &c.trusted_proxies);
    let limiter = core.ext.get::<Limiter>();
    let mut table = limiter.0.borrow_mut();
    let table = table.get_or_insert_with(|| RateTable::new(c.client_rate, c.client_burst, core.cores(), TABLE_ENTRIES));
    table.take(client, Instant::now()).map_err(|wait| {
        super::STATS.limited(work);
        tracing::debug!(core = core.index, %client, work = work.name(), "rate limit reached (--client-rate, --client-burst)");
        wait.as_secs_f64().ceil().clamp(1.0, 86_400.0) as u64
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_bucket_allows_its_burst_then_its_rate() {
        let t0 = Instant::now();
        let mut table = RateTable::new(2.0, 3, 1, 16);
        for _ in 0..3 {
            assert!(table.take(ip("10.0.0.1"), t0).is_ok());
        }
        let wait = table.take(ip("10.0.0.1"), t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        assert!(table.take(ip("10.0.0.2"), t0).is_ok(), "another address has its own bucket");
        assert!(table.take(ip("10.0.0.1"), t0 + Duration::from_millis(500)).is_ok(), "refilled at the rate");
        assert!(table.take(ip("10.0.0.1"), t0 + Duration::from_millis(500)).is_err());
    }

    #[test]
    fn each_core_holds_its_share() {
        let table = RateTable::new(50.0, 501, 2, 16);
        assert_eq!((table.rate, table.burst), (25.0, 251.0));
    }

    #[test]
    fn the_table_is_bounded_and_drops_the_idle_generation() {
        let t0 = Instant::now();
        let mut table = RateTable::new(1.0, 1, 1, 8);
        table.take(ip("10.0.0.1"), t0).unwrap();
        for i in 2..=200u8 {
            table.take(ip(&format!("10.0.1.{i}")), t0).unwrap();
            assert!(table.len() <= 8, "bounded: {}", table.len());
        }
        // The first address went with its generation: a fresh, full bucket.
        assert!(table.take(ip("10.0.0.1"), t0).is_ok());
        // One still in the table keeps its empty bucket.
        assert!(table.take(ip("10.0.1.200"), t0).is_err());
    }

    #[test]
    fn ipv6_clients_are_counted_by_their_64() {
        let t0 = Instant::now();
        let mut table = RateTable::new(1.0, 1, 1, 16);
        table.take(ip("2001:db8:1:2::1"), t0).unwrap();
        assert!(table.take(ip("2001:db8:1:2::ffff"), t0).is_err());
        assert!(table.take(ip("2001:db8:1:3::1"), t0).is_ok());
        table.take(ip("::ffff:10.0.0.9"), t0).unwrap();
        assert!(table.take(ip("10.0.0.9"), t0).is_err(), "IPv4-mapped is the IPv4 address");
    }

    #[test]
    fn forwarded_for_is_read_only_from_trusted_proxies() {
        let trusted = [TrustedProxy { net: ip("10.1.0.0"), prefix: 16 }, TrustedProxy { net: ip("127.0.0.3"), prefix: 32 }];
        let mut headers = http::HeaderMap::new();
        headers.insert("x-forwarded-for", "6.6.6.6, 203.0.113.7, 10.1.2.3".parse().unwrap());
        // From a trusted proxy: right to left, past the trusted hops.
        assert_eq!(client_address(ip("127.0.0.3"), &headers, &trusted), ip("203.0.113.7"));
        // From anyone else: the header is ignored.
        assert_eq!(client_address(ip("127.0.0.4"), &headers, &trusted), ip("127.0.0.4"));
        // No header: the proxy itself.
        assert_eq!(client_address(ip("127.0.0.3"), &http::HeaderMap::new(), &trusted), ip("127.0.0.3"));
        headers.insert("x-forwarded-for", "[2001:db8::5]:443".parse().unwrap());
        assert_eq!(client_address(ip("10.1.9.9"), &headers, &trusted), ip("2001:db8::5"));
    }

    #[test]
    fn trusted_proxy_networks_match_by_prefix() {
        let net = TrustedProxy { net: ip("10.1.0.0"), prefix: 16 };
        assert!(net.contains(ip("10.1.255.1")) && !net.contains(ip("10.2.0.1")));
        assert!(net.contains(ip("::ffff:10.1.0.7")), "IPv4-mapped addresses match IPv4 networks");
        let v6 = TrustedProxy { net: ip("fd00::"), prefix: 8 };
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        assert!(TrustedProxy { net: ip("0.0.0.0"), prefix: 0 }.contains(ip("8.8.8.8")));
    }
}
