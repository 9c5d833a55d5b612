//! The fleet over AMQP 1.0: an Event Hubs-like endpoint on 127.0.0.1 that hubcast consumes
//! with `--iot-hub-event-hub-connection-string "Endpoint=amqp://127.0.0.1:PORT/;…;EntityPath=load-hub"`.
//!
//! It speaks what hubcast's consumer uses of Event Hubs (see hubcast's `src/amqp/`):
//! - SASL PLAIN with the key name and key of the connection string (or ANONYMOUS followed
//!   by a `put-token` on `$cbs`, which is accepted without checking: this is a load
//!   generator, not a test of authentication);
//! - `$management` READ of `com.microsoft:eventhub` (partition ids) and
//!   `com.microsoft:partition` (last enqueued sequence number), replies routed to the
//!   link named by `reply-to`;
//! - partition links `<entity>/ConsumerGroups/<cg>/Partitions/<id>`: a link resumes after
//!   the sequence number of its selector filter (`x-opt-sequence-number > 'N'`), and
//!   otherwise starts at the partition's end (`@latest`);
//! - messages as IoT Hub writes them: device id, source and enqueued time as message
//!   annotations, `x-opt-sequence-number` / `x-opt-offset` / `x-opt-enqueued-time`, the JSON
//!   body as one `Data` section.
//!
//! Messages are made when the link has credit, not stored: device `d` lives on partition
//! `d % P`, and each partition link sends at `rate / P` (or as fast as its credit allows),
//! pre-settled, so the link credit hubcast gives is the only flow control.
//!
//! **Why not fe2o3's acceptor.** It was the endpoint until the harness, not hubcast, turned
//! out to set the pace of every AMQP run: ~0.97 of a CPU for ~115,000 msgs/s, each message
//! built as a map of `Value`s, serialized, passed through three tasks and written on its own
//! (docs/benchmarks/2026-11-27-amqp-sender.md). The endpoint is now one task per connection
//! ([`conn`]) that decodes and encodes the performatives with fe2o3-amqp-types and serde_amqp
//! and writes telemetry transfers by hand ([`wire`]), many per socket write. [`telemetry`] stays as the reference the hand-written bytes are tested
//! against.

mod conn;
pub mod wire;

use std::io;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fe2o3_amqp::types::messaging::annotations::OwnedKey;
use fe2o3_amqp::types::messaging::{Data, Message, MessageAnnotations};
use fe2o3_amqp::types::primitives::{Array, Binary, OrderedMap, Symbol, Timestamp, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::{device_id, now_micros, FleetPlan, FleetStats};

pub const ENTITY: &str = "load-hub";
pub const KEY_NAME: &str = "load";
pub const KEY: &str = "bG9hZC10ZXN0LWtleQ==";

struct Partition {
    /// Sequence number of the next message.
    next_seq: AtomicI64,
    /// Ids of the devices on this partition.
    devices: Vec<String>,
    /// Message `seq` comes from device [`device_index`]`(seq, devices, stride)`.
    stride: usize,
}

/// A stride coprime with `n` near `n` × 0.618 (the golden ratio's): `seq × stride mod n` visits
/// every device of a partition once per `n` messages, in an order that spreads any block of
/// device ids evenly over the cycle. In id order (stride 1) the sockets, which watch devices
/// `0 … sockets × subs`, got data only while each partition's cycle passed through that block:
/// with 1 M devices and 18,000 sockets, bursts of ~7 s every ~40 s on every instance at once,
/// which the fleet report first read as hubcast stopping (docs/benchmarks/2026-11-27-fleet-scale.md).
pub fn stride_for(n: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    if n <= 2 {
        return 1;
    }
    let mut stride = ((n as f64 * 0.618_033_988_7) as usize).max(1);
    while gcd(stride, n) != 1 {
        stride += 1;
    }
    stride
}

/// The index (in its partition) of the device message `seq` comes from (see [`stride_for`]).
pub fn device_index(seq: i64, devices: usize, stride: usize) -> usize {
    let n = devices.max(1) as u128;
    ((seq.max(0) as u128 % n) * stride as u128 % n) as usize
}

/// One run of the fleet: its counters and switch, and its rate per partition.
#[derive(Clone)]
struct Run {
    stats: Arc<FleetStats>,
    rate_per_partition: f64,
}

struct Shared {
    partitions: Vec<Partition>,
    /// The current run; partition links outlive runs (hubcast attaches them once).
    run: watch::Sender<Option<Run>>,
}

/// The running endpoint (its accept loop stops with the runtime).
pub struct Endpoint {
    pub port: u16,
    shared: Arc<Shared>,
}

impl Endpoint {
    /// The connection string hubcast is started with.
    pub fn connection_string(&self) -> String {
        format!(
            "Endpoint=amqp://127.0.0.1:{}/;SharedAccessKeyName={KEY_NAME};SharedAccessKey={KEY};EntityPath={ENTITY}",
            self.port
        )
    }

    /// Hands the partitions a new run: they send at `rate` in total (0: as fast as the link
    /// credit allows) once `stats` says run, until it says stop.
    pub fn set_run(&self, stats: Arc<FleetStats>, rate: f64) {
        let rate_per_partition = rate / self.shared.partitions.len() as f64;
        self.shared.run.send_replace(Some(Run { stats, rate_per_partition }));
    }
}

/// Binds `127.0.0.1:port` (0: any) and serves the partitions of `plan`'s devices; the
/// messages flow once a run is set ([`Endpoint::set_run`]).
pub async fn start(port: u16, plan: &FleetPlan) -> io::Result<Endpoint> {
    let listener = TcpListener::bind(("127.0.0.1", port)).await?;
    let port = listener.local_addr()?.port();
    let devices = plan.devices.max(1);
    let p = plan.partitions.clamp(1, devices);
    let partitions = (0..p)
        .map(|i| {
            let devices: Vec<String> = (0..devices).filter(|d| d % p == i).map(device_id).collect();
            Partition { next_seq: AtomicI64::new(0), stride: stride_for(devices.len()), devices }
        })
        .collect();
    let shared = Arc::new(Shared { partitions, run: watch::channel(None).0 });
    let endpoint = Endpoint { port, shared: shared.clone() };
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((tcp, _)) => {
                    let _ = tcp.set_nodelay(true);
                    tokio::spawn(conn::serve(shared.clone(), tcp));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    });
    Ok(endpoint)
}

/// The sequence number a selector filter resumes after, if it names one.
pub fn resume_after(filter: &str) -> Option<i64> {
    let rest = filter.split("x-opt-sequence-number").nth(1)?;
    let digits: String = rest.chars().skip_while(|c| !c.is_ascii_digit() && *c != '-').take_while(|c| c.is_ascii_digit() || *c == '-').collect();
    digits.parse().ok()
}

/// One telemetry message as IoT Hub puts it on its built-in endpoint.
pub fn telemetry(device: &str, seq: i64, body: &[u8]) -> Message<Data> {
    telemetry_at(device, seq, (now_micros() / 1000) as i64, body)
}

/// [`telemetry`] enqueued at `now_ms`.
pub fn telemetry_at(device: &str, seq: i64, now_ms: i64, body: &[u8]) -> Message<Data> {
    let now = Timestamp::from_milliseconds(now_ms);
    let mut annotations = OrderedMap::new();
    let mut put = |k: &str, v: Value| {
        annotations.insert(OwnedKey::Symbol(Symbol::from(k)), v);
    };
    put("x-opt-sequence-number", Value::Long(seq));
    put("x-opt-offset", Value::String((seq * 100).to_string()));
    put("x-opt-enqueued-time", Value::Timestamp(now.clone()));
    put("iothub-enqueuedtime", Value::Timestamp(now));
    put("iothub-connection-device-id", Value::String(device.to_string()));
    put("iothub-message-source", Value::String("Telemetry".into()));
    Message::builder().message_annotations(MessageAnnotations(annotations)).data(Binary::from(body.to_vec())).build()
}

fn read(shared: &Shared, kind: &str, partition: &str) -> (i32, Value) {
    let mut map = OrderedMap::new();
    map.insert(Value::String("name".into()), Value::String(ENTITY.into()));
    match kind {
        "com.microsoft:eventhub" => {
            let ids: Vec<Value> = (0..shared.partitions.len()).map(|p| Value::String(p.to_string())).collect();
            map.insert(Value::String("partition_count".into()), Value::Int(ids.len() as i32));
            map.insert(Value::String("partition_ids".into()), Value::Array(Array::from(ids)));
        }
        "com.microsoft:partition" => {
            let Some(p) = partition.parse::<usize>().ok().and_then(|i| shared.partitions.get(i)) else {
                return (404, Value::Null);
            };
            let next = p.next_seq.load(Ordering::Relaxed);
            map.insert(Value::String("last_enqueued_sequence_number".into()), Value::Long(next - 1));
            map.insert(Value::String("is_partition_empty".into()), Value::Bool(next == 0));
        }
        _ => return (400, Value::Null),
    }
    (200, Value::Map(map))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_selector_with_a_sequence_number_resumes_after_it() {
        assert_eq!(resume_after("amqp.annotation.x-opt-sequence-number > '41'"), Some(41));
        assert_eq!(resume_after("amqp.annotation.x-opt-offset > '@latest'"), None);
    }

    use fe2o3_amqp::link::receiver::CreditMode;
    use fe2o3_amqp::sasl_profile::SaslProfile;
    use fe2o3_amqp::types::messaging::{Body, MessageId, Properties, Source};
    use fe2o3_amqp::types::primitives::SimpleValue;
    use fe2o3_amqp::{Connection, Receiver, Sender, Session};

    fn plan(devices: usize, partitions: usize) -> FleetPlan {
        FleetPlan { via: super::super::Via::Amqp, devices, rate: 0.0, batch: 1, conns: 1, partitions, pipeline: 1 }
    }

    fn annotation(m: &Message<Body<Value>>, k: &str) -> Option<Value> {
        let a = m.message_annotations.as_ref()?;
        a.get(&k as &dyn fe2o3_amqp::types::messaging::annotations::AnnotationKey).cloned()
    }

    /// The endpoint against fe2o3's client, as hubcast uses it: SASL PLAIN, a `$management`
    /// READ answered on the reply link, a partition link resumed after a sequence number whose
    /// messages are IoT Hub telemetry, a refused partition, a refused key.
    #[tokio::test]
    async fn fe2o3_consumes_the_endpoint_as_hubcast_does() {
        let work = async {
            let endpoint = start(0, &plan(100, 4)).await.unwrap();
            let url = format!("amqp://127.0.0.1:{}", endpoint.port);
            let wrong = Connection::builder()
                .container_id("t")
                .sasl_profile(SaslProfile::Plain { username: KEY_NAME.into(), password: "nope".into() })
                .open(url.as_str())
                .await;
            assert!(wrong.is_err(), "a wrong key is refused");

            let mut connection = Connection::builder()
                .container_id("t")
                .sasl_profile(SaslProfile::Plain { username: KEY_NAME.into(), password: KEY.into() })
                .open(url.as_str())
                .await
                .unwrap();
            let mut session = Session::begin(&mut connection).await.unwrap();

            // $management READ of the event hub, the reply on the link named by reply-to.
            let mut requests = Sender::attach(&mut session, "mgmt-out", "$management").await.unwrap();
            let mut replies = Receiver::builder()
                .name("mgmt-in")
                .source("$management")
                .target("reply-here")
                .attach(&mut session)
                .await
                .unwrap();
            let mut app = OrderedMap::new();
            app.insert("operation".to_string(), SimpleValue::String("READ".into()));
            app.insert("type".to_string(), SimpleValue::String("com.microsoft:eventhub".into()));
            app.insert("name".to_string(), SimpleValue::String(ENTITY.into()));
            let request = Message::builder()
                .properties(Properties { message_id: Some(MessageId::Ulong(7)), reply_to: Some("reply-here".into()), ..Default::default() })
                .application_properties(fe2o3_amqp::types::messaging::ApplicationProperties(app))
                .value(Value::Null)
                .build();
            requests.send(request).await.unwrap();
            let reply = replies.recv::<Body<Value>>().await.unwrap();
            replies.accept(&reply).await.unwrap();
            let reply = reply.into_message();
            assert_eq!(reply.properties.as_ref().unwrap().correlation_id, Some(MessageId::Ulong(7)));
            let Body::Value(fe2o3_amqp::types::messaging::AmqpValue(Value::Map(map))) = &reply.body else { panic!("{:?}", reply.body) };
            assert_eq!(map.get(&Value::String("partition_count".into())), Some(&Value::Int(4)));

            // Partition 1, resumed after sequence number 41.
            let filter = Some(serde_amqp::described::Described {
                descriptor: serde_amqp::descriptor::Descriptor::Code(0x0000_468c_0000_0004),
                value: Value::String("amqp.annotation.x-opt-sequence-number > '41'".into()),
            });
            let source = Source::builder()
                .address(format!("{ENTITY}/ConsumerGroups/$Default/Partitions/1"))
                .add_to_filter("apache.org:selector-filter:string", filter)
                .build();
            let mut partition = Receiver::builder()
                .name("p1")
                .source(source)
                .credit_mode(CreditMode::Auto(50))
                .attach(&mut session)
                .await
                .unwrap();
            let stats = Arc::new(FleetStats::default());
            endpoint.set_run(stats.clone(), 0.0);
            stats.run();
            for seq in 42..342_i64 {
                let delivery = partition.recv::<Body<Value>>().await.unwrap();
                partition.accept(&delivery).await.unwrap();
                let m = delivery.into_message();
                assert_eq!(annotation(&m, "x-opt-sequence-number"), Some(Value::Long(seq)));
                assert_eq!(annotation(&m, "x-opt-offset"), Some(Value::String((seq * 100).to_string())));
                // Device d lives on partition d % 4: partition 1 holds devices 1, 5, 9, …, sent
                // in the shuffled order of `device_index`.
                let device = device_id(1 + 4 * device_index(seq, 25, stride_for(25)));
                assert_eq!(annotation(&m, "iothub-connection-device-id"), Some(Value::String(device)));
                let Body::Data(data) = &m.body else { panic!("{:?}", m.body) };
                let body: serde_json::Value = serde_json::from_slice(&data.iter().next().unwrap().0).unwrap();
                assert_eq!(body["seq"], seq);
            }
            stats.stop();
            assert_eq!(stats.errors.load(Ordering::Relaxed), 0);

            // A partition that does not exist is refused.
            let refused = async {
                let mut r = Receiver::attach(&mut session, "p9", format!("{ENTITY}/ConsumerGroups/$Default/Partitions/9")).await?;
                r.recv::<Body<Value>>().await.map(|_| ()).map_err(|e| e.into())
            };
            let refused: Result<(), Box<dyn std::error::Error>> = refused.await;
            let refused = refused.expect_err("partition 9 of 4 is refused").to_string();
            assert!(refused.contains("no such partition"), "{refused}");
            connection.close().await.unwrap();
        };
        tokio::time::timeout(Duration::from_secs(20), work).await.expect("the exchange finishes");
    }

    /// Every device once per cycle, and a block of device ids spread over the cycle: the
    /// first 10 % of 166,667 devices (the watched ones of a 1 M-device run) come at least once
    /// in every 1 % of the cycle.
    #[test]
    fn each_cycle_sends_every_device_once_in_an_order_that_spreads_any_block() {
        for n in [1, 2, 3, 25, 1000, 166_667] {
            let stride = stride_for(n);
            let mut seen = vec![false; n];
            for seq in 0..n as i64 {
                let i = device_index(seq, n, stride);
                assert!(!seen[i], "n = {n}: device {i} twice in one cycle");
                seen[i] = true;
            }
        }
        let n = 166_667;
        let stride = stride_for(n);
        let window = n / 100;
        for start in (0..n).step_by(window) {
            let hits = (start..start + window).filter(|&seq| device_index(seq as i64, n, stride) < n / 10).count();
            assert!(hits > 0, "messages {start}..{}: none of the first 10 % of devices", start + window);
        }
    }

    #[test]
    fn telemetry_carries_the_iot_hub_annotations_and_the_body() {
        let m = telemetry("dev-000001", 5, b"{\"sentAt\":1}");
        let a = m.message_annotations.as_ref().unwrap();
        let get = |k: &str| a.get(&k as &dyn fe2o3_amqp::types::messaging::annotations::AnnotationKey).cloned();
        assert_eq!(get("iothub-connection-device-id"), Some(Value::String("dev-000001".into())));
        assert_eq!(get("iothub-message-source"), Some(Value::String("Telemetry".into())));
        assert_eq!(get("x-opt-sequence-number"), Some(Value::Long(5)));
        assert_eq!(m.body.0.as_ref(), b"{\"sentAt\":1}");
    }
}
