//! Twins with an IoT Hub: the whole twin cached from hub reads, changes merged into it, and
//! changes held (bounded) while the whole twin is read ([`PendingTwin`]).

use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use super::*;

impl DeviceTable {
    /// IoT Hub configured: serve the twin only when it rests on a hub read that `ttl` still
    /// counts as fresh. A twin known only from change events may be partial (an `updateTwin`
    /// carries just the change), so it is never served in place of a hub read.
    pub(super) fn read_hub_twin(&self, device: &str, viewer: Viewer, ttl: TwinCacheTtl) -> Read<Option<TwinView>> {
        self.permits(device, viewer, |a| a.granted_twin())?;
        let Some(d) = self.devices.get(device) else { return Ok(None) };
        let (Some(twin), Some(read)) = (d.twin.as_ref(), d.hub_twin_read) else { return Ok(None) };
        let fresh = match ttl {
            TwinCacheTtl::Off => false,
            TwinCacheTtl::Forever => true,
            TwinCacheTtl::For(ttl) => read.elapsed() < ttl,
        };
        Ok(fresh.then(|| TwinView { doc: twin.doc.clone(), at: twin.at }))
    }

    /// Caches a twin from the hub and returns the twin to serve. When the cached twin (a
    /// previous hub read or `replaceTwin`, plus change events) has a higher `version`, the
    /// events were newer than this read: the cached document is kept, its read time renewed.
    /// Without a twin cache (`-1`) the twin is kept only while a session may be pushed it, as
    /// the base later changes merge into, and the twin served is the hub's own answer.
    pub(super) fn store_hub_twin(&mut self, device: &str, doc: Value) -> TwinView {
        let now = now_millis();
        let d = self.devices.entry_ref(device).or_default();
        if self.hub_twins == Some(TwinCacheTtl::Off) {
            let served = TwinView { doc: doc.clone(), at: now };
            if d.twin_watched() {
                Self::keep_whole_twin(d, doc, now);
            }
            self.prune(device);
            return served;
        }
        Self::keep_whole_twin(d, doc, now);
        let twin = d.twin.as_ref().expect("kept above");
        TwinView { doc: twin.doc.clone(), at: twin.at }
    }

    /// Takes a whole twin read from the hub, unless the one kept is newer.
    pub(super) fn keep_whole_twin(d: &mut Device, doc: Value, at: Millis) {
        let newer_kept = match d.twin.as_ref() {
            Some(cached) => twin_version(&cached.doc).zip(twin_version(&doc)).is_some_and(|(c, n)| c > n),
            None => false,
        };
        if !newer_kept {
            d.twin = Some(Twin { doc, at });
        }
        d.hub_twin_read = Some(Instant::now());
    }

    /// The hub's answer to a whole-twin read asked by [`Self::take_twin_fetches`]: the changes
    /// that waited are merged into it, in order (those the read already holds, by `version`,
    /// are skipped), and the result is pushed whole. If the read failed, the changes are dropped
    /// (counted as `twin_unavailable`, logged) and nothing is pushed: a change alone is not
    /// the twin; the next change asks the hub again. Returns true when the twin must be read
    /// again (changes were dropped while this read was on its way).
    pub fn hub_twin_fetched(
        &mut self,
        device_id: &str,
        read: Result<Value, Rejection>,
        now: Instant,
        out: &mut Vec<Delivery>,
    ) -> bool {
        self.dirty.device(device_id);
        let Some(device) = self.devices.get_mut(device_id) else { return false };
        let Some(mut pending) = device.twin_pending.take() else {
            return false; // a replaceTwin or a lifecycle event settled it meanwhile
        };
        if pending.overflowed {
            pending.overflowed = false;
            device.twin_pending = Some(pending);
            return true;
        }
        let Some(&(_, at)) = pending.changes.last() else { return false };
        let wanted = device.wants(|a| a.subscribed_twin());
        match read {
            Ok(doc) if doc.is_object() => Self::keep_whole_twin(device, doc, at),
            // A read answered meanwhile (GET /deviceTwin) left a whole twin to merge into.
            _ if device.twin.is_some() => {}
            failed => {
                let why = match failed {
                    Err(r) => format!("IoT Hub twin read failed: {} {}", r.status, r.message),
                    Ok(_) => "IoT Hub twin read answered no JSON object".to_string(),
                };
                for _ in &pending.changes {
                    FAULTS.record(Fault::TwinUnavailable, Some(device_id), &why);
                }
                self.prune(device_id);
                return false;
            }
        }
        let twin = device.twin.as_mut().expect("a whole twin is known here");
        for (change, _) in pending.changes {
            // Changes the read already holds are skipped by version.
            if twin_version(&change).zip(twin_version(&twin.doc)).is_none_or(|(new, kept)| new > kept) {
                merge_patch(&mut twin.doc, change);
            }
        }
        twin.at = at;
        if wanted {
            let whole = Some(twin.doc.to_string());
            let device_arc: Arc<str> = Arc::from(device_id);
            let publication = Publication { device: device_arc.clone(), at, twin: whole, ..Default::default() };
            self.publish(&device_arc, publication, now, out);
        }
        self.prune(device_id); // the sessions may have gone while the hub was read
        false
    }
}

impl PendingTwin {
    /// Holds one more change, within the bounds (see the type).
    pub(super) fn hold(&mut self, change: Value, at: Millis) {
        let size = change.to_string().len();
        if self.changes.len() >= PENDING_TWIN_CHANGES || self.bytes + size > PENDING_TWIN_BYTES {
            self.changes.clear();
            self.bytes = 0;
            self.overflowed = true;
        }
        // A change bigger than the whole bound is not held either: the read again after the
        // one in flight brings it (the hub applied it before it was sent on).
        if size > PENDING_TWIN_BYTES {
            return;
        }
        self.bytes += size;
        self.changes.push((change, at));
    }
}

/// A twin document's `version` (the whole twin's; changes carry it too).
pub(super) fn twin_version(doc: &Value) -> Option<i64> {
    doc.get("version").and_then(Value::as_i64)
}


/// JSON merge patch (RFC 7396): objects merge recursively, `null` deletes, the rest replaces.
pub fn merge_patch(target: &mut Value, patch: Value) {
    match patch {
        Value::Object(patch) => {
            if !target.is_object() {
                *target = Value::Object(Default::default());
            }
            let map = target.as_object_mut().expect("made an object above");
            for (k, v) in patch {
                if v.is_null() {
                    map.remove(&k);
                } else {
                    merge_patch(map.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other,
    }
}
