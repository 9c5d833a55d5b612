//! The flush policy of socket writers (`--socket-linger-us`, src/push/linger.rs): a socket that
//! was idle gets its message in a write of its own at once, never held; under load, writes are
//! held a bounded moment so each carries several frames. Observed through `/metrics`
//! (`hubcast_socket_writes_total`, `hubcast_socket_frames_written_total`,
//! `hubcast_socket_writes_held_total`); nothing here measures time.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);
const WRITES: &str = "hubcast_socket_writes_total{transport=\"websocket\"}";
const FRAMES: &str = "hubcast_socket_frames_written_total{transport=\"websocket\"}";
const HELD: &str = "hubcast_socket_writes_held_total";

fn subscribed(server: &Server, device: &str) -> String {
    let session = server.new_session();
    let request = json!({"type": "telemetry", "deviceId": device, "telemetryKey": null});
    server.grant(&session, request.clone());
    let (status, body) = server.subscribe(&session, request);
    assert_eq!(status, 204, "{body}");
    session
}

fn publish(server: &Server, device: &str, i: usize) {
    assert_eq!(server.ingest(json!([{"deviceId": device, "body": {"i": i}}])), 1);
}

#[test]
fn an_idle_socket_gets_a_single_message_at_once_in_a_write_of_its_own() {
    // The longest linger there is: a held write would be plain to see in the metrics.
    let server = Server::start(&["--cores", "1", "--socket-linger-us", "10000"]);
    let session = subscribed(&server, "idle-1");
    let mut live = server.live(&session);
    publish(&server, "idle-1", 0);
    let first = live.next_json(WAIT).expect("the message arrives");
    assert_eq!(first["telemetry"]["i"], 0);
    assert_eq!(server.wait_for_metric(WRITES, WAIT, Want::AtLeast(1.0)), 1.0, "one write");
    assert_eq!(server.metric(FRAMES), Some(1.0), "carrying the one frame");
    assert_eq!(server.metric(HELD), Some(0.0), "a socket that was idle is never held");
    // The socket has been quiet since (a scrape went by): the next message goes at once too.
    publish(&server, "idle-1", 1);
    assert_eq!(live.next_json(WAIT).expect("the second message arrives")["telemetry"]["i"], 1);
    assert_eq!(server.wait_for_metric(WRITES, WAIT, Want::AtLeast(2.0)), 2.0);
    assert_eq!(server.metric(FRAMES), Some(2.0), "one frame per write");
    assert_eq!(server.metric(HELD), Some(0.0));
}

/// Keeps `publishers` connections busy until `stop`: each writes 32 pipelined `POST /ingest`
/// of one message of `device`, then reads their 32 answers, so the core always has requests
/// waiting (it is saturated: it never waits for I/O while they last).
fn publish_until(server: &Server, device: &str, publishers: usize, stop: &Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    const PIPELINED: usize = 32;
    (0..publishers)
        .map(|p| {
            let (port, device, stop) = (server.port, device.to_string(), stop.clone());
            std::thread::spawn(move || {
                let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
                stream.set_read_timeout(Some(WAIT)).unwrap();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let mut burst = Vec::new();
                    for _ in 0..PIPELINED {
                        let body = json!([{"deviceId": device, "body": {"p": p, "i": i, "pad": "x".repeat(64)}}]).to_string();
                        i += 1;
                        burst.extend_from_slice(
                            format!(
                                "POST /ingest HTTP/1.1\r\nHost: 127.0.0.1\r\n{}: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                                ADMIN.0,
                                ADMIN.1,
                                body.len()
                            )
                            .as_bytes(),
                        );
                    }
                    stream.write_all(&burst).expect("pipelined requests written");
                    let (mut answers, mut got, mut chunk) = (Vec::new(), 0, [0u8; 16 * 1024]);
                    while got < PIPELINED {
                        let n = stream.read(&mut chunk).expect("answers read");
                        assert!(n > 0, "the server closed the ingest connection");
                        answers.extend_from_slice(&chunk[..n]);
                        got = answers.windows(12).filter(|w| w == b"HTTP/1.1 200").count();
                        assert_eq!(answers.windows(9).filter(|w| w == b"HTTP/1.1 ").count(), got, "every answer is 200");
                    }
                }
            })
        })
        .collect()
}

/// Reads every frame of `sockets` sockets of `device` in threads, counting envelopes.
fn readers(server: &Server, device: &str, sockets: usize, stop: &Arc<AtomicBool>, got: &Arc<AtomicU64>) -> Vec<std::thread::JoinHandle<()>> {
    (0..sockets)
        .map(|_| {
            let mut live = server.live(&subscribed(server, device));
            let (stop, got) = (stop.clone(), got.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if live.next_text(Duration::from_millis(200)).is_some() {
                        got.fetch_add(1, Ordering::Relaxed);
                    } else if live.closed.is_some() {
                        panic!("socket closed under load: {:?}", live.closed);
                    }
                }
            })
        })
        .collect()
}

/// Drives `server` (one core) with 40 sockets of one device and 4 pipelining publishers
/// until `series` passes `at_least`; returns (writes, frames, held).
fn under_load(server: &Server, series: &str, at_least: f64) -> (f64, f64, f64) {
    let (stop, got) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let mut threads = readers(server, "busy-1", 40, &stop, &got);
    threads.extend(publish_until(server, "busy-1", 4, &stop));
    server.wait_for_metric(series, Duration::from_secs(60), Want::AtLeast(at_least));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("a client thread failed");
    }
    assert!(got.load(Ordering::Relaxed) > 0, "messages were delivered");
    let seen = (server.metric(WRITES).unwrap(), server.metric(FRAMES).unwrap(), server.metric(HELD).unwrap());
    eprintln!("under load: {} envelopes read; writes, frames, held: {seen:?}", got.load(Ordering::Relaxed));
    seen
}

#[test]
fn under_load_writes_are_held_and_carry_several_frames_each() {
    let server = Server::start(&["--cores", "1", "--socket-linger-us", "2000"]);
    // Until writes were held a good many times (the core saturated by the fan-out).
    let (writes, frames, held) = under_load(&server, HELD, 200.0);
    assert!(held >= 200.0, "writes held under load: {held}");
    assert!(frames / writes > 1.0, "frames per write under load: {frames} / {writes}");
}

#[test]
fn with_the_linger_off_no_write_is_ever_held() {
    let server = Server::start(&["--cores", "1", "--socket-linger-us", "0"]);
    // The same load, for more writes than the test above needs to see its holds.
    let (writes, _, held) = under_load(&server, WRITES, 4000.0);
    assert!(writes >= 4000.0);
    assert_eq!(held, 0.0);
}
