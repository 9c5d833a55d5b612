//! The request vocabulary shared by the REST API and the shards: grants and subscriptions.
//!
//! Bodies are validated here, once, with messages that name the offending field; the shards
//! only ever see well-formed, bounded values.

use serde_json::{Map, Value};

use crate::config::{MAX_DEVICE_ID_LEN, MAX_KEY_LEN};

/// Data a session can subscribe to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataKind {
    Telemetry,
    DeviceTwin,
    ConnectionState,
    D2cMessages,
}

impl DataKind {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "telemetry" => Self::Telemetry,
            "deviceTwin" => Self::DeviceTwin,
            "connectionState" => Self::ConnectionState,
            "d2cMessages" => Self::D2cMessages,
            _ => return None,
        })
    }
}

/// What a grant permits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GrantKind {
    Data(DataKind),
    DesiredProperties,
    DirectMethod,
}

impl GrantKind {
    /// The ux4iot 3.x names.
    pub fn parse(s: &str) -> Option<Self> {
        if let Some(kind) = DataKind::parse(s) {
            return Some(Self::Data(kind));
        }
        Some(match s {
            "desiredProperties" => Self::DesiredProperties,
            "directMethod" => Self::DirectMethod,
            _ => return None,
        })
    }

    /// The 3.x type replacing a ux4iot 1.x/2.x grant type (renamed in ux4iot 3.0.0).
    ///
    /// These are refused, not taken as aliases: in 2.x a grant also subscribed, in 3.x it is
    /// permission only, so a 2.x client whose grant was quietly accepted would wait for data
    /// that never comes.
    pub fn legacy_replacement(s: &str) -> Option<&'static str> {
        Some(match s {
            "subscribeToTelemetry" => "telemetry",
            "subscribeToConnectionState" => "connectionState",
            "subscribeToDeviceTwin" => "deviceTwin",
            "subscribeToD2CMessages" | "subscribeToD2cMessages" => "d2cMessages",
            "modifyDesiredProperties" => "desiredProperties",
            "invokeDirectMethod" => "directMethod",
            _ => return None,
        })
    }

    /// Whether this grant needs the IoT Hub service API (the twin is read from the hub).
    pub fn needs_hub(self) -> bool {
        matches!(self, Self::DesiredProperties | Self::DirectMethod | Self::Data(DataKind::DeviceTwin))
    }
}

/// A grant: kind plus an optional key (`telemetryKey` or `directMethodName`); `None` = all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub kind: GrantKind,
    pub key: Option<Box<str>>,
}

/// A subscription: kind plus an optional telemetry key; `None` = all keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subscription {
    pub kind: DataKind,
    pub key: Option<Box<str>>,
}

/// A rejected request: HTTP status and the message for `{"errorMessage": …}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u16,
    pub message: String,
}

impl Rejection {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }
}

pub type Checked<T> = Result<T, Rejection>;

pub fn as_object<'a>(body: &'a Value, what: &str) -> Checked<&'a Map<String, Value>> {
    body.as_object()
        .ok_or_else(|| Rejection::bad_request(format!("{what} must be a JSON object")))
}

/// A required, non-empty string field of at most `max` bytes.
pub fn required_str<'a>(obj: &'a Map<String, Value>, field: &str, max: usize) -> Checked<&'a str> {
    match obj.get(field) {
        None | Some(Value::Null) => Err(Rejection::bad_request(format!("missing field `{field}`"))),
        Some(Value::String(s)) if s.is_empty() => Err(Rejection::bad_request(format!("field `{field}` must not be empty"))),
        Some(Value::String(s)) if s.len() > max => {
            Err(Rejection::bad_request(format!("field `{field}` is longer than {max} bytes")))
        }
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(Rejection::bad_request(format!("field `{field}` must be a string"))),
    }
}

/// An optional key field: absent or null = wildcard.
pub fn optional_key(obj: &Map<String, Value>, field: &str) -> Checked<Option<Box<str>>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.len() > MAX_KEY_LEN => {
            Err(Rejection::bad_request(format!("field `{field}` is longer than {MAX_KEY_LEN} bytes")))
        }
        Some(Value::String(s)) => Ok(Some(s.as_str().into())),
        Some(_) => Err(Rejection::bad_request(format!("field `{field}` must be a string or null"))),
    }
}

pub fn device_id(obj: &Map<String, Value>) -> Checked<&str> {
    required_str(obj, "deviceId", MAX_DEVICE_ID_LEN)
}

/// The session id field; the raw string is returned and resolved against the session table later.
pub fn session_field<'a>(obj: &'a Map<String, Value>, fallback: Option<&'a str>) -> Checked<&'a str> {
    match obj.get("sessionId") {
        None | Some(Value::Null) => fallback.ok_or_else(|| Rejection::bad_request("missing field `sessionId`")),
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(Rejection::bad_request("field `sessionId` must be a string")),
    }
}

/// A parsed `PUT/DELETE /grants` body.
#[derive(Debug, Clone)]
pub struct GrantRequest {
    pub session: String,
    pub device: String,
    pub grant: Grant,
}

impl GrantRequest {
    pub fn parse(body: &Value) -> Checked<Self> {
        let obj = as_object(body, "grant request")?;
        let session = session_field(obj, None)?.to_string();
        let device = device_id(obj)?.to_string();
        let kind = match obj.get("type") {
            None | Some(Value::Null) => {
                let refusal = legacy_grant(obj.get("grantType"));
                return Err(refusal.unwrap_or_else(|| Rejection::bad_request("missing field `type`")));
            }
            Some(Value::String(s)) => match GrantKind::parse(s) {
                Some(kind) => kind,
                None => {
                    let refusal = legacy_grant(obj.get("type"));
                    return Err(refusal.unwrap_or_else(|| Rejection::bad_request("unknown grant type")));
                }
            },
            Some(_) => return Err(Rejection::bad_request("field `type` must be a string")),
        };
        let key = match kind {
            GrantKind::Data(DataKind::Telemetry) => optional_key(obj, "telemetryKey")?,
            GrantKind::DirectMethod => optional_key(obj, "directMethodName")?,
            _ => None,
        };
        Ok(Self { session, device, grant: Grant { kind, key } })
    }
}

/// The refusal of a ux4iot 1.x/2.x grant (a 2.x type name under `type` or `grantType`), naming
/// the 3.x request to send instead; `None` when `value` is no grant type of either version.
fn legacy_grant(value: Option<&Value>) -> Option<Rejection> {
    let name = value?.as_str()?;
    let current = GrantKind::legacy_replacement(name).or_else(|| GrantKind::parse(name).map(|_| name))?;
    Some(Rejection::bad_request(format!(
        "unknown grant type: `{name}` is a ux4iot 2.x grant; send {{\"type\": \"{current}\"}} instead \
         (since ux4iot 3.0.0 a grant only permits; subscribe with PUT /subscription)"
    )))
}

/// A parsed subscription request, with its original JSON kept for the bulk echo.
#[derive(Debug, Clone)]
pub struct SubscriptionRequest {
    pub session: String,
    pub device: String,
    pub subscription: Subscription,
}

impl SubscriptionRequest {
    pub fn parse(body: &Value, session_header: Option<&str>) -> Checked<Self> {
        let obj = as_object(body, "subscription request")?;
        let session = session_field(obj, session_header)?.to_string();
        let device = device_id(obj)?.to_string();
        let kind = match obj.get("type") {
            None | Some(Value::Null) => return Err(Rejection::bad_request("missing field `type`")),
            Some(Value::String(s)) => {
                DataKind::parse(s).ok_or_else(|| Rejection::bad_request("unknown subscription type"))?
            }
            Some(_) => return Err(Rejection::bad_request("field `type` must be a string")),
        };
        let key = if kind == DataKind::Telemetry { optional_key(obj, "telemetryKey")? } else { None };
        Ok(Self { session, device, subscription: Subscription { kind, key } })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn legacy_grant_names_are_refused_naming_the_current_type() {
        let e = GrantRequest::parse(&json!({"grantType":"subscribeToTelemetry","sessionId":"s","deviceId":"d","telemetryKey":"t"})).unwrap_err();
        assert!(e.message.contains(r#"{"type": "telemetry"}"#), "{}", e.message);
        let e = GrantRequest::parse(&json!({"type":"invokeDirectMethod","sessionId":"s","deviceId":"d"})).unwrap_err();
        assert!(e.message.contains(r#"{"type": "directMethod"}"#), "{}", e.message);
        let e = GrantRequest::parse(&json!({"grantType":"deviceTwin","sessionId":"s","deviceId":"d"})).unwrap_err();
        assert!(e.message.contains(r#"{"type": "deviceTwin"}"#), "{}", e.message);
    }

    #[test]
    fn unknown_grant_type_is_named() {
        let e = GrantRequest::parse(&json!({"type":"x","sessionId":"s","deviceId":"d"})).unwrap_err();
        assert_eq!(e.message, "unknown grant type");
    }

    #[test]
    fn overlong_device_id_is_rejected() {
        let long = "d".repeat(MAX_DEVICE_ID_LEN + 1);
        let e = SubscriptionRequest::parse(&json!({"type":"telemetry","sessionId":"s","deviceId":long}), None).unwrap_err();
        assert!(e.message.contains("deviceId"));
    }
}
