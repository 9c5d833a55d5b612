//! The durable store's engine, chosen by measurement (issue 11): hubcast's per-core append log
//! with snapshots (`src/store/log.rs`) against redb, a well-kept embedded B-tree store, doing
//! the same work a core does.
//!
//! Workload: `DEVICES` devices (default 200,000) each with three telemetry keys; they report in
//! units of work of `BATCH` devices (a `POST /ingest` batch or an AMQP batch is one commit on
//! a core), for `ROUNDS` rounds (every device three times), then one sync to disk. Then the
//! store is opened again and everything read back (start-up). Both engines store the same
//! bytes per device (the log's own record encoding) and neither syncs per commit: the log
//! writes each commit to the OS and syncs once a second (`--fsync-interval`); redb commits with
//! `Durability::None` (written, not synced) and syncs once at the end with an `Immediate`
//! commit, which is the most favourable setting for it.
//!
//! `cargo bench --bench store_engines` (env: DEVICES, BATCH, ROUNDS). Prints one line per
//! engine: commits per second, devices written per second, bytes on disk, time to read back.

use std::path::Path;
use std::time::{Duration, Instant};

use hubcast::shard::devices::Device;
use hubcast::store::format::{self, Change, Record};
use redb::{Database, Durability, ReadableTable, TableDefinition};

const TABLE: TableDefinition<&str, &[u8]> = TableDefinition::new("devices");

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn device(round: usize, i: usize) -> Device {
    let mut d = Device::default();
    for (j, (k, v)) in [("temperature", 20.5 + i as f64 / 1e6), ("humidity", 40.0 + round as f64), ("n", i as f64)].into_iter().enumerate() {
        d.telemetry.set(j, k, &v.to_string(), 1_700_000_000_000 + round as i64);
    }
    d
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("device-{i:07}")).collect()
}

fn du(dir: &Path) -> u64 {
    std::fs::read_dir(dir).map(|r| r.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum()).unwrap_or(0)
}

struct Result {
    engine: &'static str,
    write: Duration,
    commits: usize,
    writes: usize,
    bytes: u64,
    read: Duration,
    read_back: usize,
}

fn log_engine(dir: &Path, ids: &[String], batch: usize, rounds: usize) -> Result {
    let mut opened = hubcast::store::log::open(dir, 1, hubcast::store::Options::new(Duration::from_secs(1))).expect("open");
    let mut store = opened.stores.pop().expect("one core");
    let started = Instant::now();
    let (mut commits, mut writes) = (0, 0);
    for round in 0..rounds {
        for (c, chunk) in ids.chunks(batch).enumerate() {
            let devices: Vec<Device> = chunk.iter().enumerate().map(|(j, _)| device(round, c * batch + j)).collect();
            for (id, d) in chunk.iter().zip(&devices) {
                store.put(Change::Device { id, device: Some(d) });
            }
            store.commit();
            commits += 1;
            writes += chunk.len();
        }
    }
    store.flush().expect("sync");
    let write = started.elapsed();
    store.close().expect("close");
    drop(store);
    drop(opened);
    let bytes = du(dir);
    let started = Instant::now();
    let opened = hubcast::store::log::open(dir, 1, hubcast::store::Options::new(Duration::from_secs(1))).expect("reopen");
    let read = started.elapsed();
    let read_back = opened.loaded.iter().map(|l| l.devices.len()).sum();
    Result { engine: "log+snapshots (hubcast)", write, commits, writes, bytes, read, read_back }
}

fn redb_engine(dir: &Path, ids: &[String], batch: usize, rounds: usize) -> Result {
    let path = dir.join("redb");
    let db = Database::create(&path).expect("create");
    let started = Instant::now();
    let (mut commits, mut writes) = (0, 0);
    let mut buf = Vec::new();
    for round in 0..rounds {
        for (c, chunk) in ids.chunks(batch).enumerate() {
            let mut tx = db.begin_write().expect("begin");
            tx.set_durability(Durability::None);
            {
                let mut table = tx.open_table(TABLE).expect("table");
                for (j, id) in chunk.iter().enumerate() {
                    let d = device(round, c * batch + j);
                    buf.clear();
                    format::encode(&mut buf, Change::Device { id, device: Some(&d) });
                    table.insert(id.as_str(), buf.as_slice()).expect("insert");
                }
            }
            tx.commit().expect("commit");
            commits += 1;
            writes += chunk.len();
        }
    }
    let mut tx = db.begin_write().expect("begin");
    tx.set_durability(Durability::Immediate);
    tx.commit().expect("sync");
    let write = started.elapsed();
    drop(db);
    let bytes = du(dir);
    let started = Instant::now();
    let db = Database::create(&path).expect("reopen");
    let tx = db.begin_read().expect("read");
    let table = tx.open_table(TABLE).expect("table");
    let mut devices = hashbrown::HashMap::new();
    for entry in table.iter().expect("iter") {
        let (k, v) = entry.expect("entry");
        format::decode(v.value(), &mut |r| {
            if let Record::Device(_, Some(d)) = r {
                devices.insert(Box::<str>::from(k.value()), d);
            }
        })
        .expect("decode");
    }
    let read = started.elapsed();
    Result { engine: "redb 2 (Durability::None)", write, commits, writes, bytes, read, read_back: devices.len() }
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` (the test suite) does not: then a
    // tiny run only checks that both engines read back what they wrote.
    let full = std::env::args().any(|a| a == "--bench");
    let (n, batch, rounds) = (env("DEVICES", if full { 200_000 } else { 2_000 }), env("BATCH", 100), env("ROUNDS", 3));
    let ids = ids(n);
    println!("{n} devices x 3 keys, {rounds} rounds, {batch} devices per commit");
    println!("{:<26} {:>12} {:>16} {:>12} {:>10} {:>14}", "engine", "commits/s", "device writes/s", "MB on disk", "read s", "devices read");
    for run in [log_engine as fn(&Path, &[String], usize, usize) -> Result, redb_engine] {
        let dir = std::env::temp_dir().join(format!("hubcast-engines-{}-{}", std::process::id(), fastrand::u32(..)));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let r = run(&dir, &ids, batch, rounds);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(r.read_back, n, "{} read back every device", r.engine);
        println!(
            "{:<26} {:>12.0} {:>16.0} {:>12.1} {:>10.3} {:>14}",
            r.engine,
            r.commits as f64 / r.write.as_secs_f64(),
            r.writes as f64 / r.write.as_secs_f64(),
            r.bytes as f64 / 1e6,
            r.read.as_secs_f64(),
            r.read_back
        );
    }
}
