//! Presence across instances started with different `--lease-ttl` (review of issue 23's
//! presence, docs/design/recovery.md step 11 c): whether another instance is dead is judged
//! by its own TTL and heartbeat, named in its `instance` key, not by the judge's. Real
//! binaries on a real redis-server and on a 3-master Redis Cluster (`both_engines!`), the npm
//! socket.io-client behind a cutting proxy.

mod common;

use common::recovery::*;
use common::redis::Engine;

both_engines!(a_live_instance_with_a_shorter_lease_ttl_than_the_judges_is_asked_for_its_rings);

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
