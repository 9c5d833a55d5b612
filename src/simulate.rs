//! `--simulate N`: a built-in fleet of N devices, so a newcomer sees live data without an
//! Azure account. Each device sends telemetry about once a second (numbers, a boolean, an
//! object), reports a twin change now and then, and drops off-line for a few seconds once
//! in a while (connection events, and silence while off-line).
//!
//! It runs on core 0 (a [`CorePlugin`] started beside every core) and feeds the same ingest
//! path as every other source.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::app::relay::CorePlugin;
use crate::app::Core;
use crate::ingest::{IngestMessage, Properties, SourceKind};
use crate::timefmt::now_millis;

const TICK: Duration = Duration::from_millis(100);
/// Telemetry period per device, in ticks.
const PERIOD: u64 = 10;

struct SimDevice {
    id: Box<str>,
    temperature: f64,
    offline_until_tick: u64,
    firmware_minor: u32,
}

pub fn device_name(i: u32) -> String {
    format!("sim-device-{i:04}")
}

fn message(device: &str, source: SourceKind, op: Option<&str>, body: serde_json::Value) -> IngestMessage {
    let mut properties = Properties::new();
    if let Some(op) = op {
        properties.push(("opType".into(), op.into()));
    }
    let now = now_millis();
    IngestMessage {
        device_id: device.into(),
        source,
        properties,
        body: body.to_string().into_bytes(),
        enqueued_at: Some(now),
        arrived: Some(crate::metrics::Arrival::now()),
        key: crate::ingest::MsgKey::arrival(now),
    }
}

/// The fleet of `--simulate N` devices, started on core 0.
pub struct Simulator {
    pub devices: u32,
}

impl CorePlugin for Simulator {
    fn start(self: Arc<Self>, core: &Rc<Core>) {
        if core.index == 0 && self.devices > 0 {
            monoio::spawn(run(core.clone(), self.devices));
        }
    }
}

pub async fn run(core: Rc<Core>, count: u32) {
    let mut rng = fastrand::Rng::new();
    let mut devices: Vec<SimDevice> = (0..count)
        .map(|i| SimDevice {
            id: device_name(i).into(),
            temperature: 18.0 + rng.f64() * 6.0,
            offline_until_tick: 0,
            firmware_minor: 0,
        })
        .collect();
    let mut sequence: u64 = 0;
    let mut next_sequence = || {
        sequence += 1;
        format!("{sequence:020X}")
    };
    // Everyone comes on-line with a full twin.
    let mut start = Vec::with_capacity(devices.len() * 2);
    for d in &devices {
        start.push(message(&d.id, SourceKind::ConnectionState, Some("deviceConnected"), json!({"sequenceNumber": next_sequence()})));
        start.push(message(&d.id, SourceKind::TwinChange, Some("replaceTwin"), json!({
            "version": 1,
            "tags": {"site": format!("plant-{}", rng.u32(1..4))},
            "properties": {"desired": {"telemetryInterval": 1000}, "reported": {"firmware": "1.0.0", "mode": "normal"}}
        })));
    }
    core.ingest_detached(start);
    tracing::info!(devices = count, "simulated fleet started");

    let mut tick: u64 = 0;
    loop {
        monoio::time::sleep(TICK).await;
        tick += 1;
        let mut batch = Vec::new();
        for (i, d) in devices.iter_mut().enumerate() {
            if !(i as u64 + tick).is_multiple_of(PERIOD) {
                continue;
            }
            if d.offline_until_tick > 0 {
                if tick >= d.offline_until_tick {
                    d.offline_until_tick = 0;
                    batch.push(message(&d.id, SourceKind::ConnectionState, Some("deviceConnected"), json!({"sequenceNumber": next_sequence()})));
                }
                continue;
            }
            if rng.u32(0..300) == 0 {
                // Off-line for 5 to 15 s.
                d.offline_until_tick = tick + rng.u64(50..150);
                batch.push(message(&d.id, SourceKind::ConnectionState, Some("deviceDisconnected"), json!({"sequenceNumber": next_sequence()})));
                continue;
            }
            d.temperature = (d.temperature + (rng.f64() - 0.5) * 0.4).clamp(10.0, 35.0);
            batch.push(message(&d.id, SourceKind::Telemetry, None, json!({
                "temperature": (d.temperature * 10.0).round() / 10.0,
                "humidity": rng.u32(35..65),
                "pressure": ((1013.0 + (rng.f64() - 0.5) * 8.0) * 10.0).round() / 10.0,
                "running": rng.u32(0..20) != 0,
                "batteryLevel": 100 - (tick / 600 % 100) as u32,
                "geoposition": {"lat": 52.52 + i as f64 * 1e-3, "lng": 13.40 + (tick as f64 * 1e-5).sin() * 1e-2},
            })));
            if rng.u32(0..60) == 0 {
                d.firmware_minor += 1;
                batch.push(message(&d.id, SourceKind::TwinChange, Some("updateTwin"), json!({
                    "version": 2 + d.firmware_minor,
                    "properties": {"reported": {"firmware": format!("1.{}.0", d.firmware_minor),
                                                "mode": if rng.bool() { "normal" } else { "eco" }}}
                })));
            }
        }
        if !batch.is_empty() {
            // Back-pressure: wait while this core's cross-core backlog is over its bound.
            core.mesh.wait_for_room().await;
            core.ingest_detached(batch);
        }
    }
}
