//! `POST /directMethod` and `PATCH /deviceTwinDesiredProperties`: relayed to the IoT Hub
//! service API when `iotHubServiceConnectionString` is configured.
//!
//! Order of checks: hub configured (400), body (400), caller (401/404), grant (403), then
//! the hub call. The admin key skips the grant check. The hub's error statuses are forwarded
//! with its message; 503/504 of our own mean a busy client or a hub that did not answer in time
//! (see `crate::hub`).

use std::rc::Rc;

use serde_json::{json, Map, Value};

use super::auth::{admin_key_matches, parse_session};
use crate::http::{Request, Response};
use crate::model::{as_object, device_id, optional_key, Checked, Grant, GrantKind, Rejection};
use crate::hub::{method_budget, HubCall, HubClient};
use crate::app::Core;
use crate::shard::{ask, DeviceOp, Viewer};

/// IoT Hub's limit on a direct method payload (request and response): 128 KB.
pub const MAX_METHOD_PAYLOAD_BYTES: usize = 128 * 1024;
/// IoT Hub's limit on a twin's desired properties: 32 KB; a larger patch cannot succeed.
pub const MAX_DESIRED_PATCH_BYTES: usize = 32 * 1024;

/// Refuses, before it is queued for the hub, a value the hub would refuse for its size; this
/// also bounds the memory a full queue of waiting calls can hold.
fn within(value: Option<&Value>, max: usize, what: &str) -> Checked<()> {
    let len = value.map_or(0, |v| v.to_string().len());
    if len > max {
        return Err(Rejection::new(413, format!("{what} is {len} bytes; IoT Hub accepts at most {} KiB", max / 1024)));
    }
    Ok(())
}

/// A validated direct-method call.
pub struct MethodCall {
    pub device: String,
    pub method: String,
    pub params: Value,
}

impl MethodCall {
    /// The hub's request body (`methodName`, `payload`, and the timeouts the caller gave) and
    /// our deadline for the call.
    fn hub_call(self, margin: std::time::Duration) -> (HubCall, std::time::Duration) {
        let given = |field: &str| self.params.get(field).filter(|v| !v.is_null()).cloned();
        let mut body = Map::new();
        body.insert("methodName".into(), Value::String(self.method.clone()));
        body.insert("payload".into(), given("payload").unwrap_or(Value::Null));
        let response_timeout = given("responseTimeoutInSeconds");
        let connect_timeout = given("connectTimeoutInSeconds");
        let budget = method_budget(
            response_timeout.as_ref().and_then(Value::as_f64),
            connect_timeout.as_ref().and_then(Value::as_f64),
            margin,
        );
        if let Some(v) = response_timeout {
            body.insert("responseTimeoutInSeconds".into(), v);
        }
        if let Some(v) = connect_timeout {
            body.insert("connectTimeoutInSeconds".into(), v);
        }
        (HubCall::InvokeMethod { device: self.device, body: Value::Object(body) }, budget)
    }
}

/// The hub client (present whenever the API is enabled: start-up stops if it cannot start).
fn hub(core: &Core) -> Checked<&HubClient> {
    core.shared.hub.as_ref().ok_or_else(|| Rejection::new(503, "IoT Hub service client not running"))
}

fn parse_method_call(body: &Value) -> Checked<MethodCall> {
    let obj = as_object(body, "direct method request")?;
    let device = device_id(obj)?.to_string();
    let params = obj.get("methodParams").ok_or_else(|| Rejection::bad_request("missing field `methodParams`"))?;
    let params_obj = as_object(params, "field `methodParams`")?;
    let method = optional_key(params_obj, "methodName")?
        .ok_or_else(|| Rejection::bad_request("missing field `methodParams.methodName`"))?;
    for field in ["responseTimeoutInSeconds", "connectTimeoutInSeconds"] {
        if params_obj.get(field).is_some_and(|v| !v.is_null() && !v.is_number()) {
            return Err(Rejection::bad_request(format!("field `methodParams.{field}` must be a number")));
        }
    }
    within(params_obj.get("payload"), MAX_METHOD_PAYLOAD_BYTES, "methodParams.payload")?;
    Ok(MethodCall { device, method: method.into(), params: params.clone() })
}

/// Checks the caller: the admin key passes; a session needs `grant` on the device.
async fn authorize(core: &Rc<Core>, req: &Request, device: &str, grant: Grant) -> Checked<()> {
    if let Some(key) = req.header("shared-access-key") {
        if admin_key_matches(&core.settings, key) {
            return Ok(());
        }
        return Err(Rejection::new(401, "Unauthorized: invalid Shared-Access-Key header"));
    }
    let raw = req
        .header("sessionid")
        .ok_or_else(|| Rejection::new(401, "Provide either a Shared-Access-Key or a sessionId header"))?;
    let session = parse_session(raw)?;
    let check = || ask(|permitted| DeviceOp::CheckGrant { device: device.into(), session, grant: grant.clone(), permitted });
    let mut permitted = super::on_device(core, Viewer::Session(session), check()).await?;
    // Several instances: a grant just given on another one may not have reached this copy.
    if !permitted && core.directory().refresh(core, session).await? {
        permitted = super::on_device(core, Viewer::Session(session), check()).await?;
    }
    if permitted {
        Ok(())
    } else {
        Err(Rejection::new(403, "Forbidden: missing grant"))
    }
}

pub async fn direct_method(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    if !core.settings.iot_hub_api_enabled() {
        return Err(Rejection::bad_request(
            "IoT Hub API disabled, cannot invoke direct method (no iotHubServiceConnectionString configured)",
        ));
    }
    let call = parse_method_call(&req.json()?)?;
    let grant = Grant { kind: GrantKind::DirectMethod, key: Some(call.method.as_str().into()) };
    authorize(core, req, &call.device, grant).await?;
    let hub = hub(core)?;
    let (hub_call, budget) = call.hub_call(hub.method_margin());
    let answer = hub.call(hub_call, budget).await?;
    // HTTP 200 from the hub; the device's own status is inside (`{status, payload}`).
    let field = |name: &str| answer.body.get(name).cloned().unwrap_or(Value::Null);
    let body = json!({ "status": field("status"), "payload": field("payload") });
    Ok(Response::json(200, body.to_string()))
}

pub async fn desired_properties(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    if !core.settings.iot_hub_api_enabled() {
        return Err(Rejection::bad_request(
            "IoT Hub API disabled, cannot patch desired properties (no iotHubServiceConnectionString configured)",
        ));
    }
    let body = req.json()?;
    let obj = as_object(&body, "desired properties request")?;
    let device = device_id(obj)?.to_string();
    match obj.get("desiredPropertyPatch") {
        Some(Value::Object(_)) => {}
        None | Some(Value::Null) => return Err(Rejection::bad_request("missing field `desiredPropertyPatch`")),
        Some(_) => return Err(Rejection::bad_request("field `desiredPropertyPatch` must be an object")),
    }
    within(obj.get("desiredPropertyPatch"), MAX_DESIRED_PATCH_BYTES, "desiredPropertyPatch")?;
    authorize(core, req, &device, Grant { kind: GrantKind::DesiredProperties, key: None }).await?;
    let patch = obj.get("desiredPropertyPatch").cloned().unwrap_or(Value::Null);
    let hub = hub(core)?;
    let answer = hub.call(HubCall::PatchDesired { device: device.clone(), patch }, hub.timeout()).await?;
    // The hub answers with the whole updated twin: keep it (cached, or as the base of pushes).
    if answer.body.is_object() {
        let (op, _served) = ask(|reply| DeviceOp::StoreHubTwin { device: device.into_boxed_str(), doc: answer.body.clone(), reply });
        let target = core.device_core(op.device());
        core.device_ops(target, vec![op]);
    }
    let body = json!({ "status": answer.status, "payload": answer.body });
    Ok(Response::json(200, body.to_string()))
}
