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

use crate::ids::{SessionId, SessionKey};
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

    pub fn as_slice(&self) -> &[Box<str>] {
        self.0.as_deref().map_or(&[], |k| k.as_slice())
    }

    pub fn contains(&self, key: &str) -> bool {
        self.iter().any(|x| &**x == key)
    }

    fn insert(&mut self, key: &str) {
        if !self.contains(key) {
            self.push(key.into());
        }
    }

    fn remove(&mut self, key: &str) {
        self.retain(|x| &**x != key);
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
    /// Whether a single concrete key passes this set.
    pub fn contains_key(&self, key: &str) -> bool {
        KeyView { all: self.all, keys: self.keys.as_slice() }.contains_key(key)
    }
}

/// A key set as an [`Access`] holds it: its wildcard is a flag bit, its keys behind the
/// entry's one pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyView<'a> {
    pub all: bool,
    pub keys: &'a [Box<str>],
}

impl KeyView<'_> {
    pub fn is_empty(&self) -> bool {
        !self.all && self.keys.is_empty()
    }

    /// Whether `key` (`None` = every key) is covered.
    pub fn covers(&self, key: Option<&str>) -> bool {
        match key {
            None => self.all,
            Some(k) => self.contains_key(k),
        }
    }

    /// Whether a single concrete key passes this set.
    #[inline]
    pub fn contains_key(&self, key: &str) -> bool {
        self.all || self.keys.iter().any(|x| &**x == key)
    }

    fn to_set(self) -> KeySet {
        KeySet { all: self.all, keys: self.keys.iter().cloned().collect() }
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

/// The flag bits of an [`Access`].
mod bit {
    /// Telemetry granted for every key.
    pub const G_TELEMETRY: u16 = 1;
    pub const G_TWIN: u16 = 1 << 1;
    pub const G_CONNECTION: u16 = 1 << 2;
    pub const G_MESSAGES: u16 = 1 << 3;
    pub const G_DESIRED: u16 = 1 << 4;
    /// Every direct method granted.
    pub const G_METHODS: u16 = 1 << 5;
    /// Subscribed to every telemetry key.
    pub const S_TELEMETRY: u16 = 1 << 6;
    pub const S_TWIN: u16 = 1 << 7;
    pub const S_CONNECTION: u16 = 1 << 8;
    pub const S_MESSAGES: u16 = 1 << 9;
    /// Subscribed to some telemetry keys (listed in [`super::More::subscribed`]): the
    /// fan-out tells an entry without subscriptions from the bits alone.
    pub const S_KEYS: u16 = 1 << 10;
    /// Scale-out: the session has a live socket on this instance (not stored).
    pub const HERE: u16 = 1 << 11;
    pub const SUBS: u16 = S_TELEMETRY | S_TWIN | S_CONNECTION | S_MESSAGES | S_KEYS;
}

/// What one session may do with one device and what it receives, packed (issue 25 item 3:
/// one entry per session per device it holds, 10 per idle session in the benchmark): the
/// kinds and wildcards are bits, and what is rare (keys, throttling, a scale-out version)
/// sits behind one pointer, `None` for the usual wildcard grants and subscriptions.
/// 16 bytes, 112 before with its map key.
#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct Access {
    bits: u16,
    more: Option<Box<More>>,
}

/// The rare part of an [`Access`]; dropped when all of it is empty again.
#[derive(Default, Debug, Clone, PartialEq, Eq)]
struct More {
    /// Telemetry keys granted one by one.
    telemetry: Keys,
    /// Direct methods granted by name.
    methods: Keys,
    /// Telemetry keys subscribed to one by one.
    subscribed: Keys,
    throttle: Option<Box<Throttle>>,
    /// Scale-out: the session's version in Redis this access was written at (not stored; 0:
    /// unversioned). A shared change older than it is not applied; an entry emptied by a
    /// versioned change stays, empty, until the session goes, so a late older change cannot
    /// bring the access back (cluster/wire.rs, `SharedOp::Accesses`).
    v: u64,
}

impl More {
    fn is_empty(&self) -> bool {
        self.telemetry.is_empty() && self.methods.is_empty() && self.subscribed.is_empty() && self.throttle.is_none() && self.v == 0
    }
}

const NO_KEYS: &[Box<str>] = &[];

impl Access {
    /// An entry holding exactly these grants and subscriptions.
    pub fn new(grants: Grants, subs: Subscriptions) -> Self {
        let mut a = Self::default();
        a.set(grants, subs);
        a
    }

    /// Replaces the grants and subscriptions; the throttle state, presence and version stay.
    pub fn set(&mut self, g: Grants, s: Subscriptions) {
        let flag = |on: bool, b: u16| if on { b } else { 0 };
        self.bits = (self.bits & bit::HERE)
            | flag(g.telemetry.all, bit::G_TELEMETRY)
            | flag(g.device_twin, bit::G_TWIN)
            | flag(g.connection_state, bit::G_CONNECTION)
            | flag(g.d2c_messages, bit::G_MESSAGES)
            | flag(g.desired_properties, bit::G_DESIRED)
            | flag(g.direct_methods.all, bit::G_METHODS)
            | flag(s.telemetry.all, bit::S_TELEMETRY)
            | flag(s.device_twin, bit::S_TWIN)
            | flag(s.connection_state, bit::S_CONNECTION)
            | flag(s.d2c_messages, bit::S_MESSAGES);
        if self.more.is_some() || !(g.telemetry.keys.is_empty() && g.direct_methods.keys.is_empty() && s.telemetry.keys.is_empty()) {
            let m = self.more();
            m.telemetry = g.telemetry.keys;
            m.methods = g.direct_methods.keys;
            m.subscribed = s.telemetry.keys;
        }
        self.tidy();
    }

    fn has(&self, b: u16) -> bool {
        self.bits & b != 0
    }

    fn put(&mut self, b: u16, on: bool) {
        if on {
            self.bits |= b;
        } else {
            self.bits &= !b;
        }
    }

    fn more(&mut self) -> &mut More {
        self.more.get_or_insert_with(Default::default)
    }

    fn keys(&self, of: impl Fn(&More) -> &Keys) -> &[Box<str>] {
        self.more.as_deref().map_or(NO_KEYS, |m| of(m).as_slice())
    }

    /// Keeps the invariants: `S_KEYS` says whether keys are subscribed, and `more` is `None`
    /// when all of it is empty.
    fn tidy(&mut self) {
        let keys = self.more.as_deref().is_some_and(|m| !m.subscribed.is_empty());
        self.put(bit::S_KEYS, keys);
        if self.more.as_deref().is_some_and(More::is_empty) {
            self.more = None;
        }
    }

    /// The grants, as a value (for the store, the wire and reads of the access).
    pub fn grants(&self) -> Grants {
        Grants {
            telemetry: self.grant_telemetry().to_set(),
            device_twin: self.has(bit::G_TWIN),
            connection_state: self.has(bit::G_CONNECTION),
            d2c_messages: self.has(bit::G_MESSAGES),
            desired_properties: self.has(bit::G_DESIRED),
            direct_methods: self.grant_methods().to_set(),
        }
    }

    /// The subscriptions, as a value.
    pub fn subs(&self) -> Subscriptions {
        Subscriptions {
            telemetry: self.sub_telemetry().to_set(),
            device_twin: self.has(bit::S_TWIN),
            connection_state: self.has(bit::S_CONNECTION),
            d2c_messages: self.has(bit::S_MESSAGES),
        }
    }

    pub fn grant_telemetry(&self) -> KeyView<'_> {
        KeyView { all: self.has(bit::G_TELEMETRY), keys: self.keys(|m| &m.telemetry) }
    }

    /// The direct methods granted.
    pub fn grant_methods(&self) -> KeyView<'_> {
        KeyView { all: self.has(bit::G_METHODS), keys: self.keys(|m| &m.methods) }
    }

    #[inline]
    pub fn sub_telemetry(&self) -> KeyView<'_> {
        KeyView { all: self.has(bit::S_TELEMETRY), keys: self.keys(|m| &m.subscribed) }
    }

    pub fn granted_twin(&self) -> bool {
        self.has(bit::G_TWIN)
    }

    pub fn granted_connection_state(&self) -> bool {
        self.has(bit::G_CONNECTION)
    }

    #[inline]
    pub fn subs_empty(&self) -> bool {
        !self.has(bit::SUBS)
    }

    /// Subscribed to some telemetry (every key or some).
    #[inline]
    pub fn subscribed_telemetry(&self) -> bool {
        self.has(bit::S_TELEMETRY | bit::S_KEYS)
    }

    #[inline]
    pub fn subscribed_twin(&self) -> bool {
        self.has(bit::S_TWIN)
    }

    #[inline]
    pub fn subscribed_connection_state(&self) -> bool {
        self.has(bit::S_CONNECTION)
    }

    #[inline]
    pub fn subscribed_messages(&self) -> bool {
        self.has(bit::S_MESSAGES)
    }

    /// Scale-out: the session has a live socket on this instance.
    pub fn here(&self) -> bool {
        self.has(bit::HERE)
    }

    pub fn set_here(&mut self, here: bool) {
        self.put(bit::HERE, here);
    }

    /// Scale-out: the session's version this access was written at (see `More::v`).
    pub fn v(&self) -> u64 {
        self.more.as_deref().map_or(0, |m| m.v)
    }

    pub fn set_v(&mut self, v: u64) {
        if v != 0 || self.more.is_some() {
            self.more().v = v;
            self.tidy();
        }
    }

    /// The throttle state (made on first use) and the telemetry subscribed to.
    pub fn throttle(&mut self) -> (&mut Throttle, KeyView<'_>) {
        let all = self.has(bit::S_TELEMETRY);
        let m: &mut More = self.more.get_or_insert_with(Default::default);
        (m.throttle.get_or_insert_with(Default::default), KeyView { all, keys: m.subscribed.as_slice() })
    }

    /// Whether a trailing throttle flush is scheduled (a rebuild does not run the throttle
    /// again over an open window: `shard/devices/replay.rs`).
    pub fn throttle_armed(&self) -> bool {
        self.more.as_deref().and_then(|m| m.throttle.as_deref()).is_some_and(|t| t.armed)
    }

    /// The throttle state if there is one, and the telemetry subscribed to.
    pub fn throttled(&mut self) -> Option<(&mut Throttle, KeyView<'_>)> {
        let all = self.has(bit::S_TELEMETRY);
        let m = self.more.as_deref_mut()?;
        Some((m.throttle.as_deref_mut()?, KeyView { all, keys: m.subscribed.as_slice() }))
    }

    /// Grants and subscriptions held (per kind or key), for the metrics.
    pub fn counts(&self) -> (u64, u64) {
        let g = (self.bits & (bit::G_TELEMETRY | bit::G_TWIN | bit::G_CONNECTION | bit::G_MESSAGES | bit::G_DESIRED | bit::G_METHODS)).count_ones();
        let s = (self.bits & (bit::S_TELEMETRY | bit::S_TWIN | bit::S_CONNECTION | bit::S_MESSAGES)).count_ones();
        let (gk, sk) = self.more.as_deref().map_or((0, 0), |m| (m.telemetry.len() + m.methods.len(), m.subscribed.len()));
        (g as u64 + gk as u64, s as u64 + sk as u64)
    }

    pub fn is_empty(&self) -> bool {
        self.bits & !bit::HERE == 0 && self.more.as_deref().is_none_or(|m| m.telemetry.is_empty() && m.methods.is_empty())
    }

    pub fn add_grant(&mut self, grant: &Grant) {
        let key = grant.key.as_deref();
        match (grant.kind, key) {
            (GrantKind::Data(DataKind::Telemetry), None) => self.bits |= bit::G_TELEMETRY,
            (GrantKind::Data(DataKind::Telemetry), Some(k)) => self.more().telemetry.insert(k),
            (GrantKind::Data(DataKind::DeviceTwin), _) => self.bits |= bit::G_TWIN,
            (GrantKind::Data(DataKind::ConnectionState), _) => self.bits |= bit::G_CONNECTION,
            (GrantKind::Data(DataKind::D2cMessages), _) => self.bits |= bit::G_MESSAGES,
            (GrantKind::DesiredProperties, _) => self.bits |= bit::G_DESIRED,
            (GrantKind::DirectMethod, None) => self.bits |= bit::G_METHODS,
            (GrantKind::DirectMethod, Some(k)) => self.more().methods.insert(k),
        }
    }

    /// Removes the permission and, at once, every subscription no remaining grant covers.
    pub fn revoke(&mut self, grant: &Grant) {
        let key = grant.key.as_deref();
        match (grant.kind, key) {
            (GrantKind::Data(DataKind::Telemetry), None) => {
                self.bits &= !bit::G_TELEMETRY;
                if let Some(m) = self.more.as_deref_mut() {
                    m.telemetry = Keys::default();
                }
            }
            (GrantKind::Data(DataKind::Telemetry), Some(k)) => {
                if let Some(m) = self.more.as_deref_mut() {
                    m.telemetry.remove(k);
                }
            }
            (GrantKind::Data(DataKind::DeviceTwin), _) => self.bits &= !bit::G_TWIN,
            (GrantKind::Data(DataKind::ConnectionState), _) => self.bits &= !bit::G_CONNECTION,
            (GrantKind::Data(DataKind::D2cMessages), _) => self.bits &= !bit::G_MESSAGES,
            (GrantKind::DesiredProperties, _) => self.bits &= !bit::G_DESIRED,
            (GrantKind::DirectMethod, None) => {
                self.bits &= !bit::G_METHODS;
                if let Some(m) = self.more.as_deref_mut() {
                    m.methods = Keys::default();
                }
            }
            (GrantKind::DirectMethod, Some(k)) => {
                if let Some(m) = self.more.as_deref_mut() {
                    m.methods.remove(k);
                }
            }
        }
        // Subscriptions the remaining grants do not cover.
        for (g, s) in [(bit::G_TWIN, bit::S_TWIN), (bit::G_CONNECTION, bit::S_CONNECTION), (bit::G_MESSAGES, bit::S_MESSAGES)] {
            if !self.has(g) {
                self.bits &= !s;
            }
        }
        if !self.has(bit::G_TELEMETRY) {
            self.bits &= !bit::S_TELEMETRY;
            if let Some(m) = self.more.as_deref_mut() {
                let granted = &m.telemetry;
                m.subscribed.retain(|k| granted.contains(k));
            }
        }
        self.tidy();
    }

    /// Whether the grants cover this subscription.
    pub fn permits(&self, sub: &Subscription) -> bool {
        match sub.kind {
            DataKind::Telemetry => self.grant_telemetry().covers(sub.key.as_deref()),
            DataKind::DeviceTwin => self.has(bit::G_TWIN),
            DataKind::ConnectionState => self.has(bit::G_CONNECTION),
            DataKind::D2cMessages => self.has(bit::G_MESSAGES),
        }
    }

    /// Whether the grants cover this grant-shaped permission (direct methods, desired properties…).
    pub fn holds(&self, grant: &Grant) -> bool {
        match grant.kind {
            GrantKind::Data(kind) => self.permits(&Subscription { kind, key: grant.key.clone() }),
            GrantKind::DesiredProperties => self.has(bit::G_DESIRED),
            GrantKind::DirectMethod => {
                self.grant_methods().covers(grant.key.as_deref())
            }
        }
    }

    /// Adds the subscription if permitted; returns whether it was.
    pub fn subscribe(&mut self, sub: &Subscription) -> bool {
        if !self.permits(sub) {
            return false;
        }
        match (sub.kind, sub.key.as_deref()) {
            (DataKind::Telemetry, None) => self.bits |= bit::S_TELEMETRY,
            (DataKind::Telemetry, Some(k)) => {
                self.more().subscribed.insert(k);
                self.bits |= bit::S_KEYS;
            }
            (DataKind::DeviceTwin, _) => self.bits |= bit::S_TWIN,
            (DataKind::ConnectionState, _) => self.bits |= bit::S_CONNECTION,
            (DataKind::D2cMessages, _) => self.bits |= bit::S_MESSAGES,
        }
        true
    }

    /// Removes the subscription if permitted (ux4iot answers 403 otherwise); returns whether it was.
    pub fn unsubscribe(&mut self, sub: &Subscription) -> bool {
        if !self.permits(sub) {
            return false;
        }
        match (sub.kind, sub.key.as_deref()) {
            (DataKind::Telemetry, None) => self.bits &= !bit::S_TELEMETRY,
            (DataKind::Telemetry, Some(k)) => {
                if let Some(m) = self.more.as_deref_mut() {
                    m.subscribed.remove(k);
                }
                self.tidy();
            }
            (DataKind::DeviceTwin, _) => self.bits &= !bit::S_TWIN,
            (DataKind::ConnectionState, _) => self.bits &= !bit::S_CONNECTION,
            (DataKind::D2cMessages, _) => self.bits &= !bit::S_MESSAGES,
        }
        true
    }
}

/// The access entries of one device, by session. The key is the session id as two `u64`s:
/// a `u128` key aligns each entry to 16 bytes (an entry is 32 bytes with [`Access`], 48
/// with a `u128`).
#[derive(Default, Debug)]
pub struct AccessMap(hashbrown::HashMap<SessionKey, Access>);

impl AccessMap {
    pub fn get(&self, session: SessionId) -> Option<&Access> {
        self.0.get(&SessionKey::of(session))
    }

    pub fn get_mut(&mut self, session: SessionId) -> Option<&mut Access> {
        self.0.get_mut(&SessionKey::of(session))
    }

    /// The session's entry, made empty when there is none.
    pub fn entry(&mut self, session: SessionId) -> &mut Access {
        self.0.entry(SessionKey::of(session)).or_default()
    }

    pub fn insert(&mut self, session: SessionId, access: Access) {
        self.0.insert(SessionKey::of(session), access);
    }

    pub fn remove(&mut self, session: SessionId) -> Option<Access> {
        self.0.remove(&SessionKey::of(session))
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&mut Access) -> bool) {
        self.0.retain(|_, a| keep(a));
    }

    pub fn values(&self) -> impl Iterator<Item = &Access> {
        self.0.values()
    }

    pub fn iter(&self) -> impl Iterator<Item = (SessionId, &Access)> {
        self.0.iter().map(|(s, a)| (s.id(), a))
    }

    #[inline]
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (SessionId, &mut Access)> {
        self.0.iter_mut().map(|(s, a)| (s.id(), a))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
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
        assert_eq!(std::mem::size_of::<Access>(), 16);
        assert_eq!(std::mem::size_of::<(SessionKey, Access)>(), 32, "a map entry, key included");
        assert_eq!(std::mem::align_of::<(SessionKey, Access)>(), 8);
        let mut k = Keys::default();
        k.insert("a");
        k.insert("b");
        k.insert("b");
        k.remove("a");
        assert_eq!(k.iter().map(|k| &**k).collect::<Vec<_>>(), ["b"]);
        k.remove("b");
        assert_eq!(k, Keys::default(), "emptied: no allocation kept");
    }

    fn grant(kind: GrantKind, key: Option<&str>) -> Grant {
        Grant { kind, key: key.map(Into::into) }
    }

    /// Wildcard grants and subscriptions (the usual case) are bits: nothing behind the pointer.
    #[test]
    fn wildcards_allocate_nothing_and_keys_are_given_back() {
        let mut a = Access::default();
        a.add_grant(&telemetry(None));
        a.add_grant(&grant(GrantKind::Data(DataKind::DeviceTwin), None));
        a.add_grant(&grant(GrantKind::DirectMethod, None));
        assert!(a.subscribe(&sub(None)));
        assert!(a.subscribe(&Subscription { kind: DataKind::DeviceTwin, key: None }));
        assert!(a.more.is_none());
        assert!(!a.subs_empty() && a.subscribed_telemetry() && a.subscribed_twin() && !a.subscribed_messages());
        assert_eq!(a.counts(), (3, 2));

        a.add_grant(&telemetry(Some("k")));
        assert!(a.subscribe(&sub(Some("k"))));
        assert!(a.more.is_some());
        assert_eq!(a.sub_telemetry(), KeyView { all: true, keys: &["k".into()] });
        assert!(a.unsubscribe(&sub(Some("k"))));
        a.revoke(&telemetry(Some("k")));
        assert!(a.more.is_none(), "keys gone: the pointer is given back");
        a.set_v(3);
        assert_eq!(a.v(), 3);
        a.set_v(0);
        assert!(a.more.is_none());
    }

    /// Through the packed form and back: what was set is what is read.
    #[test]
    fn grants_and_subscriptions_round_trip() {
        let g = Grants {
            telemetry: KeySet { all: false, keys: ["a".into(), "b".into()].into_iter().collect() },
            device_twin: true,
            connection_state: false,
            d2c_messages: true,
            desired_properties: true,
            direct_methods: KeySet { all: true, keys: ["m".into()].into_iter().collect() },
        };
        let s = Subscriptions {
            telemetry: KeySet { all: false, keys: ["b".into()].into_iter().collect() },
            device_twin: false,
            connection_state: false,
            d2c_messages: true,
        };
        let mut a = Access::new(g.clone(), s.clone());
        a.set_here(true);
        assert_eq!((a.grants(), a.subs()), (g.clone(), s.clone()));
        assert!(a.here() && !a.is_empty());
        assert!(a.holds(&grant(GrantKind::DirectMethod, Some("other"))), "the wildcard method grant");
        assert!(a.holds(&telemetry(Some("a"))) && !a.holds(&telemetry(None)));
        assert_eq!(a.counts(), (7, 2));
        a.set(Grants::default(), Subscriptions::default());
        assert!(a.is_empty() && a.here() && a.subs_empty() && a.more.is_none());
        let all = Access::new(Grants::default(), Subscriptions { telemetry: KeySet { all: true, keys: Keys::default() }, ..Default::default() });
        assert!(all.subscribed_telemetry() && all.sub_telemetry().contains_key("x"));
    }

    /// Revoking a kind drops its subscription; revoking one key of several keeps the others.
    #[test]
    fn revoking_drops_what_is_no_longer_covered() {
        let mut a = Access::default();
        for kind in [DataKind::DeviceTwin, DataKind::ConnectionState, DataKind::D2cMessages] {
            a.add_grant(&grant(GrantKind::Data(kind), None));
            assert!(a.subscribe(&Subscription { kind, key: None }));
        }
        a.add_grant(&telemetry(Some("a")));
        a.add_grant(&telemetry(Some("b")));
        assert!(a.subscribe(&sub(Some("a"))) && a.subscribe(&sub(Some("b"))));
        a.revoke(&grant(GrantKind::Data(DataKind::ConnectionState), None));
        assert!(!a.subscribed_connection_state() && a.subscribed_twin() && a.subscribed_messages());
        a.revoke(&telemetry(Some("a")));
        assert_eq!(a.sub_telemetry().keys, &["b".into()] as &[Box<str>]);
        a.revoke(&telemetry(None));
        assert!(!a.subscribed_telemetry() && a.grant_telemetry().is_empty());
        a.revoke(&grant(GrantKind::Data(DataKind::DeviceTwin), None));
        a.revoke(&grant(GrantKind::Data(DataKind::D2cMessages), None));
        assert!(a.subs_empty() && a.is_empty() && a.more.is_none());
    }

    /// The map's key gives back the same session id, and a throttle survives `set`.
    #[test]
    fn the_map_keys_sessions_and_keeps_throttling() {
        let mut m = AccessMap::default();
        let s = SessionId(u128::MAX - 5);
        m.entry(s).add_grant(&telemetry(None));
        assert!(m.get_mut(s).unwrap().subscribe(&sub(None)));
        m.entry(s).throttle().0.armed = true;
        m.get_mut(s).unwrap().set(Grants::default(), Subscriptions::default());
        assert!(m.get_mut(s).unwrap().throttled().is_some_and(|(t, _)| t.armed));
        assert_eq!(m.iter().map(|(id, _)| id).collect::<Vec<_>>(), [s]);
        assert!(m.get(SessionId(5)).is_none());
        assert!(m.remove(s).is_some() && m.is_empty());
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
        assert!(a.sub_telemetry().all, "wildcard still held");
        a.revoke(&telemetry(None));
        assert!(a.sub_telemetry().is_empty());
        assert!(a.grant_telemetry().is_empty(), "revoke without key removes every telemetry grant");
    }
}
