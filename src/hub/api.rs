//! The three IoT Hub service REST calls hubcast makes, and how the hub's answers map to ours
//! (reference iothub-wire.md §3.2–3.5). Pure functions: no I/O here.

use serde_json::Value;

use super::sas::encode;
use crate::model::Rejection;

/// The service API version every call carries (`?api-version=`).
pub const API_VERSION: &str = "2021-04-12";

/// Largest hub answer read (a twin is at most ~100 KB, a method result 128 KB): beyond → 502.
pub const MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// Longest hub error text passed on to the caller.
const MAX_MESSAGE_CHARS: usize = 1000;

/// One call to the hub.
#[derive(Debug)]
pub enum HubCall {
    /// `GET /twins/{id}`: the device twin (also the source of `connectionState`).
    GetTwin { device: String },
    /// `PATCH /twins/{id}` with `{"properties":{"desired": patch}}` and `If-Match: *`.
    PatchDesired { device: String, patch: Value },
    /// `POST /twins/{id}/methods` with `{methodName, payload, responseTimeoutInSeconds?, connectTimeoutInSeconds?}`.
    InvokeMethod { device: String, body: Value },
}

impl HubCall {
    pub fn method(&self) -> reqwest::Method {
        match self {
            HubCall::GetTwin { .. } => reqwest::Method::GET,
            HubCall::PatchDesired { .. } => reqwest::Method::PATCH,
            HubCall::InvokeMethod { .. } => reqwest::Method::POST,
        }
    }

    /// Path and query, relative to the hub's base URL; the device id is percent-encoded.
    pub fn path_and_query(&self) -> String {
        match self {
            HubCall::GetTwin { device } | HubCall::PatchDesired { device, .. } => {
                format!("/twins/{}?api-version={API_VERSION}", encode(device))
            }
            HubCall::InvokeMethod { device, .. } => {
                format!("/twins/{}/methods?api-version={API_VERSION}", encode(device))
            }
        }
    }

    /// The JSON body, if the call has one.
    pub fn body(&self) -> Option<Vec<u8>> {
        match self {
            HubCall::GetTwin { .. } => None,
            HubCall::PatchDesired { patch, .. } => {
                Some(serde_json::json!({ "properties": { "desired": patch } }).to_string().into_bytes())
            }
            HubCall::InvokeMethod { body, .. } => Some(body.to_string().into_bytes()),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            HubCall::GetTwin { .. } => "get twin",
            HubCall::PatchDesired { .. } => "patch desired properties",
            HubCall::InvokeMethod { .. } => "invoke direct method",
        }
    }
}

/// A successful hub answer: HTTP status (2xx) and JSON body.
#[derive(Debug)]
pub struct HubAnswer {
    pub status: u16,
    pub body: Value,
}

/// The answer, or the error for our caller (the hub's status forwarded, or 502/503/504 of ours).
pub type HubResult = Result<HubAnswer, Rejection>;

/// Maps a complete hub response to the result.
pub fn interpret(status: u16, error_code: Option<&str>, body: &[u8]) -> HubResult {
    match status {
        200..=299 => {
            if body.iter().all(u8::is_ascii_whitespace) {
                return Ok(HubAnswer { status, body: Value::Null });
            }
            serde_json::from_slice(body)
                .map(|body| HubAnswer { status, body })
                .map_err(|e| Rejection::new(502, format!("IoT Hub answered {status} with a body that is not JSON: {e}")))
        }
        400..=599 => Err(Rejection::new(status, error_message(status, error_code, body))),
        _ => Err(Rejection::new(502, format!("IoT Hub answered with unexpected status {status}"))),
    }
}

/// The hub's error text: the `Message` of its JSON body (itself sometimes JSON with
/// `errorCode` and `message`), else the raw text, prefixed with the status and error code.
pub fn error_message(status: u16, error_code: Option<&str>, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut code = error_code.map(str::to_string);
    let mut message: Option<String> = None;
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        let outer = v.get("Message").or_else(|| v.get("message")).and_then(Value::as_str);
        if let Some(outer) = outer {
            if let Ok(inner @ Value::Object(_)) = serde_json::from_str::<Value>(outer) {
                message = inner.get("message").or_else(|| inner.get("Message")).and_then(Value::as_str).map(Into::into);
                if code.is_none() {
                    code = inner.get("errorCode").map(|c| c.as_str().map_or_else(|| c.to_string(), Into::into));
                }
            }
            message = message.or_else(|| Some(outer.to_string()));
        }
    }
    let mut message = message.unwrap_or_else(|| text.trim().to_string());
    if message.is_empty() {
        message = "no error message".into();
    }
    if message.chars().count() > MAX_MESSAGE_CHARS {
        message = message.chars().take(MAX_MESSAGE_CHARS).collect::<String>() + "…";
    }
    match code {
        Some(code) if !code.is_empty() && !message.contains(code.as_str()) => {
            format!("IoT Hub error {status} {code}: {message}")
        }
        _ => format!("IoT Hub error {status}: {message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths_carry_the_api_version_and_encode_the_device_id() {
        let get = HubCall::GetTwin { device: "a b/c".into() };
        assert_eq!(get.path_and_query(), "/twins/a%20b%2Fc?api-version=2021-04-12");
        let invoke = HubCall::InvokeMethod { device: "d1".into(), body: json!({}) };
        assert_eq!(invoke.path_and_query(), "/twins/d1/methods?api-version=2021-04-12");
    }

    #[test]
    fn desired_patch_is_wrapped_in_properties_desired() {
        let call = HubCall::PatchDesired { device: "d".into(), patch: json!({"a": 1}) };
        let body: Value = serde_json::from_slice(&call.body().unwrap()).unwrap();
        assert_eq!(body, json!({"properties": {"desired": {"a": 1}}}));
    }

    #[test]
    fn semicolon_message_and_header_code_are_forwarded() {
        let body = br#"{"Message":"ErrorCode:DeviceNotFound;Device d1 not registered","ExceptionMessage":"Tracking ID:x"}"#;
        let r = interpret(404, Some("DeviceNotFound"), body).unwrap_err();
        assert_eq!(r.status, 404);
        assert_eq!(r.message, "IoT Hub error 404: ErrorCode:DeviceNotFound;Device d1 not registered");
    }

    #[test]
    fn nested_json_message_is_unwrapped() {
        let body = json!({"Message": "{\"errorCode\":429001,\"trackingId\":\"t\",\"message\":\"Throttled\"}"}).to_string();
        let r = interpret(429, None, body.as_bytes()).unwrap_err();
        assert_eq!(r.message, "IoT Hub error 429 429001: Throttled");
    }

    #[test]
    fn non_json_error_body_is_passed_as_text() {
        let r = interpret(503, None, b"  upstream down ").unwrap_err();
        assert_eq!((r.status, r.message.as_str()), (503, "IoT Hub error 503: upstream down"));
    }

    #[test]
    fn success_with_garbage_is_502() {
        assert_eq!(interpret(200, None, b"<html>").unwrap_err().status, 502);
        assert_eq!(interpret(302, None, b"").unwrap_err().status, 502);
        assert_eq!(interpret(200, None, br#"{"status":1}"#).unwrap().body, json!({"status": 1}));
    }
}
