//! Every Redis key and channel name of the link, in one place (`P` = `--redis-prefix`; the
//! list is in docs/OPERATIONS.md, "Several instances on Redis").
//!
//! Why a type: on a Redis Cluster a multi-key command, a transaction or a script must keep
//! all its keys in one hash slot, so names carry hash tags there: a session's key is
//! `P:session:{<id>}` (its own slot), and every control key and channel (instances,
//! watches, leases, checkpoints, `ops`, `watch`, `read`, answers) starts with `{P}` (one slot
//! for all of them: low rate, and scripts over several leases stay legal). On one Redis the
//! names stay what they were before clusters (no migration of a running deployment). Device
//! channels `P:device:<id>` carry no tag on either: spread over the slots, so the masters
//! share the traffic.

use crate::ids::SessionId;

#[derive(Debug, Clone)]
pub(crate) struct Names {
    prefix: String,
    /// `P` on one Redis, `{P}` on a cluster.
    control: String,
    cluster: bool,
}

impl Names {
    pub(crate) fn new(prefix: &str, cluster: bool) -> Names {
        let control = if cluster { format!("{{{prefix}}}") } else { prefix.to_string() };
        Names { prefix: prefix.to_string(), control, cluster }
    }

    pub(crate) fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// A session's hash: `created` and `a:<device>` per device.
    pub(crate) fn session(&self, id: SessionId) -> String {
        if self.cluster {
            format!("{}:session:{{{id}}}", self.prefix)
        } else {
            format!("{}:session:{id}", self.prefix)
        }
    }

    /// A deleted session's tombstone, in its session's slot (written with the `DEL`, lives a
    /// session TTL): a copy whose session is missing from Redis is dropped only if this says it
    /// was deleted, not lost with a Redis that restarted empty (cluster/resync.rs).
    pub(crate) fn gone(&self, id: SessionId) -> String {
        if self.cluster {
            format!("{}:gone:{{{id}}}", self.prefix)
        } else {
            format!("{}:gone:{id}", self.prefix)
        }
    }

    /// Written by `DELETE /sessions` (lives a session TTL): every session missing from Redis
    /// meanwhile was deleted (cluster/resync.rs).
    pub(crate) fn cleared(&self) -> String {
        format!("{}:cleared", self.control)
    }

    /// `MATCH` pattern of every session key (both forms).
    pub(crate) fn sessions_pattern(&self) -> String {
        format!("{}:session:*", self.prefix)
    }

    /// A key `kind:id`: a device's channel and session patterns under `P`, every other
    /// (instances, watches, leases, checkpoints, holders, handed, stalled, answers) a control
    /// name under `P` on one Redis and `{P}` on a cluster.
    pub(crate) fn key(&self, kind: &str, id: &str) -> String {
        match kind {
            "device" => self.device(id),
            "session" => format!("{}:session:{id}", self.prefix),
            _ => format!("{}:{kind}:{id}", self.control),
        }
    }

    /// One Redis: the pattern of the live instances' keys (`P:instance:<id>`).
    pub(crate) fn instances_pattern(&self) -> String {
        self.key("instance", "*")
    }

    /// A cluster: the live instances as one sorted set (member: instance, score: the time its
    /// presence expires, ms), since a `SCAN` would have to visit every master.
    pub(crate) fn instances(&self) -> String {
        format!("{}:instances", self.control)
    }

    /// Control channels: `ops`, `watch`, `read`.
    pub(crate) fn channel(&self, name: &str) -> String {
        format!("{}:{name}", self.control)
    }

    /// A device's channel (no hash tag: spread over the slots).
    pub(crate) fn device(&self, id: &str) -> String {
        format!("{}:device:{id}", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use redis::cluster_routing::{Route, SlotAddr};

    /// Two keys are in one slot when the redis crate routes them to one (it hashes exactly
    /// as Redis does: CRC16 of the hash tag if there is one).
    fn slot(key: &str) -> Route {
        Route::with_key(key, SlotAddr::Master)
    }

    #[test]
    fn one_redis_keeps_the_names_it_always_had() {
        let n = Names::new("hc", false);
        let id = SessionId(0x1234_5678_9abc);
        assert_eq!(n.session(id), format!("hc:session:{id}"));
        assert_eq!(n.key("instance", "a"), "hc:instance:a");
        assert_eq!(n.key("watching", "a"), "hc:watching:a");
        assert_eq!(n.key("lease", "0badf00d:3"), "hc:lease:0badf00d:3");
        assert_eq!(n.key("session", "*"), "hc:session:*");
        assert_eq!((n.channel("ops"), n.key("answer", "a"), n.key("device", "d")), ("hc:ops".into(), "hc:answer:a".into(), "hc:device:d".into()));
    }

    #[test]
    fn on_a_cluster_control_names_share_one_slot_and_sessions_and_devices_spread() {
        let n = Names::new("hc", true);
        let control = [
            n.instances(),
            n.key("watching", "a"),
            n.key("watching", "b"), n.key("stalled", "a"),
            n.key("lease", "1:0"),
            n.key("checkpoint", "1:0"),
            n.channel("ops"),
            n.channel("watch"),
            n.key("answer", "a"),
        ];
        assert!(control.iter().all(|k| slot(k) == slot("hc")), "{control:?}");
        let id = SessionId(0x1234_5678_9abc);
        assert_eq!(n.session(id), format!("hc:session:{{{id}}}"));
        assert_eq!(slot(&n.session(id)), slot(&id.to_string()));
        assert_eq!(slot(&n.gone(id)), slot(&n.session(id)), "a tombstone is written with its session's DEL");
        assert_eq!(slot(&n.cleared()), slot("hc"));
        let slots: std::collections::HashSet<Route> = (0..100).map(|i| slot(&n.device(&format!("dev-{i}")))).collect();
        assert!(slots.len() > 90, "device channels spread over the slots: {}", slots.len());
        assert!(n.session(id).starts_with(&n.sessions_pattern()[..n.sessions_pattern().len() - 1]));
    }
}
