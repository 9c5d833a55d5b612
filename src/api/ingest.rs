//! `POST /ingest` (admin key): the HTTP ingest API for backends that do not go through a hub.
//!
//! Body: one message or an array of them, in the shape the event stream carries:
//! `{"deviceId", "source"?, "properties"?, "enqueuedTime"?, "body"}`. Answers
//! `{"accepted": n}` once every message is applied, so later reads see it.
//!
//! One pass over the request ([`json::for_each_item`]) validates it and finds each message's
//! fields; each `body` is kept as the raw JSON text it arrived as (validated in that pass) and
//! copied once, into the message the owning core parses, like any source's. Nothing is
//! applied unless the whole request is valid.

use std::borrow::Cow;
use std::rc::Rc;

use serde_json::Value;

use super::auth::require_admin;
use crate::app::Core;
use crate::config::MAX_DEVICE_ID_LEN;
use crate::http::{Request, Response};
use crate::ingest::json::{self, Item, ItemsError, Members};
use crate::ingest::{device_id_in_body, IngestMessage, MsgKey, Properties, SourceKind};
use crate::metrics::Arrival;
use crate::model::{Checked, Rejection};
use crate::timefmt::{now_millis, parse_iso, Millis};

/// A string field's text (`None` for `null`, as if absent).
fn string_field<'a>(name: &str, text: &'a str) -> Checked<Option<Cow<'a, str>>> {
    match text.as_bytes()[0] {
        b'n' => Ok(None),
        b'"' => json::string_text(text)
            .map(Some)
            .ok_or_else(|| Rejection::bad_request(format!("field `{name}` escapes a lone UTF-16 surrogate"))),
        _ => Err(Rejection::bad_request(format!("field `{name}` must be a string"))),
    }
}

fn set_once<'a>(slot: &mut Option<&'a str>, name: &str, text: &'a str) -> Checked<()> {
    if slot.replace(text).is_some() {
        return Err(Rejection::bad_request(format!("duplicate field `{name}`")));
    }
    Ok(())
}

/// One message of the request, from its members (`{"deviceId", "source"?, "properties"?,
/// "enqueuedTime"?, "body"}`; other fields are ignored, a repeated one is refused).
fn to_message(members: &Members<'_>, device_id_key: &str, arrived: Arrival, arrived_ms: Millis) -> Checked<IngestMessage> {
    let (mut device_id, mut source, mut properties, mut enqueued_time, mut body) = (None, None, None, None, None);
    for &(ref key, text) in members {
        match key.as_ref() {
            "deviceId" => set_once(&mut device_id, "deviceId", text)?,
            "source" => set_once(&mut source, "source", text)?,
            "properties" => set_once(&mut properties, "properties", text)?,
            "enqueuedTime" => set_once(&mut enqueued_time, "enqueuedTime", text)?,
            // `null` is a body like any other (a D2C message of `null`); only an absent field is missing.
            "body" => set_once(&mut body, "body", text)?,
            _ => {}
        }
    }
    let source = match source.map(|t| string_field("source", t)).transpose()?.flatten() {
        None => SourceKind::Telemetry,
        Some(s) => SourceKind::parse(&s).ok_or_else(|| {
            Rejection::bad_request(format!(
                "unknown source `{s}` (Telemetry, twinChangeEvents, deviceConnectionStateEvents, deviceLifecycleEvents)"
            ))
        })?,
    };
    let mut props = Properties::new();
    if let Some(text) = properties.filter(|t| *t != "null") {
        let map: serde_json::Map<String, Value> = serde_json::from_str(text)
            .map_err(|_| Rejection::bad_request("field `properties` must be an object"))?;
        for (k, v) in map {
            let v = match v {
                Value::String(s) => s,
                Value::Number(_) | Value::Bool(_) => v.to_string(),
                _ => return Err(Rejection::bad_request(format!("property `{k}` must be a string, number or boolean"))),
            };
            props.push((k.into(), v.into()));
        }
    }
    let enqueued_at = match enqueued_time.map(|t| string_field("enqueuedTime", t)).transpose()?.flatten() {
        None => None,
        Some(s) => Some(parse_iso(&s).ok_or_else(|| Rejection::bad_request("field `enqueuedTime` is not an ISO 8601 time"))?),
    };
    let body = body.ok_or_else(|| Rejection::bad_request("missing field `body`"))?;
    let device_id: Box<str> = match device_id.map(|t| string_field("deviceId", t)).transpose()?.flatten() {
        Some(id) => id.into(),
        None => device_id_in_body(body.as_bytes(), device_id_key)
            .ok_or_else(|| {
                Rejection::bad_request(format!("missing field `deviceId` (and no `{device_id_key}` in the body)"))
            })?
            .into(),
    };
    if device_id.is_empty() || device_id.len() > MAX_DEVICE_ID_LEN {
        return Err(Rejection::bad_request(format!("deviceId must be 1 to {MAX_DEVICE_ID_LEN} bytes")));
    }
    Ok(IngestMessage {
        device_id,
        source,
        properties: props,
        body: body.as_bytes().to_vec(),
        enqueued_at,
        arrived: Some(arrived),
        key: MsgKey::arrival(arrived_ms),
    })
}

/// The messages of a request body: one message object or an array of them.
fn parse_batch(bytes: &[u8], device_id_key: &str) -> Checked<Vec<IngestMessage>> {
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'[' | b'{') => {}
        None => return Err(Rejection::bad_request("request body is empty; a JSON body is required")),
        Some(_) => return Err(Rejection::bad_request("body must be a message object or an array of them")),
    }
    // One arrival time for the request: its messages arrived together.
    let arrived = Arrival::now();
    let arrived_ms = now_millis();
    // About one message per 64 bytes of request (a typical one takes 60 to 200): one
    // allocation, rarely a second.
    let mut batch = Vec::with_capacity((bytes.len() / 64).min(16_384) + 1);
    let scanned = json::for_each_item(bytes, |item| {
        let i = batch.len();
        let message = match item {
            Item::Object(members) => to_message(members, device_id_key, arrived, arrived_ms),
            Item::Other(_) => Err(Rejection::bad_request("not a message object")),
        };
        batch.push(message.map_err(|e| Rejection::bad_request(format!("message {i}: {}", e.message)))?);
        Ok(())
    });
    match scanned {
        Ok(()) => Ok(batch),
        Err(ItemsError::Item(rejection)) => Err(rejection),
        Err(ItemsError::NotJson) => Err(Rejection::bad_request(format!("invalid message: {}", syntax_error(bytes)))),
    }
}

/// Where and why a body that is not JSON text fails (serde_json's words: line and column).
fn syntax_error(bytes: &[u8]) -> String {
    if let Err(e) = std::str::from_utf8(bytes) {
        return format!("the body is not UTF-8 text ({e})");
    }
    match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        Err(e) => e.to_string(),
        Ok(_) => "a string escapes a lone UTF-16 surrogate".into(),
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
    let batch = parse_batch(&req.body, &core.settings.config.custom_device_id_key)?;
    let accepted = batch.len();
    Ok((accepted, core.ingest_begin(batch).await))
}
