//! A minimal WebSocket client (RFC 6455) and the Engine.IO v4 / Socket.IO handshake on top.
//!
//! One task owns one socket: it reads, hands every complete frame of a read to a callback,
//! and writes the few frames a client sends (Socket.IO `40`, Engine.IO pongs `3`, WebSocket
//! pongs) itself, after the read. Server frames are unmasked; ours are masked. Messages are
//! never fragmented by hubcast, so continuation frames are not reassembled.

use std::io;
use std::net::SocketAddr;

use base64::Engine as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

pub const OP_TEXT: u8 = 0x1;
pub const OP_BINARY: u8 = 0x2;
pub const OP_CLOSE: u8 = 0x8;
pub const OP_PING: u8 = 0x9;
pub const OP_PONG: u8 = 0xA;

/// Which live transport a client speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Plain WebSocket at `/ws?sessionId=…`: one text frame per envelope.
    Ws,
    /// Plain WebSocket with batched frames, `/ws?sessionId=…&batch=1`: each text frame is a
    /// JSON array of the envelopes hubcast had queued for the socket when it wrote.
    #[value(name = "ws-batch")]
    #[serde(rename = "ws-batch")]
    WsBatch,
    /// Plain WebSocket with recovery offsets, `/ws?sessionId=…&offsets=1`: one text frame per
    /// envelope, each with its `"offset"` first; hubcast keeps the session's recovery history
    /// (needs `--recovery-window` > 0). What recovery costs plain WebSocket clients.
    #[value(name = "ws-offsets")]
    #[serde(rename = "ws-offsets")]
    WsOffsets,
    /// Socket.IO v4 over WebSocket at `/socket.io/?EIO=4&transport=websocket&sessionId=…`.
    Socketio,
}

impl Transport {
    pub fn path(self, session: &str) -> String {
        match self {
            Transport::Ws => format!("/ws?sessionId={session}"),
            Transport::WsBatch => format!("/ws?sessionId={session}&batch=1"),
            Transport::WsOffsets => format!("/ws?sessionId={session}&offsets=1"),
            Transport::Socketio => format!("/socket.io/?EIO=4&transport=websocket&sessionId={session}"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Transport::Ws => "ws",
            Transport::WsBatch => "ws-batch",
            Transport::WsOffsets => "ws-offsets",
            Transport::Socketio => "socketio",
        }
    }
}

/// One client WebSocket (`S`: the whole stream, or its read half after [`WsClient::split`]).
pub struct WsClient<S = TcpStream> {
    stream: S,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// Header of a frame at the start of `bytes`: (fin, opcode, header length, payload length).
pub fn parse_header(bytes: &[u8]) -> Option<(bool, u8, usize, usize)> {
    if bytes.len() < 2 {
        return None;
    }
    let fin = bytes[0] & 0x80 != 0;
    let opcode = bytes[0] & 0x0F;
    let masked = bytes[1] & 0x80 != 0;
    let (len, mut head) = match bytes[1] & 0x7F {
        126 => {
            if bytes.len() < 4 {
                return None;
            }
            (u16::from_be_bytes([bytes[2], bytes[3]]) as usize, 4)
        }
        127 => {
            if bytes.len() < 10 {
                return None;
            }
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[2..10]);
            (u64::from_be_bytes(b) as usize, 10)
        }
        n => (n as usize, 2),
    };
    if masked {
        head += 4; // servers do not mask; tolerate it in the length anyway
    }
    Some((fin, opcode, head, len))
}

/// A masked client frame.
pub fn client_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 14);
    push_client_frame(&mut out, opcode, payload);
    out
}

/// Appends a masked client frame of `payload` to `out` (the mask applied four bytes at a time:
/// a publisher masks every byte it sends).
pub fn push_client_frame(out: &mut Vec<u8>, opcode: u8, payload: &[u8]) {
    out.push(0x80 | opcode);
    match payload.len() {
        n if n < 126 => out.push(0x80 | n as u8),
        n if n <= u16::MAX as usize => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    let mask = fastrand::u32(..).to_be_bytes();
    out.extend_from_slice(&mask);
    let word = u32::from_ne_bytes(mask);
    let mut chunks = payload.chunks_exact(4);
    for c in &mut chunks {
        let v = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]) ^ word;
        out.extend_from_slice(&v.to_ne_bytes());
    }
    out.extend(chunks.remainder().iter().enumerate().map(|(i, b)| b ^ mask[i]));
}

impl WsClient {
    /// Connects and upgrades `path`; `buf` is the initial read buffer size (it grows for a
    /// frame that does not fit).
    pub async fn connect(addr: SocketAddr, path: &str, buf: usize) -> io::Result<Self> {
        Self::connect_with(addr, path, buf, None).await
    }

    /// [`WsClient::connect`] asking for a subprotocol (`Sec-WebSocket-Protocol`, e.g. `mqtt`).
    pub async fn connect_with(addr: SocketAddr, path: &str, buf: usize, protocol: Option<&str>) -> io::Result<Self> {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let key = base64::engine::general_purpose::STANDARD.encode(fastrand::u128(..).to_be_bytes());
        let protocol = protocol.map_or_else(String::new, |p| format!("sec-websocket-protocol: {p}\r\n"));
        let request = format!(
            "GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
             sec-websocket-key: {key}\r\nsec-websocket-version: 13\r\n{protocol}\r\n"
        );
        stream.write_all(request.as_bytes()).await?;
        let mut head = vec![0u8; 1024];
        let mut filled = 0;
        loop {
            let n = stream.read(&mut head[filled..]).await?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed during the WebSocket handshake"));
            }
            filled += n;
            let mut headers = [httparse::EMPTY_HEADER; 16];
            let mut resp = httparse::Response::new(&mut headers);
            match resp.parse(&head[..filled]) {
                Ok(httparse::Status::Complete(len)) => {
                    if resp.code != Some(101) {
                        let body = String::from_utf8_lossy(&head[len..filled]).into_owned();
                        return Err(io::Error::other(format!("upgrade refused: {} {body}", resp.code.unwrap_or(0))));
                    }
                    let want = tungstenite::handshake::derive_accept_key(key.as_bytes());
                    let ok = resp
                        .headers
                        .iter()
                        .any(|h| h.name.eq_ignore_ascii_case("sec-websocket-accept") && h.value == want.as_bytes());
                    if !ok {
                        return Err(io::Error::other("wrong Sec-WebSocket-Accept"));
                    }
                    let mut buf = vec![0u8; buf.max(filled - len).max(64)];
                    buf[..filled - len].copy_from_slice(&head[len..filled]);
                    return Ok(Self { stream, buf, start: 0, end: filled - len });
                }
                Ok(httparse::Status::Partial) if filled < head.len() => continue,
                Ok(httparse::Status::Partial) => return Err(io::Error::other("handshake response head too large")),
                Err(e) => return Err(io::Error::other(format!("bad handshake response: {e}"))),
            }
        }
    }

    /// The read side (frames already buffered kept) and the write half, for a client that
    /// reads and writes at the same time (a publisher reading its flow-control answers).
    pub fn split(self) -> (WsClient<OwnedReadHalf>, OwnedWriteHalf) {
        let (read, write) = self.stream.into_split();
        (WsClient { stream: read, buf: self.buf, start: self.start, end: self.end }, write)
    }
}

impl<S: AsyncRead + Unpin> WsClient<S> {
    /// Hands every complete buffered frame to `f(opcode, payload)`; reads once more when none
    /// is buffered. Returns false when the server closed the connection.
    pub async fn read_frames(&mut self, mut f: impl FnMut(u8, &[u8])) -> io::Result<bool> {
        loop {
            let mut any = false;
            while let Some((_fin, opcode, head, len)) = parse_header(&self.buf[self.start..self.end]) {
                let total = head + len;
                if self.end - self.start < total {
                    if total > self.buf.len() {
                        // The frame does not fit: move it to the front of a larger buffer.
                        self.buf.copy_within(self.start..self.end, 0);
                        self.end -= self.start;
                        self.start = 0;
                        self.buf.resize(total.next_power_of_two(), 0);
                    }
                    break;
                }
                f(opcode, &self.buf[self.start + head..self.start + total]);
                self.start += total;
                any = true;
            }
            if self.start == self.end {
                self.start = 0;
                self.end = 0;
            }
            if any {
                return Ok(true);
            }
            if self.end == self.buf.len() {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
                if self.end == self.buf.len() {
                    let n = self.buf.len() * 2;
                    self.buf.resize(n, 0);
                }
            }
            let n = self.stream.read(&mut self.buf[self.end..]).await?;
            if n == 0 {
                return Ok(false);
            }
            self.end += n;
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> WsClient<S> {
    /// Reads until one text frame arrives (answering pings meanwhile) and returns it.
    pub async fn next_text(&mut self) -> io::Result<String> {
        loop {
            let mut text = None;
            let mut pings = Vec::new();
            let open = self
                .read_frames(|op, payload| match op {
                    OP_TEXT if text.is_none() => text = Some(String::from_utf8_lossy(payload).into_owned()),
                    OP_PING => pings.push(payload.to_vec()),
                    _ => {}
                })
                .await?;
            for p in pings {
                self.send(OP_PONG, &p).await?;
            }
            if let Some(t) = text {
                return Ok(t);
            }
            if !open {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before a text frame"));
            }
        }
    }

    pub async fn send(&mut self, opcode: u8, payload: &[u8]) -> io::Result<()> {
        self.stream.write_all(&client_frame(opcode, payload)).await
    }

    /// Socket.IO: reads the Engine.IO open packet, sends CONNECT (`40`), waits for the ack.
    pub async fn socketio_handshake(&mut self) -> io::Result<()> {
        let open = self.next_text().await?;
        if !open.starts_with("0{") {
            return Err(io::Error::other(format!("expected an Engine.IO open packet, got {open:?}")));
        }
        self.send(OP_TEXT, b"40").await?;
        loop {
            let reply = self.next_text().await?;
            if reply.starts_with("40") {
                return Ok(());
            }
            if reply.starts_with("44") {
                return Err(io::Error::other(format!("Socket.IO connect refused: {reply}")));
            }
            if reply == "2" {
                self.send(OP_TEXT, b"3").await?;
            }
        }
    }
}

const SENT_AT: &[u8] = b"\"sentAt\":";

/// The `sentAt` number (µs) in a message, if any.
pub fn sent_at(payload: &[u8]) -> Option<u64> {
    let at = memchr::memmem::find(payload, SENT_AT)? + SENT_AT.len();
    number_at(payload, at)
}

/// A batched frame (`[env1,env2,…]`): how many envelopes it holds (each begins with
/// `{"deviceId":`, which the fleet's telemetry never contains) and each `sentAt` in it.
pub fn batched(payload: &[u8], mut sent: impl FnMut(u64)) -> u64 {
    for at in memchr::memmem::find_iter(payload, SENT_AT) {
        if let Some(t) = number_at(payload, at + SENT_AT.len()) {
            sent(t);
        }
    }
    memchr::memmem::find_iter(payload, b"{\"deviceId\":").count() as u64
}

/// The unsigned integer at `at` (spaces before it skipped), if any.
fn number_at(payload: &[u8], at: usize) -> Option<u64> {
    let mut v: u64 = 0;
    let mut digits = 0;
    for &b in payload[at..].iter().skip_while(|b| **b == b' ') {
        if !b.is_ascii_digit() {
            break;
        }
        v = v * 10 + u64::from(b - b'0');
        digits += 1;
    }
    (digits > 0).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_of_short_medium_and_long_frames() {
        assert_eq!(parse_header(&[0x81, 5]), Some((true, OP_TEXT, 2, 5)));
        assert_eq!(parse_header(&[0x81, 126, 1, 0]), Some((true, OP_TEXT, 4, 256)));
        assert_eq!(parse_header(&[0x82, 127, 0, 0, 0, 0, 0, 1, 0, 0]), Some((true, OP_BINARY, 10, 65536)));
        assert_eq!(parse_header(&[0x81]), None);
        assert_eq!(parse_header(&[0x81, 126, 1]), None);
    }

    #[test]
    fn client_frames_are_masked_and_unmask_to_the_payload() {
        let f = client_frame(OP_TEXT, b"40");
        assert_eq!(f[0], 0x81);
        assert_eq!(f[1], 0x80 | 2);
        let mask = &f[2..6];
        let payload: Vec<u8> = f[6..].iter().enumerate().map(|(i, b)| b ^ mask[i % 4]).collect();
        assert_eq!(payload, b"40");
    }

    #[test]
    fn sent_at_is_read_from_an_envelope() {
        let m = br#"42["data",{"deviceId":"d","timestamp":"x","telemetry":{"sentAt":1732300000123456,"seq":3}}]"#;
        assert_eq!(sent_at(m), Some(1_732_300_000_123_456));
        assert_eq!(sent_at(b"{\"telemetry\":{\"t\":1}}"), None);
    }

    #[test]
    fn a_batched_frame_gives_its_envelope_count_and_every_sent_at() {
        let m = br#"[{"deviceId":"a","timestamp":"x","telemetry":{"sentAt":5,"seq":1}},{"deviceId":"b","timestamp":"x","telemetry":{"t":1}},{"deviceId":"c","timestamp":"x","telemetry":{"sentAt": 7}}]"#;
        let mut sent = Vec::new();
        assert_eq!(batched(m, |t| sent.push(t)), 3);
        assert_eq!(sent, [5, 7]);
    }
}
