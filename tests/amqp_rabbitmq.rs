//! Against an AMQP 1.0 implementation that is not fe2o3-amqp: RabbitMQ's AMQP 1.0 plugin
//! on 127.0.0.1:5672 (guest/guest), installed and started by `scripts/services.sh`.
//!
//! hubcast reads an `EntityPath` that starts with `/` as a plain broker queue (no
//! `$management`, no partitions). The test publishes IoT Hub-shaped and plain messages to
//! the queue with an AMQP 1.0 client and reads the results over REST.
//!
//! Without RabbitMQ the test is skipped with a message, unless `CI` is set (then it fails).

mod amqp_support;

use std::time::Duration;

use amqp_support::Server;
use fe2o3_amqp::types::messaging::annotations::OwnedKey;
use fe2o3_amqp::types::messaging::{ApplicationProperties, Message, MessageAnnotations};
use fe2o3_amqp::types::primitives::{Binary, OrderedMap, SimpleValue, Symbol, Timestamp, Value};
use fe2o3_amqp::{Connection, Sender, Session};
use serde_json::json;

const RABBITMQ: &str = "127.0.0.1:5672";
const WAIT: Duration = Duration::from_secs(10);
/// Messages of one device sent after the four of each shape.
const STREAM: u64 = 300;

fn rabbitmq_available() -> bool {
    if std::net::TcpStream::connect_timeout(&RABBITMQ.parse().unwrap(), Duration::from_secs(1)).is_ok() {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("RabbitMQ is not listening on {RABBITMQ}: scripts/services.sh should have started it");
    }
    eprintln!("SKIPPED: RabbitMQ is not listening on {RABBITMQ} (run scripts/services.sh)");
    false
}

fn annotated(device: &str, source: &str, op_type: Option<&str>, body: serde_json::Value) -> Message<fe2o3_amqp::types::messaging::Data> {
    let mut annotations = OrderedMap::new();
    annotations.insert(OwnedKey::Symbol(Symbol::from("iothub-connection-device-id")), Value::String(device.into()));
    annotations.insert(OwnedKey::Symbol(Symbol::from("iothub-message-source")), Value::String(source.into()));
    annotations.insert(
        OwnedKey::Symbol(Symbol::from("iothub-enqueuedtime")),
        Value::Timestamp(Timestamp::from_milliseconds(1_704_067_200_000)),
    );
    let mut props = OrderedMap::new();
    if let Some(op) = op_type {
        props.insert("opType".to_string(), SimpleValue::String(op.into()));
    }
    Message::builder()
        .message_annotations(MessageAnnotations(annotations))
        .application_properties(ApplicationProperties(props))
        .data(Binary::from(body.to_string().into_bytes()))
        .build()
}

/// Deletes the test's queue at the end, even when the test fails.
struct QueueCleanup(String);

impl Drop for QueueCleanup {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl").args(["-q", "delete_queue", &self.0]).output();
    }
}

#[test]
fn rabbitmq_queue_messages_reach_the_cores() {
    if !rabbitmq_available() {
        return;
    }
    let queue = format!("hubcast-test-{}", std::process::id());
    let address = format!("/queue/{queue}");
    let _cleanup = QueueCleanup(queue.clone());
    let cs = format!("Endpoint=amqp://{RABBITMQ};SharedAccessKeyName=guest;SharedAccessKey=guest;EntityPath={address}");
    // A small link credit: the 300 messages below need it granted again and again.
    let server = Server::start(&["--iot-hub-event-hub-connection-string", &cs, "--log-level", "verbose", "--event-hub-prefetch", "8"]);
    server.wait_connected();

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut connection = Connection::builder()
            .container_id("hubcast-test-publisher")
            .sasl_profile(fe2o3_amqp::sasl_profile::SaslProfile::Plain { username: "guest".into(), password: "guest".into() })
            .open(format!("amqp://{RABBITMQ}").as_str())
            .await
            .expect("connect to RabbitMQ");
        let mut session = Session::begin(&mut connection).await.unwrap();
        let mut sender = Sender::attach(&mut session, "hubcast-test-sender", address.as_str()).await.unwrap();
        // IoT Hub shape: annotations, Data body.
        sender.send(annotated("rmq-1", "Telemetry", None, json!({"temp": 21.5}))).await.unwrap();
        sender
            .send(annotated("rmq-1", "twinChangeEvents", Some("replaceTwin"), json!({"version": 2, "properties": {"reported": {"fw": "3"}}})))
            .await
            .unwrap();
        // Plain shape: device id in an application property, AmqpValue body.
        let mut props = OrderedMap::new();
        props.insert("iothub-connection-device-id".to_string(), SimpleValue::String("rmq-2".into()));
        let plain = Message::builder()
            .application_properties(ApplicationProperties(props))
            .value(json!({"level": 7}).to_string())
            .build();
        sender.send(plain).await.unwrap();
        // Device id only in the body.
        sender.send(Message::builder().data(Binary::from(br#"{"deviceId":"rmq-3","on":true}"#.to_vec())).build()).await.unwrap();
        // Larger than hubcast's 64 KiB frames: the broker sends it in several transfers.
        let big = json!({"deviceId": "rmq-big", "big": "y".repeat(100_000)}).to_string();
        sender.send(Message::builder().data(Binary::from(big.into_bytes())).build()).await.unwrap();
        for n in 0..STREAM {
            let m = json!({"deviceId": "rmq-4", "n": n}).to_string();
            sender.send(Message::builder().data(Binary::from(m.into_bytes())).build()).await.unwrap();
        }
        let _ = sender.close().await;
        let _ = session.end().await;
        let _ = connection.close().await;
    });

    let (_, body) = server.wait_for("/lastValue/rmq-1/temp", WAIT, |s, _| s == 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"], json!({"temp": 21.5}));
    assert_eq!(v["timestamp"], json!("2024-01-01T00:00:00.000Z"), "the annotation's enqueued time survived the broker");
    server.wait_for("/deviceTwin/rmq-1", WAIT, |s, b| s == 200 && b.contains(r#""fw":"3""#));
    server.wait_for("/lastValue/rmq-2/level", WAIT, |s, _| s == 200);
    server.wait_for("/lastValue/rmq-3/on", WAIT, |s, _| s == 200);
    server.wait_for("/lastValue/rmq-big/big", WAIT, |s, b| s == 200 && b.len() > 100_000);
    server.wait_for("/lastValue/rmq-4/n", WAIT, |s, b| s == 200 && b.contains(&format!(r#""n":{}"#, STREAM - 1)));
    assert!(server.stderr_lines().iter().any(|l| l.contains("event hub connected") && l.contains(&address)));
    // A real broker's transfers are read off the wire (--event-hub-read-raw, on by default).
    let (_, metrics) = server.get("/metrics");
    let series = |name: &str| metrics.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok());
    let (raw, decoded) = (series("hubcast_amqp_raw_reads_total"), series("hubcast_amqp_decoded_reads_total"));
    assert_eq!((raw, decoded), (Some(5 + STREAM), Some(0)), "{metrics}");
    // Every message was accepted: the broker holds none, neither ready nor unacknowledged.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let out = std::process::Command::new("rabbitmqctl")
            .args(["-q", "list_queues", "name", "messages_ready", "messages_unacknowledged"])
            .output()
            .expect("rabbitmqctl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let row = text.lines().find(|l| l.split_whitespace().next() == Some(queue.as_str())).map(str::to_owned);
        if row.as_deref().map(|r| r.split_whitespace().skip(1).collect::<Vec<_>>()) == Some(vec!["0", "0"]) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the broker still holds messages: {row:?}");
        // The broker tells its queue counts only when asked: poll them (each rabbitmqctl call
        // takes ~0.3 s itself).
        std::thread::sleep(Duration::from_millis(100));
    }
}
