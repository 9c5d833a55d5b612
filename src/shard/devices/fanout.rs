//! Who gets what of a publication: grant and subscription filters, throttling (trailing
//! merge per session and device), the connection-state TTL; one envelope per kind, shared,
//! and one per distinct selection of keys for key-filtered subscriptions.

use std::sync::Arc;
use std::time::Instant;


use super::*;

impl DeviceTable {
    /// Pushes a publication to every session subscribed to what it carries.
    pub fn publish(&mut self, device_id: &Arc<str>, p: Publication, now: Instant, out: &mut Vec<Delivery>) {
        let throttle = self.timing.throttle;
        let Some(device) = self.devices.get_mut(&**device_id) else { return };
        let timestamp = iso(p.at);
        let envelope = EnvelopeBuilder::new(device_id, &timestamp);
        // Built on first use, shared by every session that gets the same content.
        let mut all_telemetry: Option<Arc<str>> = None;
        // Key-filtered telemetry, one envelope per distinct selection of this message's keys
        // (a bit per key; messages of more than 64 keys build one per session).
        let mut filtered: SmallVec<[(u64, Arc<str>); 4]> = SmallVec::new();
        let maskable = p.telemetry.len() <= 64;
        let whole = if p.telemetry.len() >= 64 { u64::MAX } else { (1u64 << p.telemetry.len()) - 1 };
        let mut connection: Option<Arc<str>> = None;
        let mut twin: Option<Arc<str>> = None;
        let mut message: Option<Arc<str>> = None;
        for (session, access) in device.access.iter_mut() {
            if access.subs_empty() {
                continue;
            }
            let mut send = |kind: FrameKind, frame: Arc<str>| {
                out.push(Delivery { session, device: device_id.clone(), kind, frame, arrived: p.arrived, key: p.key });
            };
            if !p.telemetry.is_empty() && access.subscribed_telemetry() {
                match throttle {
                    Some(interval) => {
                        let (throttled, subscribed) = access.throttle();
                        let free = !throttled.armed
                            && throttled.last_sent.is_none_or(|t| now.duration_since(t) >= interval);
                        if free {
                            let values = p.telemetry.iter().filter(|(k, _)| subscribed.contains_key(k));
                            if values.clone().next().is_some() {
                                throttled.last_sent = Some(now);
                                send(FrameKind::Telemetry, envelope.telemetry(values.map(|(k, v)| (&**k, &**v))));
                            }
                        } else {
                            for (k, v) in p.telemetry.iter().filter(|(k, _)| subscribed.contains_key(k)) {
                                match throttled.pending.iter_mut().find(|(pk, _)| pk == k) {
                                    Some(slot) => slot.1 = v.clone(),
                                    None => throttled.pending.push((k.clone(), v.clone())),
                                }
                                throttled.pending_at = throttled.pending_at.max(p.at);
                            }
                            if !throttled.armed && !throttled.pending.is_empty() {
                                throttled.armed = true;
                                let due = throttled.last_sent.map_or(now, |t| t + interval);
                                self.throttle_due.push(Reverse((due, (**device_id).into(), session)));
                            }
                        }
                    }
                    None if access.sub_telemetry().all => {
                        let frame = all_telemetry
                            .get_or_insert_with(|| envelope.telemetry(p.telemetry.iter().map(|(k, v)| (&**k, &**v))))
                            .clone();
                        send(FrameKind::Telemetry, frame);
                    }
                    None if maskable => {
                        let mask = p
                            .telemetry
                            .iter()
                            .enumerate()
                            .filter(|(_, (k, _))| access.sub_telemetry().contains_key(k))
                            .fold(0u64, |m, (i, _)| m | 1 << i);
                        if mask == 0 {
                            // None of the keys it wants.
                        } else if mask == whole {
                            let frame = all_telemetry
                                .get_or_insert_with(|| envelope.telemetry(p.telemetry.iter().map(|(k, v)| (&**k, &**v))))
                                .clone();
                            send(FrameKind::Telemetry, frame);
                        } else {
                            let frame = match filtered.iter().find(|(m, _)| *m == mask) {
                                Some((_, frame)) => frame.clone(),
                                None => {
                                    let values = p.telemetry.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0);
                                    let frame = envelope.telemetry(values.map(|(_, (k, v))| (&**k, &**v)));
                                    filtered.push((mask, frame.clone()));
                                    frame
                                }
                            };
                            send(FrameKind::Telemetry, frame);
                        }
                    }
                    None => {
                        let subscribed = access.sub_telemetry();
                        let values = p.telemetry.iter().filter(|(k, _)| subscribed.contains_key(k));
                        if values.clone().next().is_some() {
                            send(FrameKind::Telemetry, envelope.telemetry(values.map(|(k, v)| (&**k, &**v))));
                        }
                    }
                }
            }
            if let (Some(c), true) = (p.connection, access.subscribed_connection_state()) {
                send(FrameKind::ConnectionState, connection.get_or_insert_with(|| envelope.connection_state(c)).clone());
            }
            if let (Some(t), true) = (&p.twin, access.subscribed_twin()) {
                send(FrameKind::DeviceTwin, twin.get_or_insert_with(|| envelope.device_twin(t)).clone());
            }
            if let (Some(m), true) = (&p.message, access.subscribed_messages()) {
                send(FrameKind::Message, message.get_or_insert_with(|| envelope.message(m)).clone());
            }
        }
    }

    /// The earliest pending timer (a trailing throttle flush or an off-line check): the core's
    /// clock sleeps until it. Entries may be stale; waking for one costs a heap pop.
    pub fn next_deadline(&self) -> Option<Instant> {
        let throttle = self.throttle_due.peek().map(|Reverse((t, _, _))| *t);
        let offline = self.timing.connection_ttl.and(self.offline_due.peek().map(|Reverse((t, _))| *t));
        throttle.into_iter().chain(offline).min()
    }

    /// Sends the telemetry held back by throttling whose interval has passed.
    pub fn flush_throttled(&mut self, now: Instant, out: &mut Vec<Delivery>) {
        while let Some(Reverse((due, _, _))) = self.throttle_due.peek() {
            if *due > now {
                break;
            }
            let Reverse((_, device_id, session)) = self.throttle_due.pop().expect("peeked");
            let Some(access) = self.devices.get_mut(&*device_id).and_then(|d| d.access.get_mut(session)) else {
                continue;
            };
            let Some((throttled, subscribed)) = access.throttled() else { continue };
            throttled.armed = false;
            let pending = std::mem::take(&mut throttled.pending);
            // Subscriptions may have changed since the keys were held back.
            let values: SmallVec<[(Box<str>, JsonText); 4]> =
                pending.into_iter().filter(|(k, _)| subscribed.contains_key(k)).collect();
            if values.is_empty() {
                continue;
            }
            throttled.last_sent = Some(now);
            let device: Arc<str> = Arc::from(&*device_id);
            let envelope = EnvelopeBuilder::new(&device, &iso(throttled.pending_at));
            let frame = envelope.telemetry(values.iter().map(|(k, v)| (&**k, &**v)));
            out.push(Delivery { session, device, kind: FrameKind::Telemetry, frame, arrived: None, key: Default::default() });
        }
    }

    /// Marks devices silent for the connection-state TTL as disconnected and tells subscribers.
    pub fn expire_connections(&mut self, now: Instant, out: &mut Vec<Delivery>) {
        let Some(ttl) = self.timing.connection_ttl else { return };
        while let Some(Reverse((due, _))) = self.offline_due.peek() {
            if *due > now {
                break;
            }
            let Reverse((_, device_id)) = self.offline_due.pop().expect("peeked");
            let Some(device) = self.devices.get_mut(&*device_id) else { continue };
            let silent_since = device.last_seen.unwrap_or(now);
            let connected = device.connection.as_ref().is_some_and(|c| c.connected);
            if !connected {
                device.offline_check_armed = false;
            } else if silent_since + ttl > now {
                self.offline_due.push(Reverse((silent_since + ttl, device_id)));
            } else {
                device.offline_check_armed = false;
                self.dirty.device(&device_id);
                let at = now_millis();
                if let Some(c) = device.connection.as_mut() {
                    c.connected = false;
                    c.at = at;
                }
                tracing::debug!(device = &*device_id, "silent for the connection TTL: disconnected");
                let device: Arc<str> = Arc::from(&*device_id);
                let publication = Publication { device: device.clone(), at, connection: Some(false), ..Default::default() };
                self.publish(&device, publication, now, out);
            }
        }
    }
}
