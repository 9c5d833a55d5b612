//! The fleet over `POST /ingest`: `conns` keep-alive connections, each posting batches of
//! `batch` messages (`[{"deviceId","body"}…]`) on its share of the rate, waiting for each
//! answer (hubcast answers once the batch is applied) before the next.

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
        tasks.spawn(async move {
            if !stats.started().await {
                return;
            }
            let mut conn = HttpConn::new(addr);
            let mut pacer = Pacer::new(rate, batch, offset);
            let mut body = Vec::with_capacity(batch * 100);
            let head_prefix = format!(
                "POST /ingest HTTP/1.1\r\nhost: 127.0.0.1\r\nshared-access-key: {key}\r\ncontent-type: application/json\r\ncontent-length: "
            );
            let mut request = Vec::with_capacity(batch * 100 + 200);
            while !stats.stopped() {
                pacer.wait().await;
                if stats.stopped() {
                    break;
                }
                let first = stats.take(batch);
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
                    write_body(&mut body, sent_at, seq);
                    body.push(b'}');
                }
                body.push(b']');
                request.clear();
                request.extend_from_slice(head_prefix.as_bytes());
                request.extend_from_slice(body.len().to_string().as_bytes());
                request.extend_from_slice(b"\r\n\r\n");
                request.extend_from_slice(&body);
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
