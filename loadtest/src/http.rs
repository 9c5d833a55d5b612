//! A small HTTP/1.1 keep-alive client: one connection, one request at a time, responses
//! parsed with `httparse` and framed by `content-length` (hubcast always sends it).
//!
//! Small on purpose: the REST benchmark compares two routes through the same client, and the
//! fleet posts large batches, so what matters is that a request costs the client little.

use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest wait for one response: a harness never hangs on a stuck server.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// A response: status and body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> io::Result<serde_json::Value> {
        serde_json::from_slice(&self.body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// One keep-alive connection.
pub struct HttpConn {
    addr: SocketAddr,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
    /// Bytes of `buf` that belong to the next response.
    filled: usize,
    /// Requests answered on this connection (reconnects included).
    pub answered: u64,
}

/// Builds the bytes of a request (so that a benchmark loop can send the same bytes again).
pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(128 + body.len());
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: 127.0.0.1\r\n");
    for (k, v) in headers {
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !body.is_empty() || matches!(method, "POST" | "PUT" | "PATCH" | "DELETE") {
        out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

impl HttpConn {
    pub fn new(addr: SocketAddr) -> Self {
        Self { addr, stream: None, buf: vec![0; 16 * 1024], filled: 0, answered: 0 }
    }

    async fn stream(&mut self) -> io::Result<&mut TcpStream> {
        if self.stream.is_none() {
            let s = TcpStream::connect(self.addr).await?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
            self.filled = 0;
        }
        Ok(self.stream.as_mut().expect("just connected"))
    }

    /// Sends `request` (from [`request_bytes`]) and reads its response. On an I/O error the
    /// connection is dropped (the next call reconnects) and the error returned.
    pub async fn send(&mut self, request: &[u8]) -> io::Result<Response> {
        let result = match tokio::time::timeout(REQUEST_TIMEOUT, self.exchange(request)).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, format!("no response within {REQUEST_TIMEOUT:?}"))),
        };
        if result.is_err() {
            self.stream = None;
        }
        result
    }

    pub async fn call(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> io::Result<Response> {
        let bytes = request_bytes(method, path, headers, body);
        self.send(&bytes).await
    }

    async fn exchange(&mut self, request: &[u8]) -> io::Result<Response> {
        self.stream().await?.write_all(request).await?;
        loop {
            if let Some((head_len, status, body_len, close)) = parse_head(&self.buf[..self.filled])? {
                let total = head_len + body_len;
                if self.buf.len() < total {
                    self.buf.resize(total, 0);
                }
                while self.filled < total {
                    let stream = self.stream.as_mut().expect("connected");
                    let n = stream.read(&mut self.buf[self.filled..]).await?;
                    if n == 0 {
                        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a response"));
                    }
                    self.filled += n;
                }
                let body = self.buf[head_len..total].to_vec();
                self.buf.copy_within(total..self.filled, 0);
                self.filled -= total;
                self.answered += 1;
                if close {
                    self.stream = None;
                }
                return Ok(Response { status, body });
            }
            if self.filled == self.buf.len() {
                self.buf.resize(self.buf.len() * 2, 0);
            }
            let stream = self.stream.as_mut().expect("connected");
            let n = stream.read(&mut self.buf[self.filled..]).await?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed before a response"));
            }
            self.filled += n;
        }
    }
}

/// Parses a response head: (head length, status, body length, connection: close).
pub fn parse_head(bytes: &[u8]) -> io::Result<Option<(usize, u16, usize, bool)>> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(bytes) {
        Ok(httparse::Status::Complete(len)) => {
            let status = resp.code.unwrap_or(0);
            let mut body_len = 0;
            let mut close = false;
            for h in resp.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    body_len = std::str::from_utf8(h.value).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0);
                } else if h.name.eq_ignore_ascii_case("connection") {
                    close = h.value.eq_ignore_ascii_case(b"close");
                }
            }
            Ok(Some((len, status, body_len, close)))
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad response head: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_gives_its_length_status_and_body_length() {
        let raw = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
        assert_eq!(parse_head(raw).unwrap(), Some((raw.len() - 5, 200, 5, false)));
        assert_eq!(parse_head(b"HTTP/1.1 200 OK\r\ncontent-len").unwrap(), None);
    }

    #[test]
    fn requests_carry_a_length_when_they_have_a_body() {
        let r = request_bytes("PUT", "/grants", &[("k", "v")], b"{}");
        assert_eq!(r, b"PUT /grants HTTP/1.1\r\nhost: 127.0.0.1\r\nk: v\r\ncontent-length: 2\r\n\r\n{}");
        let r = request_bytes("GET", "/version", &[], b"");
        assert_eq!(r, b"GET /version HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n");
    }
}
