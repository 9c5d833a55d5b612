//! A throwaway `redis-server` for the scale-out tests: its own free port, nothing on disk,
//! killed with the test. Started and stopped again on the same port to test outages.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Redis {
    pub port: u16,
    child: Option<Child>,
    /// Extra `redis-server` flags (a password, TLS).
    extra: Vec<String>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_with(&[])
    }

    /// With extra `redis-server` flags (e.g. `--requirepass`).
    pub fn start_with(extra: &[&str]) -> Redis {
        let extra = extra.iter().map(|a| a.to_string()).collect();
        let mut r = Redis { port: free_port(), child: None, extra };
        // The free port may be taken again before redis-server binds it (by another test's
        // Redis, say): then it exits, and a fresh port is tried.
        for _ in 0..5 {
            if r.try_up() {
                return r;
            }
            r.port = free_port();
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on its port and waits until it answers.
    pub fn up(&mut self) {
        assert!(self.try_up(), "redis-server could not start again on port {} (taken meanwhile?)", self.port);
    }

    /// Starts the server on its port; `false` if it exited (the port was taken). It is ready
    /// once the server answering on the port is this process (`INFO`'s `process_id`): another
    /// program that took the port would answer a PING too.
    fn try_up(&mut self) -> bool {
        let mut child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (scripts/test.sh installs it)");
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return false;
            }
            if self.process_id() == Some(pid) {
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("redis-server on port {} did not answer within 10 s", self.port);
    }

    /// The process id of the server answering on the port (`AUTH` first if it has a password).
    fn process_id(&self) -> Option<u32> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
        let password = self.extra.iter().position(|a| a == "--requirepass").and_then(|i| self.extra.get(i + 1));
        let auth = password.map(|p| format!("AUTH {p}\r\n")).unwrap_or_default();
        s.write_all(format!("{auth}INFO server\r\n").as_bytes()).ok()?;
        let mut text = String::new();
        let mut buf = [0u8; 8192];
        loop {
            let n = s.read(&mut buf).ok().filter(|&n| n > 0)?;
            text.push_str(&String::from_utf8_lossy(&buf[..n]));
            if let Some(rest) = text.split("process_id:").nth(1) {
                if let Some((pid, _)) = rest.split_once("\r\n") {
                    return pid.trim().parse().ok();
                }
            }
        }
    }

    /// Kills the server (SIGKILL: an outage, nothing flushed).
    pub fn down(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// One inline command; the raw first reply bytes.
    pub fn command(&self, line: &str) -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(format!("{line}\r\n").as_bytes()).ok()?;
        let mut buf = [0u8; 65536];
        let n = s.read(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.down();
    }
}

/// One inline command (or several, `\r\n`-separated: `replies` of them) to the server on
/// `port`; the raw replies, read until they are complete.
fn raw_n(port: u16, line: &str, replies: usize) -> Option<String> {
    raw_n_over(port, line, replies, None)
}

/// [`raw_n`], over TLS when `tls` is given (trusting its CA, the server named 127.0.0.1).
fn raw_n_over(port: u16, line: &str, replies: usize, tls: Option<&TlsFiles>) -> Option<String> {
    let s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    match tls {
        None => exchange(s, line, replies),
        Some(tls) => {
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1").ok()?;
            let conn = rustls::ClientConnection::new(tls.client_config(), name).ok()?;
            exchange(rustls::StreamOwned::new(conn, s), line, replies)
        }
    }
}

/// Writes `line` and reads `replies` whole RESP replies.
fn exchange(s: impl Read + Write, line: &str, replies: usize) -> Option<String> {
    exchange_bytes(s, format!("{line}\r\n").as_bytes(), replies).map(|r| String::from_utf8_lossy(&r).into_owned())
}

/// One command of binary arguments (a RESP array) to the server on `port`; its raw reply.
fn command_bytes_at(port: u16, args: &[&[u8]]) -> Option<Vec<u8>> {
    let s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut cmd = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        cmd.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        cmd.extend_from_slice(arg);
        cmd.extend_from_slice(b"\r\n");
    }
    exchange_bytes(s, &cmd, 1)
}

/// The bytes of a RESP bulk string reply (`None`: nil or not a bulk string).
pub fn bulk_bytes(reply: &[u8]) -> Option<Vec<u8>> {
    let rest = reply.strip_prefix(b"$")?;
    let eol = rest.windows(2).position(|w| w == b"\r\n")?;
    let len: usize = std::str::from_utf8(&rest[..eol]).ok()?.parse().ok()?;
    rest.get(eol + 2..eol + 2 + len).map(<[u8]>::to_vec)
}

/// Writes `bytes` and reads `replies` whole RESP replies.
fn exchange_bytes(mut s: impl Read + Write, bytes: &[u8], replies: usize) -> Option<Vec<u8>> {
    s.write_all(bytes).ok()?;
    let mut text = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        let n = s.read(&mut buf).ok().filter(|&n| n > 0)?;
        text.extend_from_slice(&buf[..n]);
        let mut at = Some(0);
        for _ in 0..replies {
            at = at.and_then(|i| resp_end(&text, i));
        }
        if at.is_some() {
            return Some(text);
        }
    }
}

fn raw(port: u16, line: &str) -> Option<String> {
    raw_n(port, line, 1)
}

/// Where the RESP2 reply starting at `i` ends, if all of it is in `b`.
fn resp_end(b: &[u8], i: usize) -> Option<usize> {
    let eol = i + b.get(i..)?.windows(2).position(|w| w == b"\r\n")?;
    let head = std::str::from_utf8(&b[i + 1..eol]).ok()?;
    let next = eol + 2;
    match b.get(i)? {
        b'+' | b'-' | b':' => Some(next),
        b'$' => {
            let len: i64 = head.parse().ok()?;
            if len < 0 {
                return Some(next);
            }
            let end = next + len as usize + 2;
            (b.len() >= end).then_some(end)
        }
        b'*' => {
            let n: i64 = head.parse().ok()?;
            let mut at = next;
            for _ in 0..n.max(0) {
                at = resp_end(b, at)?;
            }
            Some(at)
        }
        _ => None,
    }
}

/// The `field:value` of an `INFO`-style reply.
fn info_field(text: &str, field: &str) -> Option<String> {
    text.lines().find_map(|l| l.strip_prefix(&format!("{field}:"))).map(|v| v.trim().to_string())
}

/// The bulk strings of a RESP array reply (`KEYS`, `SMEMBERS`), or the one bulk string.
pub fn bulk_strings(reply: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = reply.split("\r\n");
    while let Some(l) = lines.next() {
        if l.starts_with('$') && l != "$-1" {
            if let Some(v) = lines.next() {
                out.push(v.to_string());
            }
        }
    }
    out
}

/// One node of a [`RedisCluster`]: its client port and cluster bus port.
struct Node {
    port: u16,
    bus: u16,
    child: Option<Child>,
}

/// A throwaway Redis Cluster (Redis 7: sharded pub/sub) for the scale-out tests: `masters`
/// masters with `replicas` replicas each, every node on free ports (client and bus, so the
/// bus is not `port + 10000`), node configs in a temp dir, nothing else on disk; killed with
/// the test. Nodes are killed and restarted (same ports and config file: the same node) to
/// test outages; slots are moved with `redis-cli --cluster reshard`.
pub struct RedisCluster {
    nodes: Vec<Node>,
    dir: super::TempDir,
    /// `requirepass` (and `masterauth`) of every node.
    password: Option<String>,
    /// TLS only (no plain port), between the nodes too (`tls-cluster`): [`RedisCluster::start_tls`].
    tls: Option<TlsFiles>,
}

/// A throwaway CA and one certificate for 127.0.0.1 and localhost signed by it (for server
/// and client use: a TLS cluster's nodes present it to each other on the bus), as PEM files.
pub struct TlsFiles {
    dir: super::TempDir,
    ca_der: rustls::pki_types::CertificateDer<'static>,
}

impl TlsFiles {
    pub fn new() -> TlsFiles {
        use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose};
        let dir = super::TempDir::new();
        std::fs::create_dir_all(dir.path()).expect("the TLS files' temp dir");
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, "hubcast test Redis CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let leaf_key = KeyPair::generate().unwrap();
        let mut leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let leaf_cert = leaf.signed_by(&leaf_key, &ca_cert, &ca_key).unwrap();
        let files = TlsFiles { dir, ca_der: ca_cert.der().clone() };
        std::fs::write(files.ca(), ca_cert.pem()).unwrap();
        std::fs::write(files.cert(), leaf_cert.pem()).unwrap();
        std::fs::write(files.key(), leaf_key.serialize_pem()).unwrap();
        files
    }

    /// The CA's PEM file (`--redis-ca-file`).
    pub fn ca(&self) -> String {
        format!("{}/ca.pem", self.dir.path())
    }

    pub fn cert(&self) -> String {
        format!("{}/cert.pem", self.dir.path())
    }

    pub fn key(&self) -> String {
        format!("{}/key.pem", self.dir.path())
    }

    fn client_config(&self) -> std::sync::Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca_der.clone()).unwrap();
        let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        std::sync::Arc::new(config)
    }
}

impl RedisCluster {
    /// Starts the nodes, creates the cluster, and returns once every node says
    /// `cluster_state:ok` and they agree on the slot map.
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        Self::start_with(masters, replicas, None)
    }

    /// With a password on every node (clients and replicas need it).
    pub fn start_with(masters: usize, replicas: usize, password: Option<&str>) -> RedisCluster {
        Self::start_over(masters, replicas, password, None)
    }

    /// Speaking TLS only, to clients and between the nodes (`--port 0`, `--tls-cluster yes`),
    /// with a certificate of a CA of its own ([`RedisCluster::tls`]).
    pub fn start_tls(masters: usize) -> RedisCluster {
        Self::start_over(masters, 0, None, Some(TlsFiles::new()))
    }

    fn start_over(masters: usize, replicas: usize, password: Option<&str>, tls: Option<TlsFiles>) -> RedisCluster {
        assert!(masters >= 3, "redis-cli --cluster create needs at least 3 masters");
        let dir = super::TempDir::new();
        std::fs::create_dir_all(dir.path()).expect("the cluster's temp dir");
        let mut c = RedisCluster { nodes: Vec::new(), dir, password: password.map(str::to_string), tls };
        for _ in 0..masters * (1 + replicas) {
            let mut node = Node { port: 0, bus: 0, child: None };
            // The free ports may be taken again before redis-server binds them: fresh ones.
            let started = (0..5).any(|_| {
                node.port = free_port();
                node.bus = free_port();
                node.port != node.bus && c.try_up(&mut node)
            });
            assert!(started, "a cluster node did not start on any of 5 pairs of free ports");
            c.nodes.push(node);
        }
        let addrs: Vec<String> = c.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = Command::new("redis-cli")
            .args(c.cli_auth())
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli is installed");
        assert!(out.status.success(), "redis-cli --cluster create: {}", String::from_utf8_lossy(&out.stdout));
        c.wait_ok();
        c
    }

    /// `redis-cli`'s password and TLS flags.
    fn cli_auth(&self) -> Vec<String> {
        let tls = self.tls.iter().flat_map(|t| ["--tls".to_string(), "--cacert".to_string(), t.ca()]);
        self.password.iter().flat_map(|p| ["-a".to_string(), p.clone(), "--no-auth-warning".to_string()]).chain(tls).collect()
    }

    /// The CA, certificate and key of a TLS cluster.
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// [`raw`] with `AUTH` first when the nodes have a password (over TLS on a TLS cluster).
    fn raw_n(&self, port: u16, line: &str, replies: usize) -> Option<String> {
        let tls = self.tls.as_ref();
        match &self.password {
            None => raw_n_over(port, line, replies, tls),
            Some(p) => {
                let reply = raw_n_over(port, &format!("AUTH {p}\r\n{line}"), replies + 1, tls)?;
                Some(reply.strip_prefix("+OK\r\n").unwrap_or(&reply).to_string())
            }
        }
    }

    fn raw(&self, port: u16, line: &str) -> Option<String> {
        self.raw_n(port, line, 1)
    }

    fn conf(&self, port: u16) -> String {
        format!("{}/nodes-{port}.conf", self.dir.path())
    }

    /// Starts a node's server (again: same config file, same ports); `false` if it exited
    /// (a port was taken). Ready once the server on the port is this process.
    fn try_up(&self, node: &mut Node) -> bool {
        let port = node.port.to_string();
        let listen: Vec<&str> = match &self.tls {
            None => vec!["--port", &port],
            Some(_) => vec!["--port", "0", "--tls-port", &port, "--tls-cluster", "yes", "--tls-replication", "yes", "--tls-auth-clients", "no"],
        };
        let files = self.tls.iter().flat_map(|t| [("--tls-cert-file", t.cert()), ("--tls-key-file", t.key()), ("--tls-ca-cert-file", t.ca())]).flat_map(|(f, v)| [f.to_string(), v]);
        let mut child = Command::new("redis-server")
            .args(listen)
            .args(files)
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--cluster-enabled", "yes", "--cluster-port", &node.bus.to_string()])
            .args(["--cluster-config-file", &self.conf(node.port), "--cluster-node-timeout", "1000"])
            // A master whose slots all moved away stays a master (Redis 7 would make it a
            // replica of the taker): tests move slots back and forth.
            .args(["--cluster-allow-replica-migration", "no"])
            // A replica takes over whenever its master fails (the default refuses one whose
            // master was idle longer than 10 node timeouts: a test's idle master always is).
            .args(["--cluster-replica-validity-factor", "0"])
            .args(["--dir", self.dir.path()])
            .args(self.password.iter().flat_map(|p| ["--requirepass", p.as_str(), "--masterauth", p.as_str()]))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (scripts/services.sh installs it)");
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return false;
            }
            let answered = self.raw(node.port, "INFO server").and_then(|t| info_field(&t, "process_id")).and_then(|p| p.parse().ok());
            if answered == Some(pid) {
                node.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("cluster node on port {} did not answer within 10 s", node.port);
    }

    /// Waits until every running node says `cluster_state:ok` and agrees on who serves
    /// every slot (a reshard or failover is over everywhere).
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let running: Vec<u16> = self.nodes.iter().filter(|n| n.child.is_some()).map(|n| n.port).collect();
            let ok = running
                .iter()
                .all(|p| self.raw(*p, "CLUSTER INFO").and_then(|t| info_field(&t, "cluster_state")).as_deref() == Some("ok"));
            let maps: Vec<Vec<(u16, u16, u16)>> = running.iter().map(|p| self.slot_map_at(*p)).collect();
            if ok && !maps.is_empty() && maps.iter().all(|m| *m == maps[0] && !m.is_empty()) {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster is ok and agreed on every node within 30 s: {maps:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `(first slot, last slot, master port)` ranges as the node on `port` sees them (sorted).
    fn slot_map_at(&self, port: u16) -> Vec<(u16, u16, u16)> {
        let Some(text) = self.raw(port, "CLUSTER NODES") else { return Vec::new() };
        let mut out = Vec::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            if f.len() < 8 || !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let Some(node_port) = f[1].split(['@', ':']).nth(1).and_then(|p| p.parse().ok()) else { continue };
            for range in &f[8..] {
                if range.starts_with('[') {
                    continue; // a slot being migrated
                }
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(a), Ok(b)) = (a.trim().parse(), b.trim().parse()) {
                    out.push((a, b, node_port));
                }
            }
        }
        out.sort();
        out
    }

    /// `--redis-cluster-nodes`: every node as a seed (`rediss://` on a TLS cluster).
    pub fn seeds(&self) -> String {
        let scheme = if self.tls.is_some() { "rediss" } else { "redis" };
        self.nodes.iter().map(|n| format!("{scheme}://127.0.0.1:{}", n.port)).collect::<Vec<_>>().join(",")
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn port(&self, node: usize) -> u16 {
        self.nodes[node].port
    }

    /// The node's id (`CLUSTER MYID`).
    pub fn id(&self, node: usize) -> String {
        let reply = self.raw(self.nodes[node].port, "CLUSTER MYID").unwrap_or_default();
        bulk_strings(&reply).into_iter().next().unwrap_or_else(|| panic!("node {node} has an id: {reply}"))
    }

    /// The running nodes that are masters now.
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|i| self.nodes[*i].child.is_some())
            .filter(|i| self.raw(self.nodes[*i].port, "ROLE").is_some_and(|r| r.contains("master")))
            .collect()
    }

    /// Kills node `i` (SIGKILL: an outage, nothing flushed).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts node `i` again (same ports, same config file: it rejoins as itself, empty).
    /// Returns once it answers; [`RedisCluster::wait_ok`] waits for the cluster.
    pub fn restart(&mut self, i: usize) {
        let mut node = std::mem::replace(&mut self.nodes[i], Node { port: 0, bus: 0, child: None });
        let up = self.try_up(&mut node);
        let port = node.port;
        self.nodes[i] = node;
        assert!(up, "cluster node {i} could not start again on port {port} (taken meanwhile?)");
    }

    /// Kills every node (the whole Redis side goes away).
    pub fn down(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }

    /// Starts every stopped node again and waits for the cluster to be ok.
    pub fn up(&mut self) {
        for i in 0..self.nodes.len() {
            if self.nodes[i].child.is_none() {
                self.restart(i);
            }
        }
        self.wait_ok();
    }

    /// Moves `slots` hash slots from master `from` to master `to` (`redis-cli --cluster
    /// reshard`, with their keys), and waits until every node agrees.
    pub fn reshard(&self, from: usize, to: usize, slots: usize) {
        let out = Command::new("redis-cli")
            .args(self.cli_auth())
            .args(["--cluster", "reshard", &format!("127.0.0.1:{}", self.nodes[from].port)])
            .args(["--cluster-from", &self.id(from), "--cluster-to", &self.id(to)])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli is installed");
        assert!(
            out.status.success(),
            "redis-cli --cluster reshard: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        self.wait_ok();
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT`).
    pub fn slot_of(&self, key: &str) -> u16 {
        let port = self.nodes.iter().find(|n| n.child.is_some()).expect("a running node").port;
        let reply = self.raw(port, &format!("CLUSTER KEYSLOT {key}")).unwrap_or_default();
        reply.trim().trim_start_matches(':').parse().unwrap_or_else(|_| panic!("CLUSTER KEYSLOT {key}: {reply}"))
    }

    /// The node serving `slot` now.
    pub fn owner_of(&self, slot: u16) -> usize {
        let port = self.nodes.iter().find(|n| n.child.is_some()).expect("a running node").port;
        let owner = self.slot_map_at(port).into_iter().find(|(a, b, _)| *a <= slot && slot <= *b).map(|(_, _, p)| p);
        self.nodes.iter().position(|n| Some(n.port) == owner).unwrap_or_else(|| panic!("a node serves slot {slot}"))
    }

    /// Moves one slot to master `to`, by hand as `redis-cli --cluster reshard` does it
    /// (`IMPORTING` on the target, `MIGRATING` on the source, its keys `MIGRATE`d, then `NODE`
    /// on both and every other master), and waits until every node agrees.
    pub fn move_slot(&self, slot: u16, to: usize) {
        let from = self.owner_of(slot);
        assert_ne!(from, to, "slot {slot} is on node {to} already");
        let (from_id, to_id) = (self.id(from), self.id(to));
        let (from_port, to_port) = (self.nodes[from].port, self.nodes[to].port);
        let ok = |reply: Option<String>, what: &str| assert!(reply.as_deref().is_some_and(|r| r.starts_with("+OK")), "{what}: {reply:?}");
        ok(self.raw(to_port, &format!("CLUSTER SETSLOT {slot} IMPORTING {from_id}")), "IMPORTING");
        ok(self.raw(from_port, &format!("CLUSTER SETSLOT {slot} MIGRATING {to_id}")), "MIGRATING");
        loop {
            let keys = bulk_strings(&self.raw(from_port, &format!("CLUSTER GETKEYSINSLOT {slot} 100")).unwrap_or_default());
            if keys.is_empty() {
                break;
            }
            let auth = self.password.as_ref().map(|p| format!(" AUTH {p}")).unwrap_or_default();
            let reply = self.raw(from_port, &format!("MIGRATE 127.0.0.1 {to_port} \"\" 0 5000{auth} KEYS {}", keys.join(" ")));
            assert!(reply.as_deref().is_some_and(|r| r.starts_with('+')), "MIGRATE: {reply:?}");
        }
        ok(self.raw(to_port, &format!("CLUSTER SETSLOT {slot} NODE {to_id}")), "NODE on the target");
        ok(self.raw(from_port, &format!("CLUSTER SETSLOT {slot} NODE {to_id}")), "NODE on the source");
        for m in self.masters() {
            if m != from && m != to {
                let _ = self.raw(self.nodes[m].port, &format!("CLUSTER SETSLOT {slot} NODE {to_id}"));
            }
        }
        self.wait_ok();
    }

    /// One inline command on node `i`; the raw reply.
    pub fn command_on(&self, i: usize, line: &str) -> Option<String> {
        self.raw(self.nodes[i].port, line)
    }

    /// One inline command on whichever node serves its key: sent to a running node and
    /// sent again where a `MOVED` or `ASK` points; the raw reply.
    pub fn command(&self, line: &str) -> Option<String> {
        let mut port = self.nodes.iter().find(|n| n.child.is_some())?.port;
        let mut asking = false;
        for _ in 0..5 {
            let mut reply = if asking { self.raw_n(port, &format!("ASKING\r\n{line}"), 2)? } else { self.raw(port, line)? };
            if asking {
                reply = reply.strip_prefix("+OK\r\n").unwrap_or(&reply).to_string();
            }
            let redirect = reply.strip_prefix("-MOVED ").map(|r| (r, false)).or_else(|| reply.strip_prefix("-ASK ").map(|r| (r, true)));
            let Some((rest, ask)) = redirect else { return Some(reply) };
            port = rest.split_whitespace().nth(1)?.rsplit(':').next()?.parse().ok()?;
            asking = ask;
        }
        None
    }

    /// The keys matching `pattern` on every master (`KEYS` on each: a node holds only the
    /// keys of its own slots).
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .masters()
            .into_iter()
            .flat_map(|i| bulk_strings(&self.raw(self.nodes[i].port, &format!("KEYS {pattern}")).unwrap_or_default()))
            .collect();
        out.sort();
        out
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        self.down();
    }
}

/// The Redis side of a scale-out test: one Redis or a Redis Cluster (3 masters), so one
/// test body runs on both (see [`both_engines!`](crate::both_engines)).
pub enum Engine {
    Single(Redis),
    Cluster(RedisCluster),
}

impl Engine {
    pub fn single() -> Engine {
        Engine::Single(Redis::start())
    }

    pub fn cluster() -> Engine {
        Engine::Cluster(RedisCluster::start(3, 0))
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, Engine::Cluster(_))
    }

    /// A hubcast instance `id` on it (prefix `t`) with `extra` flags, once its link is up.
    pub fn instance(&self, id: &str, extra: &[&str]) -> super::Server {
        let mut args: Vec<String> = self.flags();
        args.extend(["--instance-id", id, "--redis-prefix", "t"].map(String::from));
        args.extend(extra.iter().map(|s| s.to_string()));
        let server = super::Server::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
        server.wait_for_metric(&format!("hubcast_redis_connected{{instance=\"{id}\"}}"), Duration::from_secs(10), super::Want::Eq(1.0));
        server
    }

    /// The hubcast flags that reach it.
    pub fn flags(&self) -> Vec<String> {
        match self {
            Engine::Single(r) => vec!["--redis-url".into(), r.url()],
            Engine::Cluster(c) => {
                let ca = c.tls().iter().flat_map(|t| ["--redis-ca-file".to_string(), t.ca()]).collect::<Vec<_>>();
                [vec!["--redis-cluster-nodes".into(), c.seeds()], ca].concat()
            }
        }
    }

    /// The whole Redis side goes away (SIGKILL: everything it held is lost).
    pub fn down(&mut self) {
        match self {
            Engine::Single(r) => r.down(),
            Engine::Cluster(c) => c.down(),
        }
    }

    /// And comes back, empty (a cluster keeps its slot map: nodes restart with their config).
    pub fn up(&mut self) {
        match self {
            Engine::Single(r) => r.up(),
            Engine::Cluster(c) => c.up(),
        }
    }

    /// One inline command (on a cluster: on the node serving its key); the raw reply.
    pub fn command(&self, line: &str) -> Option<String> {
        match self {
            Engine::Single(r) => r.command(line),
            Engine::Cluster(c) => c.command(line),
        }
    }

    /// One inline command on every running node (one Redis: on it); the raw replies.
    pub fn command_everywhere(&self, line: &str) -> Vec<Option<String>> {
        match self {
            Engine::Single(r) => vec![r.command(line)],
            Engine::Cluster(c) => (0..c.len()).filter(|i| c.nodes[*i].child.is_some()).map(|i| c.command_on(i, line)).collect(),
        }
    }

    /// One command of binary arguments on the server of `key` (a cluster: the node serving its
    /// slot now); the raw reply.
    pub fn command_bytes(&self, key: &str, args: &[&[u8]]) -> Option<Vec<u8>> {
        let port = match self {
            Engine::Single(r) => r.port,
            Engine::Cluster(c) => c.port(c.owner_of(c.slot_of(key))),
        };
        command_bytes_at(port, args)
    }

    /// The keys matching `pattern` (on a cluster: on every master).
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        match self {
            Engine::Single(r) => bulk_strings(&r.command(&format!("KEYS {pattern}")).unwrap_or_default()),
            Engine::Cluster(c) => c.keys(pattern),
        }
    }

    /// A session's key under `prefix` (docs/OPERATIONS.md: hash-tagged on a cluster).
    pub fn session_key(&self, prefix: &str, session: &str) -> String {
        match self {
            Engine::Single(_) => format!("{prefix}:session:{session}"),
            Engine::Cluster(_) => format!("{prefix}:session:{{{session}}}"),
        }
    }

    /// A control key under `prefix` (`watching:<instance>`, `checkpoint:…`): in the prefix's
    /// one slot on a cluster (`{prefix}:…`).
    pub fn control_key(&self, prefix: &str, rest: &str) -> String {
        match self {
            Engine::Single(_) => format!("{prefix}:{rest}"),
            Engine::Cluster(_) => format!("{{{prefix}}}:{rest}"),
        }
    }

    /// The time of instance `id`'s last heartbeat as Redis holds it (its instance key on one
    /// Redis, its score in the `instances` sorted set on a cluster).
    pub fn heartbeat(&self, prefix: &str, id: &str) -> Option<String> {
        let reply = match self {
            Engine::Single(_) => self.command(&format!("GET {prefix}:instance:{id}"))?,
            Engine::Cluster(_) => self.command(&format!("ZSCORE {{{prefix}}}:instances {id}"))?,
        };
        bulk_strings(&reply).into_iter().next()
    }
}

/// Runs a scale-out test on both engines: `both_engines!(name, …)` makes the tests
/// `name::single` and `name::cluster`, each calling `fn name(engine: Engine)` with its own
/// freshly started Redis side.
#[macro_export]
macro_rules! both_engines {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn single() {
                    super::$name($crate::common::redis::Engine::single())
                }
                #[test]
                fn cluster() {
                    super::$name($crate::common::redis::Engine::cluster())
                }
            }
        )*
    };
}
