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
//! (docs/BENCHMARKS.md, "AMQP ingest with a sender that is not the bottleneck"). The endpoint
//! is now one task per connection ([`conn`]) that decodes and encodes the performatives with
//! fe2o3-amqp-types and serde_amqp and writes telemetry transfers by hand ([`wire`]), many
//! per socket write. [`telemetry`] stays as the reference the hand-written bytes are tested
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
        .map(|i| Partition {
            next_seq: AtomicI64::new(0),
            devices: (0..devices).filter(|d| d % p == i).map(device_id).collect(),
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
