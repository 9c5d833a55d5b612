//! Last values: `GET /lastValue/:deviceId/:telemetryKey?`, `DELETE /lastValue/:deviceId`,
//! `GET /deviceTwin/:deviceId`, `GET /connectionState/:deviceId`.
//!
//! With the admin key nothing is checked; with a `sessionId` header the session's grants are.

use std::rc::Rc;

use super::auth::{no_such_session, viewer};
use super::path_device;
use crate::config::MAX_KEY_LEN;
use crate::http::{Request, Response};
use crate::model::{Checked, Rejection};
use crate::runtime::Core;
use crate::shard::{DeviceOp, DeviceReply, SessionOp, SessionReply, Viewer};

/// Runs a read on the device's core, through the session's core when a session is reading.
async fn read(core: &Rc<Core>, viewer: Viewer, op: DeviceOp) -> Checked<String> {
    let reply = match viewer {
        Viewer::Admin => {
            let target = core.device_core(op.device());
            core.device_ops(target, vec![op]).await.pop()
        }
        Viewer::Session(session) => {
            match core.session_op(session, SessionOp::Scoped { session, register_devices: false, ops: vec![op] }).await {
                Some(SessionReply::Scoped(Some(mut replies))) => replies.pop(),
                _ => return Err(no_such_session()),
            }
        }
    };
    match reply {
        Some(DeviceReply::Body(body)) => body,
        _ => Err(Rejection::new(503, "the core owning this device did not answer")),
    }
}

pub async fn read_telemetry(core: &Rc<Core>, req: &Request, device: &str, key: Option<&str>) -> Checked<Response> {
    let viewer = viewer(&core.settings, req, "last value of device")?;
    let device = path_device(device)?.into();
    if key.is_some_and(|k| k.len() > MAX_KEY_LEN) {
        return Err(Rejection::bad_request(format!("telemetryKey is longer than {MAX_KEY_LEN} bytes")));
    }
    let body = read(core, viewer, DeviceOp::ReadTelemetry { device, key: key.map(Into::into), viewer }).await?;
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
    let device = path_device(device)?.into();
    Ok(Response::json(200, read(core, viewer, DeviceOp::ReadTwin { device, viewer }).await?))
}

pub async fn read_connection_state(core: &Rc<Core>, req: &Request, device: &str) -> Checked<Response> {
    let viewer = viewer(&core.settings, req, "connection state")?;
    let device = path_device(device)?.into();
    Ok(Response::json(200, read(core, viewer, DeviceOp::ReadConnectionState { device, viewer }).await?))
}
