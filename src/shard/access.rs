//! What one session may do with one device (grants) and what it receives (subscriptions).
//!
//! Lives on the device's core next to the device's data, so the fan-out decision and every
//! grant check is a local lookup. Rules (see docs/PROTOCOL.md, "Behaviour where ux4iot's
//! documents are silent"):
//! - a key-less grant (`telemetryKey`/`directMethodName` null or absent) covers every key;
//! - subscribing to one telemetry key needs that key's grant or the wildcard; subscribing to
//!   all keys needs the wildcard;
//! - revoking a key removes that key's grant; revoking without a key removes every grant of
//!   that kind; subscriptions no remaining grant covers are dropped at once.

use smallvec::SmallVec;

use crate::model::{DataKind, Grant, GrantKind, Subscription};

/// A set of keys with a wildcard.
#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct KeySet {
    pub all: bool,
    pub keys: Keys,
}

/// The keys of a [`KeySet`]: one pointer, no allocation while empty (wildcard grants and
/// subscriptions, the usual case). Three key sets sit in every access entry of every
/// session on every device it holds: inline room for two keys made each 48 bytes instead
/// of 16 (issue 25 item 3, idle memory per session).
#[derive(Default, Debug, Clone, PartialEq, Eq)]
// The box is the point: one word in the entry, the Vec's three only while keys are held.
#[allow(clippy::box_collection)]
pub struct Keys(Option<Box<Vec<Box<str>>>>);

impl Keys {
    pub fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |k| k.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> std::slice::Iter<'_, Box<str>> {
        self.0.as_deref().map_or([].iter(), |k| k.iter())
    }

    pub fn push(&mut self, key: Box<str>) {
        self.0.get_or_insert_with(Default::default).push(key);
    }

    /// Keeps the keys `keep` says yes to (none left: no allocation).
    pub fn retain(&mut self, keep: impl FnMut(&Box<str>) -> bool) {
        if let Some(k) = self.0.as_mut() {
            k.retain(keep);
            if k.is_empty() {
                self.0 = None;
            }
        }
    }
}

impl<'a> IntoIterator for &'a Keys {
    type Item = &'a Box<str>;
    type IntoIter = std::slice::Iter<'a, Box<str>>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl FromIterator<Box<str>> for Keys {
    fn from_iter<I: IntoIterator<Item = Box<str>>>(iter: I) -> Self {
        let keys: Vec<Box<str>> = iter.into_iter().collect();
        Self((!keys.is_empty()).then(|| Box::new(keys)))
    }
}

impl KeySet {
    pub fn is_empty(&self) -> bool {
        !self.all && self.keys.is_empty()
    }

    /// Whether `key` (`None` = every key) is covered.
    pub fn covers(&self, key: Option<&str>) -> bool {
        match key {
            None => self.all,
            Some(k) => self.all || self.keys.iter().any(|x| &**x == k),
        }
    }

    /// Whether a single concrete key passes this set.
    pub fn contains_key(&self, key: &str) -> bool {
        self.all || self.keys.iter().any(|x| &**x == key)
    }

    fn insert(&mut self, key: Option<&str>) {
        match key {
            None => self.all = true,
            Some(k) if !self.keys.iter().any(|x| &**x == k) => self.keys.push(k.into()),
            Some(_) => {}
        }
    }

    fn remove(&mut self, key: Option<&str>) {
        match key {
            None => self.all = false,
            Some(k) => self.keys.retain(|x| &**x != k),
        }
    }

    /// Keep only what `grants` covers.
    fn restrict_to(&mut self, grants: &KeySet) {
        if !grants.all {
            self.all = false;
            self.keys.retain(|k| grants.keys.iter().any(|g| g == k));
        }
    }
}

#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct Grants {
    pub telemetry: KeySet,
    pub device_twin: bool,
    pub connection_state: bool,
    pub d2c_messages: bool,
    pub desired_properties: bool,
    pub direct_methods: KeySet,
}

#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct Subscriptions {
    pub telemetry: KeySet,
    pub device_twin: bool,
    pub connection_state: bool,
    pub d2c_messages: bool,
}

impl Subscriptions {
    pub fn is_empty(&self) -> bool {
        self.telemetry.is_empty() && !self.device_twin && !self.connection_state && !self.d2c_messages
    }
}

/// Telemetry held back by `throttlingInterval` for one session and device.
#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct Throttle {
    /// When telemetry was last sent to this session for this device.
    pub last_sent: Option<std::time::Instant>,
    /// Keys that arrived since, newest value per key, and the newest timestamp.
    pub pending: SmallVec<[(Box<str>, crate::ingest::JsonText); 4]>,
    pub pending_at: i64,
    /// A trailing flush is scheduled.
    pub armed: bool,
}

#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct Access {
    pub grants: Grants,
    pub subs: Subscriptions,
    pub throttle: Option<Box<Throttle>>,
    /// Scale-out: the session has a live socket on this instance (not stored).
    pub here: bool,
    /// Scale-out: the session's version in Redis this access was written at (not stored; 0:
    /// unversioned). A shared change older than it is not applied; an entry emptied by a
    /// versioned change stays, empty, until the session goes, so a late older change cannot
    /// bring the access back (cluster/wire.rs, `SharedOp::Accesses`).
    pub v: u64,
}

impl Access {
    pub fn is_empty(&self) -> bool {
        self.grants == Grants::default() && self.subs.is_empty()
    }

    pub fn add_grant(&mut self, grant: &Grant) {
        let g = &mut self.grants;
        match grant.kind {
            GrantKind::Data(DataKind::Telemetry) => g.telemetry.insert(grant.key.as_deref()),
            GrantKind::Data(DataKind::DeviceTwin) => g.device_twin = true,
            GrantKind::Data(DataKind::ConnectionState) => g.connection_state = true,
            GrantKind::Data(DataKind::D2cMessages) => g.d2c_messages = true,
            GrantKind::DesiredProperties => g.desired_properties = true,
            GrantKind::DirectMethod => g.direct_methods.insert(grant.key.as_deref()),
        }
    }

    /// Removes the permission and, at once, every subscription no remaining grant covers.
    pub fn revoke(&mut self, grant: &Grant) {
        let g = &mut self.grants;
        match grant.kind {
            GrantKind::Data(DataKind::Telemetry) => match grant.key.as_deref() {
                None => g.telemetry = KeySet::default(),
                key => g.telemetry.remove(key),
            },
            GrantKind::Data(DataKind::DeviceTwin) => g.device_twin = false,
            GrantKind::Data(DataKind::ConnectionState) => g.connection_state = false,
            GrantKind::Data(DataKind::D2cMessages) => g.d2c_messages = false,
            GrantKind::DesiredProperties => g.desired_properties = false,
            GrantKind::DirectMethod => match grant.key.as_deref() {
                None => g.direct_methods = KeySet::default(),
                key => g.direct_methods.remove(key),
            },
        }
        let s = &mut self.subs;
        s.telemetry.restrict_to(&g.telemetry);
        s.device_twin &= g.device_twin;
        s.connection_state &= g.connection_state;
        s.d2c_messages &= g.d2c_messages;
    }

    /// Whether the grants cover this subscription.
    pub fn permits(&self, sub: &Subscription) -> bool {
        let g = &self.grants;
        match sub.kind {
            DataKind::Telemetry => g.telemetry.covers(sub.key.as_deref()),
            DataKind::DeviceTwin => g.device_twin,
            DataKind::ConnectionState => g.connection_state,
            DataKind::D2cMessages => g.d2c_messages,
        }
    }

    /// Whether the grants cover this grant-shaped permission (direct methods, desired properties…).
    pub fn holds(&self, grant: &Grant) -> bool {
        match grant.kind {
            GrantKind::Data(kind) => self.permits(&Subscription { kind, key: grant.key.clone() }),
            GrantKind::DesiredProperties => self.grants.desired_properties,
            GrantKind::DirectMethod => self.grants.direct_methods.covers(grant.key.as_deref()),
        }
    }

    /// Adds the subscription if permitted; returns whether it was.
    pub fn subscribe(&mut self, sub: &Subscription) -> bool {
        if !self.permits(sub) {
            return false;
        }
        let s = &mut self.subs;
        match sub.kind {
            DataKind::Telemetry => s.telemetry.insert(sub.key.as_deref()),
            DataKind::DeviceTwin => s.device_twin = true,
            DataKind::ConnectionState => s.connection_state = true,
            DataKind::D2cMessages => s.d2c_messages = true,
        }
        true
    }

    /// Removes the subscription if permitted (ux4iot answers 403 otherwise); returns whether it was.
    pub fn unsubscribe(&mut self, sub: &Subscription) -> bool {
        if !self.permits(sub) {
            return false;
        }
        let s = &mut self.subs;
        match sub.kind {
            DataKind::Telemetry => s.telemetry.remove(sub.key.as_deref()),
            DataKind::DeviceTwin => s.device_twin = false,
            DataKind::ConnectionState => s.connection_state = false,
            DataKind::D2cMessages => s.d2c_messages = false,
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn telemetry(key: Option<&str>) -> Grant {
        Grant { kind: GrantKind::Data(DataKind::Telemetry), key: key.map(Into::into) }
    }
    fn sub(key: Option<&str>) -> Subscription {
        Subscription { kind: DataKind::Telemetry, key: key.map(Into::into) }
    }

    /// An access entry is held per session and device: keep it small (issue 25 item 3).
    #[test]
    fn an_access_entry_stays_small() {
        assert_eq!(std::mem::size_of::<KeySet>(), 16);
        assert!(std::mem::size_of::<Access>() <= 88, "{} bytes (grants {}, subscriptions {})", std::mem::size_of::<Access>(), std::mem::size_of::<Grants>(), std::mem::size_of::<Subscriptions>());
        let mut k = KeySet::default();
        k.insert(Some("a"));
        k.insert(Some("b"));
        k.remove(Some("a"));
        assert_eq!(k.keys.iter().map(|k| &**k).collect::<Vec<_>>(), ["b"]);
        k.remove(Some("b"));
        assert_eq!(k.keys, Keys::default(), "emptied: no allocation kept");
    }

    #[test]
    fn wildcard_grant_covers_every_key_and_all_keys() {
        let mut a = Access::default();
        a.add_grant(&telemetry(None));
        assert!(a.subscribe(&sub(Some("t"))));
        assert!(a.subscribe(&sub(None)));
    }

    #[test]
    fn per_key_grant_does_not_cover_all_keys() {
        let mut a = Access::default();
        a.add_grant(&telemetry(Some("a")));
        assert!(a.subscribe(&sub(Some("a"))));
        assert!(!a.subscribe(&sub(Some("b"))));
        assert!(!a.subscribe(&sub(None)));
    }

    #[test]
    fn revoking_the_wildcard_drops_uncovered_subscriptions() {
        let mut a = Access::default();
        a.add_grant(&telemetry(None));
        a.add_grant(&telemetry(Some("b")));
        a.subscribe(&sub(Some("a")));
        a.subscribe(&sub(None));
        a.revoke(&telemetry(Some("b")));
        assert!(a.subs.telemetry.all, "wildcard still held");
        a.revoke(&telemetry(None));
        assert!(a.subs.telemetry.is_empty());
        assert!(a.grants.telemetry.is_empty(), "revoke without key removes every telemetry grant");
    }
}
