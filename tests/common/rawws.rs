//! A raw WebSocket client for hostile-client tests: exact bytes in, exact frames out (a real
//! client library would refuse to send what these tests send).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::Server;

/// How long reads wait for a frame.
pub const WAIT: Duration = Duration::from_secs(5);

/// A valid `Sec-WebSocket-Key` (RFC 6455's example).
pub const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

/// Sends an upgrade request with `key` (None: no header); returns the stream and the status.
pub fn raw_upgrade(server: &Server, path: &str, key: Option<&str>) -> (TcpStream, u16) {
    let mut stream = server.connect();
    let key_header = key.map(|k| format!("Sec-WebSocket-Key: {k}\r\n")).unwrap_or_default();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n{key_header}Sec-WebSocket-Version: 13\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    if status != 101 {
        // Read the rest of the answer so a 400 body does not look like frames.
        let _ = stream.set_read_timeout(Some(Duration::from_millis(300)));
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
    }
    (stream, status)
}

/// One masked client frame.
pub fn client_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mask = [0x12, 0x34, 0x56, 0x78];
    let mut frame = vec![0x80 | opcode];
    match payload.len() {
        n if n < 126 => frame.push(0x80 | n as u8),
        n if n <= 0xffff => {
            frame.push(0x80 | 126);
            frame.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            frame.push(0x80 | 127);
            frame.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    frame.extend_from_slice(&mask);
    frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i & 3]));
    frame
}

/// A server frame: opcode and payload; `None` on EOF, reset or timeout.
pub fn read_frame(stream: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut head = [0u8; 2];
    stream.read_exact(&mut head).ok()?;
    let len = match head[1] & 0x7f {
        126 => {
            let mut b = [0u8; 2];
            stream.read_exact(&mut b).ok()?;
            u16::from_be_bytes(b) as usize
        }
        127 => {
            let mut b = [0u8; 8];
            stream.read_exact(&mut b).ok()?;
            u64::from_be_bytes(b) as usize
        }
        n => n as usize,
    };
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload).ok()?;
    Some((head[0] & 0x0f, payload))
}

/// Reads frames until a close frame; returns its code (`None`: the connection ended without one).
pub fn close_code(stream: &mut TcpStream) -> Option<u16> {
    stream.set_read_timeout(Some(WAIT)).unwrap();
    while let Some((opcode, payload)) = read_frame(stream) {
        if opcode == 0x8 {
            return Some(u16::from_be_bytes([payload[0], payload[1]]));
        }
    }
    None
}

/// Reads text frames until one satisfies `pred`.
pub fn text_until(stream: &mut TcpStream, pred: impl Fn(&str) -> bool) -> String {
    stream.set_read_timeout(Some(WAIT)).unwrap();
    loop {
        let (opcode, payload) = read_frame(stream).expect("a frame");
        let text = String::from_utf8_lossy(&payload).to_string();
        if opcode == 0x1 && pred(&text) {
            return text;
        }
        assert_ne!(opcode, 0x8, "closed while waiting: {payload:?}");
    }
}

/// Writes `frame` again and again without reading, until a write fails (the server closed)
/// or `limit` bytes went out; returns the bytes written.
pub fn flood(stream: &mut TcpStream, frame: &[u8], limit: usize) -> usize {
    stream.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut sent = 0;
    while sent < limit {
        match stream.write_all(frame) {
            Ok(()) => sent += frame.len(),
            Err(_) => break,
        }
    }
    sent
}


/// A Socket.IO WebSocket connected to `session` (open packet read, CONNECT answered).
pub fn socketio_connected(server: &Server, session: &str) -> TcpStream {
    let (mut stream, status) =
        raw_upgrade(server, &format!("/socket.io/?EIO=4&transport=websocket&sessionId={session}"), Some(KEY));
    assert_eq!(status, 101);
    text_until(&mut stream, |t| t.starts_with('0'));
    stream.write_all(&client_frame(0x1, b"40")).unwrap();
    text_until(&mut stream, |t| t.starts_with("40"));
    stream
}

/// An Engine.IO ping of `n` bytes from a client (never valid in Engine.IO 4): the frame of
/// issue 9's A2.
pub fn big_client_ping(n: usize) -> Vec<u8> {
    client_frame(0x1, format!("2{}", "x".repeat(n)).as_bytes())
}
