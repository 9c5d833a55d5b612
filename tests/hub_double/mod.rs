//! A local HTTP double of the IoT Hub service REST API (reference iothub-wire.md §3), started
//! by each test on 127.0.0.1:0.
//!
//! Every request is checked the way the real hub would check it: the SAS token (signature
//! recomputed with the base64-decoded key, `sr` = the lower-cased host, policy name, not
//! expired), `api-version=2021-04-12`, the path, the headers and the body shape. A request
//! that fails a check is answered 400 and recorded in [`HubDouble::violations`]; tests end
//! with [`HubDouble::assert_clean`].
//!
//! Answers: by default a small simulated hub (devices added with [`HubDouble::add_device`]:
//! twin read, desired patch merged into the twin, direct methods echoed, 404
//! DeviceNotFound / DeviceNotOnline). [`HubDouble::script`] queues answers for the next
//! requests instead: any status and body, a hang, or a closed connection.

#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use hmac::{Hmac, Mac};
use percent_encoding::percent_decode_str;
use serde_json::{json, Value};
use sha2::Sha256;

/// The hub's host name in the connection string (mixed case: `sr` must be lower-cased).
pub const HOST: &str = "TestHub.azure-devices.net";
pub const POLICY: &str = "service";
/// base64("hubcast-test-policy-key-0123456789").
pub const KEY: &str = "aHViY2FzdC10ZXN0LXBvbGljeS1rZXktMDEyMzQ1Njc4OQ==";
pub const API_VERSION: &str = "2021-04-12";

/// A scripted answer for one request.
#[derive(Clone, Debug)]
pub enum Answer {
    Json { status: u16, body: Value, error_code: Option<String> },
    Text { status: u16, body: String },
    /// Never answer (the connection is held until the double stops).
    Hang,
    /// Close the connection without answering.
    Close,
    /// Hold the request until the gate opens (or the double stops), then answer as given.
    AfterGate(Arc<Gate>, Box<Answer>),
}

/// A gate a test opens to release the requests held by [`Answer::AfterGate`].
#[derive(Debug, Default)]
pub struct Gate {
    open: Mutex<bool>,
    opened: std::sync::Condvar,
}

impl Gate {
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    /// Waits until open; false when `stop` was set or a minute passed.
    fn wait(&self, stop: &AtomicBool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut open = self.open.lock().unwrap();
        while !*open {
            if stop.load(Ordering::Relaxed) || Instant::now() >= deadline {
                return false;
            }
            open = self.opened.wait_timeout(open, Duration::from_millis(50)).unwrap().0;
        }
        true
    }
}

impl Answer {
    pub fn ok(body: Value) -> Answer {
        Answer::Json { status: 200, body, error_code: None }
    }

    /// An error the way IoT Hub writes it: `iothub-errorcode` header and a `Message` body.
    pub fn hub_error(status: u16, code: &str, message: &str) -> Answer {
        Answer::Json {
            status,
            body: json!({
                "Message": format!("ErrorCode:{code};{message}"),
                "ExceptionMessage": "Tracking ID:0123456789abcdef-G:0-TimeStamp:01/01/2026 00:00:00"
            }),
            error_code: Some(code.to_string()),
        }
    }
}

/// One request as the double received it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    /// Path as sent (percent-encoded).
    pub path: String,
    pub query: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Device id decoded from the path.
    pub device: String,
    /// `se` of the SAS token.
    pub expiry: u64,
    /// The whole Authorization header.
    pub authorization: String,
    pub at: Instant,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

#[derive(Default)]
struct State {
    scripted: Mutex<VecDeque<Answer>>,
    requests: Mutex<Vec<Recorded>>,
    violations: Mutex<Vec<String>>,
    twins: Mutex<HashMap<String, Value>>,
    stop: AtomicBool,
}

pub struct HubDouble {
    pub addr: SocketAddr,
    state: Arc<State>,
}

impl HubDouble {
    pub fn start() -> HubDouble {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the hub double");
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State::default());
        let accept_state = state.clone();
        std::thread::spawn(move || {
            while !accept_state.stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let state = accept_state.clone();
                        std::thread::spawn(move || serve(stream, state));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        HubDouble { addr, state }
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn connection_string(&self) -> String {
        format!("HostName={HOST};SharedAccessKeyName={POLICY};SharedAccessKey={KEY}")
    }

    /// The flags that point a server at this double.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--iot-hub-service-connection-string".into(),
            self.connection_string(),
            "--iot-hub-service-url".into(),
            self.url(),
            "--iot-hub-allow-insecure-http".into(),
        ]
    }

    /// Adds a device to the simulated hub; returns its twin.
    pub fn add_device(&self, id: &str, connected: bool) -> Value {
        let twin = json!({
            "deviceId": id,
            "etag": "AAAAAAAAAAE=",
            "deviceEtag": "MTIzNDU2Nzg=",
            "status": "enabled",
            "statusUpdateTime": "0001-01-01T00:00:00Z",
            "connectionState": if connected { "Connected" } else { "Disconnected" },
            "lastActivityTime": "2026-01-01T00:00:00Z",
            "cloudToDeviceMessageCount": 0,
            "authenticationType": "sas",
            "x509Thumbprint": {"primaryThumbprint": null, "secondaryThumbprint": null},
            "modelId": "",
            "version": 4,
            "capabilities": {"iotEdge": false},
            "tags": {},
            "properties": {
                "desired": {"interval": 10, "$version": 1},
                "reported": {"fw": "1.0", "$version": 3}
            }
        });
        self.state.twins.lock().unwrap().insert(id.to_string(), twin.clone());
        twin
    }

    /// The simulated twin of `id` as it is now.
    pub fn twin(&self, id: &str) -> Option<Value> {
        self.state.twins.lock().unwrap().get(id).cloned()
    }

    /// Queues `answer` for the next request that passes the checks.
    pub fn script(&self, answer: Answer) {
        self.state.scripted.lock().unwrap().push_back(answer);
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().unwrap().clone()
    }

    pub fn request_count(&self) -> usize {
        self.state.requests.lock().unwrap().len()
    }

    /// Waits until at least `n` requests arrived.
    pub fn wait_for_requests(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.request_count() >= n {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    pub fn violations(&self) -> Vec<String> {
        self.state.violations.lock().unwrap().clone()
    }

    /// Every request so far passed the checks.
    pub fn assert_clean(&self) {
        let v = self.violations();
        assert!(v.is_empty(), "the hub double saw malformed requests: {v:#?}");
    }
}

impl Drop for HubDouble {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
    }
}

/// The SAS signature of `sr` + `se`, as IoT Hub computes it.
pub fn expected_signature(sr: &str, se: &str) -> String {
    let key = BASE64.decode(KEY).unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{sr}\n{se}").as_bytes());
    BASE64.encode(mac.finalize().into_bytes())
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

fn decode(s: &str) -> String {
    percent_decode_str(s).decode_utf8_lossy().into_owned()
}

/// Checks the Authorization header; returns `se`.
fn check_token(auth: &str) -> Result<u64, String> {
    let rest = auth.strip_prefix("SharedAccessSignature ").ok_or("Authorization is not a SharedAccessSignature")?;
    let mut fields = HashMap::new();
    for pair in rest.split('&') {
        let (k, v) = pair.split_once('=').ok_or_else(|| format!("token part `{pair}` is not k=v"))?;
        if fields.insert(k.to_string(), v.to_string()).is_some() {
            return Err(format!("token field {k} given twice"));
        }
    }
    let field = |k: &str| fields.get(k).cloned().ok_or_else(|| format!("token has no `{k}`"));
    let (sr, sig, se, skn) = (field("sr")?, field("sig")?, field("se")?, field("skn")?);
    if fields.len() != 4 {
        return Err(format!("token has unexpected fields: {rest}"));
    }
    if sr != HOST.to_ascii_lowercase() {
        return Err(format!("sr is `{sr}`, expected the lower-cased hub host"));
    }
    if skn != POLICY {
        return Err(format!("skn is `{skn}`"));
    }
    let expiry: u64 = se.parse().map_err(|_| format!("se `{se}` is not a number"))?;
    if expiry <= now_secs() {
        return Err(format!("token expired (se {expiry}, now {})", now_secs()));
    }
    if decode(&sig) != expected_signature(&sr, &se) {
        return Err(format!("signature mismatch: sig {sig}"));
    }
    if sig.contains('+') || sig.contains('/') || sig.contains('=') {
        return Err(format!("sig is not URL-encoded: {sig}"));
    }
    Ok(expiry)
}

/// The device id of a `/twins/{id}` or `/twins/{id}/methods` path for `method`.
fn check_path(method: &str, path: &str) -> Result<String, String> {
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (method, segments.as_slice()) {
        ("GET" | "PATCH", ["twins", id]) | ("POST", ["twins", id, "methods"]) if !id.is_empty() => Ok(decode(id)),
        _ => Err(format!("unexpected {method} {path}")),
    }
}

fn check_body(method: &str, headers: &[(String, String)], body: &[u8]) -> Result<(), String> {
    let header = |n: &str| headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(n)).map(|(_, v)| v.as_str());
    if method == "GET" {
        return if body.is_empty() { Ok(()) } else { Err("GET with a body".into()) };
    }
    if header("content-type") != Some("application/json; charset=utf-8") {
        return Err(format!("content-type is {:?}", header("content-type")));
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("body is not JSON: {e}"))?;
    let obj = v.as_object().ok_or("body is not an object")?;
    match method {
        "PATCH" => {
            match header("if-match") {
                Some("*") => {}
                Some(etag) if etag.starts_with('"') && etag.ends_with('"') => {}
                other => return Err(format!("If-Match is {other:?}")),
            }
            let desired = v.pointer("/properties/desired").ok_or("no properties.desired")?;
            if !desired.is_object() || obj.len() != 1 || v["properties"].as_object().unwrap().len() != 1 {
                return Err(format!("patch body is not {{properties:{{desired:{{…}}}}}}: {v}"));
            }
        }
        _ => {
            if !obj.get("methodName").is_some_and(Value::is_string) || !obj.contains_key("payload") {
                return Err(format!("method body lacks methodName or payload: {v}"));
            }
            for (k, value) in obj {
                match k.as_str() {
                    "methodName" | "payload" => {}
                    "responseTimeoutInSeconds" | "connectTimeoutInSeconds" if value.is_number() => {}
                    _ => return Err(format!("unexpected method body field {k}: {value}")),
                }
            }
        }
    }
    Ok(())
}

fn merge(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else if v.is_object() && t.get(k).is_some_and(Value::is_object) {
                    merge(t.get_mut(k).unwrap(), v);
                } else {
                    t.insert(k.clone(), v.clone());
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

/// The simulated hub's answer.
fn simulate(state: &State, req: &Recorded) -> Answer {
    let mut twins = state.twins.lock().unwrap();
    let Some(twin) = twins.get_mut(&req.device) else {
        return Answer::hub_error(404, "DeviceNotFound", &format!("Device {} not registered", req.device));
    };
    match req.method.as_str() {
        "GET" => Answer::ok(twin.clone()),
        "PATCH" => {
            let patch = req.json()["properties"]["desired"].clone();
            merge(&mut twin["properties"]["desired"], &patch);
            let v = twin["properties"]["desired"]["$version"].as_u64().unwrap_or(0) + 1;
            twin["properties"]["desired"]["$version"] = json!(v);
            twin["version"] = json!(twin["version"].as_u64().unwrap_or(0) + 1);
            Answer::ok(twin.clone())
        }
        _ => {
            if twin["connectionState"] != "Connected" {
                return Answer::hub_error(404, "DeviceNotOnline", &format!("Device {} is not online", req.device));
            }
            let body = req.json();
            Answer::ok(json!({"status": 200, "payload": {"method": body["methodName"], "received": body["payload"]}}))
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        412 => "Precondition Failed",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

fn write_answer(stream: &mut TcpStream, status: u16, content_type: &str, body: &[u8], error_code: Option<&str>) -> bool {
    let mut head = format!("HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n", reason(status), body.len());
    if let Some(code) = error_code {
        head.push_str(&format!("iothub-errorcode: {code}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).and_then(|_| stream.write_all(body)).is_ok()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// One keep-alive connection.
fn serve(mut stream: TcpStream, state: Arc<State>) {
    stream.set_nonblocking(false).ok();
    stream.set_read_timeout(Some(Duration::from_millis(100))).ok();
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        // Read one request head.
        let head_end = loop {
            if let Some(pos) = find(&buf, b"\r\n\r\n") {
                break pos + 4;
            }
            if state.stop.load(Ordering::Relaxed) {
                return;
            }
            match stream.read(&mut chunk) {
                Ok(0) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(_) => return,
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let mut lines = head.split("\r\n");
        let mut request_line = lines.next().unwrap_or("").split(' ');
        let method = request_line.next().unwrap_or("").to_string();
        let target = request_line.next().unwrap_or("").to_string();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_string(), v.trim().to_string())))
            .collect();
        let length: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            match stream.read(&mut chunk) {
                Ok(0) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    if state.stop.load(Ordering::Relaxed) {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
        let body = buf[head_end..head_end + length].to_vec();
        buf.drain(..head_end + length);
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let authorization = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("authorization"))
            .map(|(_, v)| v.clone())
            .unwrap_or_default();

        let checked = (|| -> Result<(String, u64), String> {
            let expiry = check_token(&authorization)?;
            if query != format!("api-version={API_VERSION}") {
                return Err(format!("query is `{query}`"));
            }
            let device = check_path(&method, path)?;
            check_body(&method, &headers, &body)?;
            Ok((device, expiry))
        })();
        let (device, expiry) = match checked {
            Ok(v) => v,
            Err(violation) => {
                state.violations.lock().unwrap().push(format!("{method} {target}: {violation}"));
                let body = json!({"Message": format!("double: {violation}")}).to_string();
                if !write_answer(&mut stream, 400, "application/json; charset=utf-8", body.as_bytes(), None) {
                    return;
                }
                continue;
            }
        };
        let recorded = Recorded {
            method,
            path: path.to_string(),
            query: query.to_string(),
            headers,
            body,
            device,
            expiry,
            authorization,
            at: Instant::now(),
        };
        state.requests.lock().unwrap().push(recorded.clone());
        let scripted = state.scripted.lock().unwrap().pop_front();
        let mut answer = scripted.unwrap_or_else(|| simulate(&state, &recorded));
        while let Answer::AfterGate(gate, then) = answer {
            if !gate.wait(&state.stop) {
                return;
            }
            answer = *then;
        }
        let written = match answer {
            Answer::Json { status, body, error_code } => write_answer(
                &mut stream,
                status,
                "application/json; charset=utf-8",
                body.to_string().as_bytes(),
                error_code.as_deref(),
            ),
            Answer::Text { status, body } => write_answer(&mut stream, status, "text/plain", body.as_bytes(), None),
            Answer::Hang => {
                let until = Instant::now() + Duration::from_secs(60);
                while !state.stop.load(Ordering::Relaxed) && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(20));
                }
                return;
            }
            Answer::Close | Answer::AfterGate(..) => return,
        };
        if !written {
            return;
        }
    }
}
