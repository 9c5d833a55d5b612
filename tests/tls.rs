//! TLS (`--tls-cert`, `--tls-key`): HTTPS and WSS on the one port, checked with standard
//! clients (curl, socket.io-client in node, tungstenite over rustls, ureq over rustls) that
//! trust a throwaway CA made here; certificate reloads on SIGHUP and on file change; bad
//! files stop start-up with a message naming the flag.

mod common;

use std::io::ErrorKind;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use serde_json::{json, Value};
use tungstenite::{Message, WebSocket};

const WAIT: Duration = Duration::from_secs(10);

/// A throwaway CA and one server certificate (for 127.0.0.1 and localhost) signed by it, as
/// PEM files in a fresh directory.
struct Pki {
    dir: PathBuf,
    ca_der: CertificateDer<'static>,
    leaf_der: CertificateDer<'static>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!("hubcast-tls-{}-{}-{name}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, format!("hubcast test CA {name}"));
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let leaf_key = KeyPair::generate().unwrap();
        let mut leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
        leaf.distinguished_name.push(DnType::CommonName, format!("hubcast test server {name}"));
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let leaf_cert = leaf.signed_by(&leaf_key, &ca_cert, &ca_key).unwrap();
        std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
        std::fs::write(dir.join("cert.pem"), leaf_cert.pem()).unwrap();
        std::fs::write(dir.join("key.pem"), leaf_key.serialize_pem()).unwrap();
        Pki { dir, ca_der: ca_cert.der().clone(), leaf_der: leaf_cert.der().clone() }
    }

    fn ca(&self) -> String {
        self.file("ca.pem")
    }
    fn cert(&self) -> String {
        self.file("cert.pem")
    }
    fn key(&self) -> String {
        self.file("key.pem")
    }
    fn file(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }

    /// The server's flags for this certificate.
    fn args(&self) -> Vec<String> {
        vec!["--tls-cert".into(), self.cert(), "--tls-key".into(), self.key()]
    }

    fn client_config(&self) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca_der.clone()).unwrap();
        let config = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Arc::new(config)
    }

    /// A REST client (ureq over rustls) trusting only this CA.
    fn agent(&self) -> ureq::Agent {
        ureq::AgentBuilder::new().timeout(WAIT).tls_config(self.client_config()).build()
    }

    /// Installs this certificate's files over `target`'s (renamed into place, as a deploy does).
    fn install_over(&self, target: &Pki) {
        for name in ["cert.pem", "key.pem"] {
            let tmp = target.dir.join(format!("{name}.new"));
            std::fs::copy(self.dir.join(name), &tmp).unwrap();
            std::fs::rename(&tmp, target.dir.join(name)).unwrap();
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(pki: &Pki) -> Server {
    let args = pki.args();
    let server = Server::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(server.base.starts_with("https://127.0.0.1:"), "printed URL {}", server.base);
    server
}

/// A TLS connection made with rustls trusting `pki`'s CA; the handshake is completed.
fn tls_connect(server: &Server, pki: &Pki) -> std::io::Result<StreamOwned<ClientConnection, TcpStream>> {
    let tcp = TcpStream::connect(("127.0.0.1", server.port))?;
    tcp.set_read_timeout(Some(WAIT))?;
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let conn = ClientConnection::new(pki.client_config(), name).map_err(std::io::Error::other)?;
    let mut stream = StreamOwned::new(conn, tcp);
    while stream.conn.is_handshaking() {
        stream.conn.complete_io(&mut stream.sock)?;
    }
    Ok(stream)
}

/// The leaf certificate the server presented.
fn presented(stream: &StreamOwned<ClientConnection, TcpStream>) -> CertificateDer<'static> {
    stream.conn.peer_certificates().expect("server certificates")[0].clone().into_owned()
}

type Wss = WebSocket<StreamOwned<ClientConnection, TcpStream>>;

/// A plain WebSocket client (tungstenite) over `wss://`.
fn wss(server: &Server, pki: &Pki, session: &str) -> Wss {
    let stream = tls_connect(server, pki).expect("TLS handshake");
    let url = format!("wss://127.0.0.1:{}/ws?sessionId={session}", server.port);
    let (ws, response) = tungstenite::client(url.as_str(), stream).expect("websocket handshake over TLS");
    assert_eq!(response.status().as_u16(), 101);
    ws
}

/// The next text message as JSON (pings are answered by tungstenite).
fn next_json(ws: &mut Wss) -> Value {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        match ws.read() {
            Ok(Message::Text(text)) => return serde_json::from_str(&text).unwrap(),
            Ok(_) => {}
            Err(tungstenite::Error::Io(e)) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => panic!("websocket read failed: {e}"),
        }
    }
    panic!("no message within {WAIT:?}");
}

/// A session allowed to and subscribed to `device`'s telemetry, made over HTTPS.
fn subscribed(server: &Server, agent: &ureq::Agent, device: &str) -> String {
    let session = server.new_session_on(agent);
    let sub = json!({"type": "telemetry", "deviceId": device, "telemetryKey": null});
    server.grant_on(agent, &session, sub.clone());
    let (status, body) = server.subscribe_on(agent, &session, sub);
    assert_eq!(status, 204, "{body}");
    session
}

/// Runs curl against the server; returns (exit success, HTTP status, body, stderr).
fn curl(server: &Server, args: &[&str], path: &str) -> (bool, u16, String, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10", "-w", "\n%{http_code}"])
        .args(args)
        .arg(format!("https://127.0.0.1:{}{path}", server.port))
        .output()
        .expect("curl is installed (scripts/test.sh installs it)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = stdout.rsplit_once('\n').unwrap_or(("", &stdout));
    (out.status.success(), code.trim().parse().unwrap_or(0), body.to_string(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn curl_speaks_https_to_the_port_and_verifies_the_certificate() {
    let pki = Pki::new("curl");
    let server = start(&pki);
    let (ok, status, body, err) = curl(&server, &["--cacert", &pki.ca(), "-X", "POST"], "/session");
    assert!(ok, "curl failed: {err}");
    assert_eq!(status, 200, "{body}");
    assert!(parse_json(&body)["sessionId"].is_string(), "{body}");
    // Without the CA, curl refuses the server: the certificate really is the test CA's.
    let (ok, _, _, err) = curl(&server, &[], "/status");
    assert!(!ok, "curl accepted an unknown CA");
    assert!(err.contains("certificate") || err.contains("SSL"), "{err}");
    // A request body over TLS, read in full (POST /ingest, 200 with the accepted count).
    let body = json!([{"deviceId": "dev-1", "body": {"temperature": 21.5}}]).to_string();
    let (ok, status, answer, err) = curl(
        &server,
        &["--cacert", &pki.ca(), "-H", "Shared-Access-Key: test-primary", "-H", "content-type: application/json", "--data-binary", &body],
        "/ingest",
    );
    assert!(ok, "{err}");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(parse_json(&answer)["accepted"], 1, "{answer}");
}

#[test]
fn plain_websockets_over_wss_receive_data_on_every_core() {
    let pki = Pki::new("wss");
    let server = start(&pki);
    let agent = pki.agent();
    // Eight sessions spread over both cores: most sockets move to another core after the
    // upgrade, with their TLS session.
    let mut sockets: Vec<(String, Wss)> = (0..8)
        .map(|i| {
            let device = format!("dev-{i}");
            let session = subscribed(&server, &agent, &device);
            let ws = wss(&server, &pki, &session);
            (device, ws)
        })
        .collect();
    for (i, (device, ws)) in sockets.iter_mut().enumerate() {
        server.ingest_on(&agent, json!({"deviceId": device, "body": {"n": i}}));
        let message = next_json(ws);
        assert_eq!(message["deviceId"], json!(device), "{message}");
        assert_eq!(message["telemetry"]["n"], json!(i), "{message}");
    }
}

#[test]
fn plain_http_on_the_tls_port_is_closed_and_the_server_goes_on() {
    use std::io::{Read, Write};
    let pki = Pki::new("plain");
    let server = start(&pki);
    let mut tcp = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    tcp.set_read_timeout(Some(WAIT)).unwrap();
    tcp.write_all(b"GET /status HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    let mut answer = Vec::new();
    // At most a TLS alert, then the end: never an HTTP answer in clear.
    let _ = tcp.read_to_end(&mut answer);
    assert!(!answer.starts_with(b"HTTP/"), "{:?}", String::from_utf8_lossy(&answer));
    let (ok, status, body, err) = curl(&server, &["--cacert", &pki.ca(), "-X", "POST"], "/session");
    assert!(ok && status == 200, "{status} {body} {err}");
}

#[test]
fn big_bodies_and_frames_span_many_tls_records() {
    let pki = Pki::new("big");
    let server = start(&pki);
    let agent = pki.agent();
    let session = subscribed(&server, &agent, "dev-big");
    let mut ws = wss(&server, &pki, &session);
    // ~600 KB each way: dozens of 16 KiB records in, and more than rustls' 64 KiB outgoing
    // buffer out, so both the read loop and partial writes are exercised.
    let blob: String = (0..600_000).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
    server.ingest_on(&agent, json!({"deviceId": "dev-big", "body": {"blob": blob}}));
    let message = next_json(&mut ws);
    assert_eq!(message["telemetry"]["blob"].as_str().map(str::len), Some(blob.len()));
    assert_eq!(message["telemetry"]["blob"], json!(blob));
    // The same connection goes on afterwards.
    server.ingest_on(&agent, json!({"deviceId": "dev-big", "body": {"n": 1}}));
    assert_eq!(next_json(&mut ws)["telemetry"]["n"], 1);
}

#[test]
fn socketio_client_over_wss_receives_data() {
    let pki = Pki::new("sio");
    let server = start(&pki);
    let agent = pki.agent();
    let direct = subscribed(&server, &agent, "dev-ws");
    let upgraded = subscribed(&server, &agent, "dev-poll");
    let ca = pki.ca();
    let env = [("NODE_EXTRA_CA_CERTS", ca.as_str())];
    // One client straight over wss://, one starting with HTTPS long-polling and upgrading.
    let ws = server.socketio_env(&[&direct], "websocket", false, &env);
    let polling = server.socketio_env(&[&upgraded], "polling,websocket", false, &env);
    let connected = ws.wait_for("connect", WAIT).expect("socket.io-client connected over wss://");
    assert_eq!(connected["transport"], "websocket", "{connected}");
    // The upgrade may complete before or after the Socket.IO connect; both must happen.
    let first_two: Vec<Value> = (0..2).map(|_| polling.next(WAIT).expect("connect and upgrade")).collect();
    assert!(first_two.iter().any(|e| e["event"] == "connect"), "connected over https:// long-polling: {first_two:?}");
    let upgrade = first_two.iter().find(|e| e["event"] == "upgrade").expect("upgraded to wss://");
    assert_eq!(upgrade["transport"], "websocket");
    server.ingest_on(&agent, json!([{"deviceId": "dev-ws", "body": {"t": 1}}, {"deviceId": "dev-poll", "body": {"t": 2}}]));
    let data = ws.wait_for("data", WAIT).expect("data over wss://");
    assert_eq!(data["data"]["deviceId"], "dev-ws", "{data}");
    let data = polling.wait_for("data", WAIT).expect("data after the upgrade");
    assert_eq!(data["data"]["deviceId"], "dev-poll", "{data}");
}

/// Waits for the server's log line saying the certificate was reloaded by `trigger`.
fn wait_reloaded(server: &Server, trigger: &str) {
    server
        .wait_for_stderr(WAIT, |l| l.contains("TLS certificate reloaded") && l.contains(trigger))
        .unwrap_or_else(|| panic!("no reload by {trigger} logged:\n{}", server.stderr_lines().join("\n")));
}

fn assert_rotated(server: &Server, old: &Pki, new: &Pki) {
    let stream = tls_connect(server, new).expect("a new connection trusts the new CA");
    assert_eq!(presented(&stream), new.leaf_der, "a new connection gets the new certificate");
    let Err(err) = tls_connect(server, old) else { panic!("the old CA still verifies new connections") };
    assert!(err.to_string().contains("certificate") || err.to_string().contains("Unknown"), "{err}");
}

#[test]
fn sighup_reloads_the_certificate_for_new_connections_and_old_ones_keep_working() {
    let old = Pki::new("old");
    let new = Pki::new("new");
    let server = start(&old);
    let agent = old.agent();
    let session = subscribed(&server, &agent, "dev-1");
    let mut live = wss(&server, &old, &session);
    let first = tls_connect(&server, &old).expect("TLS with the first certificate");
    assert_eq!(presented(&first), old.leaf_der);
    // First proof the old socket carries data.
    server.ingest_on(&agent, json!({"deviceId": "dev-1", "body": {"n": 1}}));
    assert_eq!(next_json(&mut live)["telemetry"]["n"], 1);

    new.install_over(&old);
    server.signal(libc::SIGHUP);
    wait_reloaded(&server, "SIGHUP");
    assert_rotated(&server, &old, &new);
    // The socket opened before the reload goes on with its session.
    server.ingest_on(&new.agent(), json!({"deviceId": "dev-1", "body": {"n": 2}}));
    assert_eq!(next_json(&mut live)["telemetry"]["n"], 2);
    // So does a kept-alive REST connection opened before: the old agent trusts only the old
    // CA, which no new connection passes any more, so this answer came over its pooled one.
    let (status, _, _) = server.call_on(&agent, "GET", "/status", &[ADMIN], None);
    assert_eq!(status, 200);
}

#[test]
fn changed_files_are_reloaded_without_a_signal() {
    let old = Pki::new("before");
    let new = Pki::new("after");
    let server = start(&old);
    new.install_over(&old);
    wait_reloaded(&server, "files changed");
    assert_rotated(&server, &old, &new);
}

#[test]
fn a_bad_replacement_keeps_the_previous_certificate() {
    let pki = Pki::new("keep");
    let server = start(&pki);
    std::fs::write(pki.dir.join("key.pem"), "not a key").unwrap();
    server.signal(libc::SIGHUP);
    server
        .wait_for_stderr(WAIT, |l| l.contains("reload failed") && l.contains("--tls-key"))
        .unwrap_or_else(|| panic!("no failed reload logged:\n{}", server.stderr_lines().join("\n")));
    let stream = tls_connect(&server, &pki).expect("still serving the previous certificate");
    assert_eq!(presented(&stream), pki.leaf_der);
}

/// Runs the binary with `args`, expecting it to refuse to start; returns stderr.
fn refused(args: &[String]) -> String {
    let (ok, _, stderr) = run_expecting_exit(&full_args(&args.iter().map(String::as_str).collect::<Vec<_>>(), true), &[]);
    assert!(!ok, "started with {args:?}");
    stderr
}

#[test]
fn missing_or_invalid_files_stop_start_up_naming_the_flag() {
    let pki = Pki::new("bad");
    let other = Pki::new("other");
    let missing = pki.file("missing.pem");
    let garbage = pki.file("garbage.pem");
    std::fs::write(&garbage, "hello").unwrap();
    let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();

    let err = refused(&s(&["--tls-cert", &missing, "--tls-key", &pki.key()]));
    assert!(err.contains("--tls-cert") && err.contains("missing.pem"), "{err}");
    let err = refused(&s(&["--tls-cert", &garbage, "--tls-key", &pki.key()]));
    assert!(err.contains("--tls-cert") && err.contains("no PEM certificate"), "{err}");
    let err = refused(&s(&["--tls-cert", &pki.cert(), "--tls-key", &missing]));
    assert!(err.contains("--tls-key") && err.contains("missing.pem"), "{err}");
    let err = refused(&s(&["--tls-cert", &pki.cert(), "--tls-key", &garbage]));
    assert!(err.contains("--tls-key"), "{err}");
    // A key that belongs to another certificate.
    let err = refused(&s(&["--tls-cert", &pki.cert(), "--tls-key", &other.key()]));
    assert!(err.contains("--tls-key") && err.contains("--tls-cert"), "{err}");
    // One flag without the other.
    let err = refused(&s(&["--tls-cert", &pki.cert()]));
    assert!(err.contains("--tls-key"), "{err}");
}
