//! Hostile HTTP clients against hubcast under a memory limit, as in a container: chunked
//! bodies declaring a huge chunk and streaming data, and clients that pipeline requests and
//! never read. The process must survive and keep answering `GET /version` to others.
//!
//! Two limits: the peak resident memory after the attack must stay below what the floods
//! pushed (about 200 MiB are taken before the 413s end them), and an address-space cap (`prlimit --as`) of the idle server's
//! mappings plus 512 MiB is set on the running server, so a burst of new mappings fails
//! inside it rather than passing unnoticed. (mimalloc reserves its arenas up front, so the cap
//! alone would not see buffering inside them: the peak RSS is the bound that does.)

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{raw_exchange, raw_get, read_response, RawOutcome, Server};

/// Address space allowed beyond what the idle server maps.
const MAPPING_HEADROOM: u64 = 512 * 1024 * 1024;
/// Most resident memory the server may reach during the attack (an idle debug server holds
/// about 20–30 MiB; the floods push about 200 MiB before their 413s, and try to push 1 GiB).
const PEAK_RSS_LIMIT: u64 = 128 * 1024 * 1024;
const FLOODERS: usize = 4;
/// Bytes each flooder tries to push in all.
const FLOOD_BYTES: usize = 256 * 1024 * 1024;
/// Most floods per flooder (each one is answered and closed within about a second).
const ROUNDS: usize = 4;
const PIPELINERS: usize = 12;

fn proc_status(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// One round of a chunked flood: a chunk declared 7fffffff bytes, then data until the server
/// stops taking it. Returns the answer's status (0: none) and the bytes sent.
fn flood_once(port: u16, budget: usize) -> (u16, usize) {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else { return (0, 0) };
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    if stream.write_all(b"POST /version HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n7fffffff\r\n").is_err() {
        return (0, 0);
    }
    let mut writer = stream.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let block = vec![b'x'; 256 * 1024];
        let mut sent = 0;
        while sent < budget {
            match writer.write(&block[..block.len().min(budget - sent)]) {
                Ok(n) if n > 0 => sent += n,
                _ => break,
            }
        }
        sent
    });
    let status = match read_response(&mut stream) {
        RawOutcome::Response(r) => r.status,
        _ => 0,
    };
    // Drain what follows so the sender ends on the server's close, not on our read side.
    let mut sink = [0u8; 4096];
    while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
    drop(stream);
    (status, sender.join().unwrap())
}

/// Pipelines `GET /version` and never reads, reconnecting whenever the server closes, until `stop`.
fn pipeline_until(port: u16, stop: &AtomicBool, closed: &AtomicUsize) {
    let batch: Vec<u8> = raw_get("/version").repeat(256);
    while !stop.load(Ordering::Relaxed) {
        let Ok(stream) = TcpStream::connect(("127.0.0.1", port)) else { continue };
        stream.set_nonblocking(true).unwrap();
        let mut writer = &stream;
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            match writer.write(&batch) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(20)),
                Err(_) => {
                    closed.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
}

struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[test]
fn hubcast_under_a_memory_limit_survives_chunked_floods_and_pipeliners_that_never_read() {
    let mut server = Server::start(&["--max-body-bytes", "65536", "--max-connections", "64", "--http-idle-timeout", "2"]);
    let pid = server.pid();
    let footprint = proc_status(pid, "VmSize:").expect("VmSize of the server");
    let idle_rss = proc_status(pid, "VmRSS:").expect("VmRSS of the server");
    assert!(idle_rss < PEAK_RSS_LIMIT / 2, "the idle server holds {} MiB: raise PEAK_RSS_LIMIT", idle_rss >> 20);
    let capped = Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &format!("--as={}", footprint + MAPPING_HEADROOM)])
        .status()
        .expect("run prlimit (util-linux)");
    assert!(capped.success(), "prlimit failed");

    let port = server.port;
    let stop = AtomicBool::new(false);
    let pipeliners_closed = AtomicUsize::new(0);
    let (statuses, pushed, answered) = std::thread::scope(|s| {
        // However this ends (a failed assertion too), the pipeliners stop, so the scope ends.
        let _stop = StopOnDrop(&stop);
        for _ in 0..PIPELINERS {
            s.spawn(|| pipeline_until(port, &stop, &pipeliners_closed));
        }
        let flooders: Vec<_> = (0..FLOODERS)
            .map(|_| {
                s.spawn(move || {
                    let (mut statuses, mut pushed) = (Vec::new(), 0);
                    while pushed < FLOOD_BYTES && statuses.len() < ROUNDS {
                        let (status, sent) = flood_once(port, FLOOD_BYTES - pushed);
                        statuses.push(status);
                        pushed += sent;
                    }
                    (statuses, pushed)
                })
            })
            .collect();
        // Another client keeps asking for the version while the attack runs.
        let mut answered = 0;
        while !flooders.iter().all(|f| f.is_finished()) {
            let mut client = TcpStream::connect(("127.0.0.1", port)).expect("connect while under attack");
            client.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            match raw_exchange(&mut client, &raw_get("/version")) {
                RawOutcome::Response(r) => assert_eq!(r.status, 200, "GET /version under attack: {}", r.head),
                other => panic!("GET /version unanswered under attack (server alive: {:?}): {other:?}", proc_status(pid, "VmRSS:")),
            }
            answered += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        let results: Vec<(Vec<u16>, usize)> = flooders.into_iter().map(|f| f.join().unwrap()).collect();
        // The pipeliners' slots come back too (their stalled writes close them).
        let deadline = Instant::now() + Duration::from_secs(30);
        while pipeliners_closed.load(Ordering::Relaxed) < PIPELINERS {
            assert!(Instant::now() < deadline, "pipeliners that never read were not closed");
            std::thread::sleep(Duration::from_millis(50));
        }
        let statuses: Vec<u16> = results.iter().flat_map(|r| r.0.iter().copied()).collect();
        let pushed: usize = results.iter().map(|r| r.1).sum();
        (statuses, pushed, answered)
    });
    assert!(server.is_running(), "hubcast died under the memory limit");
    server.assert_alive();
    assert!(statuses.contains(&413), "no flood was answered 413: {statuses:?}");
    assert!(answered > 0, "GET /version was never tried during the attack");
    let peak = proc_status(pid, "VmHWM:").expect("VmHWM of the server");
    eprintln!(
        "floods answered {statuses:?}, {} MiB pushed, peak RSS {} MiB, {answered} GET /version answered during the attack",
        pushed >> 20,
        peak >> 20
    );
    assert!(pushed as u64 > PEAK_RSS_LIMIT, "the floods pushed only {} MiB", pushed >> 20);
    assert!(peak < PEAK_RSS_LIMIT, "peak RSS {} MiB under floods of {} MiB: input was buffered", peak >> 20, pushed >> 20);
}
