//! Metrics: per-core counters (plain `Cell`s, touched only by their core) gathered from every
//! core over the mesh when `GET /metrics` is scraped, rendered in Prometheus text format.

use std::cell::Cell;
use std::fmt::Write;
use std::num::NonZeroU32;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Request latency histogram bounds, in seconds.
pub const LATENCY_BOUNDS: [f64; 12] = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5];
/// [`LATENCY_BOUNDS`] in nanoseconds.
const LATENCY_BOUNDS_NANOS: [u64; 12] = {
    let mut nanos = [0u64; 12];
    let mut i = 0;
    while i < 12 {
        nanos[i] = (LATENCY_BOUNDS[i] * 1e9 + 0.5) as u64;
        i += 1;
    }
    nanos
};

/// Every route label, in a fixed order (index = position).
pub const ROUTES: [&str; 21] = [
    "version", "status", "logLevel", "session", "sessions", "grants", "subscription", "subscriptions",
    "lastValue", "deviceTwin", "connectionState", "directMethod", "deviceTwinDesiredProperties", "ingest",
    "metrics", "openapi", "console", "devices", "socket.io", "preflight", "other",
];

pub const SOURCES: [&str; 4] = ["Telemetry", "twinChangeEvents", "deviceConnectionStateEvents", "deviceLifecycleEvents"];
pub const TRANSPORTS: [&str; 3] = ["websocket", "socketio_websocket", "socketio_polling"];
/// Why a connection state recovery failed (`push::stream::Failure`, same order).
pub const RECOVERY_FAILURES: [&str; 6] = ["window", "bound", "unknown_pid", "unknown_offset", "history_lost", "off"];
/// Why recovery history was trimmed (`push::stream::TrimCause`, same order).
pub const RECOVERY_TRIMS: [&str; 3] = ["window", "session_bound", "core_bound"];
/// How a rebuild of a killed instance's client's history ended (design step 11).
pub const REBUILD_OUTCOMES: [&str; 2] = ["rebuilt", "refused"];
/// This instance's asks of the other instances' device rings (step 11 g), by outcome: asks
/// published (one per asking core), asks that could not be sent, answers got, answers that
/// refused (over their bound there, over `--redis-inbound-bytes` here), instances that did
/// not answer in time.
pub const RING_ASKS: [&str; 5] = ["sent", "unsent", "answered", "refused", "timed_out"];
/// Answers to another instance's ask, by outcome (one per answering core).
pub const RING_ANSWERS: [&str; 3] = ["sent", "over_bound", "unsent"];
/// Reads of one device's ring for a rebuild, here or for another instance's ask.
pub const RING_READS: [&str; 3] = ["held", "not_held", "lost"];
/// Index of `socketio_polling` in [`TRANSPORTS`]: no WebSocket writer of its own.
const POLLING: usize = 2;

#[derive(Default)]
pub struct Histogram {
    buckets: [Cell<u64>; LATENCY_BOUNDS.len()],
    count: Cell<u64>,
    sum_micros: Cell<u64>,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        // Compared in whole nanoseconds (it runs once per delivery on the fan-out path).
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        if let Some(i) = LATENCY_BOUNDS_NANOS.iter().position(|b| nanos <= *b) {
            self.buckets[i].set(self.buckets[i].get() + 1);
        }
        self.count.set(self.count.get() + 1);
        self.sum_micros.set(self.sum_micros.get() + d.as_micros() as u64);
    }

    fn snapshot(&self) -> HistogramSnapshot {
        (self.buckets.iter().map(Cell::get).collect(), self.count.get(), self.sum_micros.get())
    }
}

/// A histogram's per-bound counts (not cumulative), count and sum in microseconds.
pub type HistogramSnapshot = (Vec<u64>, u64, u64);

/// When hubcast received a device message (POST /ingest, AMQP, the simulator), carried with
/// it into every delivery it causes and every socket queue slot, for the ingest→socket
/// delivery histogram. Microseconds since a process-wide epoch, wrapping every ~71 minutes
/// (4 bytes a slot; `Option<Arrival>` too): the elapsed time is a wrapping difference, exact
/// for anything younger than that, and nothing waits that long (queues are bounded, a stalled
/// write or an unanswered ping ends the socket within seconds). The epoch is shared by every
/// thread because a message is stamped on one (an AMQP thread, an HTTP core) and delivered on
/// another; `Instant` is monotonic across threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrival(NonZeroU32);

fn epoch_micros() -> u32 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    // Truncation is the wrap described above.
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u32
}

impl Arrival {
    pub fn now() -> Self {
        // 0 is the niche that keeps `Option<Arrival>` at 4 bytes; 1 µs off once per wrap.
        Self(NonZeroU32::new(epoch_micros()).unwrap_or(NonZeroU32::MIN))
    }

    /// A given stamp (unit tests).
    #[cfg(test)]
    pub(crate) fn at(micros: u32) -> Self {
        Self(NonZeroU32::new(micros).expect("nonzero"))
    }

    /// Time since the arrival.
    pub fn elapsed(self) -> Duration {
        self.age_at(Self::now())
    }

    /// Time from the arrival to `now` (one clock read serves a whole write's arrivals).
    pub fn age_at(self, now: Arrival) -> Duration {
        Duration::from_micros(u64::from(now.0.get().wrapping_sub(self.0.get())))
    }
}

fn bump(c: &Cell<u64>, n: u64) {
    c.set(c.get() + n);
}

/// One core's counters.
#[derive(Default)]
pub struct CoreMetrics {
    pub messages_in: [Cell<u64>; SOURCES.len()],
    pub messages_out: [Cell<u64>; TRANSPORTS.len()],
    pub sockets_open: [Cell<u64>; TRANSPORTS.len()],
    pub conflated: Cell<u64>,
    pub slow_consumers_closed: Cell<u64>,
    pub requests: [Histogram; ROUTES.len()],
    /// HTTP connections that stopped reading at their pipelining bound (`http` module docs).
    pub http_pipeline_pauses: Cell<u64>,
    /// Times a live-data socket's reader paused to let its core serve others (transport's
    /// `READ_BUDGET`: epoll only).
    pub socket_read_pauses: Cell<u64>,
    /// Ingest→socket delivery latency, by transport.
    pub deliveries: [Histogram; TRANSPORTS.len()],
    /// Writes made by WebSocket writer tasks, by transport (polling is not counted: its
    /// answers go through the HTTP writer).
    pub socket_writes: [Cell<u64>; TRANSPORTS.len()],
    /// WebSocket frames those writes carried (data and control), by transport.
    pub socket_frames_written: [Cell<u64>; TRANSPORTS.len()],
    /// Connection state recovery (push/stream.rs): restores asked and made, by transport;
    /// failed, by [`RECOVERY_FAILURES`]; frames replayed; history trimmed, by [`RECOVERY_TRIMS`].
    pub recovery_attempts: [Cell<u64>; TRANSPORTS.len()],
    pub recovery_succeeded: [Cell<u64>; TRANSPORTS.len()],
    pub recovery_failed: [Cell<u64>; RECOVERY_FAILURES.len()],
    pub recovery_replayed: Cell<u64>,
    /// Frames written ahead to the store (`--recovery-durable`), and streams whose history a
    /// start dropped by the crash rule.
    pub recovery_appended: Cell<u64>,
    pub recovery_trimmed: [Cell<u64>; RECOVERY_TRIMS.len()],
    /// Rebuilds from device rings (design step 11), by [`REBUILD_OUTCOMES`]; asks of other
    /// instances' rings by [`RING_ASKS`]; answers to theirs by [`RING_ANSWERS`]; device ring
    /// reads by [`RING_READS`].
    pub rebuilds: [Cell<u64>; REBUILD_OUTCOMES.len()],
    pub ring_asks: [Cell<u64>; RING_ASKS.len()],
    pub ring_answers: [Cell<u64>; RING_ANSWERS.len()],
    pub ring_reads: [Cell<u64>; RING_READS.len()],
}

impl CoreMetrics {
    pub fn message_in(&self, source: usize) {
        bump(&self.messages_in[source], 1);
    }

    /// One more of a labelled counter (`counters[i]`).
    pub fn count(counters: &[Cell<u64>], i: usize) {
        bump(&counters[i], 1);
    }
    pub fn messages_out(&self, transport: usize, n: u64) {
        bump(&self.messages_out[transport], n);
    }
    pub fn socket_opened(&self, transport: usize) {
        bump(&self.sockets_open[transport], 1);
    }
    pub fn socket_closed(&self, transport: usize) {
        self.sockets_open[transport].set(self.sockets_open[transport].get().saturating_sub(1));
    }
    pub fn conflated(&self, n: u64) {
        bump(&self.conflated, n);
    }
    pub fn slow_consumer_closed(&self) {
        bump(&self.slow_consumers_closed, 1);
    }
    pub fn request(&self, route: usize, d: Duration) {
        self.requests[route].observe(d);
    }
    pub fn http_pipeline_paused(&self) {
        bump(&self.http_pipeline_pauses, 1);
    }
    pub fn socket_read_paused(&self) {
        bump(&self.socket_read_pauses, 1);
    }
    /// One successful WebSocket write that carried `frames` frames.
    pub fn socket_written(&self, transport: usize, frames: u64) {
        bump(&self.socket_writes[transport], 1);
        bump(&self.socket_frames_written[transport], frames);
    }
    /// Envelopes just written to a socket (or handed to a poll's answer), by their arrivals.
    /// They all left in one write: the clock is read once for them (a read per envelope was
    /// ~5 % of a saturated core's fan-out samples).
    pub fn delivered(&self, transport: usize, arrivals: impl IntoIterator<Item = Arrival>) {
        let mut arrivals = arrivals.into_iter().peekable();
        if arrivals.peek().is_none() {
            return;
        }
        let now = Arrival::now();
        for a in arrivals {
            self.deliveries[transport].observe(a.age_at(now));
        }
    }

    pub fn snapshot(&self, state: StateCounts) -> Snapshot {
        let get = |c: &Cell<u64>| c.get();
        Snapshot {
            messages_in: self.messages_in.iter().map(get).collect(),
            messages_out: self.messages_out.iter().map(get).collect(),
            sockets_open: self.sockets_open.iter().map(get).collect(),
            conflated: self.conflated.get(),
            slow_consumers_closed: self.slow_consumers_closed.get(),
            requests: self.requests.iter().map(Histogram::snapshot).collect(),
            state,
            http_pipeline_pauses: self.http_pipeline_pauses.get(),
            socket_read_pauses: self.socket_read_pauses.get(),
            deliveries: self.deliveries.iter().map(Histogram::snapshot).collect(),
            socket_writes: self.socket_writes.iter().map(get).collect(),
            socket_frames_written: self.socket_frames_written.iter().map(get).collect(),
            recovery_attempts: self.recovery_attempts.iter().map(get).collect(),
            recovery_succeeded: self.recovery_succeeded.iter().map(get).collect(),
            recovery_failed: self.recovery_failed.iter().map(get).collect(),
            recovery_replayed: self.recovery_replayed.get(),
            recovery_appended: self.recovery_appended.get(),
            recovery_trimmed: self.recovery_trimmed.iter().map(get).collect(),
            rebuilds: self.rebuilds.iter().map(get).collect(),
            ring_asks: self.ring_asks.iter().map(get).collect(),
            ring_answers: self.ring_answers.iter().map(get).collect(),
            ring_reads: self.ring_reads.iter().map(get).collect(),
        }
    }
}

/// Sizes read from a core's shard at scrape time.
#[derive(Debug, Default, Clone)]
pub struct StateCounts {
    pub devices: u64,
    pub sessions: u64,
    pub grants: u64,
    pub subscriptions: u64,
    pub inbox_depth: u64,
    pub ingress_depth: u64,
    /// Bytes of the batches in this core's ingress queue (`--event-hub-queue-bytes`).
    pub ingress_bytes: u64,
    /// Items (deliveries, messages, operations) in this core's cross-core inbox.
    pub inbox_messages: u64,
    /// Items waiting on this core for a full inbox, per destination core.
    pub mesh_backlog: Vec<u64>,
    /// The most items one of those backlogs ever held.
    pub mesh_backlog_peak: u64,
    /// Telemetry deliveries conflated in those backlogs.
    pub mesh_conflated: u64,
    /// Wake-ups of the core's timer task (app/clock.rs).
    pub timer_wakeups: u64,
    /// Socket writes held back under load (push/linger.rs).
    pub socket_writes_held: u64,
    /// Charged bytes of the core's recovery histories (push/stream.rs).
    pub recovery_history_bytes: u64,
    /// Messages read again from their partition after a takeover, recognised by their key
    /// and not applied twice (`ingest::key`).
    pub ingest_rereads: u64,
}

/// A core's metrics, sent to the core answering the scrape.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub messages_in: Vec<u64>,
    pub messages_out: Vec<u64>,
    pub sockets_open: Vec<u64>,
    pub conflated: u64,
    pub slow_consumers_closed: u64,
    pub requests: Vec<HistogramSnapshot>,
    pub state: StateCounts,
    pub http_pipeline_pauses: u64,
    pub socket_read_pauses: u64,
    pub deliveries: Vec<HistogramSnapshot>,
    pub socket_writes: Vec<u64>,
    pub socket_frames_written: Vec<u64>,
    pub recovery_attempts: Vec<u64>,
    pub recovery_succeeded: Vec<u64>,
    pub recovery_failed: Vec<u64>,
    pub recovery_replayed: u64,
    pub recovery_appended: u64,
    pub recovery_trimmed: Vec<u64>,
    pub rebuilds: Vec<u64>,
    pub ring_asks: Vec<u64>,
    pub ring_answers: Vec<u64>,
    pub ring_reads: Vec<u64>,
}

/// Connection state recovery (push/stream.rs).
fn render_recovery(out: &mut String, cores: &[Snapshot]) {
    let sum = |pick: &dyn Fn(&Snapshot) -> u64| cores.iter().map(pick).sum::<u64>();
    family(out, "hubcast_recovery_attempts_total", "counter", "Reconnects that asked to recover (a Socket.IO pid, or a WebSocket since=), by transport.");
    for (i, t) in TRANSPORTS.iter().enumerate() {
        let _ = writeln!(out, "hubcast_recovery_attempts_total{{transport=\"{t}\"}} {}", sum(&|c| c.recovery_attempts[i]));
    }
    family(out, "hubcast_recovery_succeeded_total", "counter", "Connections recovered: every missed event replayed, same pid answered, by transport.");
    for (i, t) in TRANSPORTS.iter().enumerate() {
        let _ = writeln!(out, "hubcast_recovery_succeeded_total{{transport=\"{t}\"}} {}", sum(&|c| c.recovery_succeeded[i]));
    }
    family(out, "hubcast_recovery_failed_total", "counter", "Recoveries refused (the client gets recovered false and live data), by reason.");
    for (i, reason) in RECOVERY_FAILURES.iter().enumerate() {
        let _ = writeln!(out, "hubcast_recovery_failed_total{{reason=\"{reason}\"}} {}", sum(&|c| c.recovery_failed[i]));
    }
    family(out, "hubcast_recovery_replayed_frames_total", "counter", "Events replayed to recovered connections.");
    let _ = writeln!(out, "hubcast_recovery_replayed_frames_total {}", sum(&|c| c.recovery_replayed));
    family(
        out,
        "hubcast_recovery_appended_frames_total",
        "counter",
        "Frames of recovery histories written to the store before reaching a socket (--recovery-durable).",
    );
    let _ = writeln!(out, "hubcast_recovery_appended_frames_total {}", sum(&|c| c.recovery_appended));
    family(out, "hubcast_recovery_history_bytes", "gauge", "Bytes of recovery history held (frame + 40 per entry), all cores (bounded per core by --recovery-core-bytes).");
    let _ = writeln!(out, "hubcast_recovery_history_bytes {}", sum(&|c| c.state.recovery_history_bytes));
    family(out, "hubcast_recovery_trimmed_bytes_total", "counter", "Bytes of recovery history dropped before a client asked for them, by cause.");
    for (i, cause) in RECOVERY_TRIMS.iter().enumerate() {
        let _ = writeln!(out, "hubcast_recovery_trimmed_bytes_total{{cause=\"{cause}\"}} {}", sum(&|c| c.recovery_trimmed[i]));
    }
    let labelled = |out: &mut String, name: &str, help: &str, label: &str, values: &[&str], pick: &dyn Fn(&Snapshot, usize) -> u64| {
        family(out, name, "counter", help);
        for (i, v) in values.iter().enumerate() {
            let _ = writeln!(out, "{name}{{{label}=\"{v}\"}} {}", cores.iter().map(|c| pick(c, i)).sum::<u64>());
        }
    };
    labelled(out, "hubcast_recovery_rebuilds_total", "Histories of a killed instance's clients rebuilt here from device rings, or refused (history_lost), by outcome.", "outcome", &REBUILD_OUTCOMES, &|c, i| c.rebuilds.get(i).copied().unwrap_or(0));
    labelled(out, "hubcast_recovery_ring_asks_total", "Asks of the other instances' device rings for a rebuild here, by outcome.", "outcome", &RING_ASKS, &|c, i| c.ring_asks.get(i).copied().unwrap_or(0));
    labelled(out, "hubcast_recovery_ring_answers_total", "Answers to another instance's ask of this instance's device rings, by outcome.", "outcome", &RING_ANSWERS, &|c, i| c.ring_answers.get(i).copied().unwrap_or(0));
    labelled(out, "hubcast_recovery_ring_reads_total", "Reads of one device's ring after a client's cut, here or for another instance, by result.", "result", &RING_READS, &|c, i| c.ring_reads.get(i).copied().unwrap_or(0));
}

/// Counters kept outside the cores (sources on their own threads), as `(name, help, labels, value)`.
pub type ExternalSeries = Vec<(String, String, String, u64)>;

/// The cross-core mesh's bounded queues (runtime/mesh.rs).
fn render_mesh(out: &mut String, cores: &[Snapshot]) {
    family(out, "hubcast_mesh_inbox_messages", "gauge", "Items (deliveries, messages, operations) in a core's cross-core inbox.");
    for (core, c) in cores.iter().enumerate() {
        let _ = writeln!(out, "hubcast_mesh_inbox_messages{{core=\"{core}\"}} {}", c.state.inbox_messages);
    }
    family(out, "hubcast_mesh_backlog_messages", "gauge", "Items waiting on a core because the destination core's inbox is full.");
    for (core, c) in cores.iter().enumerate() {
        for (to, n) in c.state.mesh_backlog.iter().enumerate().filter(|(to, _)| *to != core) {
            let _ = writeln!(out, "hubcast_mesh_backlog_messages{{core=\"{core}\",to=\"{to}\"}} {n}");
        }
    }
    family(out, "hubcast_mesh_backlog_peak_messages", "gauge", "The most items one cross-core backlog of a core held since start.");
    for (core, c) in cores.iter().enumerate() {
        let _ = writeln!(out, "hubcast_mesh_backlog_peak_messages{{core=\"{core}\"}} {}", c.state.mesh_backlog_peak);
    }
    family(out, "hubcast_mesh_conflated_total", "counter", "Telemetry deliveries replaced by newer ones while the destination core was behind.");
    let _ = writeln!(out, "hubcast_mesh_conflated_total {}", cores.iter().map(|c| c.state.mesh_conflated).sum::<u64>());
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// One labelled histogram summed over the cores; nothing until it has an observation.
fn render_histogram(out: &mut String, name: &str, label: &str, cores: &[Snapshot], pick: impl Fn(&Snapshot) -> &HistogramSnapshot) {
    let count: u64 = cores.iter().map(|c| pick(c).1).sum();
    if count == 0 {
        return;
    }
    let mut cumulative = 0;
    for (b, bound) in LATENCY_BOUNDS.iter().enumerate() {
        cumulative += cores.iter().map(|c| pick(c).0[b]).sum::<u64>();
        let _ = writeln!(out, "{name}_bucket{{{label},le=\"{bound}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_bucket{{{label},le=\"+Inf\"}} {count}");
    let sum: u64 = cores.iter().map(|c| pick(c).2).sum();
    let _ = writeln!(out, "{name}_sum{{{label}}} {}", sum as f64 / 1e6);
    let _ = writeln!(out, "{name}_count{{{label}}} {count}");
}

/// Renders every core's snapshot (index = core).
pub fn render(cores: &[Snapshot], external: &ExternalSeries) -> String {
    let mut out = String::with_capacity(16 * 1024);
    family(&mut out, "hubcast_messages_in_total", "counter", "Device messages ingested, by iothub-message-source.");
    for (i, source) in SOURCES.iter().enumerate() {
        let total: u64 = cores.iter().map(|c| c.messages_in[i]).sum();
        let _ = writeln!(out, "hubcast_messages_in_total{{source=\"{source}\"}} {total}");
    }
    family(&mut out, "hubcast_ingest_rereads_total", "counter", "Device messages read again from their event stream partition (after a takeover) and recognised by their key: not applied or delivered twice.");
    let _ = writeln!(out, "hubcast_ingest_rereads_total {}", cores.iter().map(|c| c.state.ingest_rereads).sum::<u64>());
    family(&mut out, "hubcast_messages_out_total", "counter", "Data messages written to clients, by transport.");
    for (i, t) in TRANSPORTS.iter().enumerate() {
        let total: u64 = cores.iter().map(|c| c.messages_out[i]).sum();
        let _ = writeln!(out, "hubcast_messages_out_total{{transport=\"{t}\"}} {total}");
    }
    // Frames per write (the coalescing the writers achieve) is the ratio of these two.
    family(&mut out, "hubcast_socket_writes_total", "counter", "Socket writes made by WebSocket writer tasks, by transport.");
    for (i, t) in TRANSPORTS.iter().enumerate().filter(|(i, _)| *i != POLLING) {
        let total: u64 = cores.iter().map(|c| c.socket_writes[i]).sum();
        let _ = writeln!(out, "hubcast_socket_writes_total{{transport=\"{t}\"}} {total}");
    }
    family(&mut out, "hubcast_socket_frames_written_total", "counter", "WebSocket frames (data and control) carried by those writes, by transport.");
    for (i, t) in TRANSPORTS.iter().enumerate().filter(|(i, _)| *i != POLLING) {
        let total: u64 = cores.iter().map(|c| c.socket_frames_written[i]).sum();
        let _ = writeln!(out, "hubcast_socket_frames_written_total{{transport=\"{t}\"}} {total}");
    }
    family(&mut out, "hubcast_socket_writes_held_total", "counter", "WebSocket writes held back a bounded moment while their core was saturated, so they carry more frames (--socket-linger-us).");
    let _ = writeln!(out, "hubcast_socket_writes_held_total {}", cores.iter().map(|c| c.state.socket_writes_held).sum::<u64>());
    family(&mut out, "hubcast_sockets", "gauge", "Open live-data sockets, by transport.");
    for (i, t) in TRANSPORTS.iter().enumerate() {
        let total: u64 = cores.iter().map(|c| c.sockets_open[i]).sum();
        let _ = writeln!(out, "hubcast_sockets{{transport=\"{t}\"}} {total}");
    }
    family(&mut out, "hubcast_conflated_total", "counter", "Telemetry messages replaced by newer ones for slow sockets.");
    let _ = writeln!(out, "hubcast_conflated_total {}", cores.iter().map(|c| c.conflated).sum::<u64>());
    family(&mut out, "hubcast_slow_consumers_closed_total", "counter", "Sockets closed for exceeding the hard queue limit.");
    let _ = writeln!(out, "hubcast_slow_consumers_closed_total {}", cores.iter().map(|c| c.slow_consumers_closed).sum::<u64>());
    family(&mut out, "hubcast_http_pipeline_pauses_total", "counter", "Times an HTTP connection stopped reading at its pipelining bound (requests or body bytes in flight).");
    let _ = writeln!(out, "hubcast_http_pipeline_pauses_total {}", cores.iter().map(|c| c.http_pipeline_pauses).sum::<u64>());
    family(&mut out, "hubcast_socket_read_pauses_total", "counter", "Times a live-data socket that kept data ready was paused 1 ms so its core could serve others (epoll only).");
    let _ = writeln!(out, "hubcast_socket_read_pauses_total {}", cores.iter().map(|c| c.socket_read_pauses).sum::<u64>());
    for (name, help, pick) in [
        ("hubcast_devices", "Devices with cached state or grants.", (|s: &StateCounts| s.devices) as fn(&StateCounts) -> u64),
        ("hubcast_sessions", "Live sessions.", |s| s.sessions),
        ("hubcast_grants", "Grants held (per session, device and kind or key).", |s| s.grants),
        ("hubcast_subscriptions", "Subscriptions held (per session, device and kind or key).", |s| s.subscriptions),
    ] {
        family(&mut out, name, "gauge", help);
        let _ = writeln!(out, "{name} {}", cores.iter().map(|c| pick(&c.state)).sum::<u64>());
    }
    family(&mut out, "hubcast_core_queue_depth", "gauge", "Batches waiting in a core's queues.");
    for (core, c) in cores.iter().enumerate() {
        let _ = writeln!(out, "hubcast_core_queue_depth{{core=\"{core}\",queue=\"inbox\"}} {}", c.state.inbox_depth);
        let _ = writeln!(out, "hubcast_core_queue_depth{{core=\"{core}\",queue=\"ingress\"}} {}", c.state.ingress_depth);
    }
    family(&mut out, "hubcast_core_queue_bytes", "gauge", "Bytes waiting in a core's ingress queue (bounded by --event-hub-queue-bytes).");
    for (core, c) in cores.iter().enumerate() {
        let _ = writeln!(out, "hubcast_core_queue_bytes{{core=\"{core}\",queue=\"ingress\"}} {}", c.state.ingress_bytes);
    }
    family(&mut out, "hubcast_core_sessions", "gauge", "Live sessions owned by each core.");
    for (core, c) in cores.iter().enumerate() {
        let _ = writeln!(out, "hubcast_core_sessions{{core=\"{core}\"}} {}", c.state.sessions);
    }
    family(&mut out, "hubcast_core_timer_wakeups_total", "counter", "Wake-ups of each core's timer task (throttle flushes, connection TTL, session expiry).");
    for (core, c) in cores.iter().enumerate() {
        let _ = writeln!(out, "hubcast_core_timer_wakeups_total{{core=\"{core}\"}} {}", c.state.timer_wakeups);
    }
    family(&mut out, "hubcast_core_sockets", "gauge", "Open live-data sockets on each core, all transports.");
    for (core, c) in cores.iter().enumerate() {
        let _ = writeln!(out, "hubcast_core_sockets{{core=\"{core}\"}} {}", c.sockets_open.iter().sum::<u64>());
    }
    family(&mut out, "hubcast_request_duration_seconds", "histogram", "REST request latency, by route.");
    for (r, route) in ROUTES.iter().enumerate() {
        render_histogram(&mut out, "hubcast_request_duration_seconds", &format!("route=\"{route}\""), cores, |c| &c.requests[r]);
    }
    family(
        &mut out,
        "hubcast_delivery_duration_seconds",
        "histogram",
        "Time from a device message's arrival to its frame being written to a socket, by transport.",
    );
    for (t, transport) in TRANSPORTS.iter().enumerate() {
        let label = format!("transport=\"{transport}\"");
        render_histogram(&mut out, "hubcast_delivery_duration_seconds", &label, cores, |c| &c.deliveries[t]);
    }
    render_mesh(&mut out, cores);
    render_recovery(&mut out, cores);
    let mut last = String::new();
    for (name, help, labels, value) in external {
        if *name != last {
            family(&mut out, name, if name.ends_with("_total") { "counter" } else { "gauge" }, help);
            last = name.clone();
        }
        let _ = writeln!(out, "{name}{labels} {value}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latency_falls_in_the_first_bucket_whose_bound_it_does_not_exceed() {
        let h = Histogram::default();
        for micros in [100, 101, 250, 2_500_000, 2_500_001] {
            h.observe(Duration::from_micros(micros));
        }
        h.observe(Duration::from_nanos(100_001));
        let (buckets, count, sum) = h.snapshot();
        assert_eq!(buckets, vec![1, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(count, 6);
        assert_eq!(sum, 100 + 101 + 250 + 2_500_000 + 2_500_001 + 100);
    }

    #[test]
    fn the_age_of_a_stamp_is_read_against_the_given_now() {
        let (then, now) = (Arrival::at(1_000), Arrival::at(1_750));
        assert_eq!(then.age_at(now), Duration::from_micros(750));
        // Across the u32 wrap (once every ~71 minutes).
        assert_eq!(Arrival::at(u32::MAX - 9).age_at(Arrival::at(10)), Duration::from_micros(20));
    }
}
