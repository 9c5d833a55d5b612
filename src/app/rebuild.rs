//! Design step 11 (docs/design/recovery.md, "`kill -9` across instances", as built): a
//! client whose instance died comes back here with a pid this instance never issued and an
//! offset carrying a device part (`push/cut.rs`). Its session stream died with its instance;
//! what survives is the device side. Before its CONNECT is answered, this, the session's
//! core, asks each device core of the session's subscribed devices for the messages its ring
//! (`cluster/ring.rs`) holds after the client's cut of that device, has each turned into the
//! frames the session's subscriptions give (`DeviceTable::replay_frames`), and installs a
//! stream that continues the client's epoch and seq with them. The CONNECT then restores the
//! pid from it as from any stream: `recovered` true, the frames once, in order, before live.
//!
//! **Exactly once across the rebuild.** From the moment the asks leave, the session's
//! deliveries on this core are held ([`Held`]). Each device core answers on the mesh, after
//! every delivery it posted before it read its rings (same queue, in order), so a held
//! delivery whose `(device, key)` is in an answer was in the ring (dropped), and every other
//! came after (kept, after the rebuilt frames). Per device the rebuilt frames are in ring
//! order, which is the order the dead instance applied them (one origin, FIFO queues, checked
//! by the ring); devices are merged by key (time, then counter).
//!
//! **When it is refused** (the client gets `recovered` false, counted `history_lost`, with a
//! new pid and live data at once, as for any failed restore): another instance seen alive
//! ([`Core::peers_gone`]: its rings are not asked, not built), a device part that is absent, `x` or names
//! a device's last frame without a key, two subscribed devices with one hash, a session that
//! already has a stream or a socket here, any device a ring cannot answer for (see
//! `ring::Lost`), a throttled telemetry subscription or a twin/connection event after a cut,
//! more held than `--recovery-session-bytes`, or no answer within [`REBUILD_WAIT`].
//!
//! **What it cannot see**: messages the dead instance took in itself (`POST /ingest` there,
//! a partition it read and nobody reads again) that no other instance received are lost with
//! it, as its last values are; a rebuild cannot tell they existed unless the client's cut names
//! one of them (then `history_lost`). A partition read there is read again from its checkpoint
//! by its taker, with the same keys (step 9), so those are rebuilt.

use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::{HashMap, HashSet};

use crate::app::mesh::{CoreMsg, CoreTask};
use crate::app::Core;
use crate::ids::SessionId;
use crate::ingest::MsgKey;
use crate::push::cut::{device_hash, device_part, DevicePart};
use crate::push::stream::{parse_offset, PidEntry, SessionStream, Trimmed};
use crate::push::Delivery;

/// How long a CONNECT waits for the device cores' answers before it is answered without.
const REBUILD_WAIT: Duration = Duration::from_secs(2);

/// One device core's answer: per device, its frames in ring order; or why not.
type Answer = Result<Vec<Vec<Delivery>>, String>;

/// A rebuild in progress on the session's core.
#[derive(Default)]
pub(crate) struct Held {
    /// The session's deliveries since the asks left, in arrival order.
    deliveries: Vec<Delivery>,
    bytes: usize,
    over: bool,
    /// Answers by device core; `waiting` still out.
    answers: Vec<Answer>,
    waiting: usize,
    done: Option<futures_channel::oneshot::Sender<()>>,
}

/// The ask, run on a device core.
struct RingAsk {
    session: SessionId,
    reply_to: usize,
    devices: Vec<(Arc<str>, Option<u32>)>,
}

/// The answer, run on the session's core (posted after the device core's earlier deliveries).
struct RingAnswer {
    session: SessionId,
    answer: Answer,
}

impl CoreTask for RingAsk {
    fn bytes(&self) -> usize {
        64 + self.devices.iter().map(|(d, _)| d.len() + 24).sum::<usize>()
    }

    fn run(self: Box<Self>, core: &Rc<Core>) {
        let answer = core.ring_answer(self.session, &self.devices);
        core.mesh.post(self.reply_to, CoreMsg::Task(Box::new(RingAnswer { session: self.session, answer })));
    }
}

impl CoreTask for RingAnswer {
    fn bytes(&self) -> usize {
        match &self.answer {
            Ok(frames) => 64 + frames.iter().flatten().map(|d| d.frame.len() + 64).sum::<usize>(),
            Err(_) => 64,
        }
    }

    fn run(self: Box<Self>, core: &Rc<Core>) {
        core.rebuild_answered(self.session, self.answer);
    }
}

impl Core {
    /// On a device core: the frames `session` is owed for each of `devices` (this core's)
    /// after its cut, from the rings here.
    fn ring_answer(&self, session: SessionId, devices: &[(Arc<str>, Option<u32>)]) -> Answer {
        let Some(relay) = self.relay.borrow().clone() else { return Err("no relay".into()) };
        let table = self.devices.borrow();
        let mut out = Vec::with_capacity(devices.len());
        for (device, cut) in devices {
            let msgs = relay.ring_after(device, *cut).map_err(|why| format!("{device}: {why}"))?;
            out.push(table.replay_frames(session, device, &msgs).map_err(|why| format!("{device}: {why}"))?);
        }
        Ok(out)
    }

    /// Holds a delivery for a session being rebuilt (true: held, not delivered).
    pub(crate) fn rebuild_hold(&self, d: &Delivery) -> bool {
        let mut rebuilding = self.recovery.rebuilding.borrow_mut();
        let Some(held) = rebuilding.get_mut(&d.session) else { return false };
        held.bytes += d.frame.len() + 40;
        if held.bytes > self.recovery.session_bytes {
            held.over = true;
        } else {
            held.deliveries.push(d.clone());
        }
        true
    }

    fn rebuild_answered(&self, session: SessionId, answer: Answer) {
        let mut rebuilding = self.recovery.rebuilding.borrow_mut();
        let Some(held) = rebuilding.get_mut(&session) else { return };
        held.answers.push(answer);
        held.waiting = held.waiting.saturating_sub(1);
        if held.waiting == 0 {
            if let Some(done) = held.done.take() {
                let _ = done.send(());
            }
        }
    }

    /// Design step 11: whether a CONNECT restoring `pid` with `offset` on `session` should
    /// have its history rebuilt here first: recovery and a relay on, the pid unknown here and
    /// the offset carrying a device part.
    pub fn rebuild_wanted(&self, session: SessionId, pid: &str, offset: &str) -> bool {
        self.recovery.cuts.get()
            && self.recovery_elsewhere(session, pid)
            && !self.recovery.adopting.borrow().contains_key(&session)
            && !matches!(device_part(offset), None | Some(DevicePart::Absent))
    }

    /// Rebuilds `session`'s history for a client restoring `pid` after `offset` (module
    /// docs). Installs a stream continuing the offset with what the rings hold and the pid,
    /// or, when refused, the pid with no history (its restore then fails `history_lost`).
    pub async fn rebuild_stream(self: &Rc<Self>, session: SessionId, pid: &str, offset: &str) {
        let outcome = match self.peers_gone().await.and_then(|()| self.rebuild_asks(session, offset)) {
            Ok(asks) => self.rebuild_gather(session, asks).await,
            Err(why) => Err(why),
        };
        let outcome = outcome.and_then(|frames| self.rebuild_install(session, pid, offset, frames));
        if let Err(why) = outcome {
            tracing::debug!(session = %session, reason = %why, "history not rebuilt from device rings");
            self.rebuild_refused(session, pid);
        }
    }

    /// Waits until every other instance that still has a presence in Redis is known dead
    /// (its presence not renewed for a heartbeat and a second: it missed a renewal) or alive
    /// (seen renewing it between two probes: refused, its rings are not asked). The client of
    /// a `kill -9` is usually back within a second, long before the dead instance's presence
    /// expires (`--lease-ttl`), so counting live instances would refuse it; a probe every
    /// half heartbeat decides within about a heartbeat and a second, by Redis's clock.
    async fn peers_gone(&self) -> Result<(), String> {
        let relay = self.relay.borrow().clone().ok_or("no relay")?;
        let heartbeat = relay.heartbeat();
        let dead_after = (heartbeat + Duration::from_secs(1)).as_millis() as i64;
        let deadline = Instant::now() + Duration::from_secs(self.settings.config.lease_ttl) + heartbeat * 2;
        let mut seen: HashMap<Box<str>, i64> = HashMap::new();
        loop {
            let asked = relay.peers_staleness().ok_or("the Redis command queue is full")?;
            let stale = asked.await.map_err(|_| "no answer from the Redis thread".to_string())??;
            let mut undecided = 0;
            for (id, ms) in stale {
                let Some(ms) = ms else { continue }; // its presence went: dead
                if seen.get(&id).is_some_and(|before| ms < *before) {
                    return Err(format!("instance {id} is alive (its rings are not asked)"));
                }
                if ms <= dead_after {
                    undecided += 1;
                }
                seen.insert(id, ms);
            }
            if undecided == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err("another instance's presence is neither renewed nor gone".into());
            }
            monoio::time::sleep(heartbeat / 2).await;
        }
    }

    /// The cuts per device core (refusing what cannot be rebuilt), and the holding started.
    fn rebuild_asks(&self, session: SessionId, offset: &str) -> Result<Vec<(usize, Vec<(Arc<str>, Option<u32>)>)>, String> {
        if self.recovery.rebuilding.borrow().contains_key(&session) {
            return Err("another CONNECT of the session is rebuilding it".into());
        }
        let part = match device_part(offset) {
            Some(DevicePart::Cuts(c)) => DevicePart::Cuts(c),
            Some(DevicePart::Overflow) => return Err("the offset names more than 8 devices".into()),
            _ => return Err("no device part".into()),
        };
        let devices: Vec<Arc<str>> = {
            let sessions = self.sessions.borrow();
            let record = sessions.get(session).ok_or("no such session here")?;
            if !record.sockets.is_empty() || record.recovery.as_ref().is_some_and(|r| r.stream.is_some()) {
                return Err("the session has a stream or a socket here".into());
            }
            record.devices.iter().map(Arc::from).collect()
        };
        let mut hashes = HashSet::new();
        let mut per_core: HashMap<usize, Vec<(Arc<str>, Option<u32>)>> = HashMap::new();
        for device in devices {
            if !hashes.insert(device_hash(&device)) {
                return Err("two subscribed devices share a hash".into());
            }
            let cut = match part.cut_of(&device) {
                None => None,
                Some(Some(k)) => Some(*k),
                Some(None) => return Err(format!("{device}: its last frame had no key")),
            };
            per_core.entry(self.device_core(&device)).or_default().push((device, cut));
        }
        self.recovery.rebuilding.borrow_mut().insert(session, Held { waiting: per_core.len(), ..Default::default() });
        Ok(per_core.into_iter().collect())
    }

    /// Sends the asks and waits for every answer; the frames in replay order, or why not.
    async fn rebuild_gather(self: &Rc<Self>, session: SessionId, asks: Vec<(usize, Vec<(Arc<str>, Option<u32>)>)>) -> Result<Vec<Delivery>, String> {
        let (tx, rx) = futures_channel::oneshot::channel();
        if let Some(held) = self.recovery.rebuilding.borrow_mut().get_mut(&session) {
            held.done = Some(tx);
        }
        for (core, devices) in asks {
            if core == self.index {
                // This core's own deliveries were handed out synchronously: none in flight.
                let answer = self.ring_answer(session, &devices);
                self.rebuild_answered(session, answer);
            } else {
                self.mesh.post(core, CoreMsg::Task(Box::new(RingAsk { session, reply_to: self.index, devices })));
            }
        }
        let timed_out = {
            let waiting = self.recovery.rebuilding.borrow().get(&session).is_some_and(|h| h.waiting > 0);
            waiting && monoio::time::timeout(REBUILD_WAIT, rx).await.is_err()
        };
        let held = self.recovery.rebuilding.borrow_mut().remove(&session).ok_or("the rebuild was dropped")?;
        if timed_out {
            return Err("no answer from every device core in time".into());
        }
        if held.over {
            return Err("more delivered meanwhile than --recovery-session-bytes".into());
        }
        let mut per_device: Vec<std::collections::VecDeque<Delivery>> = Vec::new();
        for answer in held.answers {
            per_device.extend(answer?.into_iter().filter(|v| !v.is_empty()).map(Into::into));
        }
        let rebuilt: HashSet<(u32, MsgKey)> =
            per_device.iter().flatten().map(|d| (device_hash(&d.device), d.key)).collect();
        // Merged by key (time, then counter: one ingress thread's messages in the order it
        // took them in), each device's frames in ring order.
        let mut frames = Vec::with_capacity(per_device.iter().map(|v| v.len()).sum());
        while let Some(i) = (0..per_device.len())
            .filter(|i| !per_device[*i].is_empty())
            .min_by_key(|i| per_device[*i].front().map(|d| d.key))
        {
            frames.extend(per_device[i].pop_front());
        }
        // What arrived meanwhile and was not in a ring follows.
        let (from_rings, held_count) = (frames.len(), held.deliveries.len());
        frames.extend(held.deliveries.into_iter().filter(|d| !rebuilt.contains(&(device_hash(&d.device), d.key))));
        tracing::debug!(session = %session, from_rings, held = held_count, held_kept = frames.len() - from_rings, "device rings answered");
        Ok(frames)
    }

    /// The stream continuing the client's offset with `frames`, and its pid.
    fn rebuild_install(&self, session: SessionId, pid: &str, offset: &str, frames: Vec<Delivery>) -> Result<(), String> {
        let window = self.recovery.window.ok_or("recovery is off")?;
        let (epoch, seq) = parse_offset(offset).ok_or("not an offset")?;
        let part = device_part(offset).ok_or("not an offset")?;
        let now = Instant::now();
        let mut stream = SessionStream::continuing(epoch, seq, self.recovery.total.clone(), now);
        stream.cuts = crate::push::cut::Cuts::from_part(&part);
        let mut trimmed = Trimmed::default();
        for d in &frames {
            stream.push(&d.frame, now, window, self.recovery.session_bytes, &mut trimmed);
            stream.cuts.note_only(&d.device, d.key);
        }
        if !trimmed.is_empty() {
            return Err("the rebuilt history is over --recovery-session-bytes".into());
        }
        let mut sessions = self.sessions.borrow_mut();
        let record = sessions.get_mut(session).ok_or("the session went")?;
        let recovery = record.recovery.get_or_insert_with(Default::default);
        if recovery.stream.is_some() {
            return Err("a stream was made meanwhile".into());
        }
        recovery.stream = Some(stream);
        recovery.pids.push(PidEntry {
            pid: pid.into(),
            sid: crate::ids::random_token(15).into(),
            socket: None,
            since: now,
            epoch,
            start_seq: seq,
        });
        self.recovery.streamed.borrow_mut().insert(session);
        self.recovery.deadlines.borrow_mut().push(std::cmp::Reverse((now + window, session)));
        drop(sessions);
        self.arm_clock();
        tracing::debug!(session = %session, frames = frames.len(), "history rebuilt from device rings");
        Ok(())
    }

    /// The pid with no history: its restore fails `history_lost` (not `unknown_pid`: it was
    /// issued, and what it missed cannot be given).
    fn rebuild_refused(&self, session: SessionId, pid: &str) {
        let mut sessions = self.sessions.borrow_mut();
        let Some(record) = sessions.get_mut(session) else { return };
        let recovery = record.recovery.get_or_insert_with(Default::default);
        if recovery.pids.iter().any(|p| &*p.pid == pid) {
            return;
        }
        recovery.pids.push(PidEntry {
            pid: pid.into(),
            sid: crate::ids::random_token(15).into(),
            socket: None,
            since: Instant::now(),
            epoch: 0,
            start_seq: 0,
        });
    }
}
