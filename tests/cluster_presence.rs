//! Presence across instances started with different `--lease-ttl` (review of issue 23's
//! presence, docs/design/recovery.md step 11 c): whether another instance is dead is judged
//! by its own TTL and heartbeat, named in its `instance` key, not by the judge's. Real
//! binaries on a real redis-server and on a 3-master Redis Cluster (`both_engines!`), the npm
//! socket.io-client behind a cutting proxy.

mod common;

use common::recovery::*;
use common::redis::Engine;
use common::Want;

both_engines!(
    a_live_instance_with_a_shorter_lease_ttl_than_the_judges_is_asked_for_its_rings,
    an_older_builds_presence_naming_no_ttl_is_judged_by_the_readers_own,
);

/// B (`--lease-ttl 30`: a heartbeat of 2 s) rebuilds the history of a client whose instance
/// A was killed; C, alive, takes dev-1 in and renews its presence on its own 2 s TTL (a
/// heartbeat of 667 ms). Judged by B's TTL, C's presence (at most 2 s left of it) looked
/// renewed 28 s ago: dead, not asked for its ring of dev-1, and the rebuild was refused
/// (`history_lost`). Judged by its own, C is alive and asked: `recovered` true, every
/// message once, in order, then live data. A (killed, 2 s) is still told dead by its own.
fn a_live_instance_with_a_shorter_lease_ttl_than_the_judges_is_asked_for_its_rings(engine: Engine) {
    let mut a = engine.instance("a", &["--lease-ttl", "2"]);
    let b = engine.instance("b", &["--lease-ttl", "30", "--log-level", "debug"]);
    let c = engine.instance("c", &["--lease-ttl", "2"]);
    let (cutter, client) = client_on_a_of_three(&a, &b, &c);
    a_third_live_instance_answers_and_the_client_recovers(&mut a, &b, &c, &cutter, &client);
}

/// An older build's `instance` key holds `<time>` alone, no TTL (docs/OPERATIONS.md): such
/// an instance is judged by the reader's own `--lease-ttl`, as every instance was before.
/// In a rolling upgrade the versions run one TTL: here B at 30 s and a fake older instance
/// `old`, its presence written once in the old format with a 30 s TTL (on a cluster its
/// member of `{t}:instances` too, as the old build's script wrote it, and the old-format key
/// beside it) and never renewed, as an older build that was killed. Once B can see it (4
/// instances), A's client is cut off and A killed: B, judging `old` by its own 30 s, tells
/// it dead a heartbeat and a second after the write and rebuilds the history from C's ring
/// and its own without waiting for it: `recovered` true, every message once in order, C
/// asked and `old` never. Were the missing TTL read as 0, `old` would look renewed in the
/// future: the rebuild waits for it and the client's CONNECT with it (checked: the test then
/// fails, no `connect`). Not told apart here: a reading that takes an older build for long
/// dead (for a killed one the outcome is the same).
fn an_older_builds_presence_naming_no_ttl_is_judged_by_the_readers_own(engine: Engine) {
    let mut a = engine.instance("a", &["--lease-ttl", "2"]);
    let b = engine.instance("b", &["--lease-ttl", "30", "--log-level", "debug"]);
    let c = engine.instance("c", &["--lease-ttl", "2"]);
    let (cutter, client) = client_on_a_of_three(&a, &b, &c);
    let (key, ttl) = (engine.control_key("t", "instance:old"), "30000");
    let reply = if engine.is_cluster() {
        // The older build's presence script (`ZADD` by Redis's clock), and the key it never
        // wrote, here in the single-Redis build's format.
        let script = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) redis.call('SET', KEYS[2], now, 'PX', ARGV[2]) return 1";
        let instances = engine.control_key("t", "instances");
        engine.command_bytes(&key, &[b"EVAL", script.as_bytes(), b"2", instances.as_bytes(), key.as_bytes(), b"old", ttl.as_bytes()])
    } else {
        engine.command_bytes(&key, &[b"SET", key.as_bytes(), common::now_millis().to_string().as_bytes(), b"PX", ttl.as_bytes()])
    };
    assert!(reply.as_deref().is_some_and(|r| !r.starts_with(b"-")), "{:?}", reply.map(|r| String::from_utf8_lossy(&r).into_owned()));
    b.wait_for_metric("hubcast_redis_instances{instance=\"b\"}", WAIT, Want::Eq(4.0));
    a_third_live_instance_answers_and_the_client_recovers(&mut a, &b, &c, &cutter, &client);
    let asked: Vec<String> = b.stderr_lines().into_iter().filter(|l| l.contains("another instance is alive")).collect();
    assert!(!asked.iter().any(|l| l.contains("instance=old")), "the older build's instance, never renewed, was asked: {asked:?}");
}
