//! One AMQP connection of the endpoint, served by one task: protocol headers, SASL, then
//! open/begin/attach/flow/transfer/disposition/detach/end/close (AMQP 1.0 §2.4–2.7, §5.3).
//!
//! The task reads frames and answers them into an output buffer, and, while a run is on,
//! appends telemetry transfers to it for every partition link with credit, as far as the
//! link credit, the session's incoming window (as hubcast's last `flow` set them) and the
//! pace allow, up to [`WRITE_BATCH`] bytes per write. A partition's messages are generated
//! only when they can be sent, so nothing waits in memory but the one buffer being written.
//!
//! Bounds (back-pressure): the output buffer is refilled only once fully written, so it
//! holds at most [`WRITE_BATCH`] bytes plus one frame; while hubcast does not read, nothing is
//! generated. The input holds at most one frame of [`MAX_FRAME_SIZE`] plus one read. Replies
//! to `$management`/`$cbs` wait for their reply link (or its credit) in queues of at most
//! [`MAX_REPLIES`] (beyond that the oldest is dropped: hubcast asks one at a time, so that
//! only happens to a client that stopped reading its replies).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use fe2o3_amqp::types::definitions::{AmqpError, Error as AmqpErrorBody, Handle, Role};
use fe2o3_amqp::types::messaging::message::__private::{Deserializable, Serializable};
use fe2o3_amqp::types::messaging::{Accepted, ApplicationProperties, Body, DeliveryState, Message, MessageId, Properties, Source, TargetArchetype};
use fe2o3_amqp::types::performatives::{Attach, Begin, ChannelMax, Close, Detach, Disposition, End, Flow, MaxFrameSize, Open, Performative, Transfer};
use fe2o3_amqp::types::primitives::{Array, OrderedMap, SimpleValue, Symbol, Value};
use fe2o3_amqp::types::sasl::{SaslCode, SaslInit, SaslMechanisms, SaslOutcome};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use super::wire::{self, Frame, FRAME_AMQP, FRAME_SASL, HEADER_AMQP, HEADER_SASL};
use super::{read, resume_after, Run, Shared, ENTITY, KEY, KEY_NAME};
use crate::fleet::{now_micros, Phase};

/// Largest frame either side may send (the same as hubcast's own limit).
const MAX_FRAME_SIZE: u32 = 65_536;
/// Bytes of frames gathered before a socket write.
const WRITE_BATCH: usize = 64 * 1024;
/// The session incoming window the endpoint announces: large enough never to close, since
/// the only incoming transfers are a few `$management` and `$cbs` requests.
const WINDOW: u32 = 1 << 30;
/// Credit the endpoint gives a `$management` or `$cbs` request link, refilled at half.
const REQUEST_CREDIT: u32 = 64;
/// Most replies queued per reply address (see the module documentation).
const MAX_REPLIES: usize = 64;
/// Largest request message accepted (requests are a few hundred bytes).
const MAX_REQUEST: usize = 1 << 20;

/// Where the input stands: the protocol header and SASL come before the frames.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    Header,
    SaslInit,
    AmqpHeader,
    Frames,
    Closed,
}

enum Node {
    Management,
    Cbs,
}

/// A link, by what the endpoint does on it.
enum Kind {
    /// Sends telemetry of partition `index`.
    Partition { index: usize, pace: Option<Pace> },
    /// Sends `$management` / `$cbs` replies to the client address `address`.
    Reply { address: String },
    /// Receives requests for `node`; `partial` holds a request split over several frames.
    Requests { node: Node, partial: Vec<u8>, credit: u32, delivery_count: u32 },
}

struct Link {
    kind: Kind,
    /// Sending links: the delivery count and the credit hubcast gave (§2.6.7).
    delivery_count: u32,
    credit: u32,
}

struct Session {
    /// Transfer id of the endpoint's next transfer, and its next delivery id.
    next_outgoing_id: u32,
    next_delivery_id: u32,
    /// The peer's incoming window as of its last flow: it accepts transfers up to
    /// `remote_next_incoming_id + remote_incoming_window` (§2.5.6).
    remote_next_incoming_id: u32,
    remote_incoming_window: u32,
    /// The peer's next transfer id (for the flows the endpoint sends).
    next_incoming_id: u32,
    links: HashMap<u32, Link>,
}

impl Session {
    /// Transfers the peer's session accepts now.
    fn window(&self) -> u32 {
        let end = self.remote_next_incoming_id.wrapping_add(self.remote_incoming_window);
        let open = end.wrapping_sub(self.next_outgoing_id) as i32;
        open.max(0) as u32
    }

    fn flow(&self, handle: Option<u32>, delivery_count: Option<u32>, link_credit: Option<u32>) -> Flow {
        Flow {
            next_incoming_id: Some(self.next_incoming_id),
            incoming_window: WINDOW,
            next_outgoing_id: self.next_outgoing_id,
            outgoing_window: WINDOW,
            handle: handle.map(Handle),
            delivery_count,
            link_credit,
            available: None,
            drain: false,
            echo: false,
            properties: None,
        }
    }
}

/// A partition link's schedule at a given rate: messages come due in steps of at least 1 ms
/// worth (timers are not finer); a sender far behind restarts its schedule rather than burst
/// (as [`crate::fleet::Pacer`], without the await). "Far" is at least [`CATCH_UP`]: all
/// partitions share one task, whose wake-ups were measured 4–7 ms late a few times a second
/// on a busy machine; restarting after 4 intervals (4 ms) lost ~1.5% of the rate at 50,000/s.
struct Pace {
    interval: Duration,
    step: u64,
    next: Instant,
    /// Messages due and not yet sent (at most [`CATCH_UP`] worth).
    owed: u64,
}

/// How late a paced link may fall and still catch up (see [`Pace`]).
const CATCH_UP: Duration = Duration::from_millis(25);

impl Pace {
    fn new(rate: f64, offset: f64) -> Option<Self> {
        if rate <= 0.0 {
            return None;
        }
        let step = ((rate / 1000.0).ceil() as u64).max(1);
        let interval = Duration::from_secs_f64(step as f64 / rate);
        Some(Self { interval, step, next: Instant::now() + interval.mul_f64(offset), owed: 0 })
    }

    /// Messages that may be sent at `now`.
    fn due(&mut self, now: Instant) -> u64 {
        if self.next <= now {
            let far = (self.interval * 4).max(CATCH_UP);
            if now - self.next > far {
                self.next = now;
            }
            while self.next <= now {
                self.owed += self.step;
                self.next += self.interval;
            }
            let most = (far.as_secs_f64() / self.interval.as_secs_f64()).ceil() as u64 + 1;
            self.owed = self.owed.min(self.step * most);
        }
        self.owed
    }
}

/// The connection's state (everything but the socket and its buffers).
struct Conn {
    shared: Arc<Shared>,
    stage: Stage,
    /// Largest frame the peer takes, and how often it wants to hear from the endpoint.
    peer_max_frame: usize,
    heartbeat: Option<Duration>,
    sessions: HashMap<u16, Session>,
    /// Replies waiting for their reply link, or for its credit, by reply address.
    replies: HashMap<String, VecDeque<Vec<u8>>>,
    /// The run being sent, while it is on.
    run: Option<Run>,
    /// Telemetry transfers in the output buffer (counted as accepted once written).
    in_flight: u64,
    /// Where [`Conn::produce`] starts, so that every partition link gets its turn first.
    turn: usize,
}

/// Serves one connection until it closes or fails.
pub async fn serve(shared: Arc<Shared>, mut tcp: TcpStream) {
    let mut runs = shared.run.subscribe();
    let mut conn = Conn {
        shared,
        stage: Stage::Header,
        peer_max_frame: 512,
        heartbeat: None,
        sessions: HashMap::new(),
        replies: HashMap::new(),
        run: None,
        in_flight: 0,
        turn: 0,
    };
    let (mut input, mut out) = (BytesMut::with_capacity(2 * MAX_FRAME_SIZE as usize), Vec::with_capacity(2 * WRITE_BATCH));
    let mut written = 0;
    let mut last_write = Instant::now();
    let mut phase: Option<watch::Receiver<Phase>> = None;
    runs.mark_changed();
    let failed = loop {
        if let Err(e) = conn.take_input(&mut input, &mut out) {
            let _ = e; // a protocol error: the peer sees the connection close
            break true;
        }
        if written == out.len() {
            if conn.in_flight > 0 {
                if let Some(run) = &conn.run {
                    run.stats.accepted.fetch_add(conn.in_flight, Ordering::Relaxed);
                }
                conn.in_flight = 0;
            }
            out.clear();
            written = 0;
            if conn.stage == Stage::Closed {
                break false;
            }
            conn.produce(&mut out);
        }
        // Timers matter only once the output is written (until then the write is awaited).
        let idle = written == out.len();
        let heartbeat_at = conn.heartbeat.filter(|_| idle).map(|h| last_write + h);
        let due_at = if idle { conn.next_due() } else { None };
        let wake_at = match (due_at, heartbeat_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let (mut reader, mut writer) = tcp.split();
        tokio::select! {
            r = reader.read_buf(&mut input), if input.len() < 2 * MAX_FRAME_SIZE as usize => match r {
                Ok(0) | Err(_) => break true,
                Ok(_) => {}
            },
            r = writer.write(&out[written..]), if written < out.len() => match r {
                Ok(0) | Err(_) => break true,
                Ok(n) => {
                    written += n;
                    last_write = Instant::now();
                }
            },
            changed = runs.changed() => {
                if changed.is_err() {
                    break false;
                }
                conn.run = runs.borrow_and_update().clone();
                phase = conn.run.as_ref().map(|r| r.stats.phase.subscribe());
                conn.restart_pace();
            }
            Some(()) = phase_changed(&mut phase) => conn.restart_pace(),
            () = sleep_until(wake_at) => {
                if heartbeat_at.is_some_and(|t| t <= Instant::now()) && conn.stage == Stage::Frames {
                    wire::put_empty_frame(&mut out);
                }
            }
        }
    };
    if failed {
        if let Some(run) = &conn.run {
            if *run.stats.phase.borrow() == Phase::Run {
                run.stats.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let _ = tcp.shutdown().await;
}

/// Resolves when the run's phase changes (never without a run).
async fn phase_changed(phase: &mut Option<watch::Receiver<Phase>>) -> Option<()> {
    match phase {
        Some(rx) => match rx.changed().await {
            Ok(()) => Some(()),
            Err(_) => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn error(condition: AmqpError, text: &str) -> AmqpErrorBody {
    AmqpErrorBody::new(condition, Some(text.to_string()), None)
}

/// The selector filter of a partition link's source, if any.
fn selector_of(source: &Source) -> Option<&str> {
    match source.filter.as_ref()?.get(&Symbol::from("apache.org:selector-filter:string"))? {
        Value::Described(d) => match &d.value {
            Value::String(s) => Some(s),
            _ => None,
        },
        Value::String(s) => Some(s),
        _ => None,
    }
}

impl Conn {
    /// True while telemetry flows.
    fn running(&self) -> bool {
        self.run.as_ref().is_some_and(|r| *r.stats.phase.borrow() == Phase::Run)
    }

    /// Gives every partition link a fresh schedule (a run started or changed).
    fn restart_pace(&mut self) {
        let partitions = self.shared.partitions.len() as f64;
        let rate = self.run.as_ref().map_or(0.0, |r| r.rate_per_partition);
        for session in self.sessions.values_mut() {
            for link in session.links.values_mut() {
                if let Kind::Partition { index, pace } = &mut link.kind {
                    *pace = Pace::new(rate, *index as f64 / partitions);
                }
            }
        }
    }

    /// The next time a paced partition link with credit has messages due.
    fn next_due(&self) -> Option<Instant> {
        if !self.running() {
            return None;
        }
        let mut at: Option<Instant> = None;
        for session in self.sessions.values() {
            if session.window() == 0 {
                continue;
            }
            for link in session.links.values() {
                if let Kind::Partition { pace: Some(p), .. } = &link.kind {
                    if link.credit > 0 {
                        at = Some(at.map_or(p.next, |a| a.min(p.next)));
                    }
                }
            }
        }
        at
    }

    /// Appends to `out` whatever may be sent now: queued replies, then telemetry.
    fn produce(&mut self, out: &mut Vec<u8>) {
        self.send_replies(out);
        if !self.running() {
            return;
        }
        let Some(run) = self.run.clone() else { return };
        let now = Instant::now();
        let now_ms = (now_micros() / 1000) as i64;
        let sent_at = now_micros();
        let mut links: Vec<(u16, u32)> = Vec::new();
        for (&channel, session) in &self.sessions {
            for (&handle, link) in &session.links {
                if matches!(link.kind, Kind::Partition { .. }) {
                    links.push((channel, handle));
                }
            }
        }
        if links.is_empty() {
            return;
        }
        links.sort_unstable();
        self.turn = (self.turn + 1) % links.len();
        links.rotate_left(self.turn);
        let mut sent = 0;
        for (channel, handle) in links {
            if out.len() >= WRITE_BATCH {
                break;
            }
            let session = self.sessions.get_mut(&channel).expect("listed above");
            let window = session.window() as u64;
            let link = session.links.get_mut(&handle).expect("listed above");
            let Kind::Partition { index, pace } = &mut link.kind else { continue };
            let mut n = (link.credit as u64).min(window);
            if n == 0 {
                continue;
            }
            if let Some(p) = pace {
                n = n.min(p.due(now));
            }
            let part = &self.shared.partitions[*index];
            let mut done = 0;
            while done < n && out.len() < WRITE_BATCH {
                let seq = part.next_seq.fetch_add(1, Ordering::Relaxed);
                let device = &part.devices[super::device_index(seq, part.devices.len(), part.stride)];
                wire::put_telemetry_transfer(out, channel, handle, session.next_delivery_id, device, seq, now_ms, sent_at);
                session.next_delivery_id = session.next_delivery_id.wrapping_add(1);
                session.next_outgoing_id = session.next_outgoing_id.wrapping_add(1);
                done += 1;
            }
            link.credit -= done as u32;
            link.delivery_count = link.delivery_count.wrapping_add(done as u32);
            if let Some(p) = pace {
                p.owed -= done;
            }
            sent += done;
        }
        run.stats.sent.fetch_add(sent, Ordering::Relaxed);
        self.in_flight += sent;
    }

    /// Sends queued replies on reply links that have credit.
    fn send_replies(&mut self, out: &mut Vec<u8>) {
        if self.replies.is_empty() {
            return;
        }
        for (&channel, session) in self.sessions.iter_mut() {
            let mut window = session.window();
            for (&handle, link) in session.links.iter_mut() {
                let Kind::Reply { address } = &link.kind else { continue };
                let Some(queue) = self.replies.get_mut(address) else { continue };
                while link.credit > 0 && window > 0 {
                    window -= 1;
                    let Some(message) = queue.pop_front() else { break };
                    let id = session.next_delivery_id;
                    let transfer = wire::settled_transfer(handle, id);
                    wire::put_frame(out, FRAME_AMQP, channel, &transfer, &message);
                    session.next_delivery_id = id.wrapping_add(1);
                    session.next_outgoing_id = session.next_outgoing_id.wrapping_add(1);
                    link.credit -= 1;
                    link.delivery_count = link.delivery_count.wrapping_add(1);
                }
            }
        }
        self.replies.retain(|_, q| !q.is_empty());
    }

    /// Handles every whole header and frame in `input`, answering into `out`.
    fn take_input(&mut self, input: &mut BytesMut, out: &mut Vec<u8>) -> Result<(), String> {
        loop {
            match self.stage {
                Stage::Closed => {
                    input.clear();
                    return Ok(());
                }
                Stage::Header | Stage::AmqpHeader => {
                    if input.len() < 8 {
                        return Ok(());
                    }
                    let header = input.split_to(8);
                    if header[..] == HEADER_SASL && self.stage == Stage::Header {
                        out.extend_from_slice(&HEADER_SASL);
                        let mechanisms = SaslMechanisms {
                            sasl_server_mechanisms: Array::from(vec![Symbol::from("PLAIN"), Symbol::from("ANONYMOUS")]),
                        };
                        wire::put_frame(out, FRAME_SASL, 0, &mechanisms, &[]);
                        self.stage = Stage::SaslInit;
                    } else if header[..] == HEADER_AMQP {
                        out.extend_from_slice(&HEADER_AMQP);
                        self.stage = Stage::Frames;
                    } else {
                        out.extend_from_slice(&HEADER_SASL);
                        self.stage = Stage::Closed;
                        return Err("unknown protocol header".into());
                    }
                }
                Stage::SaslInit => {
                    let Some(frame) = wire::take_frame(input, 512)? else { return Ok(()) };
                    if frame.kind != FRAME_SASL {
                        return Err("expected sasl-init".into());
                    }
                    let init: SaslInit = serde_amqp::from_slice(&frame.body).map_err(|e| format!("sasl-init: {e}"))?;
                    let ok = match init.mechanism.0.as_str() {
                        "ANONYMOUS" => true,
                        "PLAIN" => {
                            let response = init.initial_response.map(|b| b.into_vec()).unwrap_or_default();
                            let mut parts = response.split(|b| *b == 0).skip(1);
                            parts.next() == Some(KEY_NAME.as_bytes()) && parts.next() == Some(KEY.as_bytes())
                        }
                        _ => false,
                    };
                    let code = if ok { SaslCode::Ok } else { SaslCode::Auth };
                    wire::put_frame(out, FRAME_SASL, 0, &SaslOutcome { code, additional_data: None }, &[]);
                    self.stage = if ok { Stage::AmqpHeader } else { Stage::Closed };
                }
                Stage::Frames => {
                    let Some(frame) = wire::take_frame(input, MAX_FRAME_SIZE as usize)? else { return Ok(()) };
                    if frame.kind != FRAME_AMQP {
                        return Err("unexpected SASL frame".into());
                    }
                    self.take_frame(frame, out)?;
                }
            }
        }
    }

    fn take_frame(&mut self, mut frame: Frame, out: &mut Vec<u8>) -> Result<(), String> {
        if frame.body.is_empty() {
            return Ok(()); // a heartbeat
        }
        let channel = frame.channel;
        let performative = wire::performative(&mut frame.body).map_err(|e| format!("bad performative: {e}"))?;
        match performative {
            Performative::Open(open) => {
                self.peer_max_frame = (open.max_frame_size.0 as usize).clamp(512, MAX_FRAME_SIZE as usize);
                // Heard from at least twice per idle time-out of the peer (§2.4.5).
                self.heartbeat = open.idle_time_out.filter(|ms| *ms > 0).map(|ms| Duration::from_millis(ms as u64 / 2));
                let reply = Open {
                    container_id: "hubcast-load".into(),
                    hostname: None,
                    max_frame_size: MaxFrameSize(MAX_FRAME_SIZE),
                    channel_max: ChannelMax(255),
                    idle_time_out: None,
                    outgoing_locales: None,
                    incoming_locales: None,
                    offered_capabilities: None,
                    desired_capabilities: None,
                    properties: None,
                };
                wire::put_frame(out, FRAME_AMQP, 0, &reply, &[]);
            }
            Performative::Begin(begin) => {
                // The endpoint's channel is the peer's: each side numbers its own.
                let session = Session {
                    next_outgoing_id: 0,
                    next_delivery_id: 0,
                    remote_next_incoming_id: 0,
                    remote_incoming_window: begin.incoming_window,
                    next_incoming_id: begin.next_outgoing_id,
                    links: HashMap::new(),
                };
                let reply = Begin {
                    remote_channel: Some(channel),
                    next_outgoing_id: 0,
                    incoming_window: WINDOW,
                    outgoing_window: WINDOW,
                    handle_max: Handle(u32::MAX),
                    offered_capabilities: None,
                    desired_capabilities: None,
                    properties: None,
                };
                self.sessions.insert(channel, session);
                wire::put_frame(out, FRAME_AMQP, channel, &reply, &[]);
            }
            Performative::Attach(attach) => self.attach(channel, attach, out),
            Performative::Flow(flow) => self.flow(channel, flow, out),
            Performative::Transfer(transfer) => self.transfer(channel, transfer, frame.body, out)?,
            Performative::Disposition(_) => {} // every delivery the endpoint sends is pre-settled
            Performative::Detach(detach) => {
                // A detach of a link the endpoint refused (and so detached first) is the
                // peer's answer: it gets none.
                let known = self.sessions.get_mut(&channel).is_some_and(|s| s.links.remove(&detach.handle.0).is_some());
                if known {
                    let reply = Detach { handle: detach.handle, closed: detach.closed, error: None };
                    wire::put_frame(out, FRAME_AMQP, channel, &reply, &[]);
                }
            }
            Performative::End(_) => {
                self.sessions.remove(&channel);
                wire::put_frame(out, FRAME_AMQP, channel, &End { error: None }, &[]);
            }
            Performative::Close(_) => {
                wire::put_frame(out, FRAME_AMQP, 0, &Close { error: None }, &[]);
                self.stage = Stage::Closed;
            }
        }
        Ok(())
    }

    fn attach(&mut self, channel: u16, attach: Attach, out: &mut Vec<u8>) {
        let Some(session) = self.sessions.get_mut(&channel) else { return };
        let handle = attach.handle.0;
        let source_address = attach.source.as_ref().and_then(|s| s.address.clone()).unwrap_or_default();
        let target_address = match attach.target.as_deref() {
            Some(TargetArchetype::Target(t)) => t.address.clone().unwrap_or_default(),
            _ => String::new(),
        };
        // The peer receives on its `Receiver` links: the endpoint sends on them.
        let endpoint_sends = attach.role == Role::Receiver;
        let kind = if endpoint_sends {
            if source_address == "$management" || source_address == "$cbs" {
                Some(Kind::Reply { address: target_address })
            } else {
                source_address
                    .rsplit_once("/Partitions/")
                    .filter(|(path, _)| path.starts_with(&format!("{ENTITY}/ConsumerGroups/")))
                    .and_then(|(_, id)| id.parse::<usize>().ok())
                    .filter(|id| *id < self.shared.partitions.len())
                    .map(|index| Kind::Partition { index, pace: None })
            }
        } else {
            match target_address.as_str() {
                "$management" => Some(Kind::Requests { node: Node::Management, partial: Vec::new(), credit: 0, delivery_count: 0 }),
                "$cbs" => Some(Kind::Requests { node: Node::Cbs, partial: Vec::new(), credit: 0, delivery_count: 0 }),
                _ => None,
            }
        };
        let peer_delivery_count = attach.initial_delivery_count.unwrap_or(0);
        let reply = Attach {
            name: attach.name,
            handle: attach.handle,
            role: if endpoint_sends { Role::Sender } else { Role::Receiver },
            snd_settle_mode: attach.snd_settle_mode,
            rcv_settle_mode: attach.rcv_settle_mode,
            source: attach.source.clone(),
            target: attach.target,
            unsettled: None,
            incomplete_unsettled: false,
            initial_delivery_count: endpoint_sends.then_some(0),
            max_message_size: None,
            offered_capabilities: None,
            desired_capabilities: None,
            properties: None,
        };
        wire::put_frame(out, FRAME_AMQP, channel, &reply, &[]);
        let Some(mut kind) = kind else {
            let text = if endpoint_sends { "no such partition" } else { "this endpoint takes no messages" };
            let detach = Detach { handle: Handle(handle), closed: true, error: Some(error(AmqpError::NotFound, text)) };
            wire::put_frame(out, FRAME_AMQP, channel, &detach, &[]);
            return;
        };
        match &mut kind {
            Kind::Partition { index, pace } => {
                let part = &self.shared.partitions[*index];
                if let Some(after) = attach.source.as_deref().and_then(selector_of).and_then(resume_after) {
                    part.next_seq.fetch_max(after + 1, Ordering::Relaxed);
                }
                let rate = self.run.as_ref().map_or(0.0, |r| r.rate_per_partition);
                *pace = Pace::new(rate, *index as f64 / self.shared.partitions.len() as f64);
            }
            Kind::Requests { credit, delivery_count, .. } => {
                *credit = REQUEST_CREDIT;
                *delivery_count = peer_delivery_count;
                let flow = session.flow(Some(handle), Some(peer_delivery_count), Some(REQUEST_CREDIT));
                wire::put_frame(out, FRAME_AMQP, channel, &flow, &[]);
            }
            Kind::Reply { .. } => {}
        }
        session.links.insert(handle, Link { kind, delivery_count: 0, credit: 0 });
    }

    fn flow(&mut self, channel: u16, flow: Flow, out: &mut Vec<u8>) {
        let Some(session) = self.sessions.get_mut(&channel) else { return };
        // The session's window, carried by every flow (§2.7.4); before the peer has seen the
        // endpoint's begin it counts from the endpoint's first id, 0.
        session.remote_next_incoming_id = flow.next_incoming_id.unwrap_or(0);
        session.remote_incoming_window = flow.incoming_window;
        let Some(handle) = flow.handle else {
            if flow.echo {
                let reply = session.flow(None, None, None);
                wire::put_frame(out, FRAME_AMQP, channel, &reply, &[]);
            }
            return;
        };
        let Some(link) = session.links.get_mut(&handle.0) else { return };
        if matches!(link.kind, Kind::Requests { .. }) {
            return;
        }
        // Credit as of the peer's delivery count (§2.6.7).
        if let Some(credit) = flow.link_credit {
            let theirs = flow.delivery_count.unwrap_or(0);
            link.credit = (theirs.wrapping_add(credit).wrapping_sub(link.delivery_count) as i32).max(0) as u32;
        }
        if flow.drain {
            // Nothing is held back for later: use up the credit and say so.
            link.delivery_count = link.delivery_count.wrapping_add(link.credit);
            link.credit = 0;
        }
        if flow.echo || flow.drain {
            let (count, credit) = (link.delivery_count, link.credit);
            let reply = session.flow(Some(handle.0), Some(count), Some(credit));
            wire::put_frame(out, FRAME_AMQP, channel, &reply, &[]);
        }
    }

    fn transfer(&mut self, channel: u16, transfer: Transfer, payload: BytesMut, out: &mut Vec<u8>) -> Result<(), String> {
        let Some(session) = self.sessions.get_mut(&channel) else { return Ok(()) };
        session.next_incoming_id = session.next_incoming_id.wrapping_add(1);
        let handle = transfer.handle.0;
        let Some(link) = session.links.get_mut(&handle) else { return Ok(()) };
        let Kind::Requests { node, partial, credit, delivery_count } = &mut link.kind else { return Ok(()) };
        if partial.len() + payload.len() > MAX_REQUEST {
            return Err("request too large".into());
        }
        partial.extend_from_slice(&payload);
        if transfer.more {
            return Ok(());
        }
        let request = std::mem::take(partial);
        let is_cbs = matches!(node, Node::Cbs);
        *delivery_count = delivery_count.wrapping_add(1);
        *credit = credit.saturating_sub(1);
        if transfer.settled != Some(true) {
            if let Some(id) = transfer.delivery_id {
                let disposition = Disposition {
                    role: Role::Receiver,
                    first: id,
                    last: None,
                    settled: true,
                    state: Some(DeliveryState::Accepted(Accepted {})),
                    batchable: false,
                };
                wire::put_frame(out, FRAME_AMQP, channel, &disposition, &[]);
            }
        }
        if *credit < REQUEST_CREDIT / 2 {
            *credit = REQUEST_CREDIT;
            let (count, given) = (*delivery_count, *credit);
            let flow = session.flow(Some(handle), Some(count), Some(given));
            wire::put_frame(out, FRAME_AMQP, channel, &flow, &[]);
        }
        let Ok(Deserializable(request)) = serde_amqp::from_slice::<Deserializable<Message<Body<Value>>>>(&request) else {
            return Ok(()); // not a request this endpoint understands: no reply
        };
        let app = request.application_properties.clone().unwrap_or_default();
        let text = |k: &str| match app.get(k) {
            Some(SimpleValue::String(s)) => s.clone(),
            _ => String::new(),
        };
        let props = request.properties.clone().unwrap_or_default();
        let reply_to = props.reply_to.clone().unwrap_or_default();
        let (status, body) = if is_cbs { (202, Value::Null) } else { read(&self.shared, &text("type"), &text("partition")) };
        let mut reply_props = OrderedMap::new();
        reply_props.insert("status-code".to_string(), SimpleValue::Int(status));
        reply_props.insert("status-description".to_string(), SimpleValue::String(if status < 300 { "OK" } else { "refused" }.into()));
        let reply = Message::builder()
            .properties(Properties { correlation_id: props.message_id.clone().or(Some(MessageId::Ulong(0))), ..Default::default() })
            .application_properties(ApplicationProperties(reply_props))
            .value(body)
            .build();
        let encoded = serde_amqp::to_vec(&Serializable(reply)).map_err(|e| format!("cannot encode a reply: {e}"))?;
        // The client attaches its reply link right after its request link: the reply waits
        // for it (and for its credit) in `replies`.
        let queue = self.replies.entry(reply_to).or_default();
        if queue.len() == MAX_REPLIES {
            queue.pop_front();
        }
        queue.push_back(encoded);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_paced_link_catches_up_a_late_wake_up_but_does_not_burst_after_a_long_stall() {
        // 10,000/s: steps of 10 messages every millisecond.
        let mut pace = Pace::new(10_000.0, 0.0).unwrap();
        let start = pace.next;
        assert_eq!(pace.due(start - Duration::from_micros(1)), 0);
        assert_eq!(pace.due(start), 10);
        pace.owed = 0;
        // Woken 7 ms late: the 7 steps missed are still due.
        assert_eq!(pace.due(start + Duration::from_millis(8)), 80);
        pace.owed = 0;
        // Stalled a second (hubcast gave no credit): one step, and a fresh schedule.
        let later = start + Duration::from_secs(1);
        assert_eq!(pace.due(later), 10);
        assert!(pace.next > later);
    }
}
