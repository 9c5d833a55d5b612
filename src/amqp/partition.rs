//! One receiver per partition: attach with a start position, receive, hand batches to the
//! cores, remember how far it got.
//!
//! **Flow control.** The link runs with `prefetch` credit, refilled by the tap (or fe2o3) as deliveries
//! are accepted. A batch is accepted only after [`Ingress::send`] returned, and that waits
//! while an owning core's queue is full. So a slow core stops the credit, the broker stops
//! sending, and at most `prefetch` messages per partition wait in memory.
//!
//! **Hand-offs** ([`HandOff`], `--event-hub-linger-ms`). Each hand-off to the cores is a
//! cross-thread queue send that may wake a core through its eventfd; on a shared CPU the
//! woken core preempts the consumer. A consumer that keeps up with the socket would hand over
//! every few messages (measured: 8–13 per hand-off, 21,700 core wake-ups/s). So a partition
//! whose previous hand-off is less than `linger` old (a busy stream) keeps receiving until
//! `linger` after that hand-off before handing over: while busy, at most one hand-off per
//! `linger` per partition. A partition whose previous hand-off is older (a quiet or slow
//! stream) hands over what it has at once: no added latency. The linger ends early when the
//! batch reaches [`MAX_BATCH`] messages, or half the link credit (new credit is granted
//! once half of it was accepted, and nothing is accepted while lingering: holding more would
//! wait for messages the credit forbids), or the credit is used up, or the link fails. Bounds:
//! at most `min(MAX_BATCH, prefetch)` messages of `maxMessageBytes` each per hand-off, and
//! `linger` (+ up to 1 ms of tokio's timer granularity) of added latency while busy.
//!
//! **Exactly once.** The partition's position (sequence number, offset) is recorded right
//! after a batch is in the cores' queues, with no await in between, and a reconnect resumes
//! after it (`x-opt-sequence-number > N`). A message at or before the recorded position that
//! the broker sends again is skipped. Nothing is lost when the connection drops: messages
//! received but not yet handed over (also those held by a linger) were never recorded, so
//! they are asked for again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fe2o3_amqp::link::receiver::CreditMode;
use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::messaging::{Body, Source};
use fe2o3_amqp::types::primitives::Value;
use fe2o3_amqp::Receiver;
use serde_amqp::described::Described;
use serde_amqp::descriptor::Descriptor;

use super::map::{position_of, MapSettings, Position, Received};
use super::tap::{self, OwnedLink, TapHandle};
use super::StartPosition;
use crate::ingest::faults::{Fault, FAULTS};
use crate::app::Ingress;

/// Filter-set key Event Hubs reads the start position from.
pub const SELECTOR_FILTER: &str = "apache.org:selector-filter:string";
/// Descriptor of `apache.org:selector-filter:string`.
const SELECTOR_FILTER_CODE: u64 = 0x0000_468c_0000_0004;
/// Most messages handed to the cores in one batch.
const MAX_BATCH: usize = 256;

/// When a partition hands its messages to the cores (see the module documentation).
#[derive(Clone, Copy, Debug)]
pub struct HandOff {
    /// `--event-hub-linger-ms`: while the stream is busy, at most one hand-off per `linger`;
    /// zero hands over whatever has arrived at once.
    pub linger: Duration,
    /// The link credit (`--event-hub-prefetch`).
    pub prefetch: u32,
}

impl HandOff {
    /// Most messages held while lingering: half the link credit (fe2o3 grants new credit
    /// once half of it was accepted), at most [`MAX_BATCH`].
    pub fn hold(&self) -> usize {
        usize::try_from(self.prefetch / 2).unwrap_or(usize::MAX).clamp(1, MAX_BATCH)
    }
}

/// Last position of every partition, kept across reconnects.
pub type Positions = Arc<Mutex<HashMap<String, Position>>>;

/// The selector that starts a partition: after its recorded position, else at `start`.
pub fn start_filter(position: Option<&Position>, start: &StartPosition) -> String {
    if let Some(p) = position {
        if let Some(seq) = p.sequence {
            return format!("amqp.annotation.x-opt-sequence-number > '{seq}'");
        }
        if let Some(offset) = &p.offset {
            return format!("amqp.annotation.x-opt-offset > '{offset}'");
        }
    }
    match start {
        StartPosition::Latest => "amqp.annotation.x-opt-offset > '@latest'".into(),
        StartPosition::Earliest => "amqp.annotation.x-opt-offset > '-1'".into(),
        StartPosition::EnqueuedAfter(ms) => format!("amqp.annotation.x-opt-enqueued-time > '{ms}'"),
    }
}

/// Attaches a receiver to `address`, with a selector filter unless `filter` is `None`.
pub async fn attach(
    session: &mut SessionHandle<()>,
    name: String,
    address: &str,
    filter: Option<&str>,
    prefetch: u32,
) -> Result<Receiver, String> {
    let mut source = Source::builder().address(address.to_string());
    if let Some(expr) = filter {
        let described = Described { descriptor: Descriptor::Code(SELECTOR_FILTER_CODE), value: Value::String(expr.into()) };
        source = source.add_to_filter(SELECTOR_FILTER, Some(described));
    }
    let attach = Receiver::builder()
        .name(name)
        .source(source.build())
        .credit_mode(CreditMode::Auto(prefetch))
        .auto_accept(false)
        .attach(session);
    match tokio::time::timeout(super::connect::CALL_TIMEOUT, attach).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(format!("cannot attach a receiver to {address}: {e}")),
        Err(_) => Err(format!("no answer to the attach of {address}")),
    }
}

/// Why a partition stopped.
pub enum End {
    /// The link or the connection failed: reconnect.
    Lost(String),
    /// The cores are gone (shutdown): stop.
    CoresGone,
    /// Told to let the partition go (its lease went to another instance): the link was
    /// detached, the connection and the other partitions go on.
    Released,
}

/// Tells one partition task to detach its link and end ([`End::Released`]) after the batch
/// it is handing over, if any.
pub type Release = tokio::sync::watch::Receiver<bool>;

/// A message fe2o3's receiver decoded whole.
type Got = fe2o3_amqp::link::delivery::Delivery<Body<Value>>;

/// Waits for at least one message and takes up to `max` (cancel safe): from the tap when it
/// serves the link, else from fe2o3's receiver. fe2o3's receiver is polled in both cases: it
/// reports the end of the link and of the connection.
async fn recv(receiver: &mut Receiver, tapped: Option<&OwnedLink>, got: &mut Vec<Got>, from_tap: &mut Vec<tap::Delivery>, max: usize) -> Result<(), String> {
    let fe2o3 = async {
        match receiver.recv::<Body<Value>>().await {
            Ok(d) => Ok(d),
            Err(e) => Err(e.to_string()),
        }
    };
    tokio::pin!(fe2o3);
    match tapped {
        Some(link) => tokio::select! {
            biased;
            open = link.recv(from_tap, max) => if open {
                Ok(())
            } else {
                // fe2o3 reads the same `detach` right after the tap: its error names the
                // broker's reason (an `amqp:link:*` condition and description), if any.
                match tokio::time::timeout(Duration::from_secs(1), &mut fe2o3).await {
                    Ok(Err(e)) => Err(e),
                    _ => Err("link detached".into()),
                }
            },
            r = &mut fe2o3 => r.map(|d| got.push(d)),
        },
        None => fe2o3.await.map(|d| got.push(d)),
    }
}

/// Receives until the link fails. `label` is the partition id (or the queue address);
/// `name` the link's name (the tap serves it if it can, see [`tap`]).
#[allow(clippy::too_many_arguments)]
pub async fn consume(
    mut receiver: Receiver,
    name: String,
    label: String,
    positions: Positions,
    ingress: Ingress,
    settings: Arc<MapSettings>,
    handoff: HandOff,
    tap: Option<TapHandle>,
    mut release: Release,
) -> End {
    let mut last = positions.lock().unwrap_or_else(|e| e.into_inner()).get(&label).cloned();
    // One wait for the whole loop (not one per batch): a graceful shutdown ends it.
    let stopping = crate::shutdown::STOPPING.wait();
    tokio::pin!(stopping);
    // Its lease moved: detach between batches (the position of what was handed over is
    // recorded; the next holder resumes after the checkpoint).
    let released = async move {
        if release.wait_for(|r| *r).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(released);
    let tapped = tap.as_ref().and_then(|t| t.link(&name));
    // The partition number each message's key holds (design step 9), parsed once.
    let partition_number = crate::ingest::key::partition_number(&label);
    if tap.is_some() && tapped.is_none() {
        tracing::warn!(partition = %label, "the AMQP tap does not serve this link: fe2o3 decodes its messages");
    }
    // Kept across batches: a delivery is several hundred bytes, and growing a fresh Vec to
    // MAX_BATCH for every batch copied each one about twice.
    let mut got: Vec<Got> = Vec::with_capacity(MAX_BATCH);
    let mut from_tap: Vec<tap::Delivery> = Vec::with_capacity(MAX_BATCH);
    let hold = handoff.hold();
    // When the previous hand-off returned (the stream is busy while it is recent).
    let mut last_handoff: Option<tokio::time::Instant> = None;
    loop {
        let mut failure = None;
        // recv is cancel safe: a graceful shutdown may interrupt the wait for the next event.
        let first = tokio::select! {
            r = recv(&mut receiver, tapped.as_ref(), &mut got, &mut from_tap, MAX_BATCH) => r,
            _ = &mut stopping => {
                // AMQP detach (closed): the hub releases the link at once.
                let _ = tokio::time::timeout(std::time::Duration::from_secs(2), receiver.close()).await;
                tracing::debug!(partition = %label, "receiver detached");
                return End::CoresGone;
            }
            _ = &mut released => {
                // Messages the tap still holds for this link were never handed over nor
                // recorded: the next holder reads them again from the checkpoint.
                let _ = tokio::time::timeout(std::time::Duration::from_secs(2), receiver.close()).await;
                if let Some(link) = &tapped {
                    link.forget();
                }
                tracing::debug!(partition = %label, "receiver detached: the lease moved");
                return End::Released;
            }
        };
        if let Err(e) = first {
            return End::Lost(format!("connection lost (partition {label}: {e})"));
        }
        // Take whatever else has already arrived, without waiting (recv is cancel safe); if
        // the previous hand-off was recent, also what arrives until `linger` after it, while
        // the credit allows more.
        let linger_until = last_handoff.map(|at| at + handoff.linger).filter(|until| *until > tokio::time::Instant::now());
        let linger = tokio::time::sleep_until(linger_until.unwrap_or_else(tokio::time::Instant::now));
        tokio::pin!(linger);
        loop {
            let n = got.len() + from_tap.len();
            if n >= MAX_BATCH {
                break;
            }
            let room = MAX_BATCH - got.len();
            let credit = tapped.as_ref().map_or_else(|| receiver.credit(), OwnedLink::credit);
            let lingering = linger_until.is_some() && n < hold && credit > 0;
            tokio::select! {
                biased;
                r = recv(&mut receiver, tapped.as_ref(), &mut got, &mut from_tap, room) => if let Err(e) = r {
                    failure = Some(format!("connection lost (partition {label}: {e})"));
                    break;
                },
                _ = &mut linger, if lingering => break,
                _ = std::future::ready(()), if !lingering => break,
            }
        }

        let total = got.len() + from_tap.len();
        super::STATS.received.fetch_add(total as u64, std::sync::atomic::Ordering::Relaxed);
        let mut batch = Vec::with_capacity(total);
        // Sequence number of each message of `batch` (for the durable store's marks).
        let mut seqs: Vec<i64> = Vec::with_capacity(total);
        let mut infos: Vec<DeliveryInfo> = Vec::with_capacity(got.len());
        // The redelivery check needs each message's sequence number; the position recorded
        // is that of the batch's newest message, read once at the end.
        let mut newest_seq = last.as_ref().and_then(|p| p.sequence);
        // The newest message with a position: its bytes as tapped, or fe2o3's decoding.
        let mut newest: Option<Newest> = None;
        let (mut first_seq, mut last_seq) = (None, None);
        let (mut raw, mut decoded) = (0u64, 0u64);
        // Maps one message into `batch`; `true` if it has a position (the newest so far).
        let mut take = |received: Received<'_>| -> bool {
            let sequence = received.sequence();
            if let (Some(seq), Some(done)) = (sequence, newest_seq) {
                if seq <= done {
                    FAULTS.record(Fault::Redelivered, None, &format!("partition {label} sequence number {seq} <= {done}"));
                    return false;
                }
            }
            warn_retention_gap(&label, newest_seq, sequence);
            let positioned = sequence.is_some() || received.has_offset();
            match received.to_ingest_sequenced(&settings, sequence) {
                Ok(mut msg) => {
                    // The key's partition (design step 9; `ingest::key`).
                    msg.key = msg.key.in_numbered(partition_number);
                    if sequence.is_none() {
                        super::STATS.unsequenced.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::debug!(partition = %label, device = %msg.device_id, "message without a sequence number: applied unordered");
                    }
                    batch.push(msg);
                    seqs.push(sequence.unwrap_or(crate::app::ingress::NO_SEQUENCE));
                }
                Err(r) => FAULTS.record(r.fault, r.device.as_deref(), &r.detail),
            }
            if positioned {
                first_seq = first_seq.or(sequence);
                last_seq = sequence.or(last_seq);
                newest_seq = sequence;
            }
            positioned
        };
        for d in &from_tap {
            match &d.message {
                Ok(bytes) => match Received::read(bytes) {
                    Ok(r) => {
                        raw += 1;
                        if take(r) {
                            newest = Some(Newest::Raw(bytes.clone()));
                        }
                    }
                    // Not an AMQP message: fe2o3 would have failed the link on it; so does
                    // this (nothing of this batch was handed over or recorded).
                    Err(e) => return End::Lost(format!("connection lost (partition {label}: {e})")),
                },
                Err(size) => FAULTS.record(
                    Fault::Oversized,
                    None,
                    &format!("partition {label}: a message of {size} bytes, more than maxMessageBytes and {} bytes of other sections", tap::SECTION_SLACK),
                ),
            }
        }
        for delivery in got.drain(..) {
            let (info, mut message) = delivery.into_parts();
            infos.push(info);
            decoded += 1;
            if take(Received::decoded(&mut message)) {
                newest = Some(Newest::Decoded(Box::new(message)));
            }
        }
        super::STATS.raw_reads.fetch_add(raw, std::sync::atomic::Ordering::Relaxed);
        super::STATS.decoded_reads.fetch_add(decoded, std::sync::atomic::Ordering::Relaxed);
        let newest = newest.and_then(|n| n.position()).or_else(|| last.clone());
        let count = batch.len();
        // With a durable store every core records the position with the state (even when no
        // message survived mapping); without one this is a plain send.
        let upto = newest.as_ref().and_then(|p| p.sequence).filter(|_| newest != last);
        if count > 0 || upto.is_some() {
            if !ingress.send_marked(batch, seqs, &label, upto).await {
                return End::CoresGone;
            }
            super::STATS.handoffs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if !handoff.linger.is_zero() {
                last_handoff = Some(tokio::time::Instant::now());
            }
        }
        // In the cores' queues now: record the position before anything else can happen.
        if newest != last {
            positions.lock().unwrap_or_else(|e| e.into_inner()).insert(label.clone(), newest.clone().unwrap_or_default());
            last = newest;
        }
        tracing::debug!(partition = %label, count, first_seq, last_seq, "handed to the cores");
        if let Some(link) = &tapped {
            link.done(&from_tap);
            from_tap.clear();
        }
        if !infos.is_empty() {
            if let Err(e) = receiver.accept_all(infos).await {
                return End::Lost(format!("partition {label}: cannot settle: {e}"));
            }
        }
        if let Some(reason) = failure {
            return End::Lost(reason);
        }
    }
}

/// The newest message of a batch with a position, read again once at the end of the batch.
enum Newest {
    Raw(bytes::Bytes),
    Decoded(Box<fe2o3_amqp::types::messaging::Message<Body<Value>>>),
}

impl Newest {
    fn position(&self) -> Option<Position> {
        match self {
            Newest::Raw(bytes) => Received::read(bytes).ok().map(|r| r.position()),
            Newest::Decoded(m) => Some(position_of(m)),
        }
    }
}

/// Sequence numbers of a partition have no gaps: a first message past `done + 1` means the
/// events in between left the hub's retention while hubcast was away. Logged, not fatal.
fn warn_retention_gap(label: &str, done: Option<i64>, seq: Option<i64>) {
    if let (Some(done), Some(seq)) = (done, seq) {
        if seq > done + 1 {
            tracing::warn!(
                partition = %label,
                resumed_after = done,
                first_available = seq,
                missed = seq - done - 1,
                "the stored position left the event hub's retention: events in between are gone; reading on from the oldest retained"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_position_wins_over_the_start_position() {
        let p = Position { sequence: Some(41), offset: Some("4100".into()), enqueued: None };
        assert_eq!(start_filter(Some(&p), &StartPosition::Latest), "amqp.annotation.x-opt-sequence-number > '41'");
        let p = Position { sequence: None, offset: Some("4100".into()), enqueued: None };
        assert_eq!(start_filter(Some(&p), &StartPosition::Earliest), "amqp.annotation.x-opt-offset > '4100'");
    }

    #[test]
    fn start_positions_become_selector_filters() {
        assert_eq!(start_filter(None, &StartPosition::Latest), "amqp.annotation.x-opt-offset > '@latest'");
        assert_eq!(start_filter(None, &StartPosition::Earliest), "amqp.annotation.x-opt-offset > '-1'");
        assert_eq!(
            start_filter(None, &StartPosition::EnqueuedAfter(1_700_000_000_000)),
            "amqp.annotation.x-opt-enqueued-time > '1700000000000'"
        );
    }
}
