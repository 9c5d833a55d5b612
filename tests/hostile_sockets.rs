//! hubcast under a memory limit (`prlimit --as`) while issue 9's hostile clients push at the
//! same time: Socket.IO pings of 65 KB before and after CONNECT from sockets that never read,
//! a stalled reader of big device messages, and 20,000 pipelined polling handshakes. Before
//! the fixes each of them alone could take hundreds of MiB and the process aborted. The process
//! must survive and keep serving a normal client.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::rawws::*;
use common::*;
use serde_json::{json, Value};

/// Room the limit leaves above what the idle process reserved at its peak: enough for normal
/// work, far less than one unbounded socket queue used to take (8192 × 65 KB).
const HEADROOM_KIB: u64 = 192 * 1024;

/// A `/proc/PID/status` field in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

/// `VmPeak` (address space, what `--as` limits) and `VmHWM` (peak resident memory) of an idle
/// server after a first request. mimalloc reserves its arenas up front, so allocations inside
/// them do not move `VmPeak`: the resident peak is the bound that sees them.
fn idle_peaks_kib(args: &[&str]) -> (u64, u64) {
    let server = Server::start(args);
    server.assert_alive();
    (status_kib(server.pid(), "VmPeak:"), status_kib(server.pid(), "VmHWM:"))
}

fn subscribed(server: &Server, device: &str, kind: &str) -> String {
    let session = server.new_session();
    let request = json!({"type": kind, "deviceId": device});
    server.grant(&session, request.clone());
    assert_eq!(server.subscribe(&session, request).0, 204);
    session
}

#[test]
fn hubcast_under_a_memory_limit_survives_every_hostile_socket_and_keeps_serving() {
    let args = ["--cores", "2", "--max-connections", "400", "--ping-timeout", "1000"];
    let (idle_peak, idle_resident) = idle_peaks_kib(&args);
    let limit_kib = idle_peak + HEADROOM_KIB;
    let limit = format!("--as={}", limit_kib * 1024);
    let mut server = Server::start_wrapped(&["prlimit", &limit, "--"], &args);

    // The normal client, connected first; it reads everything.
    let normal = subscribed(&server, "dev-ok", "telemetry");
    let mut live = server.live(&normal);
    server.ingest(json!({"deviceId": "dev-ok", "body": {"n": 0}}));
    assert!(live.next_json(WAIT).is_some(), "the normal client gets data before the attack");

    let stalled_session = subscribed(&server, "dev-big", "d2cMessages");
    let _stalled = server.live(&stalled_session); // never read again
    let flooder_sessions: Vec<String> = (0..4).map(|_| subscribed(&server, "dev-ok", "telemetry")).collect();

    std::thread::scope(|scope| {
        // A2: sockets without a session flooding 65 KB pings.
        for _ in 0..4 {
            scope.spawn(|| {
                let (mut stream, _) = raw_upgrade(&server, "/socket.io/?EIO=4&transport=websocket", Some(KEY));
                flood(&mut stream, &big_client_ping(65_000), 64 << 20);
            });
        }
        // A2: connected sockets that never read, flooding the same.
        for session in &flooder_sessions {
            let server = &server;
            scope.spawn(move || {
                let mut stream = socketio_connected(server, session);
                flood(&mut stream, &big_client_ping(65_000), 64 << 20);
            });
        }
        // A stalled reader of 60 KB device messages.
        scope.spawn(|| {
            let agent = new_agent();
            let pad = "p".repeat(60_000);
            for _ in 0..40 {
                let batch: Vec<Value> = (0..10).map(|i| json!({"deviceId": "dev-big", "body": {"i": i, "pad": pad}})).collect();
                server.ingest_on(&agent, Value::Array(batch));
            }
        });
        // A3: 20,000 pipelined polling handshakes on one connection, answers read as they come.
        scope.spawn(|| {
            let stream = server.connect();
            let mut reader = stream.try_clone().unwrap();
            reader.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let drain = std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                while matches!(reader.read(&mut buf), Ok(n) if n > 0) {}
            });
            let request = raw_get("/socket.io/?EIO=4&transport=polling");
            let all: Vec<u8> = request.iter().copied().cycle().take(request.len() * 20_000).collect();
            let mut writer = stream;
            let _ = writer.write_all(&all);
            drain.join().unwrap();
        });
        // Meanwhile the normal client keeps getting its data.
        for n in 1..=20 {
            server.ingest(json!({"deviceId": "dev-ok", "body": {"n": n}}));
            loop {
                let frame = live.next_json(Duration::from_secs(10)).expect("the normal client is served during the attack");
                if frame["telemetry"]["n"] == json!(n) {
                    break;
                }
            }
        }
    });

    assert!(server.is_running(), "hubcast survived under a {} MiB address-space limit", limit_kib / 1024);
    let resident = status_kib(server.pid(), "VmHWM:");
    assert!(
        resident < idle_resident + HEADROOM_KIB,
        "peak RSS {} MiB, idle {} MiB: the hostile clients were buffered",
        resident / 1024,
        idle_resident / 1024
    );
    server.assert_alive();
    server.ingest(json!({"deviceId": "dev-ok", "body": {"after": true}}));
    let frame = live.next_json(WAIT).expect("the normal client is still served after the attack");
    assert_eq!(frame["telemetry"], json!({"after": true}));
    // The normal client was served after the attack, so a failed allocation would be logged
    // by now (and would have aborted the process).
    let failed: Vec<String> = server.stderr_lines().into_iter().filter(|l| l.contains("memory allocation")).collect();
    assert!(failed.is_empty(), "{failed:?}");
}
