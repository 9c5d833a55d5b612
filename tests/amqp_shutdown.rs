//! Graceful shutdown with the event stream connected: the partition links are detached
//! (AMQP detach, closed) and the connection closed before the process exits 0.

mod amqp_support;

use std::time::Duration;

use amqp_support::{FakeAuth, FakeHub, NewEvent, Server};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn sigterm_detaches_every_partition_link_and_closes_the_connection() {
    let hub = FakeHub::start(&["0", "1"], FakeAuth::Plain);
    let cs = hub.connection_string();
    let mut server = Server::start(&["--iot-hub-event-hub-connection-string", cs.as_str()]);
    server.wait_connected();
    hub.publish("1", NewEvent::telemetry("pump-1", json!({"pressure": 4.2})));
    server.wait_for("/lastValue/pump-1/pressure", WAIT, |s, _| s == 200);
    assert_eq!(hub.stats().closed_links, 0);

    server.signal(libc::SIGTERM);
    let exit = server.wait_exit(WAIT).expect("exits");
    assert_eq!(exit.code(), Some(0), "{}", server.log_tail(30));
    assert_eq!(hub.stats().closed_links, 2, "each partition link closed with a detach");
    // The connection ended with an AMQP close, not a dropped socket (the fake sees it as its
    // connection task ends, after the process exited).
    let stats = hub.wait_for_stats(WAIT, |s| s.closed_connections > 0);
    assert_eq!(stats.closed_connections, 1, "{stats:?}");
    server.wait_for_log("partition links detached, connection closed", WAIT);
}
