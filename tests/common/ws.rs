//! A plain WebSocket client (tungstenite) for the live-push tests.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::Value;
use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::{Message, WebSocket};

use super::Server;

pub struct Live {
    pub ws: WebSocket<TcpStream>,
    /// Close code and reason, once the server closed.
    pub closed: Option<(u16, String)>,
}

/// Opens a WebSocket to `base` (`http://host:port`) at `path_and_query`.
pub fn connect(base: &str, path_and_query: &str) -> Live {
    try_connect(base, path_and_query).unwrap_or_else(|(status, body)| panic!("websocket handshake: {status} {body}"))
}

/// Like [`connect`]; a refused upgrade gives its HTTP status and body.
pub fn try_connect(base: &str, path_and_query: &str) -> Result<Live, (u16, String)> {
    let addr = base.trim_start_matches("http://").to_string();
    let stream = TcpStream::connect(&addr).expect("connect");
    stream.set_nodelay(true).ok();
    let url = format!("ws://{addr}{path_and_query}");
    match tungstenite::client(url.as_str(), stream) {
        Ok((ws, response)) => {
            assert_eq!(response.status().as_u16(), 101);
            Ok(Live { ws, closed: None })
        }
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(response))) => {
            let body = response.body().as_deref().map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default();
            Err((response.status().as_u16(), body))
        }
        Err(e) => panic!("websocket handshake: {e}"),
    }
}

impl Server {
    /// Opens `/ws?sessionId=…` (or any path) with a standard WebSocket client.
    pub fn ws(&self, path_and_query: &str) -> Live {
        connect(&self.base, path_and_query)
    }

    pub fn live(&self, session: &str) -> Live {
        self.ws(&format!("/ws?sessionId={session}"))
    }
}

impl Live {
    /// The next text frame as JSON, or `None` when nothing arrives within `timeout` (or closed).
    pub fn next_json(&mut self, timeout: Duration) -> Option<Value> {
        self.next_text(timeout).map(|t| serde_json::from_str(&t).expect("frames are JSON"))
    }

    /// The next text frame as sent, or `None` when nothing arrives within `timeout` (or closed).
    pub fn next_text(&mut self, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            self.ws.get_ref().set_read_timeout(Some(left.max(Duration::from_millis(1)))).ok();
            match self.ws.read() {
                Ok(Message::Text(t)) => return Some(t.to_string()),
                Ok(Message::Close(frame)) => {
                    self.closed = Some(frame.map_or((1005, String::new()), |f| (u16::from(f.code), f.reason.to_string())));
                    return None;
                }
                Ok(_) => continue,
                Err(tungstenite::Error::Io(e))
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
                {
                    return None
                }
                Err(_) => {
                    self.closed.get_or_insert((1006, String::new()));
                    return None;
                }
            }
        }
    }

    /// Every frame arriving within `window`.
    pub fn collect(&mut self, window: Duration) -> Vec<Value> {
        let deadline = Instant::now() + window;
        let mut out = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.next_json(left) {
                Some(v) => out.push(v),
                None => break,
            }
        }
        out
    }

    /// Waits for the server to close; returns the close code.
    pub fn wait_closed(&mut self, timeout: Duration) -> Option<u16> {
        let deadline = Instant::now() + timeout;
        while self.closed.is_none() {
            let left = deadline.checked_duration_since(Instant::now())?;
            self.next_json(left);
        }
        self.closed.as_ref().map(|(c, _)| *c)
    }

    pub fn close(mut self) {
        let _ = self.ws.close(Some(tungstenite::protocol::CloseFrame { code: CloseCode::Normal, reason: "".into() }));
    }
}
