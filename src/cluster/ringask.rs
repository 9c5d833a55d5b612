//! Design step 11 with other live instances (docs/design/recovery.md, "asking the others'
//! rings"): the instance rebuilding a killed instance's client asks every other instance for
//! what its device rings (`ring.rs`) hold of the session's devices after the client's cuts.
//!
//! **Channels.** The ask goes on `P:read` (every instance subscribes to it), the answers on
//! the asker's `P:answer:<id>`; each payload's first byte ([`ASK`], [`ANSWER`]) tells it
//! from a read's (version byte 1). An instance before this step counts the ask undecodable
//! and does not answer: the asker's deadline refuses the rebuild (honest, `history_lost`).
//! Nothing here runs unless a client comes back with a pid another instance issued and an
//! offset naming devices: no Redis traffic for a device nobody watches, none with recovery
//! off.
//!
//! **Order (why exactly once holds).** The asker sends one ask per device core of its own,
//! from that core, after the core's watch changes are with the link (`Relay::rings_ask`): so
//! its `SUBSCRIBE` and `+watch` go before the ask on one connection. Each instance gets the
//! watch before the ask (one subscriber connection, in order), routes the ask to each device
//! core holding asked devices (the queue of their messages), and that core reads its rings,
//! publishes what it took in before (its outbox flushed) and only then its answer, on one
//! command connection. On the asker the answer is routed to the asking core behind every
//! device message received before it (`link`: messages flushed to the cores first), and that
//! core posts the frames to the session's core behind the deliveries it made of them. So a
//! delivery the session's core holds meanwhile (`app/rebuild.rs`, `Held`) either is in an
//! answer (dropped) or came after it (kept, after the rebuilt frames).
//!
//! **On a Redis Cluster** (design step 11 h) device messages arrive over sharded subscribers
//! (one per master) and the answer on `P:answer:<id>` over the control subscriber, so the
//! order above would not hold between them: each device is answered alone (`of` = the
//! devices asked), on **its own channel** ([`encode_on_device`], `SPUBLISH`), behind the
//! answering core's outbox, so it reaches the asker on the one connection that carries that
//! device's messages, after those published before it. The ask keeps its order as it is:
//! the asker's `SSUBSCRIBE`s are confirmed before its `+watch`, and `+watch` and the ask go
//! on one connection through the control master.
//!
//! **Bounds and policy.** An answer is at most `adopt::blob_max` bytes (twice
//! `--recovery-session-bytes` + 64 KiB, as an adopted history): past it the answering core
//! sends a refusal instead (the asker refuses the rebuild). On the asker an answer is
//! charged to `--redis-inbound-bytes` from its arrival until its core has read it, and one
//! that would pass that bound is replaced by a refusal (the subscriber is not dropped for
//! it). An ask names at most [`MAX_DEVICES`] devices (a session's offset names at most 8).
//! Answers nobody waits for (late, or to an ask that gave up) are dropped by the session's
//! core.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use hashbrown::HashMap;

use super::link::Ctx;
use super::wire::{decode_message, encode_message};
use super::Inbound;
use crate::app::relay::RingMiss;
use crate::ids::SessionId;
use crate::runtime::routing::core_of_device;
use crate::shard::devices::{Decided, Kept};

/// First byte of an ask (a read's is 1).
pub const ASK: u8 = 0x52;
/// First byte of an answer (a read's answer's is 1).
pub const ANSWER: u8 = 0x53;
/// Devices one ask names at most.
pub const MAX_DEVICES: usize = 64;
/// First byte of an answer on a Redis Cluster, sent on the device's own channel
/// ([`encode_on_device`]; a device message's first byte is its wire version, 1 or 2).
pub const DEVICE_ANSWER: u8 = 0x54;

/// What one answering core says of one device.
#[derive(Debug, Clone)]
pub enum Part {
    /// What followed the cut, oldest first, with what was decided for each (`ring.rs`).
    Msgs(Vec<Kept>),
    Miss(RingMiss),
}

fn put_str(buf: &mut Vec<u8>, s: &[u8]) {
    buf.extend_from_slice(&(s.len() as u32).to_le_bytes());
    buf.extend_from_slice(s);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (out, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(out)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.bytes()?).ok()
    }
    fn session(&mut self) -> Option<SessionId> {
        Some(SessionId(u128::from_le_bytes(self.take(16)?.try_into().ok()?)))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// A kept message: `message`, then how long before the answer it was applied (µs, u64),
/// then its decision: 0 from the message, 1 twin `at` (i64) `doc`, 2 connection `at` (i64)
/// `connected` (u8), 3 nothing, 4 held.
fn put_kept(buf: &mut Vec<u8>, from: &str, k: &Kept, now: std::time::Instant) {
    put_str(buf, &encode_message(from, 0, &k.msg));
    buf.extend_from_slice(&(now.saturating_duration_since(k.at).as_micros() as u64).to_le_bytes());
    match &k.decided {
        Decided::FromMessage => buf.push(0),
        Decided::Twin { at, doc } => {
            buf.push(1);
            buf.extend_from_slice(&at.to_le_bytes());
            put_str(buf, doc.as_bytes());
        }
        Decided::Connection { at, connected } => {
            buf.push(2);
            buf.extend_from_slice(&at.to_le_bytes());
            buf.push(*connected as u8);
        }
        Decided::Nothing => buf.push(3),
        Decided::Held => buf.push(4),
    }
}

fn read_kept(r: &mut Reader<'_>, now: std::time::Instant) -> Option<Kept> {
    let (_, _, msg) = decode_message(r.bytes()?)?;
    let ago = std::time::Duration::from_micros(r.u64()?);
    let decided = match r.u8()? {
        0 => Decided::FromMessage,
        1 => {
            let at = r.u64()? as i64;
            Decided::Twin { at, doc: r.str()?.into() }
        }
        2 => {
            let at = r.u64()? as i64;
            Decided::Connection { at, connected: r.u8()? == 1 }
        }
        3 => Decided::Nothing,
        4 => Decided::Held,
        _ => return None,
    };
    Some(Kept { msg, decided, at: now.checked_sub(ago).unwrap_or(now) })
}

/// `ASK origin session reply_core n (device has_cut cut)*`.
pub fn encode_ask(origin: &str, session: SessionId, reply_core: u32, devices: &[(Arc<str>, Option<u32>)]) -> Vec<u8> {
    let mut buf = vec![ASK];
    put_str(&mut buf, origin.as_bytes());
    buf.extend_from_slice(&session.0.to_le_bytes());
    buf.extend_from_slice(&reply_core.to_le_bytes());
    buf.extend_from_slice(&(devices.len() as u32).to_le_bytes());
    for (device, cut) in devices {
        put_str(&mut buf, device.as_bytes());
        buf.push(cut.is_some() as u8);
        buf.extend_from_slice(&cut.unwrap_or(0).to_le_bytes());
    }
    buf
}

/// Devices and their cuts.
type DeviceCuts = Vec<(Arc<str>, Option<u32>)>;

/// An ask: the asker, the session, the asker's core to answer, the devices and their cuts.
pub type Asked<'a> = (&'a str, SessionId, u32, DeviceCuts);

pub fn decode_ask(bytes: &[u8]) -> Option<Asked<'_>> {
    let mut r = Reader(bytes);
    if r.u8()? != ASK {
        return None;
    }
    let origin = r.str()?;
    let session = r.session()?;
    let reply_core = r.u32()?;
    let n = r.u32()? as usize;
    if n > MAX_DEVICES {
        return None;
    }
    let mut devices = Vec::with_capacity(n);
    for _ in 0..n {
        let device: Arc<str> = r.str()?.into();
        let has = r.u8()?;
        let cut = r.u32()?;
        devices.push((device, (has == 1).then_some(cut)));
    }
    r.0.is_empty().then_some((origin, session, reply_core, devices))
}

/// `ANSWER from session reply_core of status …`: `of` answers from `from` make its whole
/// answer (one per device core there holding asked devices). Status 0: `n (device kind …)*`
/// (kind 0: `n (kept)*`, each message as `wire::encode_message` writes it with its age and
/// decision, `put_kept`; 1: not held, `origin`;
/// 2: lost, why); status 1: refused, why.
pub fn encode_answer(from: &str, session: SessionId, reply_core: u32, of: u32, parts: &Result<Vec<(Arc<str>, Part)>, String>) -> Vec<u8> {
    let now = std::time::Instant::now();
    let mut buf = vec![ANSWER];
    put_str(&mut buf, from.as_bytes());
    buf.extend_from_slice(&session.0.to_le_bytes());
    buf.extend_from_slice(&reply_core.to_le_bytes());
    buf.extend_from_slice(&of.to_le_bytes());
    match parts {
        Err(why) => {
            buf.push(1);
            put_str(&mut buf, why.as_bytes());
        }
        Ok(parts) => {
            buf.push(0);
            buf.extend_from_slice(&(parts.len() as u32).to_le_bytes());
            for (device, part) in parts {
                put_str(&mut buf, device.as_bytes());
                match part {
                    Part::Msgs(msgs) => {
                        buf.push(0);
                        buf.extend_from_slice(&(msgs.len() as u32).to_le_bytes());
                        for k in msgs {
                            put_kept(&mut buf, from, k, now);
                        }
                    }
                    Part::Miss(RingMiss::NotHeld { origin }) => {
                        buf.push(1);
                        buf.push(*origin as u8);
                    }
                    Part::Miss(RingMiss::Lost(why)) => {
                        buf.push(2);
                        put_str(&mut buf, why.as_bytes());
                    }
                }
            }
        }
    }
    buf
}

/// A Redis Cluster's answer for one device (docs/design/recovery.md step 11 h): `answer` (one
/// device's [`encode_answer`]) for instance `to`, published on the device's channel by
/// `origin` at `seq` of the answering core's device messages, so that it reaches `to` behind
/// every message of the device published before it (one master, one subscriber) and a copy
/// published again after a slot move is dropped as a message would be.
pub fn encode_on_device(to: &str, origin: &str, seq: u64, answer: &[u8]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(answer.len() + to.len() + origin.len() + 17);
    buf.push(DEVICE_ANSWER);
    put_str(&mut buf, to.as_bytes());
    put_str(&mut buf, origin.as_bytes());
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(answer);
    buf
}

/// `to`, `origin`, `seq` and the answer of [`encode_on_device`]'s payload.
pub fn decode_on_device(bytes: &[u8]) -> Option<(&str, &str, u64, &[u8])> {
    let mut r = Reader(bytes);
    if r.u8()? != DEVICE_ANSWER {
        return None;
    }
    let to = r.str()?;
    let origin = r.str()?;
    let seq = u64::from_le_bytes(r.take(8)?.try_into().ok()?);
    Some((to, origin, seq, r.0))
}

/// An answer's head: who answered, the session, the asking core.
pub fn answer_head(bytes: &[u8]) -> Option<(&str, SessionId, u32)> {
    let mut r = Reader(bytes);
    if r.u8()? != ANSWER {
        return None;
    }
    Some((r.str()?, r.session()?, r.u32()?))
}

/// A whole answer: who, the session, `of`, and the parts or why not.
pub type Answered = (Box<str>, SessionId, u32, Result<Vec<(Arc<str>, Part)>, String>);

pub fn decode_answer(bytes: &[u8]) -> Option<Answered> {
    let now = std::time::Instant::now();
    let mut r = Reader(bytes);
    if r.u8()? != ANSWER {
        return None;
    }
    let from: Box<str> = r.str()?.into();
    let session = r.session()?;
    let _reply_core = r.u32()?;
    let of = r.u32()?;
    let parts = match r.u8()? {
        1 => Err(r.str()?.to_string()),
        0 => {
            let n = r.u32()? as usize;
            if n > MAX_DEVICES {
                return None;
            }
            let mut parts = Vec::with_capacity(n);
            for _ in 0..n {
                let device: Arc<str> = r.str()?.into();
                let part = match r.u8()? {
                    0 => {
                        let k = r.u32()? as usize;
                        let mut msgs = Vec::with_capacity(k.min(4096));
                        for _ in 0..k {
                            let kept = read_kept(&mut r, now)?;
                            if *kept.msg.device_id != *device {
                                return None;
                            }
                            msgs.push(kept);
                        }
                        Part::Msgs(msgs)
                    }
                    1 => Part::Miss(RingMiss::NotHeld { origin: r.u8()? == 1 }),
                    2 => Part::Miss(RingMiss::Lost(r.str()?.to_string())),
                    _ => return None,
                };
                parts.push((device, part));
            }
            Ok(parts)
        }
        _ => return None,
    };
    r.0.is_empty().then_some((from, session, of, parts))
}

/// On `P:read`, another instance's ask: to each device core here holding asked devices, in
/// the queue of their messages (after those before it: the caller flushed them).
pub(super) async fn on_ask(ctx: &Ctx, payload: &[u8]) {
    let Some((origin, session, reply_core, devices)) = decode_ask(payload) else {
        ctx.stats.undecodable.fetch_add(1, Ordering::Relaxed);
        return;
    };
    if origin == &*ctx.o.instance {
        return;
    }
    let cores = ctx.cores.len();
    let mut per_core: HashMap<usize, DeviceCuts> = HashMap::new();
    for (device, cut) in devices {
        per_core.entry(core_of_device(&device, cores)).or_default().push((device, cut));
    }
    // On a cluster each device is answered alone, on its own channel (module docs of
    // `encode_on_device`): as many answers as devices.
    let of = if ctx.o.names.is_cluster() { per_core.values().map(Vec::len).sum::<usize>() } else { per_core.len() } as u32;
    let to: Arc<str> = origin.into();
    for (core, devices) in per_core {
        let _ = ctx.cores[core].send(Inbound::RingsAsk { to: to.clone(), session, reply_core, of, devices }).await;
    }
}

/// On `P:answer:<this>`, an answer to this instance's ask: to the asking core, charged to
/// `--redis-inbound-bytes` until it has read it (past the bound: a refusal in its place).
pub(super) async fn on_answer(ctx: &Ctx, payload: &[u8]) {
    let Some((from, session, reply_core)) = answer_head(payload) else {
        ctx.stats.undecodable.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let Some(core) = ctx.cores.get(reply_core as usize) else { return };
    let charged = payload.len() as u64;
    let before = ctx.stats.inbound_bytes.fetch_add(charged, Ordering::Relaxed);
    let (payload, charged) = if before + charged > ctx.o.inbound_bytes {
        ctx.stats.inbound_bytes.fetch_sub(charged, Ordering::Relaxed);
        (encode_answer(from, session, reply_core, 1, &Err("over --redis-inbound-bytes here".into())), 0)
    } else {
        (payload.to_vec(), charged)
    };
    if core.send(Inbound::RingsAnswer { payload, charged }).await.is_err() {
        ctx.stats.inbound_bytes.fetch_sub(charged, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::IngestMessage;

    fn msg(device: &str, n: u64) -> Kept {
        Kept { msg: IngestMessage::ring_fixture(device, n), decided: Decided::FromMessage, at: std::time::Instant::now() }
    }

    #[test]
    fn asks_and_answers_round_trip_and_garbage_is_refused() {
        let session = SessionId(7);
        let devices: Vec<(Arc<str>, Option<u32>)> = vec![("d1".into(), Some(42)), ("d2".into(), None)];
        let ask = encode_ask("b", session, 1, &devices);
        assert_eq!(decode_ask(&ask), Some(("b", session, 1, devices.clone())));
        assert_eq!(decode_ask(&ask[..ask.len() - 1]), None);
        assert_eq!(decode_ask(&[1, 2, 3]), None, "a read's payload is not an ask");
        let parts = Ok(vec![
            ("d1".into(), Part::Msgs(vec![msg("d1", 1), Kept { decided: Decided::Twin { at: 7, doc: "{\"a\":1}".into() }, ..msg("d1", 2) }, Kept { decided: Decided::Connection { at: -3, connected: true }, ..msg("d1", 3) }, Kept { decided: Decided::Held, ..msg("d1", 4) }])),
            ("d2".into(), Part::Miss(RingMiss::NotHeld { origin: true })),
            ("d3".into(), Part::Miss(RingMiss::Lost("Gap".into()))),
        ]);
        let answer = encode_answer("c", session, 1, 2, &parts);
        assert_eq!(answer_head(&answer), Some(("c", session, 1)));
        let (from, s, of, got) = decode_answer(&answer).expect("decodes");
        assert_eq!((&*from, s, of), ("c", session, 2));
        let got = got.unwrap();
        let Part::Msgs(msgs) = &got[0].1 else { panic!("{got:?}") };
        assert_eq!(msgs.iter().map(|m| (m.msg.key, m.msg.body.clone())).collect::<Vec<_>>(), (1..=4).map(|n| (msg("d1", n).msg.key, msg("d1", n).msg.body)).collect::<Vec<_>>());
        let decided: Vec<&Decided> = msgs.iter().map(|k| &k.decided).collect();
        assert_eq!(decided, [&Decided::FromMessage, &Decided::Twin { at: 7, doc: "{\"a\":1}".into() }, &Decided::Connection { at: -3, connected: true }, &Decided::Held]);
        assert!(matches!(&got[1].1, Part::Miss(RingMiss::NotHeld { origin: true })));
        assert!(matches!(&got[2].1, Part::Miss(RingMiss::Lost(why)) if why == "Gap"));
        let refused = encode_answer("c", session, 0, 1, &Err("over".into()));
        assert!(matches!(decode_answer(&refused).unwrap().3, Err(why) if why == "over"));
        assert!(decode_answer(&answer[..answer.len() - 3]).is_none());
        // A message of another device inside a device's part is refused.
        let wrong = encode_answer("c", session, 1, 1, &Ok(vec![("d1".into(), Part::Msgs(vec![msg("d9", 1)]))]));
        assert!(decode_answer(&wrong).is_none());
        // A cluster's answer on a device channel: addressed, sequenced, the answer inside.
        let on = encode_on_device("b", "c", 9, &answer);
        assert_eq!(decode_on_device(&on), Some(("b", "c", 9, &answer[..])));
        assert_eq!(decode_on_device(&on[..10]), None);
        assert!(decode_on_device(&encode_message("c", 1, &msg("d1", 1).msg)).is_none(), "a device message is not an answer");
    }
}
