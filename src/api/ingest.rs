//! `POST /ingest` (admin key): the HTTP ingest API for backends that do not go through a hub.
//!
//! Body: one message or an array of them, in the shape the event stream carries:
//! `{"deviceId", "source"?, "properties"?, "enqueuedTime"?, "body"}`. Answers
//! `{"accepted": n}` once every message is applied, so later reads see it.

use std::rc::Rc;

use serde_json::{Map, Value};

use super::auth::require_admin;
use crate::config::MAX_DEVICE_ID_LEN;
use crate::http::{Request, Response};
use crate::ingest::{IngestMessage, Properties, SourceKind};
use crate::model::{as_object, Checked, Rejection};
use crate::runtime::Core;
use crate::timefmt::parse_iso;

fn parse_message(obj: &Map<String, Value>, device_id_key: &str) -> Checked<IngestMessage> {
    let source = match obj.get("source") {
        None | Some(Value::Null) => SourceKind::Telemetry,
        Some(Value::String(s)) => SourceKind::parse(s).ok_or_else(|| {
            Rejection::bad_request(format!(
                "unknown source `{s}` (Telemetry, twinChangeEvents, deviceConnectionStateEvents, deviceLifecycleEvents)"
            ))
        })?,
        Some(_) => return Err(Rejection::bad_request("field `source` must be a string")),
    };
    let mut properties = Properties::new();
    match obj.get("properties") {
        None | Some(Value::Null) => {}
        Some(Value::Object(props)) => {
            for (k, v) in props {
                let v = match v {
                    Value::String(s) => s.clone(),
                    Value::Number(_) | Value::Bool(_) => v.to_string(),
                    _ => return Err(Rejection::bad_request(format!("property `{k}` must be a string, number or boolean"))),
                };
                properties.push((k.as_str().into(), v.into()));
            }
        }
        Some(_) => return Err(Rejection::bad_request("field `properties` must be an object")),
    }
    let enqueued_at = match obj.get("enqueuedTime") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(
            parse_iso(s).ok_or_else(|| Rejection::bad_request("field `enqueuedTime` is not an ISO 8601 time"))?,
        ),
        Some(_) => return Err(Rejection::bad_request("field `enqueuedTime` must be an ISO 8601 string")),
    };
    let body = obj.get("body").ok_or_else(|| Rejection::bad_request("missing field `body`"))?;
    let device_id = match obj.get("deviceId") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => match body.get(device_id_key) {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(Rejection::bad_request(format!("missing field `deviceId` (and no `{device_id_key}` in the body)"))),
        },
        Some(_) => return Err(Rejection::bad_request("field `deviceId` must be a string")),
    };
    if device_id.is_empty() || device_id.len() > MAX_DEVICE_ID_LEN {
        return Err(Rejection::bad_request(format!("deviceId must be 1 to {MAX_DEVICE_ID_LEN} bytes")));
    }
    Ok(IngestMessage {
        device_id: device_id.into(),
        source,
        properties,
        body: serde_json::to_vec(body).expect("a JSON value serialises"),
        enqueued_at,
    })
}

pub async fn post(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    require_admin(&core.settings, req)?;
    let body = req.json()?;
    let items = match &body {
        Value::Array(items) => items.as_slice(),
        single => std::slice::from_ref(single),
    };
    let key = &core.settings.config.custom_device_id_key;
    let mut batch = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let message = as_object(item, "message")
            .and_then(|obj| parse_message(obj, key))
            .map_err(|e| Rejection::bad_request(format!("message {i}: {}", e.message)))?;
        batch.push(message);
    }
    let accepted = batch.len();
    core.ingest(batch).await;
    Ok(Response::json(200, serde_json::json!({ "accepted": accepted }).to_string()))
}
