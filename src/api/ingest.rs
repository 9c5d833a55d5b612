//! `POST /ingest` (admin key): the HTTP ingest API for backends that do not go through a hub.
//!
//! Body: one message or an array of them, in the shape the event stream carries:
//! `{"deviceId", "source"?, "properties"?, "enqueuedTime"?, "body"}`. Answers
//! `{"accepted": n}` once every message is applied, so later reads see it.
//!
//! Messages are deserialised borrowing from the request, and each `body` is kept as the raw
//! JSON text it arrived as: the owning core parses it once, like any source.

use std::borrow::Cow;
use std::rc::Rc;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::auth::require_admin;
use crate::config::MAX_DEVICE_ID_LEN;
use crate::http::{Request, Response};
use crate::ingest::{device_id_in_body, IngestMessage, Properties, SourceKind};
use crate::model::{Checked, Rejection};
use crate::app::Core;
use crate::timefmt::parse_iso;

/// One message as sent.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireMessage<'a> {
    #[serde(default, borrow)]
    device_id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    source: Option<Cow<'a, str>>,
    #[serde(default)]
    properties: Option<serde_json::Map<String, Value>>,
    #[serde(default, borrow)]
    enqueued_time: Option<Cow<'a, str>>,
    /// `null` is a body like any other (a D2C message of `null`); only an absent field is missing.
    #[serde(default, borrow, deserialize_with = "present")]
    body: Option<&'a RawValue>,
}

/// Keeps a present field as `Some`, even when it is `null` (serde maps `null` to `None`).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

fn to_message(wire: WireMessage<'_>, device_id_key: &str) -> Checked<IngestMessage> {
    let source = match wire.source.as_deref() {
        None => SourceKind::Telemetry,
        Some(s) => SourceKind::parse(s).ok_or_else(|| {
            Rejection::bad_request(format!(
                "unknown source `{s}` (Telemetry, twinChangeEvents, deviceConnectionStateEvents, deviceLifecycleEvents)"
            ))
        })?,
    };
    let mut properties = Properties::new();
    for (k, v) in wire.properties.unwrap_or_default() {
        let v = match v {
            Value::String(s) => s,
            Value::Number(_) | Value::Bool(_) => v.to_string(),
            _ => return Err(Rejection::bad_request(format!("property `{k}` must be a string, number or boolean"))),
        };
        properties.push((k.into(), v.into()));
    }
    let enqueued_at = match wire.enqueued_time.as_deref() {
        None => None,
        Some(s) => Some(parse_iso(s).ok_or_else(|| Rejection::bad_request("field `enqueuedTime` is not an ISO 8601 time"))?),
    };
    let body = wire.body.ok_or_else(|| Rejection::bad_request("missing field `body`"))?;
    let device_id = match wire.device_id {
        Some(id) => id.into_owned(),
        None => device_id_in_body(body.get().as_bytes(), device_id_key).ok_or_else(|| {
            Rejection::bad_request(format!("missing field `deviceId` (and no `{device_id_key}` in the body)"))
        })?,
    };
    if device_id.is_empty() || device_id.len() > MAX_DEVICE_ID_LEN {
        return Err(Rejection::bad_request(format!("deviceId must be 1 to {MAX_DEVICE_ID_LEN} bytes")));
    }
    Ok(IngestMessage {
        device_id: device_id.into(),
        source,
        properties,
        body: body.get().as_bytes().to_vec(),
        enqueued_at,
        arrived: Some(crate::metrics::Arrival::now()),
    })
}

fn parse_batch<'a>(bytes: &'a [u8]) -> Checked<Vec<WireMessage<'a>>> {
    let invalid = |e: serde_json::Error| Rejection::bad_request(format!("invalid message: {e}"));
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'[') => serde_json::from_slice(bytes).map_err(invalid),
        Some(b'{') => serde_json::from_slice(bytes).map(|m| vec![m]).map_err(invalid),
        None => Err(Rejection::bad_request("request body is empty; a JSON body is required")),
        Some(_) => Err(Rejection::bad_request("body must be a message object or an array of them")),
    }
}

pub async fn post(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    let (accepted, applied) = begin(core, req).await?;
    applied.await;
    Ok(accepted_response(accepted))
}

/// The answer to a batch of `accepted` messages, once they are applied.
pub fn accepted_response(accepted: usize) -> Response {
    Response::json(200, serde_json::json!({ "accepted": accepted }).to_string())
}

/// Validates the batch and hands it to the owning cores ([`Core::ingest_begin`]); returns
/// how many messages it holds and a future that resolves once they are all applied. A
/// pipelining connection begins its batches in request order and awaits them in that order.
pub async fn begin(core: &Rc<Core>, req: &Request) -> Checked<(usize, impl std::future::Future<Output = ()>)> {
    require_admin(&core.settings, req)?;
    let key = &core.settings.config.custom_device_id_key;
    let wire = parse_batch(&req.body)?;
    let mut batch = Vec::with_capacity(wire.len());
    for (i, message) in wire.into_iter().enumerate() {
        let message = to_message(message, key).map_err(|e| Rejection::bad_request(format!("message {i}: {}", e.message)))?;
        batch.push(message);
    }
    let accepted = batch.len();
    Ok((accepted, core.ingest_begin(batch).await))
}
