//! Batched frames (`/ws?sessionId=…&batch=1`): several envelopes per text frame as a JSON
//! array, at most 64 KiB of payload per frame unless one envelope alone is bigger. Opt-in,
//! plain WebSocket only: without the parameter, and on Socket.IO, one envelope per frame.

mod common;

use std::time::Duration;

use common::ws::{try_connect, Live};
use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(5);
/// The batched frame's payload bound (`transport::BATCH_FRAME_BYTES`).
const BOUND: usize = 64 * 1024;

fn subscribed(server: &Server, device: &str) -> String {
    let session = server.new_session();
    let request = json!({"type": "telemetry", "deviceId": device, "telemetryKey": null});
    server.grant(&session, request.clone());
    let (status, body) = server.subscribe(&session, request);
    assert_eq!(status, 204, "{body}");
    session
}

/// `n` messages of `device` in one POST /ingest, each `{"i": k, "pad": "<pad bytes>"}`.
fn publish(server: &Server, device: &str, n: usize, pad: usize) {
    let pad = "p".repeat(pad);
    let batch: Vec<Value> = (0..n).map(|i| json!({"deviceId": device, "body": {"i": i, "pad": pad}})).collect();
    assert_eq!(server.ingest(json!(batch)), n as u64);
}

/// Reads batched frames until `n` envelopes arrived; returns them and each frame's
/// (payload length, envelope count, largest envelope).
fn read_batched(live: &mut Live, n: usize) -> (Vec<Value>, Vec<(usize, usize, usize)>) {
    let mut envelopes = Vec::new();
    let mut frames = Vec::new();
    while envelopes.len() < n {
        let text = live.next_text(WAIT).unwrap_or_else(|| panic!("{} of {n} envelopes, then nothing", envelopes.len()));
        let array: Vec<Value> = serde_json::from_str(&text).unwrap_or_else(|e| panic!("a JSON array ({e}): {text:.200}"));
        assert!(!array.is_empty(), "never an empty array");
        let largest = array.iter().map(|v| v.to_string().len()).max().unwrap();
        frames.push((text.len(), array.len(), largest));
        envelopes.extend(array);
    }
    (envelopes, frames)
}

fn assert_in_order_once(envelopes: &[Value], device: &str, n: usize) {
    assert_eq!(envelopes.len(), n, "exactly once");
    for (k, e) in envelopes.iter().enumerate() {
        assert_eq!(e["deviceId"], device);
        assert_eq!(e["telemetry"]["i"], k, "in order: envelope {k} is {e:.100}");
    }
}

#[test]
fn a_batched_socket_gets_every_message_once_in_order_in_bounded_arrays() {
    // 200 messages of ~1 KiB: ~200 KiB, so a drain of them takes several 64 KiB frames; under
    // the soft queue limits (256 messages, 1 MiB), so nothing is conflated.
    const N: usize = 200;
    let server = Server::start(&[]);
    let session = subscribed(&server, "b-1");
    let mut live = server.ws(&format!("/ws?sessionId={session}&batch=1"));
    publish(&server, "b-1", N, 1000);
    let (envelopes, frames) = read_batched(&mut live, N);
    assert_in_order_once(&envelopes, "b-1", N);
    for &(len, count, largest) in &frames {
        assert!(len <= BOUND || count == 1, "a frame over the bound holds one envelope: {len} bytes, {count}");
        assert!(len <= BOUND + largest, "{len} bytes");
    }
    assert!(frames.iter().any(|&(_, count, _)| count > 1), "envelopes queued together share a frame: {frames:?}");
    // Envelopes per frame shows in the metrics: fewer frames than messages.
    let out = server.wait_for_metric("hubcast_messages_out_total{transport=\"websocket\"}", WAIT, Want::AtLeast(N as f64));
    let frames_written = server.metric("hubcast_socket_frames_written_total{transport=\"websocket\"}").unwrap();
    assert!(frames_written < out, "{frames_written} frames for {out} envelopes");
}

#[test]
fn an_envelope_bigger_than_the_bound_goes_alone_in_an_array_of_one() {
    let server = Server::start(&[]);
    let session = subscribed(&server, "b-big");
    let mut live = server.ws(&format!("/ws?sessionId={session}&batch=1"));
    let batch = json!([
        {"deviceId": "b-big", "body": {"i": 0, "pad": "s"}},
        {"deviceId": "b-big", "body": {"i": 1, "pad": "x".repeat(BOUND + 100)}},
        {"deviceId": "b-big", "body": {"i": 2, "pad": "s"}},
    ]);
    server.ingest(batch);
    let (envelopes, frames) = read_batched(&mut live, 3);
    assert_in_order_once(&envelopes, "b-big", 3);
    let big = frames.iter().find(|&&(len, _, _)| len > BOUND).expect("the big envelope's frame");
    assert_eq!(big.1, 1, "alone: {frames:?}");
}

#[test]
fn a_socket_without_batch_on_the_same_session_still_gets_one_envelope_per_frame() {
    const N: usize = 100;
    let server = Server::start(&[]);
    let session = subscribed(&server, "b-2");
    let mut batched = server.ws(&format!("/ws?sessionId={session}&batch=1"));
    let mut plain = server.live(&session);
    let mut explicit_off = server.ws(&format!("/ws?sessionId={session}&batch=0"));
    publish(&server, "b-2", N, 100);
    let (envelopes, _) = read_batched(&mut batched, N);
    assert_in_order_once(&envelopes, "b-2", N);
    for live in [&mut plain, &mut explicit_off] {
        let frames: Vec<Value> = (0..N).map(|k| live.next_json(WAIT).unwrap_or_else(|| panic!("frame {k}"))).collect();
        assert!(frames.iter().all(Value::is_object), "one envelope (an object) per frame");
        assert_in_order_once(&frames, "b-2", N);
    }
}

#[test]
fn batch_takes_only_0_or_1_and_anything_else_is_refused_with_400() {
    let server = Server::start(&[]);
    let session = subscribed(&server, "b-3");
    // The positive case first: batch=1 is accepted and delivers.
    let mut live = server.ws(&format!("/ws?sessionId={session}&batch=1"));
    publish(&server, "b-3", 1, 1);
    assert_eq!(read_batched(&mut live, 1).0[0]["telemetry"]["i"], 0);
    for bad in ["2", "yes", "true", ""] {
        match try_connect(&server.base, &format!("/ws?sessionId={session}&batch={bad}")) {
            Ok(_) => panic!("batch={bad} was accepted"),
            Err((status, body)) => {
                assert_eq!(status, 400, "batch={bad}: {body}");
                assert!(body.contains("batch must be 1"), "batch={bad}: {body}");
            }
        }
    }
}

#[test]
fn socket_io_never_batches_even_when_asked() {
    const N: usize = 20;
    let server = Server::start(&[]);
    let session = subscribed(&server, "b-4");
    // socket.io-client appends the session id to the query: the parameter rides along.
    let with_batch = format!("{session}&batch=1");
    let client = server.socketio(&[&with_batch], "websocket");
    client.wait_for("connect", WAIT).expect("connected");
    publish(&server, "b-4", N, 10);
    let events: Vec<Value> = (0..N)
        .map(|k| client.wait_for("data", WAIT).unwrap_or_else(|| panic!("data event {k}"))["data"].clone())
        .collect();
    assert!(events.iter().all(Value::is_object), "one envelope per data event");
    assert_in_order_once(&events, "b-4", N);
}
