//! HTTP/1.1 connections: monoio-http's request-head and chunked-body decoders over a
//! monoio-codec framed reader, our own response encoder, and the limits.
//!
//! We drive monoio-http's decoders ourselves instead of its `ServerCodec` because the
//! WebSocket and Socket.IO upgrades need the socket and any bytes read past the request
//! back, which `ServerCodec` cannot give. Limits: request head ≤ 16 KiB (431), body ≤
//! `maxBodyBytes` (413, checked before reading it), idle keep-alive `httpIdleTimeout`,
//! connections ≤ `maxConnections` (503 beyond).
//!
//! monoio reads are not cancel-safe: a read is only ever raced against a timeout when the
//! connection is abandoned if the timeout wins.

pub mod request;
pub mod response;

use std::rc::Rc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use monoio::io::{AsyncWriteRentExt, OwnedReadHalf, Splitable};
use monoio::io::stream::Stream;
use monoio::net::{TcpListener, TcpStream};
use monoio_codec::{Decoded, Decoder, FramedRead};
use monoio_http::common::request::RequestHead;
use monoio_http::h1::codec::decoder::{ChunkedBodyDecoder, DecodeError, RequestHeadDecoder};

use crate::config::MAX_REQUEST_HEAD_BYTES;
use crate::runtime::Core;
pub use request::Request;
pub use response::Response;

/// Why a request could not be read.
#[derive(Debug)]
pub enum ReadError {
    HeadTooLarge,
    Malformed(String),
    Io,
}

impl From<DecodeError> for ReadError {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::Io(_) | DecodeError::UnexpectedEof => ReadError::Io,
            e => ReadError::Malformed(e.to_string()),
        }
    }
}

impl From<std::io::Error> for ReadError {
    fn from(_: std::io::Error) -> Self {
        ReadError::Io
    }
}

/// monoio-http's request-head decoder with a cap on how much it may buffer.
#[derive(Default)]
pub struct HeadDecoder(RequestHeadDecoder);

impl Decoder for HeadDecoder {
    type Item = RequestHead;
    type Error = ReadError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Decoded<RequestHead>, ReadError> {
        // The head must end within the limit, however many bytes one read brought in.
        if src.len() > MAX_REQUEST_HEAD_BYTES {
            let window = &src[..src.len().min(MAX_REQUEST_HEAD_BYTES + 4)];
            if memchr::memmem::find(window, b"\r\n\r\n").is_none() {
                return Err(ReadError::HeadTooLarge);
            }
        }
        match self.0.decode(src)? {
            Decoded::Some(head) => Ok(Decoded::Some(head)),
            Decoded::Insufficient => Ok(Decoded::Insufficient),
            Decoded::InsufficientAtLeast(n) => Ok(Decoded::InsufficientAtLeast(n)),
        }
    }
}

/// A body of known length (monoio-http keeps its own fixed-length decoder private).
struct FixedBody(usize);

impl Decoder for FixedBody {
    type Item = Bytes;
    type Error = ReadError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Decoded<Bytes>, ReadError> {
        if src.len() < self.0 {
            return Ok(Decoded::InsufficientAtLeast(self.0 - src.len()));
        }
        Ok(Decoded::Some(src.split_to(self.0).freeze()))
    }
}

pub type Framed = FramedRead<OwnedReadHalf<TcpStream>, HeadDecoder>;

enum BodyLength {
    None,
    Fixed(usize),
    Chunked,
}

fn body_length(head: &RequestHead) -> Result<BodyLength, Response> {
    if let Some(te) = head.headers.get(http::header::TRANSFER_ENCODING) {
        if te.as_bytes().eq_ignore_ascii_case(b"chunked") {
            return Ok(BodyLength::Chunked);
        }
        return Err(Response::error(400, "unsupported transfer-encoding").closing());
    }
    match head.headers.get(http::header::CONTENT_LENGTH) {
        None => Ok(BodyLength::None),
        Some(v) => match v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()) {
            Some(0) => Ok(BodyLength::None),
            Some(n) => Ok(BodyLength::Fixed(n)),
            None => Err(Response::error(400, "invalid content-length header").closing()),
        },
    }
}

fn too_large(limit: usize) -> Response {
    Response::error(413, &format!("request body exceeds the limit of {limit} bytes (maxBodyBytes)")).closing()
}

/// Reads the whole body, refusing more than `limit` bytes.
async fn read_body(framed: &mut Framed, head: &RequestHead, limit: usize) -> Result<Bytes, Response> {
    let io_error = || Response::error(400, "connection closed while reading the request body").closing();
    match body_length(head)? {
        BodyLength::None => Ok(Bytes::new()),
        BodyLength::Fixed(n) if n > limit => Err(too_large(limit)),
        BodyLength::Fixed(n) => match framed.next_with(&mut FixedBody(n)).await {
            Some(Ok(body)) => Ok(body),
            _ => Err(io_error()),
        },
        BodyLength::Chunked => {
            let mut decoder = ChunkedBodyDecoder::default();
            let mut body = BytesMut::new();
            loop {
                match framed.next_with(&mut decoder).await {
                    Some(Ok(Some(chunk))) => {
                        if body.len() + chunk.len() > limit {
                            return Err(too_large(limit));
                        }
                        body.extend_from_slice(&chunk);
                    }
                    Some(Ok(None)) => return Ok(body.freeze()),
                    Some(Err(DecodeError::Chunked)) => {
                        return Err(Response::error(400, "malformed chunked body").closing())
                    }
                    _ => return Err(io_error()),
                }
            }
        }
    }
}

fn expects_continue(head: &RequestHead) -> bool {
    head.headers.get(http::header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

fn wants_keep_alive(head: &RequestHead) -> bool {
    let connection = head.headers.get(http::header::CONNECTION).map(|v| v.as_bytes().to_ascii_lowercase());
    match head.version {
        http::Version::HTTP_10 => connection.as_deref() == Some(b"keep-alive"),
        _ => connection.as_deref() != Some(b"close"),
    }
}

/// Whether the buffered input already holds the next request's head, so its answer can
/// share one write with this one (pipelining).
fn next_request_buffered(framed: &Framed) -> bool {
    memchr::memmem::find(framed.read_buffer(), b"\r\n\r\n").is_some()
}

/// Serves one client connection until it closes, errs or idles out.
pub async fn serve(core: Rc<Core>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let (read, mut write) = stream.into_split();
    let mut framed: Framed = FramedRead::with_capacity(read, HeadDecoder::default(), 8 * 1024);
    let idle = Duration::from_secs(core.settings.config.http_idle_timeout);
    let limit = core.settings.config.max_body_bytes as usize;
    let mut out: Vec<u8> = Vec::with_capacity(4 * 1024);
    loop {
        let next = monoio::time::timeout(idle, framed.next()).await;
        // A request in hand until its answer is written: a graceful shutdown waits for it.
        let _in_hand = core.drain.request();
        let (response, keep_alive) = match next {
            Err(_) | Ok(None) | Ok(Some(Err(ReadError::Io))) => break,
            Ok(Some(Err(ReadError::HeadTooLarge))) => (
                Response::error(431, &format!("request head exceeds {MAX_REQUEST_HEAD_BYTES} bytes")).closing(),
                false,
            ),
            Ok(Some(Err(ReadError::Malformed(e)))) => {
                (Response::error(400, &format!("malformed HTTP request: {e}")).closing(), false)
            }
            Ok(Some(Ok(head))) if crate::transport::is_upgrade(&head) => {
                match crate::transport::check_upgrade(&head) {
                    Ok(kind) => {
                        if !out.is_empty() {
                            let (result, _) = write.write_all(std::mem::take(&mut out)).await;
                            if result.is_err() {
                                return;
                            }
                        }
                        crate::transport::upgrade(core, head, kind, framed, write).await;
                        return;
                    }
                    Err(response) => (response.closing(), false),
                }
            }
            Ok(Some(Ok(head))) => {
                let keep_alive = wants_keep_alive(&head);
                // Clients that wait for permission before sending a body (curl does, past 1 KiB):
                // refuse an oversized one at once, otherwise invite it.
                if expects_continue(&head) {
                    if let Ok(BodyLength::Fixed(n)) = body_length(&head) {
                        if n > limit {
                            let response = too_large(limit);
                            response.encode(&mut out, false);
                            let _ = write.write_all(out).await;
                            return;
                        }
                    }
                    out.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
                    let (result, buf) = write.write_all(std::mem::take(&mut out)).await;
                    out = buf;
                    out.clear();
                    if result.is_err() {
                        break;
                    }
                }
                match monoio::time::timeout(idle, read_body(&mut framed, &head, limit)).await {
                    Err(_) => (Response::error(408, "timed out reading the request body").closing(), false),
                    Ok(Err(response)) => (response, false),
                    Ok(Ok(body)) => {
                        let request = Request {
                            path: head.uri.path().to_string(),
                            query: head.uri.query().map(str::to_string),
                            method: head.method,
                            headers: head.headers,
                            body,
                        };
                        (crate::api::handle(&core, request).await, keep_alive)
                    }
                }
            }
        };
        // While shutting down, each connection gets one last answer.
        let keep_alive = keep_alive && !crate::shutdown::STOPPING.is_stopping();
        let close = !keep_alive || response.close;
        response.encode(&mut out, keep_alive);
        if close || out.len() >= 64 * 1024 || !next_request_buffered(&framed) {
            let (result, buf) = write.write_all(out).await;
            out = buf;
            out.clear();
            if result.is_err() {
                break;
            }
        }
        if close {
            break;
        }
    }
    if !out.is_empty() {
        let _ = write.write_all(out).await;
    }
}

/// Decrements the core's connection count when a connection ends.
struct ConnectionSlot(Rc<Core>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.connections.set(self.0.connections.get() - 1);
    }
}

/// Accepts connections on this core's listener, within this core's share of the limit.
pub async fn accept_loop(core: Rc<Core>, listener: Rc<TcpListener>) {
    let cap = (core.settings.config.max_connections as usize).div_ceil(core.cores());
    loop {
        match listener.accept().await {
            Ok((stream, _peer)) => {
                if core.connections.get() >= cap {
                    tracing::warn!(core = core.index, cap, "connection limit reached; refusing a connection");
                    monoio::spawn(refuse(stream));
                    continue;
                }
                core.connections.set(core.connections.get() + 1);
                let slot = ConnectionSlot(core.clone());
                monoio::spawn(async move {
                    serve(slot.0.clone(), stream).await;
                    drop(slot);
                });
            }
            Err(_) if crate::shutdown::STOPPING.is_stopping() => return, // listener shut down
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                monoio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

async fn refuse(mut stream: TcpStream) {
    let mut out = Vec::new();
    Response::error(503, "connection limit reached (maxConnections)").closing().encode(&mut out, false);
    let _ = stream.write_all(out).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(input: &[u8]) -> Result<Decoded<RequestHead>, ReadError> {
        HeadDecoder::default().decode(&mut BytesMut::from(input))
    }

    #[test]
    fn a_head_followed_by_a_body_is_decoded_whatever_the_buffer_length() {
        let head = b"POST /ingest HTTP/1.1\r\nhost: x\r\ncontent-length: 20000\r\n\r\n";
        for extra in [0, MAX_REQUEST_HEAD_BYTES - head.len(), MAX_REQUEST_HEAD_BYTES - head.len() + 1,
                      MAX_REQUEST_HEAD_BYTES - head.len() + 3, MAX_REQUEST_HEAD_BYTES - head.len() + 4, 20000] {
            let mut input = head.to_vec();
            input.extend(std::iter::repeat_n(b'x', extra));
            assert!(matches!(decode(&input), Ok(Decoded::Some(_))), "buffer of {} bytes", input.len());
        }
    }

    #[test]
    fn a_head_that_does_not_end_within_the_limit_is_refused_at_every_length() {
        for len in [MAX_REQUEST_HEAD_BYTES + 1, MAX_REQUEST_HEAD_BYTES + 3, MAX_REQUEST_HEAD_BYTES + 4, 40000] {
            let mut input = b"GET / HTTP/1.1\r\nx-long: ".to_vec();
            input.resize(len, b'a');
            assert!(matches!(decode(&input), Err(ReadError::HeadTooLarge)), "{len} bytes");
        }
    }
}
