//! Adoption (docs/design/recovery.md step 6): on SIGTERM an instance hands each away client's
//! recovery history to another live instance, so the client recovers there. Why a handshake
//! and not one message: Redis pub/sub has no positions, so the history written on the stopping
//! instance A and the device messages the adopter B starts receiving when it subscribes must
//! be stitched without a gap, and a gap that cannot be ruled out is declared, never hidden.
//!
//! On `P:adopt:<instance>` (`P` = `--redis-prefix`; on a cluster `{P}`), one Redis only:
//! 1. **A → B `adopt`** (session, the store's `Change::Stream` record): written after A's
//!    goodbyes (every pid away); A also sets `P:stream:<session>` = B for the window left.
//!    B loads the session, installs the history (its pids held aside: a restore fails
//!    `unknown_pid` until step 3), watches the session's devices, and once every device core
//!    of the session has handed its watch changes to the link (a mark per core, after them),
//!    the link has subscribed and announced them: then
//! 2. **B → A `watching`**. A's pub/sub connection gets it after every device message
//!    published before B subscribed (one Redis, one connection, one order); A hands a mark
//!    to each of the session's device cores here after those messages (same queue), each
//!    core posts it to the session's core after the deliveries they made (same mesh order).
//! 3. **A → B `kept`/`voided`**: with every mark in, the history here either did not grow
//!    since it was written (B has everything: kept, the pids become valid on B) or did (a
//!    frame B lacks may exist: voided, B's history of the session takes a new epoch, so the
//!    client's offset fails `history_lost`). No verdict within `--recovery-handoff-wait` + 1 s is voided.
//!
//!
//! **Step 6b**, the client back on a third instance X: its CONNECT names a pid X does not
//! know, so X (before answering, at most 2 s: `Core::take_stream`) reads `P:stream:<session>`
//! and sends **X → B `take`**; B hands the history to X by name, with the same three steps
//! (B in A's part, X adopting; `P:stream:<session>` then names X), and drops its copy and its
//! watch once the verdict is given; X answers the CONNECT once the verdict is in (`none`: B
//! has nothing to give, the CONNECT goes on at once). A CONNECT on B while its adoption waits
//! for the verdict waits for it the same way.
//!
//! **On a Redis Cluster** device channels arrive over sharded subscribers (one per master),
//! not the control connection, so step 2's order does not hold as such. There the stopping
//! instance, on `watching`, publishes one mark per device of the session **to itself on the
//! device's own channel** (`SPUBLISH`, [`DEVICE_MARK`]): the device's master runs the
//! adopter's `SSUBSCRIBE` (confirmed before `watching` was sent) before the mark, so every
//! message published there before that subscription reaches this instance's subscriber of
//! that master before the mark; the link hands the mark to the device's core after them and
//! the session's core counts each device's mark once (`app::recovery::MarkOf`; on one
//! Redis each core's): a mark that comes twice never stands for another still on its way. This instance learnt the adopter watches
//! the devices before `watching` (its `+watch`es went first on the one control connection),
//! so what it takes in itself after a mark is published to the adopter. The adopter does
//! nothing differently. (`unsupported` is no longer counted: it stays in the metric, 0.)
//! Bounds and back-pressure, each counted in `hubcast_redis_adoptions_total`:
//! one history at most [`blob_max`] bytes (`too_large`, kept); what one stopping instance sends
//! at most [`SEND_BYTES`] in all, split over its cores (`over_bound`, kept): Redis buffers
//! each subscriber's pub/sub output up to its `client-output-buffer-limit` (32 MiB hard by
//! default) and would drop B's connection past it; a full command queue is `over_bound` too
//! (nothing waits); at most [`PENDING`] adoptions in flight per instance on either side
//! (`over_bound` on A, `refused` on B); on B a history is charged to `--redis-inbound-bytes`
//! until its core has installed it, and one that would pass that bound is `refused` (the
//! subscriber is not dropped for it). A history kept is written to the data dir as before
//! (step 5) and otherwise lost with the process: its client gets `recovered` false.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hashbrown::{HashMap, HashSet};

use super::conn::Conn;
use super::link::{within, Ctx, Failed, State};
use super::{Command, Inbound};
use crate::app::recovery::MarkOf;
use crate::ids::SessionId;
use crate::runtime::routing::{core_of_device, core_of_session};

/// All histories one stopping instance sends, in bytes (split evenly over its cores).
pub(super) const SEND_BYTES: usize = 16 << 20;
/// Adoptions in flight per instance, on either side.
pub(super) const PENDING: usize = 65_536;
// How long each side waits: `Settings::recovery_settle_wait` (the stopping instance, for its
// verdicts before it leaves Redis; `--recovery-handoff-wait`, 4 s by default, within
// `--shutdown-timeout` with the goodbyes and the leases' 3 s) and
// `Settings::recovery_verdict_wait` (the adopter, a second more, so a verdict given at the
// stopping side's end still arrives in time; 2 s before was too short for a loaded adopter
// to subscribe and answer, and histories were voided for nothing).

/// The largest history sent: twice `--recovery-session-bytes` (a stream is trimmed to it,
/// charged 40 bytes an entry; encoded, an entry costs 24 + its frame) and room for its pids.
pub(super) fn blob_max(session_bytes: u64) -> usize {
    (session_bytes as usize).saturating_mul(2).saturating_add(64 << 10)
}

/// Outcomes counted in `hubcast_redis_adoptions_total{outcome}`: the stopping instance's
/// (sent, kept, voided, refused by the adopter, and not sent: no_peer, too_large, over_bound,
/// unsupported), then the adopter's (received, confirmed, lost: voided or no verdict in time,
/// refused), then the stitch's: `tail_sent` (the stopping instance sent what its copy took
/// in after the hand-over) and `stitched` (the adopter joined it: its client recovers).
pub(super) const OUTCOMES: [&str; 14] = [
    "sent", "kept", "voided", "refused_by_peer", "no_peer", "too_large", "over_bound", "unsupported", "received", "confirmed", "lost", "refused", "tail_sent", "stitched",
];
pub(super) const SENT: usize = 0;
pub(super) const KEPT: usize = 1;
pub(super) const VOIDED: usize = 2;
pub(super) const REFUSED_BY_PEER: usize = 3;
pub(super) const NO_PEER: usize = 4;
pub(super) const TOO_LARGE: usize = 5;
pub(super) const OVER_BOUND: usize = 6;
pub(super) const UNSUPPORTED: usize = 7;
pub(super) const RECEIVED: usize = 8;
pub(super) const CONFIRMED: usize = 9;
pub(super) const LOST: usize = 10;
pub(super) const REFUSED: usize = 11;
pub(super) const TAIL_SENT: usize = 12;
pub(super) const STITCHED: usize = 13;

const KIND_ADOPT: u8 = b'A';
const KIND_WATCHING: u8 = b'W';
const KIND_REFUSED: u8 = b'N';
const KIND_KEPT: u8 = b'C';
const KIND_VOIDED: u8 = b'V';
/// Not kept, with the frames the history took in after the hand-over (push/stitch.rs).
const KIND_TAIL: u8 = b'S';
/// Step 6b: X asks the holder for a history, which answers with an adoption or this.
const KIND_TAKE: u8 = b'T';
const KIND_NONE: u8 = b'0';
const VERSION: u8 = 1;

/// The link's adoption state (on the Redis thread).
#[derive(Default)]
pub(super) struct Adoptions {
    /// Stopping: histories sent, to whom, and the session's devices (where the marks go).
    handing: HashMap<SessionId, (Arc<str>, Vec<Box<str>>)>,
    /// Waiting for `handing` to empty (the main thread's `Cluster::leave`).
    settled: Vec<std::sync::mpsc::Sender<()>>,
    /// Adopting: who handed each history, and the device cores that reported their watch.
    adopted: HashMap<SessionId, (Arc<str>, usize)>,
}

/// `version, kind, origin (u32 length + bytes), session u128, rest`.
fn encode(kind: u8, origin: &str, session: SessionId, rest: &[u8]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(2 + 4 + origin.len() + 16 + rest.len());
    buf.push(VERSION);
    buf.push(kind);
    buf.extend_from_slice(&(origin.len() as u32).to_le_bytes());
    buf.extend_from_slice(origin.as_bytes());
    buf.extend_from_slice(&session.0.to_le_bytes());
    buf.extend_from_slice(rest);
    buf
}

/// What [`encode`] wrote; `None` for anything else (counted undecodable by the caller).
fn decode(bytes: &[u8]) -> Option<(u8, &str, SessionId, &[u8])> {
    let (&version, rest) = bytes.split_first()?;
    if version != VERSION {
        return None;
    }
    let (&kind, rest) = rest.split_first()?;
    let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let origin = std::str::from_utf8(rest.get(4..4 + len)?).ok()?;
    let rest = rest.get(4 + len..)?;
    let session = SessionId(u128::from_le_bytes(rest.get(..16)?.try_into().ok()?));
    Some((kind, origin, session, &rest[16..]))
}

/// First byte of a Redis Cluster's step 2 mark, sent on a device's own channel (module docs,
/// "On a Redis Cluster"; a device message's first byte is its wire version, 1 or 2).
pub(super) const DEVICE_MARK: u8 = 0x55;

/// `DEVICE_MARK, to (u32 length + bytes), session u128, marks expected u32`.
fn encode_mark(to: &str, session: SessionId, n: u32) -> Vec<u8> {
    let mut buf = Vec::with_capacity(1 + 4 + to.len() + 16 + 4);
    buf.push(DEVICE_MARK);
    buf.extend_from_slice(&(to.len() as u32).to_le_bytes());
    buf.extend_from_slice(to.as_bytes());
    buf.extend_from_slice(&session.0.to_le_bytes());
    buf.extend_from_slice(&n.to_le_bytes());
    buf
}

fn decode_mark(bytes: &[u8]) -> Option<(&str, SessionId, u32)> {
    let (&kind, rest) = bytes.split_first()?;
    if kind != DEVICE_MARK {
        return None;
    }
    let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let to = std::str::from_utf8(rest.get(4..4 + len)?).ok()?;
    let rest = rest.get(4 + len..)?;
    let session = SessionId(u128::from_le_bytes(rest.get(..16)?.try_into().ok()?));
    let n = u32::from_le_bytes(rest.get(16..20)?.try_into().ok()?);
    (rest.len() == 20).then_some((to, session, n))
}

/// On a Redis Cluster, stopping, `watching` in: one mark per device of the session, each
/// `SPUBLISH`ed by this instance to itself on the device's own channel, so it comes back on
/// the shard subscriber of that device's master after every message published there before
/// the adopter's `SSUBSCRIBE` (confirmed before its `watching` was sent). By a task of its
/// own (the pub/sub task never waits on Redis); a mark that does not come back (a failed
/// command, the slot moving) leaves the verdict undecided: the adopter voids after
/// `Settings::recovery_verdict_wait`, honestly.
fn mark_on_devices(ctx: &Ctx, conn: &Conn, session: SessionId, devices: &[Box<str>]) {
    let payload = encode_mark(&ctx.o.instance, session, devices.len() as u32);
    let channels: Vec<String> = devices.iter().map(|d| ctx.key("device", d)).collect();
    let mut conn = conn.clone();
    tokio::task::spawn_local(async move {
        for channel in channels {
            let publish = redis::cmd("SPUBLISH").arg(&channel).arg(&payload).to_owned();
            match within("SPUBLISH adoption mark", publish.query_async::<i64>(&mut conn)).await {
                Ok(0) => tracing::debug!(session = %session, channel, "an adoption mark reached no subscriber here: the adopter voids the history"),
                Ok(_) => {}
                Err(reason) => tracing::debug!(session = %session, reason = %reason, "an adoption mark was not published: the adopter voids the history"),
            }
        }
    });
}

/// A Redis Cluster's mark on `device`'s channel (from the shard task, after the device's
/// messages before it were handed to their core): to the device's core, as `watching` hands
/// one to each core on one Redis; the session's core counts each device's once.
pub(super) async fn on_device_mark(ctx: &Ctx, device: &str, payload: &[u8]) {
    let Some((to, session, n)) = decode_mark(payload) else {
        ctx.stats.undecodable.fetch_add(1, Ordering::Relaxed);
        return;
    };
    if to != &*ctx.o.instance {
        return;
    }
    let _ = ctx.cores[core_of_device(device, ctx.cores.len())].send(Inbound::AdoptMark { session, cores: n as usize, device: Some(device.into()) }).await;
}

/// The adopter of `session` among the other live instances: by the session id over them in
/// order, so every instance would pick the same one.
fn adopter(instances: &HashSet<Arc<str>>, session: SessionId) -> Option<Arc<str>> {
    let mut live: Vec<&Arc<str>> = instances.iter().collect();
    if live.is_empty() {
        return None;
    }
    live.sort();
    Some(live[(session.0 % live.len() as u128) as usize].clone())
}

fn count(ctx: &Ctx, outcome: usize) {
    ctx.stats.adoptions[outcome].fetch_add(1, Ordering::Relaxed);
}

#[allow(clippy::too_many_arguments)]
/// Stopping: sends `session`'s history to its adopter and names it in `P:stream:<session>`
/// for the window left.
pub(super) async fn send(ctx: &Ctx, state: &State, conn: &mut Conn, session: SessionId, devices: Vec<Box<str>>, blob: Vec<u8>, left: Duration, to: Option<Arc<str>>) -> Result<(), Failed> {
    let to = {
        let mut s = state.borrow_mut();
        if s.adopt.handing.len() >= PENDING {
            drop(s);
            count(ctx, OVER_BOUND);
            return Ok(());
        }
        let Some(to) = to.or_else(|| adopter(&s.instances, session)) else {
            drop(s);
            count(ctx, NO_PEER);
            tracing::warn!(session = %session, "no other live instance to hand the recovery history to: its client will not recover");
            return Ok(());
        };
        // Before the publication: the answer may come before this task sees it done.
        s.adopt.handing.insert(session, (to.clone(), devices));
        to
    };
    let mut pipe = redis::pipe();
    pipe.cmd("PUBLISH").arg(ctx.key("adopt", &to)).arg(encode(KIND_ADOPT, &ctx.o.instance, session, &blob));
    pipe.cmd("SET").arg(ctx.key("stream", &session.to_string())).arg(&*to).arg("PX").arg(left.as_millis().max(1) as u64).ignore();
    let (receivers,): (i64,) = match within("PUBLISH adopt", pipe.query_async(conn)).await {
        Ok(r) => r,
        Err(reason) => {
            forget(ctx, state, session);
            count(ctx, NO_PEER);
            return Err(reason);
        }
    };
    // On a cluster a classic `PUBLISH` counts the subscribers of the node that ran it only
    // (the bus carries it to the others uncounted): 0 says nothing there, and an adopter
    // that is gone gives no verdict (`Cluster::leave` waits at most `--recovery-handoff-wait`).
    if receivers == 0 && !ctx.o.names.is_cluster() {
        forget(ctx, state, session);
        count(ctx, NO_PEER);
        tracing::warn!(session = %session, to = %to, "the instance chosen to adopt a recovery history is gone: its client will not recover");
        return Ok(());
    }
    count(ctx, SENT);
    tracing::debug!(session = %session, to = %to, bytes = blob.len(), "recovery history handed over");
    Ok(())
}

/// Step 6b, on the instance a client came back to with a pid it does not know: the holder
/// `P:stream:<session>` names is asked to hand the history over (as at a SIGTERM, to this
/// instance by name); with no holder, the CONNECT waiting for it goes on at once.
pub(super) async fn take(ctx: &Ctx, conn: &mut Conn, session: SessionId) -> Result<(), Failed> {
    let holder: Option<String> = within("GET stream", redis::cmd("GET").arg(ctx.key("stream", &session.to_string())).query_async(conn)).await?;
    match holder.filter(|h| h.as_str() != &*ctx.o.instance) {
        Some(holder) => {
            let publish = redis::cmd("PUBLISH").arg(ctx.key("adopt", &holder)).arg(encode(KIND_TAKE, &ctx.o.instance, session, &[])).to_owned();
            let receivers: i64 = within("PUBLISH take", publish.query_async(conn)).await?;
            // On a cluster 0 says nothing (see `send`): the CONNECT waits its 2 s at most.
            if receivers == 0 && !ctx.o.names.is_cluster() {
                let _ = ctx.cores[core_of_session(session, ctx.cores.len())].send(Inbound::TakeDone { session }).await;
            }
        }
        None => {
            let _ = ctx.cores[core_of_session(session, ctx.cores.len())].send(Inbound::TakeDone { session }).await;
        }
    }
    Ok(())
}

/// A handed history is settled (verdict sent, refused, or never sent).
fn forget(_ctx: &Ctx, state: &State, session: SessionId) {
    let mut s = state.borrow_mut();
    s.adopt.handing.remove(&session);
    if s.adopt.handing.is_empty() {
        for done in s.adopt.settled.drain(..) {
            let _ = done.send(());
        }
    }
}

/// `Cluster::leave`: answered once every history handed over has its verdict.
pub(super) fn settle(state: &State, done: std::sync::mpsc::Sender<()>) {
    let mut s = state.borrow_mut();
    if s.adopt.handing.is_empty() {
        let _ = done.send(());
    } else {
        s.adopt.settled.push(done);
    }
}

/// Stopping: the session's core decided (`Core::adoption_marked`); told to the adopter.
pub(super) async fn verdict(ctx: &Ctx, state: &State, conn: &mut Conn, session: SessionId, kept: bool, tail: Option<Vec<u8>>) -> Result<(), Failed> {
    let Some((to, _)) = state.borrow().adopt.handing.get(&session).cloned() else { return Ok(()) };
    // Counted before `forget` lets `Cluster::leave` go on and log the outcomes.
    let (outcome, kind) = match (kept, &tail) {
        (true, _) => (KEPT, KIND_KEPT),
        (false, Some(_)) => (TAIL_SENT, KIND_TAIL),
        (false, None) => (VOIDED, KIND_VOIDED),
    };
    count(ctx, outcome);
    forget(ctx, state, session);
    let payload = encode(kind, &ctx.o.instance, session, tail.as_deref().unwrap_or_default());
    drop(tail);
    let publish = redis::cmd("PUBLISH").arg(ctx.key("adopt", &to)).arg(payload).to_owned();
    within("PUBLISH adoption verdict", publish.query_async::<()>(conn)).await
}

/// Adopting: one device core of the session handed its watch changes over (`cores` in all;
/// 0: the history was not taken). With all of them, the link has subscribed to the devices
/// (the commands before this one): `watching` goes to the stopping instance.
pub(super) async fn watching(ctx: &Ctx, state: &State, conn: &mut Conn, session: SessionId, cores: usize) -> Result<(), Failed> {
    let origin = {
        let mut s = state.borrow_mut();
        let Some((origin, got)) = s.adopt.adopted.get_mut(&session) else { return Ok(()) };
        *got += 1;
        if cores > 0 && *got < cores {
            return Ok(());
        }
        let origin = origin.clone();
        s.adopt.adopted.remove(&session);
        origin
    };
    let kind = if cores == 0 { KIND_REFUSED } else { KIND_WATCHING };
    let publish = redis::cmd("PUBLISH").arg(ctx.key("adopt", &origin)).arg(encode(kind, &ctx.o.instance, session, &[])).to_owned();
    within("PUBLISH adoption watching", publish.query_async::<()>(conn)).await
}

/// A message on this instance's `adopt` channel (from the pub/sub task, in Redis's order,
/// after the device messages before it were handed to their cores).
pub(super) async fn on_message(ctx: &Ctx, state: &State, conn: &Conn, payload: &[u8]) {
    let Some((kind, origin, session, rest)) = decode(payload) else {
        ctx.stats.undecodable.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let cores = ctx.cores.len();
    match kind {
        KIND_ADOPT => {
            {
                let mut s = state.borrow_mut();
                if s.adopt.adopted.len() >= PENDING || s.adopt.adopted.contains_key(&session) {
                    drop(s);
                    count(ctx, REFUSED);
                    return;
                }
                s.adopt.adopted.insert(session, (origin.into(), 0));
            }
            count(ctx, RECEIVED);
            // Charged to `--redis-inbound-bytes` from here until its core has installed it
            // (its payload is charged as well while the batch that brought it is applied: for
            // that moment twice, on the safe side). Past the bound it is refused, not the
            // subscriber dropped: a history is worth less than the device messages behind it,
            // and the stopping instance hears the refusal at once.
            let charged = rest.len() as u64 + 64;
            let before = ctx.stats.inbound_bytes.fetch_add(charged, Ordering::Relaxed);
            let blob = if before + charged > ctx.o.inbound_bytes {
                ctx.stats.inbound_bytes.fetch_sub(charged, Ordering::Relaxed);
                None
            } else {
                Some(rest.to_vec())
            };
            let charged = if blob.is_some() { charged } else { 0 };
            if ctx.cores[core_of_session(session, cores)].send(Inbound::Adopt { session, blob, charged }).await.is_err() {
                ctx.stats.inbound_bytes.fetch_sub(charged, Ordering::Relaxed);
            }
        }
        KIND_WATCHING => {
            let Some(devices) = state.borrow().adopt.handing.get(&session).map(|(_, d)| d.clone()) else { return };
            if ctx.o.names.is_cluster() && !devices.is_empty() {
                mark_on_devices(ctx, conn, session, &devices);
                return;
            }
            let mut marked: Vec<usize> = devices.iter().map(|d| core_of_device(d, cores)).collect();
            marked.sort_unstable();
            marked.dedup();
            if marked.is_empty() {
                marked.push(core_of_session(session, cores));
            }
            let n = marked.len();
            for core in marked {
                let _ = ctx.cores[core].send(Inbound::AdoptMark { session, cores: n, device: None }).await;
            }
        }
        KIND_REFUSED => {
            if state.borrow().adopt.handing.contains_key(&session) {
                count(ctx, REFUSED_BY_PEER);
                forget(ctx, state, session);
                tracing::info!(session = %session, by = origin, "the adopter refused a recovery history: its client will not recover");
            }
        }
        KIND_TAKE => {
            let to: Arc<str> = origin.into();
            let _ = ctx.cores[core_of_session(session, cores)].send(Inbound::Give { session, to }).await;
        }
        KIND_NONE => {
            let _ = ctx.cores[core_of_session(session, cores)].send(Inbound::TakeDone { session }).await;
        }
        KIND_KEPT | KIND_VOIDED => {
            let _ = ctx.cores[core_of_session(session, cores)].send(Inbound::AdoptVerdict { session, kept: kind == KIND_KEPT, tail: None, charged: 0 }).await;
        }
        KIND_TAIL => {
            // Charged as a history is (above); past the bound the history is voided, not the
            // subscriber dropped.
            let charged = rest.len() as u64 + 64;
            let before = ctx.stats.inbound_bytes.fetch_add(charged, Ordering::Relaxed);
            let (tail, charged) = if before + charged > ctx.o.inbound_bytes {
                ctx.stats.inbound_bytes.fetch_sub(charged, Ordering::Relaxed);
                (None, 0)
            } else {
                (Some(rest.to_vec()), charged)
            };
            if ctx.cores[core_of_session(session, cores)].send(Inbound::AdoptVerdict { session, kept: false, tail, charged }).await.is_err() {
                ctx.stats.inbound_bytes.fetch_sub(charged, Ordering::Relaxed);
            }
        }
        _ => {
            ctx.stats.undecodable.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The stopping instance's link is gone: nothing waits for verdicts.
pub(super) fn abandon(state: &State) {
    let mut s = state.borrow_mut();
    s.adopt.handing.clear();
    for done in s.adopt.settled.drain(..) {
        let _ = done.send(());
    }
}

/// Whether `cmd` is an adoption command; handles it if so.
pub(super) async fn on_command(ctx: &Ctx, state: &State, conn: &mut Conn, command: Command) -> Result<Option<Command>, Failed> {
    match command {
        Command::Adopt { session, devices, blob, left, to } => send(ctx, state, conn, session, devices, blob, left, to).await.map(|_| None),
        Command::Take { session } => take(ctx, conn, session).await.map(|_| None),
        Command::GiveNone { session, to } => {
            let publish = redis::cmd("PUBLISH").arg(ctx.key("adopt", &to)).arg(encode(KIND_NONE, &ctx.o.instance, session, &[])).to_owned();
            within("PUBLISH adoption none", publish.query_async::<()>(conn)).await.map(|_| None)
        }
        Command::AdoptWatching { session, cores } => watching(ctx, state, conn, session, cores).await.map(|_| None),
        Command::AdoptVerdict { session, kept, tail } => verdict(ctx, state, conn, session, kept, tail).await.map(|_| None),
        Command::Settle(done) => {
            settle(state, done);
            Ok(None)
        }
        other => Ok(Some(other)),
    }
}

// ---- on the cores ---------------------------------------------------------------------------

/// Posted to a session's core by one of its device cores: a mark (see the module's step 2).
pub(super) struct Mark {
    pub session: SessionId,
    pub mark: MarkOf,
    pub cores: usize,
}

impl crate::app::mesh::CoreTask for Mark {
    fn bytes(&self) -> usize {
        32
    }
    fn run(self: Box<Self>, core: &std::rc::Rc<crate::app::Core>) {
        core.adoption_marked(self.session, self.mark, self.cores);
    }
}

/// Posted by the adopting session's core to each device core of the session after the
/// watch operations: run after them, so that core's watch changes are with the link.
pub(super) struct WatchBarrier {
    pub session: SessionId,
    pub cores: usize,
}

impl crate::app::mesh::CoreTask for WatchBarrier {
    fn bytes(&self) -> usize {
        32
    }
    fn run(self: Box<Self>, core: &std::rc::Rc<crate::app::Core>) {
        if let Some(relay) = core.relay.borrow().clone() {
            relay.adopt_watching(self.session, self.cores);
        }
    }
}

/// On the adopting session's core: loads the session, installs the history, watches its
/// devices, then one [`WatchBarrier`] per device core; voided if no verdict comes in time.
pub(super) async fn adopt_here(core: std::rc::Rc<crate::app::Core>, session: SessionId, blob: Option<Vec<u8>>, charged: u64, stats: Arc<super::Stats>) {
    // The blob's charge to `--redis-inbound-bytes`, released once the history is installed
    // (then counted in the core's recovery bytes) or refused, whichever way this returns.
    struct Charge(Arc<super::Stats>, u64);
    impl Drop for Charge {
        fn drop(&mut self) {
            self.0.inbound_bytes.fetch_sub(self.1, Ordering::Relaxed);
        }
    }
    let charge = Charge(stats.clone(), charged);
    let refuse = |why: &str| {
        core.recovery_take_done(session);
        stats.adoptions[REFUSED].fetch_add(1, Ordering::Relaxed);
        tracing::info!(session = %session, reason = why, "a recovery history handed over was not taken");
        if let Some(relay) = core.relay.borrow().clone() {
            relay.adopt_watching(session, 0);
        }
    };
    let Some(blob) = blob else { return refuse("over --redis-inbound-bytes") };
    let mut stored = None;
    let decoded = crate::store::format::decode(&blob, &mut |record| {
        if let crate::store::Record::Stream(id, Some(r)) = record {
            if id == session {
                stored = Some(r);
            }
        }
    });
    let Some(stored) = stored.filter(|_| decoded.is_ok()) else { return refuse("undecodable") };
    match core.directory().ensure(&core, session).await {
        Ok(true) => {}
        Ok(false) => return refuse("no such session"),
        Err(_) => return refuse("Redis unavailable"),
    }
    if let Err(why) = core.adopt_stream(session, stored) {
        return refuse(why);
    }
    drop(blob);
    drop(charge);
    let cores = core.cores();
    let mut marked: Vec<usize> = core.sessions.borrow().get(session).map(|r| r.devices.iter().map(|d| core_of_device(d, cores)).collect()).unwrap_or_default();
    marked.sort_unstable();
    marked.dedup();
    let n = marked.len().max(1);
    let relay = core.relay.borrow().clone();
    if marked.is_empty() || marked.contains(&core.index) {
        // This core's own watch changes went to the link within `adopt_stream`.
        if let Some(relay) = &relay {
            relay.adopt_watching(session, n);
        }
    }
    for k in marked.into_iter().filter(|k| *k != core.index) {
        core.mesh.post(k, crate::app::mesh::CoreMsg::Task(Box::new(WatchBarrier { session, cores: n })));
    }
    tracing::debug!(session = %session, "recovery history adopted; waiting for the verdict");
    monoio::time::sleep(core.settings.recovery_verdict_wait()).await;
    if core.adoption_verdict(session, false, None).is_some() {
        stats.adoptions[LOST].fetch_add(1, Ordering::Relaxed);
        tracing::info!(session = %session, "no verdict on an adopted recovery history in time: voided (its client gets recovered false)");
    }
}

/// On a device core of a handed session: the mark goes to the session's core after this
/// core's deliveries, named for this core (one Redis) or for its device (a cluster: `device`).
pub(super) fn mark(core: &std::rc::Rc<crate::app::Core>, session: SessionId, cores: usize, device: Option<Box<str>>) {
    let mark = device.map_or(MarkOf::Core(core.index), MarkOf::Device);
    let to = core_of_session(session, core.cores());
    if to == core.index {
        core.adoption_marked(session, mark, cores);
    } else {
        core.mesh.post(to, crate::app::mesh::CoreMsg::Task(Box::new(Mark { session, mark, cores })));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_garbage_does_not_decode() {
        let id = SessionId(0x1234_5678_9abc_def0);
        let bytes = encode(KIND_ADOPT, "inst-a", id, b"blob");
        assert_eq!(decode(&bytes), Some((KIND_ADOPT, "inst-a", id, &b"blob"[..])));
        assert_eq!(decode(&encode(KIND_KEPT, "b", id, &[])), Some((KIND_KEPT, "b", id, &[][..])));
        for cut in 0..2 + 4 + 6 + 16 {
            assert!(decode(&bytes[..cut]).is_none(), "{cut}");
        }
        assert!(decode(&[2, KIND_ADOPT]).is_none());
        let mark = encode_mark("inst-a", id, 3);
        assert_eq!(decode_mark(&mark), Some(("inst-a", id, 3)));
        assert!(decode_mark(&mark[..mark.len() - 1]).is_none());
        assert!(decode_mark(&bytes).is_none(), "an adoption payload is not a mark");
    }

    #[test]
    fn every_instance_picks_the_same_adopter_and_spreads_sessions() {
        let live: HashSet<Arc<str>> = ["b", "c", "d"].into_iter().map(Arc::from).collect();
        let mut again: Vec<Arc<str>> = live.iter().cloned().collect();
        again.reverse();
        let again: HashSet<Arc<str>> = again.into_iter().collect();
        let picked: HashSet<Arc<str>> = (0..60u128).map(|i| adopter(&live, SessionId(i * 7919)).unwrap()).collect();
        assert_eq!(picked.len(), 3);
        for i in 0..60u128 {
            assert_eq!(adopter(&live, SessionId(i)), adopter(&again, SessionId(i)));
        }
        assert!(adopter(&HashSet::new(), SessionId(1)).is_none());
    }
}
