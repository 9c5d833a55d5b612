//! Last values: `GET /lastValue/:deviceId/:telemetryKey?`, `DELETE /lastValue/:deviceId`,
//! `GET /deviceTwin/:deviceId`, `GET /connectionState/:deviceId`.
//!
//! With the admin key nothing is checked; with a `sessionId` header the session's grants are.
//!
//! With an IoT Hub service connection the twin comes from the hub, cached per
//! `deviceTwinCacheTTL` on the device's core (twin change events keep a cached twin current);
//! a connection state that is not cached is read from the hub's twin (`connectionState`),
//! unless `customConnectionStateKey` is set.

use std::rc::Rc;

use serde_json::{json, Value};

use super::auth::{no_such_session, viewer};
use super::path_device;
use crate::config::MAX_KEY_LEN;
use crate::http::{Request, Response};
use crate::hub::HubCall;
use crate::model::{Checked, Rejection};
use crate::runtime::Core;
use crate::shard::{DeviceOp, DeviceReply, SessionOp, SessionReply, TwinCacheTtl, Viewer};
use crate::timefmt::{iso, now_millis};

/// Runs a read on the device's core, through the session's core when a session is reading.
async fn read(core: &Rc<Core>, viewer: Viewer, op: DeviceOp) -> Checked<String> {
    match run(core, viewer, op).await? {
        DeviceReply::Body(body) => body,
        _ => Err(Rejection::new(503, "the core owning this device did not answer")),
    }
}

/// Like [`read`], for the reads that may answer [`DeviceReply::Miss`].
async fn run(core: &Rc<Core>, viewer: Viewer, op: DeviceOp) -> Checked<DeviceReply> {
    let reply = match viewer {
        Viewer::Admin => {
            let target = core.device_core(op.device());
            core.device_ops(target, vec![op]).await.pop()
        }
        Viewer::Session(session) => {
            match crate::cluster::session_op(core, session, SessionOp::Scoped { session, register_devices: false, ops: vec![op] }).await? {
                Some(SessionReply::Scoped(Some(mut replies))) => replies.pop(),
                _ => return Err(no_such_session()),
            }
        }
    };
    match reply {
        Some(reply @ (DeviceReply::Body(_) | DeviceReply::Miss)) => Ok(reply),
        _ => Err(Rejection::new(503, "the core owning this device did not answer")),
    }
}

/// A hub 404 (unknown device) becomes our 404 with `message`; other hub errors pass unchanged.
fn hub_not_found(message: &str) -> impl Fn(Rejection) -> Rejection + '_ {
    move |r| if r.status == 404 { Rejection::new(404, format!("{message} ({})", r.message)) } else { r }
}

fn record(device: &str, data: &Value) -> String {
    json!({ "deviceId": device, "data": data, "timestamp": iso(now_millis()) }).to_string()
}

pub async fn read_telemetry(core: &Rc<Core>, req: &Request, device: &str, key: Option<&str>) -> Checked<Response> {
    let viewer = viewer(&core.settings, req, "last value of device")?;
    let device: Box<str> = path_device(device)?.into();
    if key.is_some_and(|k| k.len() > MAX_KEY_LEN) {
        return Err(Rejection::bad_request(format!("telemetryKey is longer than {MAX_KEY_LEN} bytes")));
    }
    let kind = crate::cluster::ReadKind::Telemetry(key.map(Into::into));
    let local = read(core, viewer, DeviceOp::ReadTelemetry { device: device.clone(), key: key.map(Into::into), viewer }).await;
    let body = crate::cluster::or_elsewhere(core, local, viewer, &device, kind).await?;
    Ok(Response::json(200, body))
}

pub async fn delete_telemetry(core: &Rc<Core>, req: &Request, device: &str) -> Checked<Response> {
    let viewer = viewer(&core.settings, req, "last value of device")?;
    let device = path_device(device)?.into();
    read(core, viewer, DeviceOp::DeleteTelemetry { device, viewer }).await?;
    Ok(Response::no_content())
}

pub async fn read_twin(core: &Rc<Core>, req: &Request, device: &str) -> Checked<Response> {
    let viewer = viewer(&core.settings, req, "device twin")?;
    let device: Box<str> = path_device(device)?.into();
    let Some(hub) = core.shared.hub.as_ref() else {
        // No IoT Hub: the twin known from twin change events (here or on another instance).
        let local = read(core, viewer, DeviceOp::ReadTwin { device: device.clone(), viewer }).await;
        let body = crate::cluster::or_elsewhere(core, local, viewer, &device, crate::cluster::ReadKind::Twin).await?;
        return Ok(Response::json(200, body));
    };
    let ttl = core.settings.twin_cache_ttl();
    // The cache (and, for a session, the grant) lives on the device's core; the admin key
    // without a cache has nothing to look up there.
    if ttl != TwinCacheTtl::Off || viewer != Viewer::Admin {
        if let DeviceReply::Body(body) = run(core, viewer, DeviceOp::ReadHubTwin { device: device.clone(), viewer, ttl }).await? {
            return Ok(Response::json(200, body?));
        }
    }
    let answer = hub
        .call(HubCall::GetTwin { device: device.to_string() }, hub.timeout())
        .await
        .map_err(hub_not_found("No last devicetwin found"))?;
    // Without a cache, a session's read is still kept on the device's core, as the whole twin
    // that later changes are merged into for pushes (the admin key subscribes to nothing).
    if (ttl == TwinCacheTtl::Off && viewer == Viewer::Admin) || !answer.body.is_object() {
        return Ok(Response::json(200, record(&device, &answer.body)));
    }
    let target = core.device_core(&device);
    match core.device_ops(target, vec![DeviceOp::StoreHubTwin { device: device.clone(), doc: answer.body }]).await.pop() {
        Some(DeviceReply::Body(body)) => Ok(Response::json(200, body?)),
        _ => Err(Rejection::new(503, "the core owning this device did not answer")),
    }
}

pub async fn read_connection_state(core: &Rc<Core>, req: &Request, device: &str) -> Checked<Response> {
    let viewer = viewer(&core.settings, req, "connection state")?;
    let device: Box<str> = path_device(device)?.into();
    // With customConnectionStateKey the hub is not consulted (ux4iot 4.1.0).
    let hub = core.shared.hub.as_ref().filter(|_| core.settings.config.custom_connection_state_key.is_empty());
    let Some(hub) = hub else {
        let local = read(core, viewer, DeviceOp::ReadConnectionState { device: device.clone(), viewer }).await;
        let kind = crate::cluster::ReadKind::ConnectionState;
        return Ok(Response::json(200, crate::cluster::or_elsewhere(core, local, viewer, &device, kind).await?));
    };
    if let DeviceReply::Body(body) = run(core, viewer, DeviceOp::ReadConnectionStateOrMiss { device: device.clone(), viewer }).await? {
        return Ok(Response::json(200, body?));
    }
    // Nothing cached: the hub's view (not cached: the event stream stays the source of the cache).
    let answer = hub
        .call(HubCall::GetTwin { device: device.to_string() }, hub.timeout())
        .await
        .map_err(hub_not_found("No device found"))?;
    let connected = match answer.body.get("connectionState").and_then(Value::as_str) {
        Some(state) if state.eq_ignore_ascii_case("Connected") => true,
        Some(state) if state.eq_ignore_ascii_case("Disconnected") => false,
        other => {
            return Err(Rejection::new(502, format!("IoT Hub twin has no usable connectionState ({other:?})")));
        }
    };
    Ok(Response::json(200, record(&device, &Value::Bool(connected))))
}
