//! `POST /directMethod` and `PATCH /deviceTwinDesiredProperties`: relayed to the IoT Hub
//! service API when `iotHubServiceConnectionString` is configured.
//!
//! Order of checks: hub configured (400), body (400), caller (401/404), grant (403), then
//! the hub call. The admin key skips the grant check.

use std::rc::Rc;

use serde_json::Value;

use super::auth::{admin_key_matches, no_such_session, parse_session};
use crate::http::{Request, Response};
use crate::model::{as_object, device_id, optional_key, Checked, Grant, GrantKind, Rejection};
use crate::runtime::Core;
use crate::shard::{DeviceOp, DeviceReply, SessionOp, SessionReply};

/// A validated direct-method call.
pub struct MethodCall {
    pub device: String,
    pub method: String,
    #[allow(dead_code)] // forwarded to the hub by the service client
    pub params: Value,
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
    let op = DeviceOp::CheckGrant { device: device.into(), session, grant };
    match core.session_op(session, SessionOp::Scoped { session, register_devices: false, ops: vec![op] }).await {
        Some(SessionReply::Scoped(Some(replies))) if replies.first() == Some(&DeviceReply::Permitted(true)) => Ok(()),
        Some(SessionReply::Scoped(Some(_))) => Err(Rejection::new(403, "Forbidden: missing grant")),
        _ => Err(no_such_session()),
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
    Err(Rejection::new(501, "the IoT Hub service client is not available in this build"))
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
    authorize(core, req, &device, Grant { kind: GrantKind::DesiredProperties, key: None }).await?;
    Err(Rejection::new(501, "the IoT Hub service client is not available in this build"))
}
