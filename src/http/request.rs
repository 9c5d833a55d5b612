//! A request as the API handlers see it: method, decoded path segments, headers, whole body.

use bytes::Bytes;
use http::{HeaderMap, Method};
use percent_encoding::percent_decode_str;

use crate::model::{Checked, Rejection};

pub struct Request {
    pub method: Method,
    pub path: String,
    pub query: Option<String>,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The TCP peer's address (`None` where there is no socket), for per-client limits.
    pub peer: Option<std::net::IpAddr>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty())
    }

    /// Path segments, percent-decoded (device ids may contain reserved characters).
    pub fn segments(&self) -> Checked<Vec<String>> {
        self.path
            .split('/')
            .filter(|s| !s.is_empty())
            .map(|s| {
                percent_decode_str(s)
                    .decode_utf8()
                    .map(|c| c.into_owned())
                    .map_err(|_| Rejection::bad_request("path is not valid UTF-8"))
            })
            .collect()
    }

    /// The body as JSON; an empty body is an error naming what was expected.
    pub fn json(&self) -> Checked<serde_json::Value> {
        if self.body.is_empty() {
            return Err(Rejection::bad_request("request body is empty; a JSON body is required"));
        }
        serde_json::from_slice(&self.body)
            .map_err(|e| Rejection::bad_request(format!("request body is not valid JSON: {e}")))
    }

    pub fn query_param(&self, name: &str) -> Option<String> {
        let q = self.query.as_deref()?;
        q.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (k == name).then(|| percent_decode_str(v).decode_utf8_lossy().into_owned())
        })
    }
}
