//! The JSON records of the REST reads (`{"deviceId", "data", "timestamp"}`), rendered from the
//! shard's typed views by concatenation: telemetry values are kept as the device's own JSON
//! text, so nothing is re-serialised.

use crate::push::envelope::push_json_str;
use crate::shard::{ConnectionView, TelemetryView, TwinView};
use crate::timefmt::iso;

/// `{"deviceId": device, "data": data, "timestamp": timestamp}` (`data` is JSON already).
pub fn record(device: &str, data: &str, timestamp: &str) -> String {
    let mut out = String::with_capacity(device.len() + data.len() + timestamp.len() + 40);
    out.push_str("{\"deviceId\":");
    push_json_str(&mut out, device);
    out.push_str(",\"data\":");
    out.push_str(data);
    out.push_str(",\"timestamp\":");
    push_json_str(&mut out, timestamp);
    out.push('}');
    out
}

/// One key: `data` is `{key: value}` with the value's time; every key: `data` is
/// `{key: {"value", "timestamp"}}` and the record's own timestamp is empty (as ux4iot).
pub fn telemetry(device: &str, view: &TelemetryView) -> String {
    match view {
        TelemetryView::One { key, json, at } => {
            let mut data = String::with_capacity(key.len() + json.len() + 4);
            data.push('{');
            push_json_str(&mut data, key);
            data.push(':');
            data.push_str(json);
            data.push('}');
            record(device, &data, &iso(*at))
        }
        TelemetryView::All(values) => {
            let mut data = String::from("{");
            for (key, json, at) in values {
                if data.len() > 1 {
                    data.push(',');
                }
                push_json_str(&mut data, key);
                data.push_str(":{\"value\":");
                data.push_str(json);
                data.push_str(",\"timestamp\":\"");
                data.push_str(&iso(*at));
                data.push_str("\"}");
            }
            data.push('}');
            record(device, &data, "")
        }
    }
}

pub fn twin(device: &str, view: &TwinView) -> String {
    record(device, &view.doc.to_string(), &iso(view.at))
}

pub fn connection(device: &str, view: &ConnectionView) -> String {
    record(device, if view.connected { "true" } else { "false" }, &iso(view.at))
}
