//! A rebuild's frames (docs/design/recovery.md step 11): device messages kept in a ring
//! (`cluster/ring.rs`) turned into what one session would have been sent, by that session's
//! subscriptions here now. Pure: nothing is applied again, no last value, twin or throttle
//! state moves.
//!
//! **Telemetry** is made again from the message alone (its frames depend on nothing of the
//! device's state). **A twin change or a connection event** is decided against the device's
//! state when it came (a stale twin version or an older connection sequence number is
//! dropped, a change is merged into the twin held), which a re-run cannot know: so the ring
//! keeps, with each such message, what the live path decided for it on the instance that
//! kept it ([`Decided`], from [`DeviceTable::decided`] right after the message was applied):
//! the whole twin after the change and its time, the connection state and its time, or that
//! nothing was sent. The frames are the ones [`DeviceTable::publish`] makes of that decision
//! for the session's access. The one decision that gives no frame then and a keyless one
//! later (a change held for a hub read of the whole twin, [`Decided::Held`]) fails a rebuild
//! for a session subscribed to twins (`history_lost`) rather than guess.
//!
//! **Throttled telemetry** (`throttlingInterval`): what was sent depended on when each
//! message came, so the throttle is run again over the ring's times (each entry's batch
//! clock on the instance that kept it, the clock its live throttle read), from a point where
//! its state is known: the latest *quiet point* before the client's cut (an entry
//! [`quiet`] or more after the one before it: by then any window was flushed and the next
//! telemetry was sent at once; or the ring's first entry when it holds every message since
//! it began), or, for a session that reads only telemetry of the device, the cut itself
//! (its last frame of the device was then a telemetry frame sent at once). Frames up to the
//! cut are dropped (the client had them); after it, telemetry sent at once and each trailing
//! merge (keyless, timestamped by the newest merged message, as live) are made in the order
//! the live path made them, and the state at the end is installed in the session's access
//! here, so live telemetry goes on from it (a trailing merge due later is armed).
//!
//! Where it cannot be exact it refuses: a live trailing flush runs when the core's clock
//! wakes, a little after its due time, so a message within [`EDGE`] after a due time (before
//! or after the flush?) or within [`EDGE`] of the end of a window that a flush began
//! (sent at once or merged?) could have gone either way; no quiet point and more than
//! telemetry subscribed; a window of the session's here already open (live telemetry
//! reached it before the ask); another instance's answer (its ring's times are not this
//! clock's: refused for throttled telemetry, the rebuild asks only this instance's rings
//! exactly). Assumed: the clock woke within [`EDGE`] of each due time; the messages' own
//! times grow (a trailing merge is timestamped by the newest time merged since the access
//! began, which the re-run knows only from the quiet point on).

use std::sync::Arc;

use super::*;

/// Why a rebuild's frames could not be made.
pub type Refused = &'static str;

/// How late a throttle's trailing flush may run after its due time (the core clock's wake),
/// as the re-run assumes: a message this close after a due time or a window's end refuses.
pub const EDGE: Duration = Duration::from_millis(50);

/// The gap after which a throttle's state is known: any window open before it was flushed
/// (at most an interval after the message before, plus [`EDGE`]) and the next telemetry is
/// sent at once (an interval after that flush).
pub fn quiet(interval: Duration) -> Duration {
    interval * 2 + EDGE * 2
}

/// Where a rebuild's messages of a device start from, for the throttle (module docs).
pub enum Lead<'a> {
    /// No throttle to run: another instance's answer, or throttling off.
    None,
    /// The ring's entries from a quiet point (`true`) or just the cut (`false`) through it.
    Here(&'a [Kept], bool),
}

/// The throttle run again: the session's state, whether its `last_sent` came from a
/// flush (then only within an [`EDGE`] of its due time), its due time.
struct Sim {
    interval: Duration,
    state: crate::shard::access::Throttle,
    from_flush: bool,
    due: Option<Instant>,
}

/// What the live path decided for a message that is not telemetry, where it was applied
/// (design step 11): kept with the message in a device ring, so a rebuild sends what the
/// session was sent, not a guess.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decided {
    /// Telemetry: its frames are made again from the message alone.
    FromMessage,
    /// A twin change applied: the whole twin after it (as twin subscribers were sent it) and
    /// its time.
    Twin { at: Millis, doc: Arc<str> },
    /// A connection event applied.
    Connection { at: Millis, connected: bool },
    /// Nothing sent to anyone: a stale twin version or connection sequence number, a body
    /// that is not an object, an unknown event, a lifecycle event.
    Nothing,
    /// A twin change held for a hub read of the whole twin (its frame, if any, came later
    /// without a key): a rebuild for a twin subscriber is refused.
    Held,
}

impl Decided {
    /// Bytes it holds beyond its size (charged to the ring with its message).
    pub fn charge(&self) -> usize {
        match self {
            Decided::Twin { doc, .. } => doc.len(),
            _ => 0,
        }
    }
}

/// A message kept in a device ring, what was decided for it, and when it was applied there.
#[derive(Debug, Clone)]
pub struct Kept {
    pub msg: IngestMessage,
    pub decided: Decided,
    pub at: Instant,
}

/// What [`DeviceTable::ingest`] decided for the last twin change or connection event it
/// applied (read at once by [`DeviceTable::decided`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) enum Event {
    #[default]
    Nothing,
    Twin { at: Millis },
    Connection { at: Millis, connected: bool },
    Held,
}

impl DeviceTable {
    /// What was decided for `msg`, the message this table applied last (design step 11,
    /// kept in its device's ring). Builds the twin's text only for a twin change applied.
    pub fn decided(&self, msg: &IngestMessage) -> Decided {
        match msg.source {
            SourceKind::Telemetry => Decided::FromMessage,
            SourceKind::Lifecycle => Decided::Nothing,
            SourceKind::TwinChange | SourceKind::ConnectionState => match self.event {
                Event::Nothing => Decided::Nothing,
                Event::Held => Decided::Held,
                Event::Connection { at, connected } => Decided::Connection { at, connected },
                Event::Twin { at } => match self.devices.get(&*msg.device_id).and_then(|d| d.twin.as_ref()) {
                    Some(twin) => Decided::Twin { at, doc: twin.doc.to_string().into() },
                    None => Decided::Nothing,
                },
            },
        }
    }

    /// `throttlingInterval`, if on.
    pub fn throttle(&self) -> Option<Duration> {
        self.timing.throttle
    }

    /// The frames `session` would have been sent for `kept` (messages of `device`, oldest
    /// first, with what was decided for each), each with its message's key (a trailing
    /// throttle merge none). With throttled telemetry subscribed, `lead` says where the
    /// throttle starts from (module docs), and its state at `now` is installed here.
    pub fn replay_frames(&mut self, session: SessionId, device: &Arc<str>, lead: Lead<'_>, kept: &[Kept], now: Instant) -> Result<Vec<Delivery>, Refused> {
        self.replay_frames_rerun(session, device, lead, kept, now).map(|(frames, _)| frames)
    }

    /// [`DeviceTable::replay_frames`], and whether the session's throttle of the device was
    /// run again and installed here (only then does it stand for the session's throttled
    /// telemetry made here meanwhile: the rebuild drops those held frames).
    pub fn replay_frames_rerun(&mut self, session: SessionId, device: &Arc<str>, lead: Lead<'_>, kept: &[Kept], now: Instant) -> Result<(Vec<Delivery>, bool), Refused> {
        let mut out = Vec::new();
        let Some(access) = self.devices.get(&**device).and_then(|d| d.access.get(session)) else {
            return Ok((out, false)); // not subscribed here (any more)
        };
        if access.subs_empty() || kept.is_empty() && matches!(lead, Lead::None | Lead::Here([], _)) {
            return Ok((out, false));
        }
        let mut sim = match (self.timing.throttle, access.subscribed_telemetry(), lead) {
            (Some(interval), true, Lead::Here(lead, quiet_point)) => {
                if access.throttle_armed() {
                    return Err("throttled telemetry: a window of the session is open here already");
                }
                let mut sim = Sim { interval, state: Default::default(), from_flush: false, due: None };
                let only_telemetry = !access.subscribed_messages() && !access.subscribed_connection_state() && !access.subscribed_twin();
                if only_telemetry {
                    // Exact whatever came before: the client's last frame of the device was
                    // this message's telemetry (a trailing merge has no key, so no cut), sent
                    // at once. A re-run of the lead could decide the cut otherwise (this
                    // instance saw the gaps one hop apart from the dead one): a duplicate.
                    let Some(cut) = lead.last() else {
                        return Err("throttled telemetry: no cut");
                    };
                    sim.state.last_sent = Some(cut.at);
                } else if quiet_point {
                    let mut before = Vec::new();
                    for k in lead {
                        self.frames_of_one(session, device, access, k, Some(&mut sim), &mut before)?;
                    }
                    // The cut was a frame of the message itself: had the dead instance held
                    // its telemetry in a merge the re-run sends at once (or the reverse), the
                    // values would be lost or sent twice. Only a re-run that ends the lead
                    // with nothing held is taken.
                    if sim.state.armed || !sim.state.pending.is_empty() {
                        return Err("throttled telemetry: a merge open at the cut");
                    }
                } else {
                    return Err("throttled telemetry: no quiet moment of the device before the cut");
                }
                Some(sim)
            }
            (Some(_), true, Lead::None) if !kept.is_empty() => return Err("throttled telemetry in another instance's ring"),
            _ => None,
        };
        for k in kept {
            self.frames_of_one(session, device, access, k, sim.as_mut(), &mut out)?;
        }
        let rerun = sim.is_some();
        if let Some(mut sim) = sim {
            if sim.due.is_some_and(|due| due <= now) {
                Self::flush_sim(session, device, &mut sim, &mut out);
            }
            let Sim { state, due, .. } = sim;
            if let Some(access) = self.devices.get_mut(&**device).and_then(|d| d.access.get_mut(session)) {
                *access.throttle().0 = state;
            }
            if let Some(due) = due {
                self.throttle_due.push(Reverse((due, (**device).into(), session)));
            }
        }
        Ok((out, rerun))
    }

    /// The trailing merge of a re-run throttle, at its due time.
    fn flush_sim(session: SessionId, device: &Arc<str>, sim: &mut Sim, out: &mut Vec<Delivery>) {
        let Some(due) = sim.due.take() else { return };
        sim.state.armed = false;
        let pending = std::mem::take(&mut sim.state.pending);
        if pending.is_empty() {
            return;
        }
        sim.state.last_sent = Some(due);
        sim.from_flush = true;
        let frame = EnvelopeBuilder::new(device, &iso(sim.state.pending_at)).telemetry(pending.iter().map(|(k, v)| (&**k, v.as_str())));
        out.push(Delivery { session, device: device.clone(), kind: FrameKind::Telemetry, frame, arrived: None, key: Default::default() });
    }

    /// The frames of one kept message (`sim`: the throttle run again, else none).
    fn frames_of_one(&self, session: SessionId, device: &Arc<str>, access: &crate::shard::access::Access, k: &Kept, mut sim: Option<&mut Sim>, out: &mut Vec<Delivery>) -> Result<(), Refused> {
        let Kept { msg, decided, at: applied } = k;
        if let Some(sim) = sim.as_deref_mut() {
            if let Some(due) = sim.due.filter(|due| *due <= *applied) {
                if applied.saturating_duration_since(due) < EDGE {
                    return Err("throttled telemetry: a message at a trailing flush's due time");
                }
                Self::flush_sim(session, device, sim, out);
            }
        }
        {
            let mut send = |kind: FrameKind, frame: Arc<str>| {
                out.push(Delivery { session, device: device.clone(), kind, frame, arrived: None, key: msg.key });
            };
            match decided {
                Decided::Twin { at, doc } => {
                    if access.subscribed_twin() {
                        send(FrameKind::DeviceTwin, EnvelopeBuilder::new(device, &iso(*at)).device_twin(doc));
                    }
                    return Ok(());
                }
                Decided::Connection { at, connected } => {
                    if access.subscribed_connection_state() {
                        send(FrameKind::ConnectionState, EnvelopeBuilder::new(device, &iso(*at)).connection_state(*connected));
                    }
                    return Ok(());
                }
                Decided::Nothing => return Ok(()),
                Decided::Held if access.subscribed_twin() => return Err("a twin change held for a hub read"),
                Decided::Held => return Ok(()),
                Decided::FromMessage if msg.source != SourceKind::Telemetry => {
                    if access.subscribed_twin() || access.subscribed_connection_state() {
                        return Err("a twin or connection event kept without its decision");
                    }
                    return Ok(());
                }
                Decided::FromMessage => {}
            }
        }
        let mut parsed = crate::ingest::ParsedTelemetry::default();
        let ok = crate::ingest::parse_telemetry_into(&msg.body, &self.settings, &mut parsed).is_ok();
        let property = |name: &str| msg.properties.iter().find(|(k, _)| &**k == name).map(|(_, v)| &**v);
        let header_time = property("iothub-creation-time-utc")
            .and_then(parse_iso)
            .or_else(|| property("iothub-app-iothub-creation-time-utc").and_then(parse_iso))
            .or(msg.enqueued_at)
            .or_else(|| property("iothub-enqueuedtime").and_then(parse_iso));
        // Without a time of its own: when the instance that took it in did (its key's).
        let at = parsed.timestamp.or(header_time).unwrap_or(if msg.key.ms > 0 { msg.key.ms } else { now_millis() });
        let timestamp = iso(at);
        let envelope = EnvelopeBuilder::new(device, &timestamp);
        let mut send = |kind: FrameKind, frame: Arc<str>| {
            out.push(Delivery { session, device: device.clone(), kind, frame, arrived: None, key: msg.key });
        };
        if ok && access.subscribed_telemetry() {
            let subscribed = access.sub_telemetry();
            let values = parsed.values.iter().filter(|(k, _)| subscribed.all || subscribed.contains_key(k));
            match sim {
                _ if values.clone().next().is_none() => {}
                None => send(FrameKind::Telemetry, envelope.telemetry(values.map(|(k, v)| (&**k, *v)))),
                Some(sim) => {
                    let since = sim.state.last_sent.map(|t| applied.saturating_duration_since(t));
                    if !sim.state.armed && sim.from_flush && since.is_some_and(|d| d >= sim.interval && d < sim.interval + EDGE) {
                        return Err("throttled telemetry: a message at the end of a window a flush began");
                    }
                    if !sim.state.armed && since.is_none_or(|d| d >= sim.interval) {
                        sim.state.last_sent = Some(*applied);
                        sim.from_flush = false;
                        send(FrameKind::Telemetry, envelope.telemetry(values.map(|(k, v)| (&**k, *v))));
                    } else {
                        for (k, v) in values {
                            match sim.state.pending.iter_mut().find(|(pk, _)| **pk == **k) {
                                Some(slot) => slot.1 = crate::ingest::JsonText::new(v),
                                None => sim.state.pending.push((Box::from(&**k), crate::ingest::JsonText::new(v))),
                            }
                        }
                        sim.state.pending_at = sim.state.pending_at.max(at);
                        if !sim.state.armed {
                            sim.state.armed = true;
                            sim.due = Some(sim.state.last_sent.map_or(*applied, |t| t + sim.interval));
                        }
                    }
                }
            }
        }
        if ok && access.subscribed_connection_state() {
            let connected = match parsed.connection_state {
                Some(state) => Some(state),
                None if self.settings.custom_connection_state_key.is_empty() && self.settings.connection_state_on_telemetry => Some(true),
                None => None,
            };
            if let Some(c) = connected {
                send(FrameKind::ConnectionState, envelope.connection_state(c));
            }
        }
        if access.subscribed_messages() {
            send(FrameKind::Message, envelope.message(&crate::ingest::message_json(&msg.body)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::MsgKey;
    use crate::model::{DataKind, GrantKind, Subscription};

    const INTERVAL: Duration = Duration::from_millis(300);

    fn table_with(session: SessionId) -> DeviceTable {
        let settings = IngestSettings {
            custom_timestamp_key: "_ts".into(),
            custom_device_id_key: "deviceId".into(),
            custom_connection_state_key: String::new(),
            connection_state_on_telemetry: true,
        };
        let mut t = DeviceTable::new(settings, PushTiming { throttle: Some(INTERVAL), connection_ttl: None });
        let grant = Grant { kind: GrantKind::Data(DataKind::Telemetry), key: None };
        let (op, _done) = crate::shard::ask(|done| DeviceOp::Grant { device: "d".into(), session, grant, done });
        t.apply(op);
        let sub = Subscription { kind: DataKind::Telemetry, key: None };
        let (op, _permitted) = crate::shard::ask(|permitted| DeviceOp::Subscribe { device: "d".into(), session, sub, permitted });
        t.apply(op);
        t
    }

    /// Reading `n` (keys that come and go) of device `d`, its own time `1000 + n`.
    fn reading(n: u64) -> IngestMessage {
        IngestMessage {
            device_id: "d".into(),
            source: SourceKind::Telemetry,
            properties: Default::default(),
            body: format!(r#"{{"n":{n},"k{}":{n},"_ts":{}}}"#, n % 3, 1_000 + n).into_bytes(),
            enqueued_at: None,
            arrived: None,
            key: MsgKey::partition(0, 5_000, n as i64),
        }
    }

    fn texts(frames: &[Delivery]) -> Vec<(String, bool)> {
        frames.iter().map(|d| (d.frame.to_string(), d.key.is_none())).collect()
    }

    /// The re-run equals the live throttle (its flushes run at their due time) over the same
    /// messages at the same instants, from the ring's first entry or, for a telemetry-only
    /// session, from the cut; a message at a due time's edge refuses.
    #[test]
    fn the_throttle_run_again_gives_what_the_live_one_sent() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        // (n, applied at ms): 0 sent at once, 1-2 merged (flush at 300), 3 at once, 4-5
        // merged (flush at 1000), 6 at once.
        let plan = [(0, 0), (1, 100), (2, 200), (3, 700), (4, 750), (5, 900), (6, 1500)];
        let live_session = SessionId(1);
        let mut live = table_with(live_session);
        let mut sent = Vec::new();
        // The clock wakes at each due time (300, 1000) exactly.
        for (n, at) in plan {
            for due in [300, 1_000].into_iter().filter(|due| *due <= at) {
                live.flush_throttled(t0 + ms(due), &mut sent);
            }
            live.ingest_and_publish(reading(n), t0 + ms(at), &mut sent);
        }
        live.flush_throttled(t0 + ms(2_000), &mut sent);
        assert_eq!(sent.len(), 5, "{:?}", texts(&sent));
        let kept: Vec<Kept> = plan.iter().map(|(n, at)| Kept { msg: reading(*n), decided: Decided::FromMessage, at: t0 + ms(*at) }).collect();
        let session = SessionId(2);
        let replayed = |lead: Lead<'_>, after: &[Kept]| {
            let mut t = table_with(session);
            t.replay_frames(session, &Arc::from("d"), lead, after, t0 + ms(2_000)).map(|f| texts(&f))
        };
        // From the ring's first entry (a quiet point), the cut at 0: everything after it.
        assert_eq!(replayed(Lead::Here(&kept[..1], true), &kept[1..]).unwrap(), texts(&sent[1..]));
        // A telemetry-only session from the cut itself (its last frame: 3, sent at once).
        assert_eq!(replayed(Lead::Here(&kept[3..4], false), &kept[4..]).unwrap(), texts(&sent[3..]));
        // From a quiet point before the cut at 3: what followed 3.
        assert_eq!(replayed(Lead::Here(&kept[..4], true), &kept[4..]).unwrap(), texts(&sent[3..]));
        // Another instance's ring: refused.
        assert!(replayed(Lead::None, &kept[1..]).is_err());
        // A message 10 ms after a due time (merged, or after the flush?): refused.
        let mut edge = kept.clone();
        edge[3].at = t0 + ms(310);
        assert!(replayed(Lead::Here(&edge[..1], true), &edge[1..]).is_err());
        // The state at the end is installed: a later reading merges behind the open window.
        let mut t = table_with(session);
        t.replay_frames(session, &Arc::from("d"), Lead::Here(&kept[..1], true), &kept[1..6], t0 + ms(950)).unwrap();
        let mut out = Vec::new();
        t.ingest_and_publish(reading(7), t0 + ms(960), &mut out);
        assert!(out.is_empty(), "merged into the window the re-run left open");
        t.flush_throttled(t0 + ms(1_000), &mut out);
        assert_eq!(out.len(), 1, "the window's merge, due at 1000");
    }
}
