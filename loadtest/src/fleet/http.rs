//! The fleet over `POST /ingest`: `conns` keep-alive connections, each posting batches of
//! `batch` messages (`[{"deviceId","body"}…]`) on its share of the rate, waiting for each
//! answer (hubcast answers once the batch is applied) before the next, or, with
//! `--pipeline N`, keeping up to N batches in flight per connection (answers read in order).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::task::JoinSet;

use super::{device_id, now_micros, write_body, FleetPlan, FleetStats, Pacer};
use crate::http::HttpConn;

/// Starts the senders; they wait for [`FleetStats::run`] and end at [`FleetStats::stop`].
pub fn start(addr: SocketAddr, admin_key: &str, plan: &FleetPlan, stats: Arc<FleetStats>, tasks: &mut JoinSet<()>) {
    let conns = plan.conns.max(1);
    let ids: Arc<Vec<String>> = Arc::new((0..plan.devices.max(1)).map(device_id).collect());
    for k in 0..conns {
        let stats = stats.clone();
        let ids = ids.clone();
        let key = admin_key.to_string();
        let rate = plan.rate / conns as f64;
        // Batches keep their size at any rate: a batch of B messages over D devices gives each
        // subscriber B/D messages at once, which hubcast writes to its socket in one write.
        let batch = plan.batch.max(1);
        let offset = k as f64 / conns as f64;
        if plan.pipeline > 1 {
            let depth = plan.pipeline;
            tasks.spawn(async move {
                if !stats.started().await {
                    return;
                }
                pipelined(addr, &key, &ids, rate, batch, offset, depth, &stats).await;
            });
            continue;
        }
        tasks.spawn(async move {
            if !stats.started().await {
                return;
            }
            let mut conn = HttpConn::new(addr);
            let mut pacer = Pacer::new(rate, batch, offset);
            let mut body = Vec::with_capacity(batch * 100);
            let head_prefix = head_prefix(&key);
            let mut request = Vec::with_capacity(batch * 100 + 200);
            while !stats.stopped() {
                pacer.wait().await;
                if stats.stopped() {
                    break;
                }
                build_request(&mut request, &mut body, &head_prefix, &ids, stats.take(batch), batch);
                stats.sent.fetch_add(batch as u64, Ordering::Relaxed);
                match conn.send(&request).await {
                    Ok(r) if r.status == 200 => {
                        stats.accepted.fetch_add(batch as u64, Ordering::Relaxed);
                    }
                    Ok(r) => {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        if stats.errors.load(Ordering::Relaxed) <= 3 {
                            eprintln!("hubcast-load: POST /ingest answered {}: {}", r.status, r.text());
                        }
                    }
                    Err(e) => {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        if stats.errors.load(Ordering::Relaxed) <= 3 {
                            eprintln!("hubcast-load: POST /ingest failed: {e}");
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
            }
        });
    }
}

/// A `POST /ingest` head up to its `content-length` value.
fn head_prefix(key: &str) -> String {
    format!("POST /ingest HTTP/1.1\r\nhost: 127.0.0.1\r\nshared-access-key: {key}\r\ncontent-type: application/json\r\ncontent-length: ")
}

/// Builds one `POST /ingest` of `batch` messages into `request`.
fn build_request(request: &mut Vec<u8>, body: &mut Vec<u8>, head_prefix: &str, ids: &[String], first: u64, batch: usize) {
    let sent_at = now_micros();
    body.clear();
    body.push(b'[');
    for i in 0..batch as u64 {
        let seq = first + i;
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(b"{\"deviceId\":\"");
        body.extend_from_slice(ids[(seq % ids.len() as u64) as usize].as_bytes());
        body.extend_from_slice(b"\",\"body\":");
        write_body(body, sent_at, seq);
        body.push(b'}');
    }
    body.push(b']');
    request.clear();
    request.extend_from_slice(head_prefix.as_bytes());
    request.extend_from_slice(body.len().to_string().as_bytes());
    request.extend_from_slice(b"\r\n\r\n");
    request.extend_from_slice(body);
}

/// One connection with up to `depth` batches in flight: a writer sends while it holds a
/// permit, a reader takes the answers in order and gives the permits back.
#[allow(clippy::too_many_arguments)]
async fn pipelined(addr: SocketAddr, key: &str, ids: &[String], rate: f64, batch: usize, offset: f64, depth: usize, stats: &Arc<FleetStats>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stream = match tokio::net::TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("hubcast-load: connect failed: {e}");
            return;
        }
    };
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let permits = Arc::new(tokio::sync::Semaphore::new(depth));
    let reader = {
        let permits = permits.clone();
        let stats = stats.clone();
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            let mut filled = 0;
            loop {
                while let Ok(Some((head_len, status, body_len, _))) = crate::http::parse_head(&buf[..filled]) {
                    let total = head_len + body_len;
                    if filled < total {
                        break;
                    }
                    if status == 200 {
                        stats.accepted.fetch_add(batch as u64, Ordering::Relaxed);
                    } else if stats.errors.fetch_add(1, Ordering::Relaxed) < 3 {
                        eprintln!("hubcast-load: POST /ingest answered {status}: {}", String::from_utf8_lossy(&buf[head_len..total]));
                    }
                    buf.copy_within(total..filled, 0);
                    filled -= total;
                    permits.add_permits(1);
                }
                if filled == buf.len() {
                    buf.resize(buf.len() * 2, 0);
                }
                match rd.read(&mut buf[filled..]).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => filled += n,
                }
            }
        }
    };
    let writer = async move {
        let mut pacer = Pacer::new(rate, batch, offset);
        let mut body = Vec::with_capacity(batch * 100);
        let mut request = Vec::with_capacity(batch * 100 + 200);
        let head_prefix = head_prefix(key);
        while !stats.stopped() {
            pacer.wait().await;
            let Ok(permit) = permits.acquire().await else { return };
            permit.forget();
            if stats.stopped() {
                break;
            }
            build_request(&mut request, &mut body, &head_prefix, ids, stats.take(batch), batch);
            stats.sent.fetch_add(batch as u64, Ordering::Relaxed);
            if let Err(e) = wr.write_all(&request).await {
                stats.errors.fetch_add(1, Ordering::Relaxed);
                eprintln!("hubcast-load: POST /ingest failed: {e}");
                return;
            }
        }
    };
    tokio::select! {
        _ = reader => {}
        _ = writer => {}
    }
}
