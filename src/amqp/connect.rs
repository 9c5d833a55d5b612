//! Reaching the event stream: endpoints, TLS, SASL, the IoT Hub redirect, and the two
//! request/response nodes Event Hubs offers (`$cbs` for tokens, `$management` for the
//! partition list).
//!
//! Everything here runs on the AMQP thread's tokio runtime (fe2o3-amqp spawns its engines
//! with `tokio::spawn`). Every network step is bounded by a timeout, so a peer that stops
//! answering turns into an error the supervisor retries, never into a hang.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::{RecvError, SendError};
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::definitions::{self, AmqpError, ErrorCondition, LinkError};
use fe2o3_amqp::types::messaging::{ApplicationProperties, Body, Message, MessageId, Outcome, Properties};
use fe2o3_amqp::types::primitives::{SimpleValue, Timestamp, Value};
use fe2o3_amqp::{Connection, Receiver, Sender};
use tokio::net::TcpStream;
use tokio_rustls::rustls::ClientConfig;
use tokio::time::timeout;

use crate::sas::{self, KeyConvention};

/// TCP connect, TLS and AMQP open together.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(20);
/// One request/response on `$cbs` or `$management`, one link attach.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(15);
/// The peer must send something (a heartbeat at least) this often, and so do we.
const IDLE_TIMEOUT_MS: u32 = 60_000;
/// Event Hubs' own maximum frame size (what the Azure SDKs ask for).
const MAX_FRAME_SIZE: u32 = 65_536;

/// An AMQP endpoint: where to dial, what to call it, and the entity to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub tls: bool,
    /// Host to dial (the redirect's `network-host`, usually the same as `hostname`).
    pub dial_host: String,
    pub port: u16,
    /// Name for TLS server name indication and the AMQP `open` hostname.
    pub hostname: String,
    /// Event Hub name (or, for a plain broker, the queue address).
    pub entity: String,
}

impl Endpoint {
    pub fn scheme(&self) -> &'static str {
        if self.tls {
            "amqps"
        } else {
            "amqp"
        }
    }

    /// `amqps://host/entity`: the audience of CBS tokens (as the Azure SDKs use it).
    pub fn audience(&self) -> String {
        format!("{}://{}/{}", self.scheme(), self.hostname, self.entity)
    }

    pub fn describe(&self) -> String {
        format!("{}://{}:{}/{}", self.scheme(), self.dial_host, self.port, self.entity)
    }
}

/// `sb://host/`, `amqps://host[:port][/]` or `amqp://host[:port][/]` (a bare host means
/// amqps): TLS or not, host and port. Anything after the authority is ignored.
pub fn parse_url(url: &str) -> Result<(bool, String, u16), String> {
    let (tls, rest) = if let Some(r) = url.strip_prefix("sb://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("amqps://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("amqp://") {
        (false, r)
    } else if url.contains("://") {
        return Err(format!("`{url}` is not an sb://, amqps:// or amqp:// address"));
    } else {
        (true, url)
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let default_port = if tls { 5671 } else { 5672 };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or_else(|| format!("`{url}`: unclosed [ in the host"))?;
        (host.to_string(), after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (authority.to_string(), None),
        }
    };
    if host.is_empty() {
        return Err(format!("`{url}` names no host"));
    }
    let port = match port {
        Some(p) => p.parse().map_err(|_| format!("`{url}`: port `{p}` is not a number"))?,
        None => default_port,
    };
    Ok((tls, host, port))
}

/// The TLS client configuration: the public web roots (webpki-roots), plus the certificates
/// of `ca_file` (PEM) when given. TLS is rustls with the ring provider: no OpenSSL.
pub fn tls_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, String> {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        let shown = path.display();
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<_, _>>())
            .map_err(|e| format!("cannot read the certificates of {shown}: {e}"))?;
        if certs.is_empty() {
            return Err(format!("{shown} holds no PEM certificate"));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| format!("{shown}: {e}"))?;
        }
    }
    let config = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// Opens an AMQP connection: TCP, then TLS when the endpoint asks for it (TLS first, then
/// the AMQP header, as Event Hubs expects), then SASL with `profile`, then `open`. With
/// `tap`, fe2o3 reads the socket through a [`super::tap::Tap`] (`--event-hub-read-raw`).
pub async fn open(
    endpoint: &Endpoint,
    tls: &Arc<ClientConfig>,
    profile: SaslProfile,
    container_id: &str,
    tap: Option<super::tap::TapHandle>,
) -> Result<ConnectionHandle<()>, String> {
    let target = format!("{}:{}", endpoint.dial_host, endpoint.port);
    let work = async {
        let tcp = TcpStream::connect((endpoint.dial_host.as_str(), endpoint.port))
            .await
            .map_err(|e| format!("cannot connect to {target}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let builder = Connection::builder()
            .container_id(container_id)
            .hostname(endpoint.hostname.as_str())
            .sasl_hostname(endpoint.hostname.as_str())
            .max_frame_size(MAX_FRAME_SIZE)
            .idle_time_out(IDLE_TIMEOUT_MS)
            .sasl_profile(profile);
        let opened = if endpoint.tls {
            let name = tokio_rustls::rustls::pki_types::ServerName::try_from(endpoint.hostname.clone())
                .map_err(|e| format!("`{}` is not a valid TLS server name: {e}", endpoint.hostname))?;
            let stream = tokio_rustls::TlsConnector::from(tls.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS with {target} failed: {e}"))?;
            match tap {
                Some(handle) => builder.open_with_stream(super::tap::Tap::new(stream, handle)).await,
                None => builder.open_with_stream(stream).await,
            }
        } else {
            match tap {
                Some(handle) => builder.open_with_stream(super::tap::Tap::new(tcp, handle)).await,
                None => builder.open_with_stream(tcp).await,
            }
        };
        opened.map_err(|e| match e {
            fe2o3_amqp::connection::OpenError::SaslError { code, .. } => {
                format!("{target} refused the credentials (SASL {code:?}): check SharedAccessKeyName and SharedAccessKey")
            }
            e => format!("AMQP open with {target} failed: {e}"),
        })
    };
    timeout(OPEN_TIMEOUT, work).await.map_err(|_| format!("no AMQP connection to {target} within {OPEN_TIMEOUT:?}"))?
}

/// The AMQP error a link failure carries, if the peer sent one.
pub fn remote_error_of_recv(e: &RecvError) -> Option<&definitions::Error> {
    use fe2o3_amqp::link::LinkStateError as L;
    match e {
        RecvError::LinkStateError(L::RemoteClosedWithError(err) | L::RemoteDetachedWithError(err)) => Some(err),
        _ => None,
    }
}

/// A node that is not there (a broker that is not Event Hubs has no `$management`).
pub fn is_missing_node(err: &definitions::Error) -> bool {
    matches!(
        err.condition,
        ErrorCondition::AmqpError(
            AmqpError::NotFound | AmqpError::NotImplemented | AmqpError::InvalidField | AmqpError::NotAllowed
        )
    )
}

// ---- request/response nodes ($cbs, $management) ----------------------------------------------

/// Why a request/response node could not be used.
#[derive(Debug)]
pub enum NodeError {
    /// The peer has no such node: it refused the link.
    Missing(String),
    /// Anything else (network, timeout, a refusal for another reason).
    Failed(String),
}

impl std::fmt::Display for NodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeError::Missing(s) | NodeError::Failed(s) => f.write_str(s),
        }
    }
}

/// A pair of links to a request/response node (AMQP management draft, as Event Hubs uses it
/// for `$management` and `$cbs`): requests go out with a `reply-to` naming our receiving
/// link, replies come back with `status-code` and the request's id as `correlation-id`.
pub struct NodeLink {
    node: &'static str,
    sender: Sender,
    receiver: Receiver,
    reply_to: String,
    next_id: u64,
}

/// A reply: its status and body.
pub struct Reply {
    pub status: u16,
    pub description: Option<String>,
    pub body: Value,
}

/// Why a link to `node` could not attach: `Missing` when the peer has no such node (it
/// refused the terminus, or closed the link saying so), `Failed` otherwise.
fn attach_failure(node: &str, e: impl std::fmt::Display, remote: Option<&definitions::Error>, refused: bool) -> NodeError {
    let text = format!("cannot attach to {node}: {e}");
    match remote {
        _ if refused => NodeError::Missing(text),
        Some(err) if is_missing_node(err) => NodeError::Missing(text),
        _ => NodeError::Failed(text),
    }
}

impl NodeLink {
    pub async fn attach(session: &mut SessionHandle<()>, node: &'static str, client: &str) -> Result<Self, NodeError> {
        use fe2o3_amqp::link::{ReceiverAttachError as RA, SenderAttachError as SA};
        let reply_to = format!("{client}-{}", node.trim_start_matches('$'));
        let work = async {
            let sender = Sender::builder()
                .name(format!("{reply_to}-sender"))
                .target(node)
                .source(reply_to.as_str())
                .attach(session)
                .await
                .map_err(|e| {
                    let remote = if let SA::RemoteClosedWithError(err) = &e { Some(err) } else { None };
                    attach_failure(node, &e, remote, matches!(e, SA::IncomingTargetIsNone))
                })?;
            let receiver = Receiver::builder()
                .name(format!("{reply_to}-receiver"))
                .source(node)
                .target(reply_to.as_str())
                .attach(session)
                .await
                .map_err(|e| {
                    let remote = if let RA::RemoteClosedWithError(err) = &e { Some(err) } else { None };
                    attach_failure(node, &e, remote, matches!(e, RA::IncomingSourceIsNone))
                })?;
            Ok(Self { node, sender, receiver, reply_to: reply_to.clone(), next_id: 1 })
        };
        timeout(CALL_TIMEOUT, work).await.map_err(|_| NodeError::Failed(format!("no answer from {node} within {CALL_TIMEOUT:?}")))?
    }

    /// Sends one request and waits for its reply.
    pub async fn call(&mut self, properties: Vec<(&str, SimpleValue)>, body: Value) -> Result<Reply, NodeError> {
        let node = self.node;
        let id = self.next_id;
        self.next_id += 1;
        let mut app = ApplicationProperties::default();
        for (k, v) in properties {
            app.insert(k.to_string(), v);
        }
        let message = Message::builder()
            .properties(Properties {
                message_id: Some(MessageId::Ulong(id)),
                reply_to: Some(self.reply_to.clone()),
                ..Default::default()
            })
            .application_properties(app)
            .value(body)
            .build();
        let work = async {
            let outcome = self.sender.send(message).await.map_err(|e| match &e {
                SendError::LinkStateError(fe2o3_amqp::link::LinkStateError::RemoteClosedWithError(err))
                    if is_missing_node(err) =>
                {
                    NodeError::Missing(format!("{node} refused the request: {e}"))
                }
                _ => NodeError::Failed(format!("request to {node} failed: {e}")),
            })?;
            if !matches!(outcome, Outcome::Accepted(_)) {
                return Err(NodeError::Failed(format!("{node} did not accept the request: {outcome:?}")));
            }
            loop {
                let delivery = self.receiver.recv::<Body<Value>>().await.map_err(|e| match remote_error_of_recv(&e) {
                    Some(err) if is_missing_node(err) => NodeError::Missing(format!("{node} refused: {e}")),
                    _ => NodeError::Failed(format!("no reply from {node}: {e}")),
                })?;
                let _ = self.receiver.accept(&delivery).await;
                let message = delivery.into_message();
                let correlation = message.properties.as_ref().and_then(|p| p.correlation_id.clone());
                if correlation.is_some_and(|c| c != MessageId::Ulong(id)) {
                    continue; // a late reply to an earlier (timed out) request
                }
                let reply = reply_of(message);
                if reply.status == 0 {
                    // Event Hubs always answers with a status code; a message without one is
                    // not a reply (a broker that treats "$management" as a queue name echoes
                    // the request back).
                    return Err(NodeError::Missing(format!("{node} answered without a status-code: not an Event Hubs node")));
                }
                return Ok(reply);
            }
        };
        timeout(CALL_TIMEOUT, work).await.map_err(|_| NodeError::Failed(format!("no reply from {node} within {CALL_TIMEOUT:?}")))?
    }
}

fn simple_u16(v: &SimpleValue) -> Option<u16> {
    match v {
        SimpleValue::Int(n) => u16::try_from(*n).ok(),
        SimpleValue::Uint(n) => u16::try_from(*n).ok(),
        SimpleValue::Long(n) => u16::try_from(*n).ok(),
        SimpleValue::Ulong(n) => u16::try_from(*n).ok(),
        SimpleValue::Short(n) => u16::try_from(*n).ok(),
        SimpleValue::Ushort(n) => Some(*n),
        SimpleValue::String(s) => s.parse().ok(),
        _ => None,
    }
}

fn reply_of(message: Message<Body<Value>>) -> Reply {
    let app = message.application_properties.as_ref();
    let get = |a: &str, b: &str| app.and_then(|p| p.get(a).or_else(|| p.get(b)));
    let status = get("status-code", "statusCode").and_then(simple_u16).unwrap_or(0);
    let description = get("status-description", "statusDescription").and_then(|v| match v {
        SimpleValue::String(s) => Some(s.clone()),
        _ => None,
    });
    let body = match message.body {
        Body::Value(v) => v.0,
        _ => Value::Null,
    };
    Reply { status, description, body }
}

fn map_get<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    match map {
        Value::Map(m) => m.iter().find(|(k, _)| matches!(k, Value::String(s) if s == key) || matches!(k, Value::Symbol(s) if s.0 == key)).map(|(_, v)| v),
        _ => None,
    }
}

fn check(reply: &Reply, what: &str) -> Result<(), NodeError> {
    if reply.status == 200 || reply.status == 202 {
        Ok(())
    } else {
        let detail = reply.description.clone().unwrap_or_default();
        let hint = if reply.status == 401 { " (check SharedAccessKeyName and SharedAccessKey)" } else { "" };
        Err(NodeError::Failed(format!("{what} answered {} {detail}{hint}", reply.status)))
    }
}

/// `put-token` on `$cbs`: authorizes `audience` on this connection until `expiry` (seconds).
pub async fn put_token(cbs: &mut NodeLink, audience: &str, token: &str, expiry: i64) -> Result<(), NodeError> {
    let reply = cbs
        .call(
            vec![
                ("operation", SimpleValue::String("put-token".into())),
                ("type", SimpleValue::String("servicebus.windows.net:sastoken".into())),
                ("name", SimpleValue::String(audience.into())),
                ("expiration", SimpleValue::Timestamp(Timestamp::from_milliseconds(expiry * 1000))),
            ],
            Value::String(token.into()),
        )
        .await?;
    check(&reply, "$cbs put-token")
}

fn read_request<'a>(entity: &str, kind: &str, token: Option<&str>) -> Vec<(&'a str, SimpleValue)> {
    let mut p = vec![
        ("operation", SimpleValue::String("READ".into())),
        ("name", SimpleValue::String(entity.into())),
        ("type", SimpleValue::String(kind.into())),
    ];
    if let Some(t) = token {
        p.push(("security_token", SimpleValue::String(t.into())));
    }
    p
}

/// The partition ids of an Event Hub (`$management` READ of `com.microsoft:eventhub`).
pub async fn partition_ids(mgmt: &mut NodeLink, entity: &str, token: Option<&str>) -> Result<Vec<String>, NodeError> {
    let reply = mgmt.call(read_request(entity, "com.microsoft:eventhub", token), Value::Null).await?;
    check(&reply, "$management READ")?;
    let ids: Vec<String> = match map_get(&reply.body, "partition_ids") {
        Some(Value::Array(a)) => a.iter().filter_map(|v| super::map::to_json(v).as_str().map(str::to_owned)).collect(),
        Some(Value::List(l)) => l.iter().filter_map(|v| super::map::to_json(v).as_str().map(str::to_owned)).collect(),
        _ => Vec::new(),
    };
    if ids.is_empty() {
        return Err(NodeError::Failed("$management READ answered without partition_ids".into()));
    }
    Ok(ids)
}

/// The sequence number of the last message enqueued in a partition (-1 when it is empty).
pub async fn last_sequence_number(
    mgmt: &mut NodeLink,
    entity: &str,
    partition: &str,
    token: Option<&str>,
) -> Result<i64, NodeError> {
    let mut request = read_request(entity, "com.microsoft:partition", token);
    request.push(("partition", SimpleValue::String(partition.into())));
    let reply = mgmt.call(request, Value::Null).await?;
    check(&reply, "$management partition READ")?;
    if matches!(map_get(&reply.body, "is_partition_empty"), Some(Value::Bool(true))) {
        return Ok(-1);
    }
    match map_get(&reply.body, "last_enqueued_sequence_number") {
        Some(Value::Long(n)) => Ok(*n),
        Some(Value::Int(n)) => Ok(i64::from(*n)),
        Some(Value::String(s)) => s.parse().map_err(|_| NodeError::Failed("last_enqueued_sequence_number is not a number".into())),
        _ => Err(NodeError::Failed("$management partition READ answered without last_enqueued_sequence_number".into())),
    }
}

// ---- IoT Hub redirect -------------------------------------------------------------------------

/// An IoT Hub host to ask where its built-in endpoint is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IotHubHost {
    pub tls: bool,
    pub host: String,
    pub port: u16,
}

/// Asks the IoT Hub where its events are: attach to `messages/events` and follow the
/// `amqp:link:redirect` the hub answers with (reference `iothub-wire.md` §2.8). The result
/// is the Event Hubs namespace, port and entity; the same key works there (signed the Event
/// Hubs way).
pub async fn follow_redirect(
    hub: &IotHubHost,
    tls: &Arc<ClientConfig>,
    key_name: &str,
    key: &str,
    container_id: &str,
) -> Result<Endpoint, String> {
    let hub_name = hub.host.split(['.', ':']).next().unwrap_or_default();
    let expiry = crate::timefmt::now_millis() / 1000 + 3600;
    let resource = format!("{}/messages/events", hub.host);
    let password = sas::token(&resource, key_name, key, KeyConvention::Base64Decoded, expiry)?;
    let endpoint = Endpoint {
        tls: hub.tls,
        dial_host: hub.host.clone(),
        port: hub.port,
        hostname: hub.host.clone(),
        entity: "messages/events".into(),
    };
    let profile = SaslProfile::Plain { username: format!("{key_name}@sas.root.{hub_name}"), password };
    let mut connection = open(&endpoint, tls, profile, container_id, None).await?;
    let result = async {
        let mut session = timeout(CALL_TIMEOUT, fe2o3_amqp::Session::begin(&mut connection))
            .await
            .map_err(|_| "IoT Hub did not begin a session".to_string())?
            .map_err(|e| format!("IoT Hub refused a session: {e}"))?;
        let address = format!("amqps://{}/messages/events/$management", hub.host);
        let attached = timeout(
            CALL_TIMEOUT,
            Receiver::builder().name(format!("{container_id}-redirect")).source(address).attach(&mut session),
        )
        .await
        .map_err(|_| "IoT Hub did not answer the attach to messages/events".to_string())?;
        let error = match attached {
            Err(fe2o3_amqp::link::ReceiverAttachError::RemoteClosedWithError(err)) => err,
            Err(e) => return Err(format!("IoT Hub refused messages/events: {e}")),
            Ok(mut receiver) => match timeout(CALL_TIMEOUT, receiver.recv::<Body<Value>>()).await {
                Ok(Err(e)) => match remote_error_of_recv(&e) {
                    Some(err) => err.clone(),
                    None => return Err(format!("IoT Hub closed messages/events without a redirect: {e}")),
                },
                Ok(Ok(_)) => return Err("IoT Hub delivered on messages/events instead of redirecting".into()),
                Err(_) => return Err("IoT Hub sent no redirect for messages/events".into()),
            },
        };
        redirect_target(&error, hub.tls)
    }
    .await;
    let _ = timeout(Duration::from_secs(2), connection.close()).await;
    result
}

/// The endpoint an `amqp:link:redirect` error points at.
pub fn redirect_target(error: &definitions::Error, tls: bool) -> Result<Endpoint, String> {
    if !matches!(error.condition, ErrorCondition::LinkError(LinkError::Redirect)) {
        return Err(format!("IoT Hub refused messages/events: {error}"));
    }
    let info = error.info.as_deref().ok_or("redirect without info")?;
    let field = |k: &str| info.iter().find(|(key, _)| key.0 == k).map(|(_, v)| v);
    let text = |k: &str| match field(k) {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Symbol(s)) => Some(s.0.clone()),
        _ => None,
    };
    let hostname = text("hostname").ok_or("redirect without hostname")?;
    let dial_host = text("network-host").filter(|h| !h.is_empty()).unwrap_or_else(|| hostname.clone());
    let port = field("port")
        .and_then(|v| super::map::to_json(v).as_u64())
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or(if tls { 5671 } else { 5672 });
    let address = text("address").ok_or("redirect without address")?;
    // amqps://host:5671/<event hub>/$management → <event hub>
    let path = address.split_once("://").map(|(_, rest)| rest).unwrap_or(&address);
    let entity = path.split('/').nth(1).filter(|e| !e.is_empty()).ok_or_else(|| format!("redirect address `{address}` names no event hub"))?;
    Ok(Endpoint { tls, dial_host, port, hostname, entity: entity.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fe2o3_amqp::types::primitives::{OrderedMap, Symbol};

    #[test]
    fn urls_give_tls_host_and_port() {
        assert_eq!(parse_url("sb://ns.servicebus.windows.net/").unwrap(), (true, "ns.servicebus.windows.net".into(), 5671));
        assert_eq!(parse_url("amqp://127.0.0.1:5672").unwrap(), (false, "127.0.0.1".into(), 5672));
        assert_eq!(parse_url("amqp://localhost").unwrap(), (false, "localhost".into(), 5672));
        assert_eq!(parse_url("amqps://h:1234/x").unwrap(), (true, "h".into(), 1234));
        assert_eq!(parse_url("hub.azure-devices.net").unwrap(), (true, "hub.azure-devices.net".into(), 5671));
        assert_eq!(parse_url("amqp://[::1]:99").unwrap(), (false, "::1".into(), 99));
        assert!(parse_url("http://h").is_err());
        assert!(parse_url("amqp://h:x").is_err());
    }

    #[test]
    fn a_redirect_names_the_event_hub_namespace_and_entity() {
        let mut info = OrderedMap::new();
        info.insert(Symbol::from("hostname"), Value::String("iothub-ns-x.servicebus.windows.net".into()));
        info.insert(Symbol::from("network-host"), Value::String("10.0.0.1".into()));
        info.insert(Symbol::from("port"), Value::Int(5671));
        info.insert(Symbol::from("address"), Value::String("amqps://iothub-ns-x.servicebus.windows.net:5671/hub-123/$management".into()));
        let error = definitions::Error::new(LinkError::Redirect, None, Some(info));
        let ep = redirect_target(&error, true).unwrap();
        assert_eq!(ep.hostname, "iothub-ns-x.servicebus.windows.net");
        assert_eq!(ep.dial_host, "10.0.0.1");
        assert_eq!((ep.port, ep.entity.as_str()), (5671, "hub-123"));
        let other = definitions::Error::new(AmqpError::UnauthorizedAccess, None, None);
        assert!(redirect_target(&other, true).is_err());
    }
}
