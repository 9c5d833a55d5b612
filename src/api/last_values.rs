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

use serde_json::Value;

use super::auth::viewer;
use super::{on_device, path_device};
use crate::app::directory::{ReadKind, View};
use crate::config::MAX_KEY_LEN;
use crate::http::{Request, Response};
use crate::hub::HubCall;
use crate::model::{Checked, Rejection};
use crate::app::record;
use crate::app::Core;
use crate::shard::{ask, Denial, DeviceOp, Local, Read, TwinCacheTtl, Viewer};
use futures_channel::oneshot::Receiver;
use crate::timefmt::{iso, now_millis};

const NO_TELEMETRY: &str = "No last telemetry found";
const NO_TWIN: &str = "No last devicetwin found";
const NO_CONNECTION: &str = "No device found";

/// A refused read as an HTTP error: 403 naming what was read, or 404 with `not_found`.
fn refused(denial: Denial, what: &str, not_found: &str) -> Rejection {
    match denial {
        Denial::Forbidden => Rejection::new(403, format!("Forbidden to read {what}: missing grant")),
        Denial::NotFound => Rejection::new(404, not_found),
    }
}

/// [`on_device`] for a read; a session refused here is read again from Redis once (several
/// instances: a grant just given on another instance may not have reached this copy).
async fn read<T>(core: &Rc<Core>, viewer: Viewer, mut make: impl FnMut() -> (DeviceOp, Receiver<Read<T>>)) -> Checked<Read<T>> {
    let answer = on_device(core, viewer, make()).await?;
    if let (Err(Denial::Forbidden), Viewer::Session(session)) = (&answer, viewer) {
        if core.directory().refresh(core, session).await? {
            return on_device(core, viewer, make()).await;
        }
    }
    Ok(answer)
}

/// What nothing here answered: with several instances, the freshest holder elsewhere,
/// rendered here as a read answered here is.
async fn elsewhere(core: &Rc<Core>, viewer: Viewer, device: &str, kind: ReadKind, what: &str, not_found: &str) -> Checked<String> {
    let (_, view) = core.directory().read_elsewhere(core, viewer, device, kind, None).await?.ok_or_else(|| refused(Denial::NotFound, what, not_found))?;
    Ok(render(device, &view))
}

/// A read answered here, rendered. A copy that is not current (several instances: its
/// partition is read elsewhere now, or it is a replica no longer watched) is answered only
/// when no other instance holds newer data: the freshest wins, so every instance answers
/// the same. The others unreachable: this copy, as one node would answer.
async fn answer(core: &Rc<Core>, viewer: Viewer, device: &str, kind: ReadKind, local: Local<View>) -> String {
    if !local.current {
        match core.directory().read_elsewhere(core, viewer, device, kind, Some(local.newest)).await {
            Ok(Some((newest, view))) if newest > local.newest => return render(device, &view),
            Ok(_) => {}
            Err(e) => tracing::debug!(device, reason = %e.message, "the other instances could not be asked for newer data; the copy here answers"),
        }
    }
    render(device, &local.view)
}

/// The shard's answer as a [`View`].
fn viewed<T>(local: Local<T>, as_view: impl FnOnce(T) -> View) -> Local<View> {
    Local { view: as_view(local.view), newest: local.newest, current: local.current }
}

fn render(device: &str, view: &View) -> String {
    match view {
        View::Telemetry(v) => record::telemetry(device, v),
        View::Twin(v) => record::twin(device, v),
        View::Connection(v) => record::connection(device, v),
    }
}

/// A hub 404 (unknown device) becomes our 404 with `message`; other hub errors pass unchanged.
fn hub_not_found(message: &str) -> impl Fn(Rejection) -> Rejection + '_ {
    move |r| if r.status == 404 { Rejection::new(404, format!("{message} ({})", r.message)) } else { r }
}

/// A hub answer served as it is, timestamped now.
fn hub_record(device: &str, data: &Value) -> String {
    record::record(device, &data.to_string(), &iso(now_millis()))
}

pub async fn read_telemetry(core: &Rc<Core>, req: &Request, device: &str, key: Option<&str>) -> Checked<Response> {
    const WHAT: &str = "last value of device";
    let viewer = viewer(&core.settings, req, WHAT)?;
    let device: Box<str> = path_device(device)?.into();
    if key.is_some_and(|k| k.len() > MAX_KEY_LEN) {
        return Err(Rejection::bad_request(format!("telemetryKey is longer than {MAX_KEY_LEN} bytes")));
    }
    let key: Option<Box<str>> = key.map(Into::into);
    let asked = || ask(|reply| DeviceOp::ReadTelemetry { device: device.clone(), key: key.clone(), viewer, reply });
    let body = match read(core, viewer, asked).await? {
        Ok(local) => answer(core, viewer, &device, ReadKind::Telemetry(key), viewed(local, View::Telemetry)).await,
        Err(Denial::NotFound) => elsewhere(core, viewer, &device, ReadKind::Telemetry(key), WHAT, NO_TELEMETRY).await?,
        Err(denial) => return Err(refused(denial, WHAT, NO_TELEMETRY)),
    };
    Ok(Response::json(200, body))
}

pub async fn delete_telemetry(core: &Rc<Core>, req: &Request, device: &str) -> Checked<Response> {
    const WHAT: &str = "last value of device";
    let viewer = viewer(&core.settings, req, WHAT)?;
    let device: Box<str> = path_device(device)?.into();
    read(core, viewer, || ask(|reply| DeviceOp::DeleteTelemetry { device: device.clone(), viewer, reply }))
        .await?
        .map_err(|denial| refused(denial, WHAT, NO_TELEMETRY))?;
    Ok(Response::no_content())
}

pub async fn read_twin(core: &Rc<Core>, req: &Request, device: &str) -> Checked<Response> {
    const WHAT: &str = "device twin";
    let viewer = viewer(&core.settings, req, WHAT)?;
    let device: Box<str> = path_device(device)?.into();
    let Some(hub) = core.shared.hub.as_ref() else {
        // No IoT Hub: the twin known from twin change events (here or on another instance).
        let asked = || ask(|reply| DeviceOp::ReadTwin { device: device.clone(), viewer, reply });
        let body = match read(core, viewer, asked).await? {
            Ok(local) => answer(core, viewer, &device, ReadKind::Twin, viewed(local, View::Twin)).await,
            Err(Denial::NotFound) => elsewhere(core, viewer, &device, ReadKind::Twin, WHAT, NO_TWIN).await?,
            Err(denial) => return Err(refused(denial, WHAT, NO_TWIN)),
        };
        return Ok(Response::json(200, body));
    };
    let ttl = core.settings.twin_cache_ttl();
    // The cache (and, for a session, the grant) lives on the device's core; the admin key
    // without a cache has nothing to look up there.
    if ttl != TwinCacheTtl::Off || viewer != Viewer::Admin {
        let asked = || ask(|reply| DeviceOp::ReadHubTwin { device: device.clone(), viewer, ttl, reply });
        if let Some(view) = read(core, viewer, asked).await?.map_err(|denial| refused(denial, WHAT, NO_TWIN))? {
            return Ok(Response::json(200, record::twin(&device, &view)));
        }
    }
    let answer = hub
        .call(HubCall::GetTwin { device: device.to_string() }, hub.timeout())
        .await
        .map_err(hub_not_found(NO_TWIN))?;
    // Without a cache, a session's read is still kept on the device's core, as the whole twin
    // that later changes are merged into for pushes (the admin key subscribes to nothing).
    if (ttl == TwinCacheTtl::Off && viewer == Viewer::Admin) || !answer.body.is_object() {
        return Ok(Response::json(200, hub_record(&device, &answer.body)));
    }
    let asked = ask(|reply| DeviceOp::StoreHubTwin { device: device.clone(), doc: answer.body, reply });
    let view = core.ask_device(asked).await.ok_or_else(super::stopping)?;
    Ok(Response::json(200, record::twin(&device, &view)))
}

pub async fn read_connection_state(core: &Rc<Core>, req: &Request, device: &str) -> Checked<Response> {
    const WHAT: &str = "connection state";
    let viewer = viewer(&core.settings, req, WHAT)?;
    let device: Box<str> = path_device(device)?.into();
    let asked = || ask(|reply| DeviceOp::ReadConnectionState { device: device.clone(), viewer, reply });
    let cached = read(core, viewer, asked).await?;
    // With customConnectionStateKey the hub is not consulted (ux4iot 4.1.0).
    let hub = core.shared.hub.as_ref().filter(|_| core.settings.config.custom_connection_state_key.is_empty());
    let hub = match (cached, hub) {
        (Ok(local), _) => {
            let body = answer(core, viewer, &device, ReadKind::ConnectionState, viewed(local, View::Connection)).await;
            return Ok(Response::json(200, body));
        }
        (Err(Denial::NotFound), Some(hub)) => hub,
        (Err(Denial::NotFound), None) => {
            let body = elsewhere(core, viewer, &device, ReadKind::ConnectionState, WHAT, NO_CONNECTION).await?;
            return Ok(Response::json(200, body));
        }
        (Err(denial), _) => return Err(refused(denial, WHAT, NO_CONNECTION)),
    };
    // Nothing cached: the hub's view (not cached: the event stream stays the source of the cache).
    let answer = hub
        .call(HubCall::GetTwin { device: device.to_string() }, hub.timeout())
        .await
        .map_err(hub_not_found(NO_CONNECTION))?;
    let connected = match answer.body.get("connectionState").and_then(Value::as_str) {
        Some(state) if state.eq_ignore_ascii_case("Connected") => true,
        Some(state) if state.eq_ignore_ascii_case("Disconnected") => false,
        other => {
            return Err(Rejection::new(502, format!("IoT Hub twin has no usable connectionState ({other:?})")));
        }
    };
    Ok(Response::json(200, hub_record(&device, &Value::Bool(connected))))
}
