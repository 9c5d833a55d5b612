//! Design step 11 (docs/design/recovery.md, "`kill -9` across instances", as built): a
//! client whose instance died comes back here with a pid this instance never issued and an
//! offset carrying a device part (`push/cut.rs`). Its session stream died with its instance;
//! what survives is the device side. Before its CONNECT is answered, this, the session's
//! core, asks each device core of the session's subscribed devices for the messages its ring
//! (`cluster/ring.rs`) holds after the client's cut of that device (and, with other instances
//! alive, each of them: below), has each turned into the
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
//! **Other live instances** (`cluster/ringask.rs`): the probe ([`Core::peers_alive`]) tells
//! the dead from the live; with any alive, this instance first watches the session's devices
//! (so each live instance publishes them here from before it reads its rings), and each
//! device core here, after its watch changes, asks every other instance for its rings of its
//! devices too. Their answers reach the session's core through the device core that asked,
//! behind the deliveries of what the answering instance published before it, so [`Held`]
//! works across instances as on one. Per device, the holders' parts are merged
//! ([`merge_holders`]): the instance that takes the device in and the replicas it published
//! to hold the same messages in the same order, so one list is taken and the others must be
//! within it (deduplicated by `(device, key)`); a holder lacking the cut is fine unless the
//! device is taken in there.
//!
//! **When it is refused** (the client gets `recovered` false, counted `history_lost`, with a
//! new pid and live data at once, as for any failed restore): a live instance that does not
//! answer within [`REBUILD_WAIT`] or answers a refusal (its answer over the bound, its Redis
//! queue full), a device part that is absent, `x` or names
//! a device's last frame without a key, two subscribed devices with one hash, a session that
//! already has a stream or a socket here, any device no holder has the cut of, or whose
//! taker-in lacks it, or that a ring cannot answer for (see `ring::Lost`), two holders
//! disagreeing, throttled telemetry the throttle's re-run cannot make exactly
//! (`shard/devices/replay.rs`), a twin change held for a hub read for a
//! twin subscriber (twin changes and connection events are otherwise rebuilt as the live path
//! decided them where they were applied: `shard/devices/replay.rs`),
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
use crate::app::relay::RingMiss;
use crate::metrics::CoreMetrics;
use crate::push::Delivery;
use crate::shard::devices::{Kept, Lead};

/// Indices in `metrics::RING_ASKS`.
const ASK_SENT: usize = 0;
const ASK_UNSENT: usize = 1;
const ASK_ANSWERED: usize = 2;
const ASK_REFUSED: usize = 3;
const ASK_TIMED_OUT: usize = 4;

/// How long a CONNECT waits for the answers (device cores here and other live instances)
/// before it is answered without.
const REBUILD_WAIT: Duration = Duration::from_secs(2);

/// One device's part of an answer: its frames in ring order, or why its ring lacks them.
enum Part {
    /// The frames, and whether the session's throttle of the device was run again here.
    Frames(Vec<Delivery>, bool),
    Miss(RingMiss),
}

/// A device and the client's cut of it (`None`: it had no frame of the device).
type DeviceCut = (Arc<str>, Option<u32>);

/// Devices and the client's cut of each.
type DeviceCuts = Vec<DeviceCut>;

/// Per (instance, asking core here): answers got, out of how many.
type RemoteAnswers = HashMap<(Box<str>, usize), (u32, u32)>;

/// The asks per device core here.
type Asks = Vec<(usize, DeviceCuts)>;

/// What one holder's rings gave per device: the messages after the cut (with what was
/// decided for each there), or why not.
pub type RingGot = Vec<(Arc<str>, Result<Vec<Kept>, RingMiss>)>;

/// One answer (a device core here, or one of `of` from another instance), or why not.
type Answer = Result<Vec<(Arc<str>, Part)>, String>;

/// Per device, this instance's ring entries from a quiet point (or just the cut) through
/// the cut, and whether they start at one (`Rings::lead`).
type Leads = HashMap<Arc<str>, (Vec<Kept>, bool)>;

/// Who answered: a device core here, or instance `from` for the ask of core `core` here (one
/// of `of` answers).
enum From {
    Here,
    Peer { from: Box<str>, core: usize, of: u32 },
    /// The ask of the other instances could not be sent: nothing more to wait for.
    Unsent,
}

/// A rebuild in progress on the session's core.
#[derive(Default)]
pub(crate) struct Held {
    /// The session's deliveries since the asks left, in arrival order.
    deliveries: Vec<Delivery>,
    bytes: usize,
    over: bool,
    answers: Vec<Answer>,
    /// Device cores here still to answer.
    waiting: usize,
    /// The other instances asked (seen alive), and the cores here that asked them.
    peers: Vec<Box<str>>,
    ask_cores: Vec<usize>,
    /// Per (instance, asking core): answers got, out of how many.
    remote: RemoteAnswers,
    /// An ask could not be sent (refused: no need to wait for the rest).
    unsent: bool,
    /// Per device answered here: how many deliveries were held when its answer came (with
    /// throttling, the session's telemetry of it held before then was made by this
    /// instance's own throttle state, which the answer's re-run replaced).
    answered_at: HashMap<Arc<str>, usize>,
    done: Option<futures_channel::oneshot::Sender<()>>,
}

impl Held {
    fn complete(&self) -> bool {
        self.unsent
            || self.waiting == 0
            && self.peers.iter().all(|peer| {
                self.ask_cores.iter().all(|core| self.remote.get(&(peer.clone(), *core)).is_some_and(|(got, of)| got >= of))
            })
    }
}

/// The ask, run on a device core here.
struct RingAsk {
    session: SessionId,
    reply_to: usize,
    devices: DeviceCuts,
    /// Other instances are alive: ask them too, from this core.
    remote: bool,
}

/// The answer, run on the session's core (posted after the device core's earlier deliveries).
struct RingAnswer {
    session: SessionId,
    answer: Answer,
    from: From,
}

impl CoreTask for RingAsk {
    fn bytes(&self) -> usize {
        64 + self.devices.iter().map(|(d, _)| d.len() + 24).sum::<usize>()
    }

    fn run(self: Box<Self>, core: &Rc<Core>) {
        core.ring_ask_here(self.session, self.reply_to, &self.devices, self.remote);
    }
}

fn answer_bytes(answer: &Answer) -> usize {
    match answer {
        Ok(parts) => {
            64 + parts
                .iter()
                .map(|(d, p)| match p {
                    Part::Frames(f, _) => d.len() + f.iter().map(|d| d.frame.len() + 64).sum::<usize>(),
                    Part::Miss(_) => d.len() + 32,
                })
                .sum::<usize>()
        }
        Err(_) => 64,
    }
}

impl CoreTask for RingAnswer {
    fn bytes(&self) -> usize {
        answer_bytes(&self.answer)
    }

    fn run(self: Box<Self>, core: &Rc<Core>) {
        core.rebuild_answered(self.session, self.answer, self.from);
    }
}

impl Core {
    /// On a device core here: the answer of this core's rings, then (`remote`) the ask of
    /// the other instances for the same devices, after this core's watch changes.
    fn ring_ask_here(self: &Rc<Self>, session: SessionId, reply_to: usize, devices: &[DeviceCut], remote: bool) {
        let answer = self.ring_answer(session, devices);
        self.post_answer(session, reply_to, answer, From::Here);
        if remote {
            // The answers come back to this core (it asked), then go on to the session's.
            let sent = self.relay.borrow().as_ref().is_some_and(|relay| relay.rings_ask(session, self.index, devices));
            CoreMetrics::count(&self.metrics.ring_asks, if sent { ASK_SENT } else { ASK_UNSENT });
            if !sent {
                // Not sent: an answer that refuses.
                self.post_answer(session, reply_to, Err("the ask of the other instances could not be sent".into()), From::Unsent);
            }
        }
    }

    fn post_answer(self: &Rc<Self>, session: SessionId, reply_to: usize, answer: Answer, from: From) {
        if reply_to == self.index {
            self.rebuild_answered(session, answer, from);
        } else {
            self.mesh.post(reply_to, CoreMsg::Task(Box::new(RingAnswer { session, answer, from })));
        }
    }

    /// On a device core: what `session` is owed for each of `devices` (this core's) after
    /// its cut, from the rings here.
    fn ring_answer(&self, session: SessionId, devices: &[DeviceCut]) -> Answer {
        let Some(relay) = self.relay.borrow().clone() else { return Err("no relay".into()) };
        let msgs = devices.iter().map(|(device, cut)| (device.clone(), self.ring_read(relay.ring_after(device, *cut)))).collect();
        // With throttling, where each device's throttle starts from (replay.rs).
        let quiet = self.devices.borrow().throttle().map(crate::shard::devices::quiet);
        let leads: Leads = match quiet {
            Some(quiet) => devices
                .iter()
                .filter_map(|(device, cut)| Some((device.clone(), relay.ring_lead(device, (*cut)?, quiet)?)))
                .collect(),
            None => HashMap::new(),
        };
        self.frames_of(session, msgs, Some(&leads))
    }

    /// A read of one device's ring (here, or for another instance's ask), counted.
    pub fn ring_read(&self, got: Result<Vec<Kept>, RingMiss>) -> Result<Vec<Kept>, RingMiss> {
        let result = match &got {
            Ok(_) => 0,
            Err(RingMiss::NotHeld { .. }) => 1,
            Err(RingMiss::Lost(_)) => 2,
        };
        CoreMetrics::count(&self.metrics.ring_reads, result);
        got
    }

    /// On a device core here: another instance's answer to this core's ask (ringask.rs),
    /// turned into the session's frames and passed to its core behind this core's
    /// deliveries of what came before it.
    pub fn rings_remote(self: &Rc<Self>, session: SessionId, from: Box<str>, of: u32, parts: Result<RingGot, String>) {
        let answer = parts.map_err(|why| format!("instance {from}: {why}")).and_then(|parts| self.frames_of(session, parts, None));
        let reply_to = self.session_core(session);
        let core = self.index;
        self.post_answer(session, reply_to, answer, From::Peer { from, core, of });
    }

    /// `leads`: this instance's rings' (`None`: another instance's answer).
    fn frames_of(&self, session: SessionId, msgs: RingGot, leads: Option<&Leads>) -> Answer {
        let mut table = self.devices.borrow_mut();
        let now = Instant::now();
        let mut out = Vec::with_capacity(msgs.len());
        for (device, got) in msgs {
            let lead = match leads.and_then(|l| l.get(&device)) {
                Some((lead, quiet_point)) => Lead::Here(lead, *quiet_point),
                None if leads.is_some() => Lead::Here(&[], false),
                None => Lead::None,
            };
            let part = match got {
                Ok(msgs) => {
                    let (frames, rerun) = table.replay_frames_rerun(session, &device, lead, &msgs, now).map_err(|why| format!("{device}: {why}"))?;
                    Part::Frames(frames, rerun)
                }
                Err(RingMiss::Lost(why)) => return Err(format!("{device}: {why}")),
                Err(miss) => Part::Miss(miss),
            };
            out.push((device, part));
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

    fn rebuild_answered(&self, session: SessionId, answer: Answer, from: From) {
        let mut rebuilding = self.recovery.rebuilding.borrow_mut();
        let Some(held) = rebuilding.get_mut(&session) else { return };
        match from {
            From::Here => {
                held.waiting = held.waiting.saturating_sub(1);
                if let Ok(parts) = &answer {
                    // Only where the throttle was run again does it stand for the held
                    // telemetry frames before this point (review: a device with nothing to
                    // re-run would have lost a held live frame nothing replaced).
                    let at = held.deliveries.len();
                    for (device, _) in parts.iter().filter(|(_, p)| matches!(p, Part::Frames(_, true))) {
                        held.answered_at.insert(device.clone(), at);
                    }
                }
            }
            From::Unsent => held.unsent = true,
            From::Peer { from, core, of } => {
                if !held.peers.contains(&from) || !held.ask_cores.contains(&core) {
                    return; // not asked (an instance that came up meanwhile): not waited for
                }
                let entry = held.remote.entry((from, core)).or_insert((0, of));
                entry.0 += 1;
                entry.1 = of;
                CoreMetrics::count(&self.metrics.ring_asks, if answer.is_ok() { ASK_ANSWERED } else { ASK_REFUSED });
            }
        }
        held.answers.push(answer);
        if held.complete() {
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
        let outcome = match self.peers_alive().await {
            Ok(peers) => match self.rebuild_asks(session, offset, peers) {
                Ok(asks) => self.rebuild_gather(session, asks).await,
                Err(why) => Err(why),
            },
            Err(why) => Err(why),
        };
        let outcome = outcome.and_then(|frames| self.rebuild_install(session, pid, offset, frames));
        CoreMetrics::count(&self.metrics.rebuilds, outcome.is_err() as usize);
        if let Err(why) = outcome {
            tracing::debug!(session = %session, reason = %why, "history not rebuilt from device rings");
            self.rebuild_refused(session, pid);
            // The devices watched for the asks stay watched: the CONNECT goes on to attach
            // its socket (which watches them; its detach unwatches them), and unwatching
            // them in between could let another instance's next live message miss this one
            // (the ring-lost test once timed out waiting for a data event, 1 run in 4 in
            // parallel, output not kept; none in 10 runs since this).
        }
    }

    /// Waits until every other instance that still has a presence in Redis is known dead
    /// (its presence not renewed for a heartbeat and a second: it missed a renewal) or alive
    /// (seen renewing it between two probes); the live ones, whose rings are asked. The
    /// client of a `kill -9` is usually back within a second, long before the dead
    /// instance's presence expires (`--lease-ttl`), so asking every instance with a presence
    /// would wait for the dead one; a probe every half heartbeat decides within about a
    /// heartbeat and a second, by Redis's clock.
    async fn peers_alive(&self) -> Result<Vec<Box<str>>, String> {
        let relay = self.relay.borrow().clone().ok_or("no relay")?;
        let heartbeat = relay.heartbeat();
        let dead_after = (heartbeat + Duration::from_secs(1)).as_millis() as i64;
        let deadline = Instant::now() + Duration::from_secs(self.settings.config.lease_ttl) + heartbeat * 2;
        let mut seen: HashMap<Box<str>, i64> = HashMap::new();
        let mut alive: Vec<Box<str>> = Vec::new();
        loop {
            let asked = relay.peers_staleness().ok_or("the Redis command queue is full")?;
            let stale = asked.await.map_err(|_| "no answer from the Redis thread".to_string())??;
            let mut undecided = 0;
            for (id, ms) in stale {
                let Some(ms) = ms else { continue }; // its presence went: dead
                if alive.contains(&id) {
                    continue;
                }
                if seen.get(&id).is_some_and(|before| ms < *before) {
                    tracing::debug!(instance = %id, "another instance is alive: its rings are asked");
                    alive.push(id);
                    continue;
                }
                if ms <= dead_after {
                    undecided += 1;
                }
                seen.insert(id, ms);
            }
            if undecided == 0 {
                return Ok(alive);
            }
            if Instant::now() >= deadline {
                return Err("another instance's presence is neither renewed nor gone".into());
            }
            monoio::time::sleep(heartbeat / 2).await;
        }
    }

    /// The cuts per device core (refusing what cannot be rebuilt), the devices watched for
    /// the asks, and the holding started.
    fn rebuild_asks(self: &Rc<Self>, session: SessionId, offset: &str, peers: Vec<Box<str>>) -> Result<Asks, String> {
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
        let mut per_core: HashMap<usize, DeviceCuts> = HashMap::new();
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
        // Asking others: this instance watches the devices first (each device core's watch
        // changes go to the link before its ask), so what they take in after reading their
        // rings is published here and held below.
        let watched: Vec<Box<str>> = if peers.is_empty() {
            Vec::new()
        } else {
            per_core.values().flatten().map(|(d, _)| Box::from(&**d)).collect()
        };
        self.presence(session, watched, true);
        let ask_cores = if peers.is_empty() { Vec::new() } else { per_core.keys().copied().collect() };
        self.recovery.rebuilding.borrow_mut().insert(session, Held { waiting: per_core.len(), peers, ask_cores, ..Default::default() });
        Ok(per_core.into_iter().collect())
    }

    /// Sends the asks and waits for every answer; the frames in replay order, or why not.
    async fn rebuild_gather(self: &Rc<Self>, session: SessionId, asks: Asks) -> Result<Vec<Delivery>, String> {
        let (tx, rx) = futures_channel::oneshot::channel();
        let remote = {
            let mut rebuilding = self.recovery.rebuilding.borrow_mut();
            let held = rebuilding.get_mut(&session).ok_or("the rebuild was dropped")?;
            held.done = Some(tx);
            !held.peers.is_empty()
        };
        let cuts: HashMap<Arc<str>, Option<u32>> = asks.iter().flat_map(|(_, d)| d.iter().cloned()).collect();
        for (core, devices) in asks {
            if core == self.index {
                // This core's own deliveries were handed out synchronously: none in flight.
                self.ring_ask_here(session, self.index, &devices, remote);
            } else {
                self.mesh.post(core, CoreMsg::Task(Box::new(RingAsk { session, reply_to: self.index, devices, remote })));
            }
        }
        let timed_out = {
            let waiting = self.recovery.rebuilding.borrow().get(&session).is_some_and(|h| !h.complete());
            waiting && monoio::time::timeout(REBUILD_WAIT, rx).await.is_err()
        };
        let held = self.recovery.rebuilding.borrow_mut().remove(&session).ok_or("the rebuild was dropped")?;
        if timed_out {
            let missing: Vec<&str> = held.peers.iter().filter(|p| !held.ask_cores.iter().all(|c| held.remote.get(&((*p).clone(), *c)).is_some_and(|(g, o)| g >= o))).map(|p| &**p).collect();
            for _ in &missing {
                CoreMetrics::count(&self.metrics.ring_asks, ASK_TIMED_OUT);
            }
            return Err(format!("no answer in time (device cores here waiting: {}, instances: {missing:?})", held.waiting));
        }
        if held.over {
            return Err("more delivered meanwhile than --recovery-session-bytes".into());
        }
        // Per device, every holder's part: frames from one or more (the instance that took it
        // in, replicas that were sent it), or why it lacks them.
        let mut by_device: HashMap<Arc<str>, Vec<Part>> = HashMap::new();
        for answer in held.answers {
            for (device, part) in answer? {
                by_device.entry(device).or_default().push(part);
            }
        }
        let mut per_device: Vec<std::collections::VecDeque<Delivery>> = Vec::new();
        for (device, parts) in by_device {
            if let Some(frames) = merge_holders(&device, cuts.get(&device).copied().flatten(), parts)? {
                if !frames.is_empty() {
                    per_device.push(frames.into());
                }
            }
        }
        let rebuilt: HashSet<(u32, MsgKey)> =
            per_device.iter().flatten().filter(|d| !d.key.is_none()).map(|d| (device_hash(&d.device), d.key)).collect();
        // Merged by key (time, then counter: one ingress thread's messages in the order it
        // took them in), each device's frames in ring order; a throttle's trailing merge
        // (keyless) right after the frame before it.
        let mut frames = Vec::with_capacity(per_device.iter().map(|v| v.len()).sum());
        let mut last_key = vec![MsgKey::NONE; per_device.len()];
        while let Some(i) = (0..per_device.len())
            .filter(|i| !per_device[*i].is_empty())
            .min_by_key(|i| per_device[*i].front().map(|d| if d.key.is_none() { last_key[*i] } else { d.key }))
        {
            if let Some(d) = per_device[i].pop_front() {
                if !d.key.is_none() {
                    last_key[i] = d.key;
                }
                frames.push(d);
            }
        }
        // What arrived meanwhile and was not in a ring follows; with throttling, not the
        // session's telemetry of a device made here before its answer re-ran the throttle.
        let throttled = self.devices.borrow().throttle().is_some();
        let (from_rings, held_count) = (frames.len(), held.deliveries.len());
        let answered_at = held.answered_at;
        frames.extend(held.deliveries.into_iter().enumerate().filter(|(i, d)| {
            let remade = throttled && d.kind == crate::push::FrameKind::Telemetry && answered_at.get(&d.device).is_some_and(|at| i < at);
            !remade && !rebuilt.contains(&(device_hash(&d.device), d.key))
        }).map(|(_, d)| d));
        tracing::debug!(session = %session, from_rings, held = held_count, held_kept = frames.len() - from_rings, peers = held.peers.len(), "device rings answered");
        Ok(frames)
    }

    /// The stream continuing the client's offset with `frames`, and its pid.
    fn rebuild_install(&self, session: SessionId, pid: &str, offset: &str, frames: Vec<Delivery>) -> Result<(), String> {
        let window = self.recovery.window.ok_or("recovery is off")?;
        let (epoch, seq) = parse_offset(offset).ok_or("not an offset")?;
        let part = device_part(offset).ok_or("not an offset")?;
        let now = Instant::now();
        let mut stream = SessionStream::continuing(epoch, seq, self.recovery.history.clone(), now);
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
        // `--recovery-durable`: written whole, as a stream made new is, so the appends of
        // what follows have a base and a restart here (even a `kill -9`) keeps it.
        let written = self.durable_record(recovery, true, now);
        drop(sessions);
        self.recovery_write(session, written);
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

/// One device's frames from every holder's part (`cut`: the client's; `None`: it had none of
/// the device): each holder that has the cut gives what followed it in its ring order; they
/// must agree (every frame of each is in the longest, by key: the instance that took the
/// device in and the replicas it published to hold the same messages in the same order), and
/// one of them gives the frames. A holder where the device is taken in that lacks the cut,
/// or no holder with it, refuses. `None`: nothing owed.
fn merge_holders(device: &str, cut: Option<u32>, parts: Vec<Part>) -> Result<Option<Vec<Delivery>>, String> {
    let mut lists: Vec<Vec<Delivery>> = Vec::new();
    for part in parts {
        match part {
            Part::Frames(f, _) => lists.push(f),
            Part::Miss(RingMiss::NotHeld { origin: true }) => {
                return Err(format!("{device}: its cut is not held where it is taken in"));
            }
            Part::Miss(RingMiss::NotHeld { origin: false }) => {}
            Part::Miss(RingMiss::Lost(why)) => return Err(format!("{device}: {why}")),
        }
    }
    if lists.is_empty() {
        return match cut {
            Some(_) => Err(format!("{device}: no instance holds its cut")),
            None => Ok(None),
        };
    }
    lists.sort_by_key(|l| std::cmp::Reverse(l.len()));
    let mut lists = lists.into_iter();
    let longest = lists.next().expect("one");
    let keys: HashSet<MsgKey> = longest.iter().map(|d| d.key).collect();
    for other in lists {
        if other.iter().any(|d| !keys.contains(&d.key)) {
            return Err(format!("{device}: two holders hold different messages after its cut"));
        }
    }
    Ok(Some(longest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::SessionId;

    fn frames(device: &str, ns: &[u64]) -> Part {
        Part::Frames(ns.iter().map(|n| delivery(device, *n)).collect(), false)
    }

    fn delivery(device: &str, n: u64) -> Delivery {
        Delivery { session: SessionId(1), device: device.into(), kind: crate::push::FrameKind::Message, frame: format!("{n}").into(), arrived: None, key: MsgKey { ms: 1, n } }
    }

    fn ns(got: Option<Vec<Delivery>>) -> Vec<u64> {
        got.unwrap_or_default().iter().map(|d| d.key.n).collect()
    }

    #[test]
    fn holders_of_a_device_merge_into_one_list_or_refuse() {
        let not_held = |origin| Part::Miss(RingMiss::NotHeld { origin });
        // The taker in and a replica that has part of it: the longest, once.
        assert_eq!(ns(merge_holders("d", Some(1), vec![frames("d", &[2, 3]), frames("d", &[2, 3, 4]), not_held(false)]).unwrap()), [2, 3, 4]);
        // A replica that began after the cut, the taker in with it.
        assert_eq!(ns(merge_holders("d", Some(1), vec![not_held(false), frames("d", &[2])]).unwrap()), [2]);
        assert!(merge_holders("d", Some(1), vec![not_held(false), not_held(false)]).is_err(), "nobody holds the cut");
        assert!(merge_holders("d", Some(1), vec![frames("d", &[2]), not_held(true)]).is_err(), "its taker in lost the cut");
        assert!(merge_holders("d", Some(1), vec![frames("d", &[2, 3]), frames("d", &[4])]).is_err(), "two origins");
        assert!(merge_holders("d", None, vec![frames("d", &[]), Part::Miss(RingMiss::Lost("NoCut".into()))]).is_err());
        assert_eq!(ns(merge_holders("d", None, vec![]).unwrap()), Vec::<u64>::new());
    }
}
