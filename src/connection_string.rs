//! Parsing of Azure connection strings (`Key=Value;Key=Value`).
//!
//! Values may contain `=` (base64 keys), so each part splits at its first `=`. Keys are
//! matched case-insensitively, as the Azure SDKs do.

use std::fmt;

#[derive(Debug, PartialEq, Eq)]
pub struct ParseError(String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn parts(s: &str) -> Result<Vec<(String, String)>, ParseError> {
    let mut out = Vec::new();
    for part in s.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| ParseError(format!("part `{}` is not Key=Value", part.chars().take(40).collect::<String>())))?;
        out.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    if out.is_empty() {
        return Err(ParseError("empty connection string".into()));
    }
    Ok(out)
}

fn get(parts: &[(String, String)], key: &str) -> Option<String> {
    parts.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

fn require(parts: &[(String, String)], key: &str, shown: &str) -> Result<String, ParseError> {
    get(parts, key).filter(|v| !v.is_empty()).ok_or_else(|| ParseError(format!("missing {shown}")))
}

/// Where device messages come from: an Event Hub endpoint, or an IoT Hub whose built-in
/// endpoint is found by following the AMQP redirect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventHubConnection {
    /// `sb://host/` or `amqp://host:port` for the Event Hub form; `None` for the IoT Hub form.
    pub endpoint: Option<String>,
    /// IoT Hub host name (IoT Hub form).
    pub host_name: Option<String>,
    pub key_name: String,
    pub key: String,
    pub entity_path: Option<String>,
}

impl EventHubConnection {
    pub fn parse(s: &str) -> Result<Self, ParseError> {
        let p = parts(s)?;
        let endpoint = get(&p, "endpoint");
        let host_name = get(&p, "hostname");
        if endpoint.is_none() && host_name.is_none() {
            return Err(ParseError("missing Endpoint (Event Hub) or HostName (IoT Hub)".into()));
        }
        if let Some(e) = &endpoint {
            if !(e.starts_with("sb://") || e.starts_with("amqp://") || e.starts_with("amqps://")) {
                return Err(ParseError("Endpoint must start with sb://, amqps:// or amqp://".into()));
            }
        }
        Ok(Self {
            endpoint,
            host_name,
            key_name: require(&p, "sharedaccesskeyname", "SharedAccessKeyName")?,
            key: require(&p, "sharedaccesskey", "SharedAccessKey")?,
            entity_path: get(&p, "entitypath"),
        })
    }
}

/// IoT Hub service connection string: `HostName=…;SharedAccessKeyName=…;SharedAccessKey=…`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceConnection {
    pub host_name: String,
    pub key_name: String,
    pub key: String,
}

impl ServiceConnection {
    pub fn parse(s: &str) -> Result<Self, ParseError> {
        let p = parts(s)?;
        let connection = Self {
            host_name: require(&p, "hostname", "HostName")?,
            key_name: require(&p, "sharedaccesskeyname", "SharedAccessKeyName")?,
            key: require(&p, "sharedaccesskey", "SharedAccessKey")?,
        };
        // IoT Hub signs with the base64-decoded key: a key that does not decode cannot sign.
        crate::sas::decode_key(&connection.key).map_err(ParseError)?;
        Ok(connection)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_hub_form_keeps_equals_signs_in_keys() {
        let c = EventHubConnection::parse(
            "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=listen;SharedAccessKey=ab==;EntityPath=hub",
        )
        .unwrap();
        assert_eq!(c.key, "ab==");
        assert_eq!(c.entity_path.as_deref(), Some("hub"));
    }

    #[test]
    fn iot_hub_form_is_accepted() {
        let c = EventHubConnection::parse("HostName=h.azure-devices.net;SharedAccessKeyName=service;SharedAccessKey=k").unwrap();
        assert_eq!(c.host_name.as_deref(), Some("h.azure-devices.net"));
    }

    #[test]
    fn garbage_is_rejected_with_a_reason() {
        assert!(EventHubConnection::parse("garbage").is_err());
        assert!(ServiceConnection::parse("HostName=h").unwrap_err().to_string().contains("SharedAccessKeyName"));
        let bad_key = "HostName=h;SharedAccessKeyName=service;SharedAccessKey=not base64!";
        assert!(ServiceConnection::parse(bad_key).unwrap_err().to_string().contains("base64"));
    }
}
