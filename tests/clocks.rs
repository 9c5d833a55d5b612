//! The per-core clock (src/runtime/clock.rs): each core's timer task sleeps until its next
//! deadline instead of ticking. Counted with `hubcast_core_timer_wakeups_total` over a window
//! bounded by events (server pings on an open socket), never by wall-clock assertions.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use tungstenite::Message;

const WAIT: Duration = Duration::from_secs(3);
const CORES: usize = 2;

/// Timer wake-ups of every core together.
fn wakeups(server: &Server) -> f64 {
    (0..CORES)
        .map(|core| {
            let series = format!("hubcast_core_timer_wakeups_total{{core=\"{core}\"}}");
            server.metric(&series).unwrap_or_else(|| panic!("{series} is exported"))
        })
        .sum()
}

/// Waits for the server's next WebSocket ping (tungstenite answers it); false on timeout.
fn next_ping(live: &mut ws::Live, timeout: Duration) -> bool {
    live.ws.get_ref().set_read_timeout(Some(timeout)).ok();
    loop {
        match live.ws.read() {
            Ok(Message::Ping(_)) => return true,
            Ok(Message::Text(t)) => panic!("nothing is pushed while idle, got {t}"),
            Ok(_) => continue,
            Err(e) => panic!("socket failed while waiting for a ping: {e}"),
        }
    }
}

#[test]
fn an_idle_core_with_throttling_on_and_a_session_open_wakes_only_for_its_pings() {
    let server = Server::start(&["--cores", "2", "--throttling-interval", "300", "--ping-interval", "100", "--ping-timeout", "5000"]);
    let session = server.new_session();
    let sub = json!({"deviceId": "dev-1", "type": "telemetry", "telemetryKey": null});
    server.grant(&session, sub.clone());
    let (status, body) = server.subscribe(&session, sub);
    assert_eq!(status, 204, "{body}");
    let mut live = server.live(&session);
    // Throttling is in use: the leading message goes straight out and arms nothing.
    server.ingest(json!({"deviceId": "dev-1", "body": {"t": 1}}));
    assert_eq!(live.next_json(WAIT).expect("the leading message")["telemetry"], json!({"t": 1}));

    // The window: ten server pings. A 5 ms tick would wake both cores ~200 times in it. The
    // pings themselves run on the core's socket timers (src/transport/timers.rs): one wake-up
    // sends a ping, and the answer (tungstenite pongs at once) moves the next ping earlier
    // than the answer's 5 s deadline, at most one more; nothing else wakes between pings.
    let before = wakeups(&server);
    for n in 0..10 {
        assert!(next_ping(&mut live, WAIT), "ping {n} arrives");
    }
    let idle = wakeups(&server) - before;
    assert!((9.0..=22.0).contains(&idle), "{idle} timer wake-ups over ten pings of an idle hubcast");

    // The counter is live, and a sleeping clock is woken for an earlier deadline: two messages
    // within the interval hold the second back until a trailing flush, which needs the timer.
    let before = wakeups(&server);
    server.ingest(json!([{"deviceId": "dev-1", "body": {"t": 2}}, {"deviceId": "dev-1", "body": {"t": 3}}]));
    let mut telemetry = Vec::new();
    while telemetry.len() < 2 {
        let frame = live.next_json(WAIT).expect("leading and trailing telemetry");
        telemetry.push(frame["telemetry"].clone());
    }
    assert_eq!(telemetry, vec![json!({"t": 2}), json!({"t": 3})]);
    assert!(wakeups(&server) > before, "the trailing flush was a timer wake-up");
}
