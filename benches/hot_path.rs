//! Micro-benchmarks of the per-message hot path: body parse, last-value update, routing,
//! the fan-out decision per subscriber, frame encoding (plain and Socket.IO), and HTTP request
//! framing (head parse, chunked body).
//!
//! `cargo bench --bench hot_path` (results in docs/BENCHMARKS.md).

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use hubcast::ids::SessionId;
use hubcast::ingest::{parse_telemetry, IngestMessage, IngestSettings, Properties, SourceKind};
use hubcast::model::{DataKind, Grant, GrantKind, Subscription};
use hubcast::push::envelope::EnvelopeBuilder;
use hubcast::runtime::routing::core_of_device;
use hubcast::shard::devices::{DeviceTable, PushTiming};
use hubcast::shard::DeviceOp;
use hubcast::transport::frame::write_text;
use hubcast::transport::socketio::EVENT_PREFIX;

const BODY: &[u8] = br#"{"temperature":21.5,"humidity":48,"pressure":1013.2,"running":true,"batteryLevel":97,"geoposition":{"lat":52.52,"lng":13.4}}"#;

fn settings() -> IngestSettings {
    IngestSettings {
        custom_timestamp_key: "_ts".into(),
        custom_device_id_key: "deviceId".into(),
        custom_connection_state_key: String::new(),
        connection_state_on_telemetry: true,
    }
}

fn table() -> DeviceTable {
    DeviceTable::new(settings(), PushTiming { throttle: None, connection_ttl: None })
}

fn message(device: &str) -> IngestMessage {
    IngestMessage {
        device_id: device.into(),
        source: SourceKind::Telemetry,
        properties: Properties::new(),
        body: BODY.to_vec(),
        enqueued_at: Some(1_700_000_000_000),
        arrived: None,
        key: Default::default(),
    }
}

fn parse(c: &mut Criterion) {
    let s = settings();
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(1));
    g.bench_function("parse_telemetry_body", |b| {
        b.iter_batched_ref(|| BODY.to_vec(), |body| black_box(parse_telemetry(body, &s).map(|p| p.values.len())), BatchSize::SmallInput)
    });
    let ids: Vec<String> = (0..10_000).map(|i| format!("device-{i:05}")).collect();
    g.bench_function("route_to_core", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % ids.len();
            black_box(core_of_device(&ids[i], 2))
        })
    });
    g.bench_function("parse_and_update_last_values_10k_devices", |b| {
        let mut t = table();
        let mut out = Vec::new();
        let mut i = 0;
        b.iter_batched(
            || {
                i = (i + 1) % ids.len();
                message(&ids[i])
            },
            |m| {
                t.ingest_and_publish(m, Instant::now(), &mut out);
                out.clear();
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn fan_out(c: &mut Criterion) {
    let mut g = c.benchmark_group("fan_out");
    for subscribers in [1u64, 100] {
        let mut t = table();
        for s in 0..subscribers {
            let session = SessionId(s as u128 + 1);
            let grant = Grant { kind: GrantKind::Data(DataKind::Telemetry), key: None };
            t.apply(hubcast::shard::ask(|done| DeviceOp::Grant { device: "d".into(), session, grant, done }).0);
            // Half subscribe to every key, half to one key: both paths of the decision.
            let key = (s % 2 == 1).then(|| "temperature".into());
            let sub = Subscription { kind: DataKind::Telemetry, key };
            t.apply(hubcast::shard::ask(|permitted| DeviceOp::Subscribe { device: "d".into(), session, sub, permitted }).0);
        }
        g.throughput(Throughput::Elements(subscribers));
        g.bench_function(format!("decide_per_message_{subscribers}_subscribers"), |b| {
            let mut out = Vec::with_capacity(subscribers as usize);
            b.iter_batched(
                || message("d"),
                |m| {
                    t.ingest_and_publish(m, Instant::now(), &mut out);
                    black_box(out.len());
                    out.clear();
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

fn encoding(c: &mut Criterion) {
    let mut g = c.benchmark_group("encode");
    g.throughput(Throughput::Elements(1));
    let values = [("temperature", "21.5"), ("humidity", "48"), ("running", "true")];
    g.bench_function("envelope", |b| {
        b.iter(|| black_box(EnvelopeBuilder::new("device-00042", "2026-11-23T11:18:14.123Z").telemetry(values.iter().copied())))
    });
    let frame = EnvelopeBuilder::new("device-00042", "2026-11-23T11:18:14.123Z").telemetry(values.iter().copied());
    let mut out = Vec::with_capacity(64 * 1024);
    g.bench_function("websocket_frame_plain", |b| {
        b.iter(|| {
            out.clear();
            write_text(&mut out, &[frame.as_bytes()]);
            black_box(out.len())
        })
    });
    g.bench_function("websocket_frame_socketio", |b| {
        b.iter(|| {
            out.clear();
            write_text(&mut out, &[EVENT_PREFIX, frame.as_bytes(), b"]"]);
            black_box(out.len())
        })
    });
    g.finish();
}

/// A request head as ux4iot's clients send it (PUT /grants from the security backend).
const REQUEST_HEAD: &[u8] = b"PUT /grants HTTP/1.1\r\nHost: hubcast.example.com\r\nUser-Agent: axios/1.7.2\r\nAccept: application/json, text/plain, */*\r\nContent-Type: application/json\r\nShared-Access-Key: 9c2b7e3f5a1d4c8e9f0a1b2c3d4e5f60\r\nContent-Length: 96\r\nConnection: keep-alive\r\n\r\n";

fn http(c: &mut Criterion) {
    let mut g = c.benchmark_group("http");
    g.throughput(Throughput::Elements(1));
    g.bench_function("parse_request_head", |b| {
        b.iter(|| black_box(hubcast::http::codec::parse_head(black_box(REQUEST_HEAD)).map(|h| h.map(|h| h.2))))
    });
    let body = vec![b'x'; 16 * 1024];
    let chunked = hubcast::http::codec::encode_chunked(&body, &[4096]);
    g.throughput(Throughput::Bytes(body.len() as u64));
    g.bench_function("decode_chunked_16k", |b| {
        b.iter_batched_ref(
            || (bytes::BytesMut::from(&chunked[..]), bytes::BytesMut::new()),
            |(src, out)| black_box(hubcast::http::codec::ChunkedDecoder::new(1 << 20).decode(src, out)),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, parse, fan_out, encoding, http);
criterion_main!(benches);
