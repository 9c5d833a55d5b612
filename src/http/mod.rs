//! HTTP/1.1 connections: the connection loop over the sans-IO [`codec`], our own response
//! encoder, and the limits.
//!
//! The loop owns its read buffer (instead of a framework's server codec) because the
//! WebSocket and Socket.IO upgrades need the socket and any bytes read past the request back.
//! Limits (README, "Limits"): request head ≤ 16 KiB (431), body ≤ `maxBodyBytes` (413,
//! checked from the declared length, or per chunk before the chunk is buffered), idle
//! keep-alive `httpIdleTimeout`, connections ≤ `maxConnections` for the whole process (503
//! beyond).
//!
//! Input is read only while a request is incomplete, so a pipelining client is held back by
//! TCP once its answers stop being read; a write that makes no progress for
//! [`write_stall_limit`] (or a flush taking longer than the idle timeout) closes the
//! connection, so such a client cannot keep its slot.
//!
//! An early error (413, a malformed head or body) is written, the write side shut down, and
//! the input drained for a bounded time before closing (lingering close), so a client still
//! sending its body reads the answer instead of a reset.
//!
//! monoio reads are not cancel-safe: a read is only ever raced against a timeout when the
//! connection is abandoned if the timeout wins.

pub mod codec;
pub mod request;
pub mod response;

use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use monoio::buf::{IoBuf, SliceMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use monoio::net::{TcpListener, TcpStream};

use crate::config::MAX_REQUEST_HEAD_BYTES;
use crate::runtime::Core;
use crate::tls::{ReadHalf, Stream, WriteHalf};
use codec::{BodyError, ChunkedDecoder, Framing, HeadError};
pub use codec::RequestHead;
pub use request::Request;
pub use response::Response;

/// Most bytes asked of one read.
const READ_CHUNK: usize = 8 * 1024;
/// Lingering close: how long, and how many bytes, are read and dropped after an early error.
const LINGER_TIME: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 8 * 1024 * 1024;
/// Answers buffered for a pipelining client before they are written.
const PIPELINE_FLUSH_BYTES: usize = 64 * 1024;

/// A write making no progress for this long closes the connection (never more than the idle
/// timeout, which also bounds a whole flush).
pub fn write_stall_limit(idle: Duration) -> Duration {
    idle.min(Duration::from_secs(10))
}

/// Open client connections of the whole process (HTTP and live sockets), against
/// `maxConnections`. One atomic touched at accept and close only, never per message.
static OPEN_CONNECTIONS: AtomicUsize = AtomicUsize::new(0);

/// One counted connection; the count goes down when it is dropped, whatever path ends it.
#[must_use]
pub struct ConnectionSlot(());

impl ConnectionSlot {
    /// Takes a slot if fewer than `max` connections are open.
    pub fn try_acquire(max: usize) -> Option<Self> {
        OPEN_CONNECTIONS
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| Self(()))
    }

    /// Counts a connection accepted before (a socket taken over after its upgrade).
    pub fn acquire() -> Self {
        OPEN_CONNECTIONS.fetch_add(1, Ordering::AcqRel);
        Self(())
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        OPEN_CONNECTIONS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The read side of a connection and the bytes read but not used yet.
pub struct Framed {
    io: ReadHalf,
    buf: BytesMut,
}

/// Why no request could be read.
enum ReadError {
    /// The client closed, the read failed, or it stopped sending (no answer is due).
    Gone,
    Head(HeadError),
}

impl Framed {
    fn new(io: ReadHalf) -> Self {
        Self { io, buf: BytesMut::with_capacity(READ_CHUNK) }
    }

    /// Bytes read past what was used (the start of the next request, or WebSocket frames).
    pub fn read_buffer(&self) -> &[u8] {
        &self.buf
    }

    pub fn into_inner(self) -> ReadHalf {
        self.io
    }

    /// Reads more input after what is buffered; `Ok(0)` at end of input.
    async fn fill(&mut self, want: usize) -> std::io::Result<usize> {
        self.buf.reserve(want.clamp(READ_CHUNK, 1 << 20));
        let (len, cap) = (self.buf.len(), self.buf.capacity());
        // SAFETY: `len..cap` is the buffer's spare capacity; the read initialises what it
        // fills and extends the buffer's length over exactly that (`SliceMut::set_init`).
        let slice = unsafe { SliceMut::new_unchecked(std::mem::take(&mut self.buf), len, cap) };
        let (result, slice) = self.io.read(slice).await;
        self.buf = slice.into_inner();
        result
    }

    fn skip_empty_lines(&mut self) {
        let n = codec::leading_empty_lines(&self.buf);
        let _ = self.buf.split_to(n);
    }

    async fn read_head(&mut self) -> Result<(RequestHead, Framing), ReadError> {
        loop {
            self.skip_empty_lines();
            if let Some((head, framing, n)) = codec::parse_head(&self.buf).map_err(ReadError::Head)? {
                let _ = self.buf.split_to(n);
                return Ok((head, framing));
            }
            match self.fill(READ_CHUNK).await {
                Ok(0) | Err(_) => return Err(ReadError::Gone),
                Ok(_) => {}
            }
        }
    }

    /// Whether the next request's head is already here (its answer can then share one write
    /// with this one).
    fn next_request_buffered(&mut self) -> bool {
        self.skip_empty_lines();
        !matches!(codec::parse_head(&self.buf), Ok(None))
    }

    /// Reads a body of the given framing, within `limit` bytes.
    async fn read_body(&mut self, framing: Framing, limit: u64) -> Result<Bytes, Response> {
        let gone = || Response::error(400, "connection closed while reading the request body").closing();
        match framing {
            Framing::None => Ok(Bytes::new()),
            Framing::Length(n) if n > limit => Err(too_large(limit)),
            Framing::Length(n) => {
                let n = n as usize;
                while self.buf.len() < n {
                    match self.fill(n - self.buf.len()).await {
                        Ok(0) | Err(_) => return Err(gone()),
                        Ok(_) => {}
                    }
                }
                Ok(self.buf.split_to(n).freeze())
            }
            Framing::Chunked => {
                let mut decoder = ChunkedDecoder::new(limit);
                let mut body = BytesMut::new();
                loop {
                    match decoder.decode(&mut self.buf, &mut body) {
                        Ok(true) => return Ok(body.freeze()),
                        Ok(false) => {}
                        Err(BodyError::TooLarge) => return Err(too_large(limit)),
                        Err(BodyError::Malformed(e)) => {
                            return Err(Response::error(400, &format!("malformed chunked body: {e}")).closing())
                        }
                    }
                    match self.fill(READ_CHUNK).await {
                        Ok(0) | Err(_) => return Err(gone()),
                        Ok(_) => {}
                    }
                }
            }
        }
    }
}

fn too_large(limit: u64) -> Response {
    Response::error(413, &format!("request body exceeds the limit of {limit} bytes (maxBodyBytes)")).closing()
}

fn head_error(e: HeadError) -> Response {
    match e {
        HeadError::TooLarge => Response::error(
            431,
            &format!("request head exceeds {MAX_REQUEST_HEAD_BYTES} bytes or {} fields", codec::MAX_HEADERS),
        ),
        HeadError::Malformed(e) => Response::error(400, &format!("malformed HTTP request: {e}")),
        HeadError::NotImplemented(e) => Response::error(501, &e),
    }
    .closing()
}

fn expects_continue(head: &RequestHead) -> bool {
    head.headers.get(http::header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// Whether `Connection` lists `token`.
fn connection_has(head: &RequestHead, token: &[u8]) -> bool {
    head.headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

fn wants_keep_alive(head: &RequestHead) -> bool {
    match head.version {
        http::Version::HTTP_10 => connection_has(head, b"keep-alive"),
        _ => !connection_has(head, b"close"),
    }
}

/// Why answers could not be written.
enum WriteFailed {
    Io,
    Stalled,
}

/// Writes `out` whole; a write without progress for `stall`, or a flush longer than `total`,
/// fails. Gives the buffer back (cleared) for reuse.
async fn flush(write: &mut WriteHalf, out: Vec<u8>, stall: Duration, total: Duration) -> Result<Vec<u8>, WriteFailed> {
    let deadline = Instant::now().checked_add(total);
    let mut out = out;
    let mut pos = 0;
    while pos < out.len() {
        let left = deadline.map_or(stall, |d| d.saturating_duration_since(Instant::now()).min(stall));
        // Abandoning the write on timeout is safe: the connection is dropped with it.
        match monoio::time::timeout(left, write.write(out.slice(pos..))).await {
            Err(_) => return Err(WriteFailed::Stalled),
            Ok((Ok(0) | Err(_), _)) => return Err(WriteFailed::Io),
            Ok((Ok(n), slice)) => {
                out = slice.into_inner();
                pos += n;
            }
        }
    }
    out.clear();
    Ok(out)
}

/// Lingering close: the answer is out; stop writing, then read and drop what the client is
/// still sending, for a bounded time and size, so it can read the answer before the close.
async fn linger(framed: Framed, mut write: WriteHalf) {
    let _ = write.shutdown().await;
    let mut io = framed.into_inner();
    let Some(deadline) = Instant::now().checked_add(LINGER_TIME) else { return };
    let mut buf = vec![0u8; 64 * 1024];
    let mut drained = 0;
    while drained < LINGER_BYTES {
        let left = deadline.saturating_duration_since(Instant::now());
        // Abandoning the read on timeout is safe: the connection is closed right after.
        match monoio::time::timeout(left, io.read(buf)).await {
            Ok((Ok(n), b)) if n > 0 => {
                buf = b;
                drained += n;
            }
            _ => break,
        }
    }
}

/// What to write for one request, and what becomes of the connection after it.
struct Answer {
    response: Response,
    keep_alive: bool,
    /// The answer to a HEAD request: written without its body.
    head_only: bool,
    /// The request (or its body) was not read whole: linger before closing.
    unread_input: bool,
}

impl Answer {
    /// An error found while reading the request: answered, then the connection closes.
    fn early(response: Response) -> Self {
        Self { response, keep_alive: false, head_only: false, unread_input: true }
    }
}

/// Serves one client connection (plain or TLS) until it closes, errs or idles out.
pub async fn serve(core: Rc<Core>, stream: Stream) {
    let _ = stream.set_nodelay(true);
    let (read, mut write) = stream.into_split();
    let mut framed = Framed::new(read);
    let idle = Duration::from_secs(core.settings.config.http_idle_timeout);
    let stall = write_stall_limit(idle);
    let limit = core.settings.config.max_body_bytes;
    let mut out: Vec<u8> = Vec::with_capacity(4 * 1024);
    loop {
        let next = monoio::time::timeout(idle, framed.read_head()).await;
        // A request in hand until its answer is written: a graceful shutdown waits for it.
        let _in_hand = core.drain.request();
        let answer = match next {
            Err(_) | Ok(Err(ReadError::Gone)) => break,
            Ok(Err(ReadError::Head(e))) => Answer::early(head_error(e)),
            Ok(Ok((head, _))) if crate::transport::is_upgrade(&head) => match crate::transport::check_upgrade(&head) {
                Ok(kind) => {
                    if !out.is_empty() && flush(&mut write, std::mem::take(&mut out), stall, idle).await.is_err() {
                        return;
                    }
                    crate::transport::upgrade(core, head, kind, framed, write).await;
                    return;
                }
                Err(response) => Answer { response: response.closing(), keep_alive: false, head_only: false, unread_input: false },
            },
            Ok(Ok((head, framing))) => {
                let keep_alive = wants_keep_alive(&head);
                let head_only = head.method == http::Method::HEAD;
                // Clients that wait for permission before sending a body (curl does, past 1 KiB):
                // refuse an oversized one at once, otherwise invite it.
                let refused = matches!(framing, Framing::Length(n) if n > limit);
                if expects_continue(&head) && !refused && framing != Framing::None {
                    out.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
                    match flush(&mut write, std::mem::take(&mut out), stall, idle).await {
                        Ok(buf) => out = buf,
                        Err(_) => break,
                    }
                }
                match monoio::time::timeout(idle, framed.read_body(framing, limit)).await {
                    Err(_) => Answer::early(Response::error(408, "timed out reading the request body").closing()),
                    Ok(Err(response)) => Answer::early(response),
                    Ok(Ok(body)) => {
                        let request = Request {
                            path: head.uri.path().to_string(),
                            query: head.uri.query().map(str::to_string),
                            // HEAD is answered as GET would be, without the body (RFC 9110 §9.3.2).
                            method: if head_only { http::Method::GET } else { head.method },
                            headers: head.headers,
                            body,
                        };
                        let response = crate::api::handle(&core, request).await;
                        Answer { response, keep_alive, head_only, unread_input: false }
                    }
                }
            }
        };
        // While shutting down, each connection gets one last answer.
        let keep_alive = answer.keep_alive && !crate::shutdown::STOPPING.is_stopping();
        let close = !keep_alive || answer.response.close;
        answer.response.encode_for(&mut out, keep_alive, !answer.head_only);
        if close || out.len() >= PIPELINE_FLUSH_BYTES || !framed.next_request_buffered() {
            match flush(&mut write, std::mem::take(&mut out), stall, idle).await {
                Ok(buf) => out = buf,
                Err(WriteFailed::Stalled) => {
                    tracing::info!(core = core.index, ?stall, "closing an HTTP connection whose client does not read its answers");
                    return;
                }
                Err(WriteFailed::Io) => return,
            }
        }
        if close {
            if answer.unread_input {
                linger(framed, write).await;
            }
            return;
        }
    }
    if !out.is_empty() {
        let _ = flush(&mut write, out, stall, idle).await;
    }
}

/// Accepts connections on this core's listener, within the process-wide limit.
pub async fn accept_loop(core: Rc<Core>, listener: Rc<TcpListener>) {
    let cap = core.settings.config.max_connections as usize;
    loop {
        match listener.accept().await {
            Ok((stream, _peer)) => {
                let Some(slot) = ConnectionSlot::try_acquire(cap) else {
                    tracing::warn!(core = core.index, cap, "connection limit reached; refusing a connection");
                    monoio::spawn(refuse(stream));
                    continue;
                };
                let core = core.clone();
                monoio::spawn(async move {
                    if let Some(stream) = handshake(&core, stream).await {
                        serve(core, stream).await;
                    }
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

/// The TLS handshake when TLS is on (bounded by the idle timeout; the connection is dropped
/// when it fails or takes longer).
async fn handshake(core: &Core, stream: TcpStream) -> Option<Stream> {
    let Some(config) = crate::tls::server_config() else { return Some(Stream::Plain(stream)) };
    let idle = Duration::from_secs(core.settings.config.http_idle_timeout);
    // Abandoning the handshake on timeout is safe: the connection is dropped with it.
    match monoio::time::timeout(idle, crate::tls::stream::accept(stream, config)).await {
        Ok(Ok(stream)) => Some(stream),
        Ok(Err(e)) => {
            tracing::debug!(core = core.index, error = %e, "TLS handshake failed");
            None
        }
        Err(_) => None,
    }
}

/// Answers 503 to a connection over the limit (plain HTTP only: over TLS it is closed at
/// once, since a handshake is the expensive part the limit protects against).
async fn refuse(stream: TcpStream) {
    if crate::tls::enabled() {
        return;
    }
    let mut out = Vec::new();
    Response::error(503, "connection limit reached (maxConnections)").closing().encode(&mut out, false);
    let (_, mut write) = Stream::Plain(stream).into_split();
    let _ = flush(&mut write, out, Duration::from_secs(1), Duration::from_secs(1)).await;
}
