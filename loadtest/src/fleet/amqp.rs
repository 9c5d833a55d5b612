//! The fleet over AMQP 1.0: an Event Hubs-like endpoint on 127.0.0.1 (fe2o3-amqp's
//! acceptor) that hubcast consumes with
//! `--iot-hub-event-hub-connection-string "Endpoint=amqp://127.0.0.1:PORT/;…;EntityPath=load-hub"`.
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

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fe2o3_amqp::acceptor::sasl_acceptor::{SaslAcceptor, SaslServerFrame};
use fe2o3_amqp::acceptor::{ConnectionAcceptor, LinkAcceptor, LinkEndpoint, SessionAcceptor};
use fe2o3_amqp::types::definitions::{self, AmqpError};
use fe2o3_amqp::types::messaging::annotations::OwnedKey;
use fe2o3_amqp::types::messaging::{AmqpValue, ApplicationProperties, Body, Data, Message, MessageAnnotations, MessageId, Properties};
use fe2o3_amqp::types::primitives::{Array, Binary, OrderedMap, SimpleValue, Symbol, Timestamp, Value};
use fe2o3_amqp::types::sasl::{SaslCode, SaslInit, SaslOutcome, SaslResponse};
use fe2o3_amqp::{Receiver, Sendable, Sender};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use super::{device_id, now_micros, write_body, FleetPlan, FleetStats, Pacer};

pub const ENTITY: &str = "load-hub";
pub const KEY_NAME: &str = "load";
pub const KEY: &str = "bG9hZC10ZXN0LWtleQ==";

type Reply = Message<AmqpValue<Value>>;

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

/// Binds `127.0.0.1:port` (0: any) and serves the fleet's partitions.
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
                    tokio::spawn(serve_connection(shared.clone(), tcp));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    });
    Ok(endpoint)
}

#[derive(Default)]
struct Conn {
    /// Reply links by the client address they deliver to.
    replies: Mutex<HashMap<String, mpsc::Sender<Reply>>>,
}

#[derive(Clone)]
struct Sasl;

impl SaslAcceptor for Sasl {
    fn mechanisms(&self) -> Array<Symbol> {
        Array::from(vec![Symbol::from("PLAIN"), Symbol::from("ANONYMOUS")])
    }

    fn on_init(&mut self, init: SaslInit) -> SaslServerFrame {
        let ok = match init.mechanism.0.as_str() {
            "ANONYMOUS" => true,
            "PLAIN" => {
                let response = init.initial_response.map(|b| b.into_vec()).unwrap_or_default();
                let mut parts = response.split(|b| *b == 0).skip(1);
                parts.next() == Some(KEY_NAME.as_bytes()) && parts.next() == Some(KEY.as_bytes())
            }
            _ => false,
        };
        let code = if ok { SaslCode::Ok } else { SaslCode::Auth };
        SaslServerFrame::Outcome(SaslOutcome { code, additional_data: None })
    }

    fn on_response(&mut self, _response: SaslResponse) -> SaslServerFrame {
        SaslServerFrame::Outcome(SaslOutcome { code: SaslCode::Auth, additional_data: None })
    }
}

async fn serve_connection(shared: Arc<Shared>, tcp: tokio::net::TcpStream) {
    let acceptor = ConnectionAcceptor::builder().container_id("hubcast-load").sasl_acceptor(Sasl).build();
    let Ok(mut connection) = acceptor.accept(tcp).await else { return };
    let conn = Arc::new(Conn::default());
    let sessions = SessionAcceptor::new();
    while let Ok(mut session) = sessions.accept(&mut connection).await {
        let shared = shared.clone();
        let conn = conn.clone();
        tokio::spawn(async move {
            let links = LinkAcceptor::new();
            while let Ok(link) = links.accept(&mut session).await {
                match link {
                    LinkEndpoint::Sender(sender) => {
                        tokio::spawn(serve_outgoing(shared.clone(), conn.clone(), sender));
                    }
                    LinkEndpoint::Receiver(receiver) => {
                        tokio::spawn(serve_incoming(shared.clone(), conn.clone(), receiver));
                    }
                }
            }
        });
    }
}

fn refusal(condition: impl Into<definitions::ErrorCondition>, text: &str) -> definitions::Error {
    definitions::Error::new(condition, Some(text.to_string()), None)
}

/// The sequence number a selector filter resumes after, if it names one.
pub fn resume_after(filter: &str) -> Option<i64> {
    let rest = filter.split("x-opt-sequence-number").nth(1)?;
    let digits: String = rest.chars().skip_while(|c| !c.is_ascii_digit() && *c != '-').take_while(|c| c.is_ascii_digit() || *c == '-').collect();
    digits.parse().ok()
}

fn selector_of(sender: &Sender) -> Option<String> {
    let filter = sender.source().as_ref()?.filter.as_ref()?;
    match filter.get(&Symbol::from("apache.org:selector-filter:string"))? {
        Value::Described(d) => match &d.value {
            Value::String(s) => Some(s.clone()),
            _ => None,
        },
        Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

/// A link on which the endpoint sends: a reply link or a partition.
async fn serve_outgoing(shared: Arc<Shared>, conn: Arc<Conn>, mut sender: Sender) {
    let address = sender.source().as_ref().and_then(|s| s.address.clone()).unwrap_or_default();
    if address == "$management" || address == "$cbs" {
        let client = sender.target().as_ref().and_then(|t| t.address.clone()).unwrap_or_default();
        let (tx, mut rx) = mpsc::channel(16);
        conn.replies.lock().unwrap().insert(client, tx);
        while let Some(reply) = rx.recv().await {
            if sender.send(Sendable::builder().message(reply).settled(true).build()).await.is_err() {
                break;
            }
        }
        return;
    }
    let partition = address
        .rsplit_once("/Partitions/")
        .filter(|(path, _)| path.starts_with(&format!("{ENTITY}/ConsumerGroups/")))
        .and_then(|(_, id)| id.parse::<usize>().ok())
        .filter(|id| *id < shared.partitions.len());
    let Some(index) = partition else {
        let _ = sender.close_with_error(refusal(AmqpError::NotFound, "no such partition")).await;
        return;
    };
    let part = &shared.partitions[index];
    if let Some(after) = selector_of(&sender).as_deref().and_then(resume_after) {
        part.next_seq.fetch_max(after + 1, Ordering::Relaxed);
    }
    let mut runs = shared.run.subscribe();
    let mut body = Vec::with_capacity(128);
    loop {
        let Some(run) = runs.borrow_and_update().clone() else {
            if runs.changed().await.is_err() {
                return;
            }
            continue;
        };
        let stats = &run.stats;
        if stats.started().await {
            // Pace in steps of at least 1 ms worth of messages (timers are not finer).
            let step = ((run.rate_per_partition / 1000.0).ceil() as usize).max(1);
            let mut pacer = Pacer::new(run.rate_per_partition, step, index as f64 / shared.partitions.len() as f64);
            while !stats.stopped() {
                pacer.wait().await;
                for _ in 0..step {
                    let seq = part.next_seq.fetch_add(1, Ordering::Relaxed);
                    let device = &part.devices[(seq as usize) % part.devices.len()];
                    body.clear();
                    write_body(&mut body, now_micros(), seq as u64);
                    let message = telemetry(device, seq, &body);
                    stats.sent.fetch_add(1, Ordering::Relaxed);
                    if sender.send(Sendable::builder().message(message).settled(true).build()).await.is_err() {
                        if !stats.stopped() {
                            stats.errors.fetch_add(1, Ordering::Relaxed);
                        }
                        return;
                    }
                    stats.accepted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // This run is over: wait for the next one.
        if runs.changed().await.is_err() {
            return;
        }
    }
}

/// One telemetry message as IoT Hub puts it on its built-in endpoint.
pub fn telemetry(device: &str, seq: i64, body: &[u8]) -> Message<Data> {
    let now = Timestamp::from_milliseconds((now_micros() / 1000) as i64);
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

/// A link on which the endpoint receives: requests to `$management` or `$cbs`.
async fn serve_incoming(shared: Arc<Shared>, conn: Arc<Conn>, mut receiver: Receiver) {
    let address = receiver.target().as_ref().and_then(|t| t.address.clone()).unwrap_or_default();
    if address != "$management" && address != "$cbs" {
        let _ = receiver.close_with_error(refusal(AmqpError::NotFound, "this endpoint takes no messages")).await;
        return;
    }
    while let Ok(delivery) = receiver.recv::<Body<Value>>().await {
        let _ = receiver.accept(&delivery).await;
        let request = delivery.into_message();
        let app = request.application_properties.clone().unwrap_or_default();
        let text = |k: &str| match app.get(k) {
            Some(SimpleValue::String(s)) => s.clone(),
            _ => String::new(),
        };
        let props = request.properties.clone().unwrap_or_default();
        let reply_to = props.reply_to.clone().unwrap_or_default();
        let (status, body) = if address == "$cbs" { (202, Value::Null) } else { read(&shared, &text("type"), &text("partition")) };
        let mut reply_props = OrderedMap::new();
        reply_props.insert("status-code".to_string(), SimpleValue::Int(status));
        reply_props.insert("status-description".to_string(), SimpleValue::String(if status < 300 { "OK" } else { "refused" }.into()));
        let reply = Message::builder()
            .properties(Properties { correlation_id: props.message_id.clone().or(Some(MessageId::Ulong(0))), ..Default::default() })
            .application_properties(ApplicationProperties(reply_props))
            .value(body)
            .build();
        // The client attaches its receiving link right after its sending one: wait for it.
        let mut route = None;
        for _ in 0..200 {
            route = conn.replies.lock().unwrap().get(&reply_to).cloned();
            if route.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        match route {
            Some(tx) => {
                let _ = tx.send(reply).await;
            }
            None => return,
        }
    }
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
