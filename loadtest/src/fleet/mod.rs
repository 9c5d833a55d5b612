//! The device fleet: D devices sending telemetry at a total rate R (or as fast as hubcast
//! takes it), through `POST /ingest` ([`http`]) or through an AMQP 1.0 Event Hubs-like
//! endpoint that the harness serves and hubcast consumes ([`amqp`]).
//!
//! Every telemetry body carries `sentAt`, the send time in µs since the epoch, which the
//! live clients subtract from their clock on arrival (same machine, same clock). It is taken
//! when a batch is built, just before it is written, so the generator's own queueing is not
//! counted as hubcast's latency.
//!
//! The fleet waits for [`Phase::Run`] and stops at [`Phase::Stop`], so that a mode can set
//! up its clients first and measure over a window of its choice.

pub mod amqp;
pub mod http;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio::time::Instant;

/// Where the fleet sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// `POST /ingest` batches over keep-alive connections.
    Http,
    /// An AMQP 1.0 Event Hubs-like endpoint served by the harness.
    Amqp,
}

/// What the fleet does.
#[derive(Clone, Debug)]
pub struct FleetPlan {
    pub via: Via,
    pub devices: usize,
    /// Messages per second in total; 0: as fast as hubcast takes them.
    pub rate: f64,
    /// Messages per `POST /ingest`.
    pub batch: usize,
    /// Keep-alive connections posting batches.
    pub conns: usize,
    /// Partitions of the AMQP endpoint.
    pub partitions: usize,
    /// HTTP: batches in flight per connection (1: wait for each answer).
    pub pipeline: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Wait,
    Run,
    Stop,
}

/// Counters and the start/stop switch, shared by every sender.
pub struct FleetStats {
    pub phase: watch::Sender<Phase>,
    /// Messages handed to hubcast (sent on the wire).
    pub sent: AtomicU64,
    /// Messages hubcast acknowledged (`{"accepted": n}`; AMQP: settled transfers).
    pub accepted: AtomicU64,
    /// Failed requests or transfers.
    pub errors: AtomicU64,
    /// Next message index (picks the device).
    next: AtomicU64,
}

impl Default for FleetStats {
    fn default() -> Self {
        Self {
            phase: watch::channel(Phase::Wait).0,
            sent: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            next: AtomicU64::new(0),
        }
    }
}

impl FleetStats {
    pub fn run(&self) {
        self.phase.send_replace(Phase::Run);
    }

    pub fn stop(&self) {
        self.phase.send_replace(Phase::Stop);
    }

    /// Waits for the start; false if the fleet was stopped before it started.
    pub async fn started(&self) -> bool {
        let mut rx = self.phase.subscribe();
        matches!(rx.wait_for(|p| *p != Phase::Wait).await.map(|p| *p), Ok(Phase::Run))
    }

    pub fn stopped(&self) -> bool {
        *self.phase.borrow() == Phase::Stop
    }

    /// Takes `n` message indexes.
    pub fn take(&self, n: usize) -> u64 {
        self.next.fetch_add(n as u64, Ordering::Relaxed)
    }
}

/// The id of device `i`.
pub fn device_id(i: usize) -> String {
    format!("dev-{i:06}")
}

pub fn now_micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// The telemetry body of message `seq` (appended to `out`).
pub fn write_body(out: &mut Vec<u8>, sent_at: u64, seq: u64) {
    use std::io::Write;
    let temperature = 15.0 + (seq % 200) as f64 / 10.0;
    let _ = write!(out, "{{\"sentAt\":{sent_at},\"temperature\":{temperature:.1},\"seq\":{seq}}}");
}

/// Paces one sender at `rate` messages/s in steps of `step` messages: waits until the next
/// step is due. Falls behind without bursting to catch up more than one step.
pub struct Pacer {
    interval: Option<Duration>,
    next: Instant,
}

impl Pacer {
    /// `offset` (0..1) spreads the senders' schedules over one interval.
    pub fn new(rate: f64, step: usize, offset: f64) -> Self {
        let interval = (rate > 0.0).then(|| Duration::from_secs_f64(step as f64 / rate));
        let next = Instant::now() + interval.map_or(Duration::ZERO, |i| i.mul_f64(offset));
        Self { interval, next }
    }

    pub async fn wait(&mut self) {
        let Some(interval) = self.interval else { return };
        let now = Instant::now();
        if self.next > now {
            tokio::time::sleep_until(self.next).await;
        } else if now - self.next > interval * 4 {
            // Far behind (hubcast slower than the rate): do not burst, restart the schedule.
            self.next = now;
        }
        self.next += interval;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_json_with_the_send_time() {
        let mut out = Vec::new();
        write_body(&mut out, 1_732_300_000_000_001, 7);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["sentAt"], 1_732_300_000_000_001u64);
        assert_eq!(v["seq"], 7);
        assert!(v["temperature"].is_f64());
    }
}
