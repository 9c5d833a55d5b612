//! Responses: status, body, and the encoding to HTTP/1.1 bytes (CORS headers on every one).

use std::fmt::Write;

use crate::model::Rejection;

pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub extra_headers: Vec<(&'static str, String)>,
    /// Close the connection after this response.
    pub close: bool,
}

impl Response {
    pub fn new(status: u16, content_type: &'static str, body: impl Into<Vec<u8>>) -> Self {
        Self { status, content_type, body: body.into(), extra_headers: Vec::new(), close: false }
    }

    pub fn json(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Self::new(status, "application/json; charset=utf-8", body)
    }

    pub fn text(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Self::new(status, "text/plain; charset=utf-8", body)
    }

    pub fn no_content() -> Self {
        Self::new(204, "", Vec::new())
    }

    /// `{"errorMessage": "…"}` with the given status.
    pub fn error(status: u16, message: &str) -> Self {
        Self::json(status, serde_json::json!({ "errorMessage": message }).to_string())
    }

    /// 429 for unauthenticated work over the client's rate (`admission::rate`), with the
    /// seconds until it may try again.
    pub fn rate_limited(retry_after_s: u64) -> Self {
        let message = format!(
            "too many new sessions or socket handshakes from this client address (--client-rate, --client-burst); retry after {retry_after_s} s"
        );
        Self::error(429, &message).with_header("retry-after", retry_after_s.to_string())
    }

    pub fn rejection(r: Rejection) -> Self {
        Self::error(r.status, &r.message)
    }

    pub fn with_header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.extra_headers.push((name, value.into()));
        self
    }

    pub fn closing(mut self) -> Self {
        self.close = true;
        self
    }

    /// Appends the encoded response to `out`.
    pub fn encode(&self, out: &mut Vec<u8>, keep_alive: bool) {
        self.encode_for(out, keep_alive, true)
    }

    /// Appends the encoded response to `out`; without its body (but with the body's
    /// Content-Length) when `with_body` is false, as the answer to a HEAD request.
    pub fn encode_for(&self, out: &mut Vec<u8>, keep_alive: bool, with_body: bool) {
        let mut head = String::with_capacity(256);
        let _ = write!(head, "HTTP/1.1 {} {}\r\n", self.status, reason(self.status));
        head.push_str("access-control-allow-origin: *\r\n");
        if !self.content_type.is_empty() {
            let _ = write!(head, "content-type: {}\r\n", self.content_type);
        }
        for (name, value) in &self.extra_headers {
            let _ = write!(head, "{name}: {value}\r\n");
        }
        if self.status != 204 {
            let _ = write!(head, "content-length: {}\r\n", self.body.len());
        }
        if !keep_alive || self.close {
            head.push_str("connection: close\r\n");
        }
        head.push_str("\r\n");
        out.extend_from_slice(head.as_bytes());
        if self.status != 204 && with_body {
            out.extend_from_slice(&self.body);
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        101 => "Switching Protocols",
        200 => "OK",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        412 => "Precondition Failed",
        415 => "Unsupported Media Type",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}
