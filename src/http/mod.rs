//! HTTP/1.1 connections: the connection loop over the sans-IO [`codec`], our own response
//! encoder, and the limits.
//!
//! The loop owns its read buffer (instead of a framework's server codec) because the
//! WebSocket and Socket.IO upgrades need the socket and any bytes read past the request back.
//! Limits (docs/CONFIGURATION.md, "Limits"): request head ≤ 16 KiB (431), body ≤ `maxBodyBytes` (413,
//! checked from the declared length, or per chunk before the chunk is buffered), idle
//! keep-alive `httpIdleTimeout`, connections ≤ `maxConnections` for the whole process (503
//! beyond).
//!
//! **Pipelining** (RFC 9112 §9.3.2): a connection has a reader and a writer that run at the
//! same time (one task; see [`serve`]). The reader keeps reading requests while earlier
//! answers are pending, and the writer writes the answers strictly in request order, as they
//! become ready, many per write when they are. `POST /ingest` is *begun* by the reader (its
//! batch validated and handed to the owning cores, in request order) and *awaited* by the
//! writer, so a few keep-alive connections are not limited by each batch's fan-out. Any
//! other request is a barrier: it runs only once every earlier answer is written, so a read
//! pipelined after an ingest sees its messages (read-your-writes per connection), and a
//! write (a DELETE, a subscription) is never overtaken by a later request.
//!
//! Bounds and back-pressure: at most [`PIPELINE_MAX_REQUESTS`] requests, holding at most
//! [`PIPELINE_MAX_BODY_BYTES`] of bodies (one request may pass the byte bound by its own
//! body, up to `maxBodyBytes`), are read but not yet answered. At either bound the reader
//! stops reading (`hubcast_http_pipeline_pauses_total` counts it), so the socket's receive
//! buffer fills and TCP holds the client back until answers are written. `POST /ingest`
//! itself waits for room in the mesh's backlogs before it is begun, so a slow core holds
//! back the reader too. A write that makes no progress for [`write_stall_limit`] (or a flush
//! taking longer than the idle timeout) closes the connection, so a client that does not
//! read its answers cannot keep its slot. The idle timeout counts only while nothing is in
//! hand: no request being read or handled, no answer unwritten.
//!
//! An early error (413, a malformed head or body) is written, the write side shut down, and
//! the input drained for a bounded time before closing (lingering close, [`linger`]), so a
//! client still sending its body reads the answer instead of a reset.
//!
//! monoio reads are not cancel-safe: a read is only ever raced against a timeout when the
//! connection is abandoned if the timeout wins.

pub mod codec;
mod over_cap;
pub mod request;
pub mod response;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use monoio::buf::{IoBuf, SliceMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use monoio::net::{TcpListener, TcpStream};

use crate::config::MAX_REQUEST_HEAD_BYTES;
use crate::app::Core;
use crate::shutdown::Busy;
use crate::tls::{ReadHalf, Stream, WriteHalf};
use codec::{BodyError, ChunkedDecoder, Framing, HeadError};
pub use codec::RequestHead;
pub use request::Request;
pub use response::Response;

/// What the connection loop hands each request to: the REST API (`src/api`), the layer above,
/// chosen by main.rs (`http::accept_loop::<api::Rest, transport::Sockets>`). HTTP frames requests and answers
/// (and recognises upgrades); the service decides what a request means.
#[allow(async_fn_in_trait)] // one core's tasks: never sent to another thread
pub trait Service: 'static {
    /// Whether `req` is begun while earlier answers of its connection are pending
    /// (`POST /ingest`, through [`Service::begin`]); any other request waits for them.
    fn pipelines(req: &Request) -> bool;
    /// Begins a pipelined request now, in the order the connection read it; the returned
    /// future resolves with its answer.
    async fn begin(core: &Rc<Core>, req: Request) -> Pin<Box<dyn Future<Output = Response>>>;
    /// Answers a request.
    async fn handle(core: &Rc<Core>, req: Request) -> Response;
}

/// What takes a connection over when it asks for a protocol upgrade (`Upgrade: websocket`):
/// the WebSocket and Engine.IO transports (`src/transport`, `transport::Sockets`), a layer that
/// builds on this one, plugged in by main.rs (`http::accept_loop::<api::Rest, transport::Sockets>`)
/// so that HTTP names nothing above it. Static dispatch, like [`Service`]: nothing per request
/// but the header test of [`is_upgrade`].
#[allow(async_fn_in_trait)] // one core's tasks: never sent to another thread
pub trait Upgrades: 'static {
    /// What a checked upgrade asks for (which protocol), carried to [`Upgrades::upgrade`].
    type Kind;
    /// Checks an upgrade request; the error is the HTTP answer to give instead (the connection
    /// is then closed).
    fn check(head: &RequestHead) -> Result<Self::Kind, Response>;
    /// Admits a checked upgrade from `peer` (the TCP peer) or refuses it with the answer to give
    /// instead (the per-client rate limit of `admission::rate`); admitted unless overridden.
    fn admit(core: &Core, peer: Option<std::net::IpAddr>, head: &RequestHead, kind: &Self::Kind) -> Result<(), Response> {
        let _ = (core, peer, head, kind);
        Ok(())
    }
    /// Takes the connection over, once every earlier answer on it is written: the read side
    /// with any bytes read past the request, and the write side.
    async fn upgrade(core: Rc<Core>, head: RequestHead, kind: Self::Kind, framed: Framed, write: WriteHalf);
}

/// Whether a request asks for a WebSocket upgrade.
pub fn is_upgrade(head: &RequestHead) -> bool {
    head.headers
        .get(http::header::UPGRADE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"websocket"))
}

/// Most bytes asked of one read.
const READ_CHUNK: usize = 8 * 1024;
/// Lingering close ([`linger`]): the longest a connection is read and dropped after an early
/// error (nginx's `lingering_time`, 30 s there) ...
const LINGER_TIME: Duration = Duration::from_secs(5);
/// ... and the longest wait for more input meanwhile (nginx's `lingering_timeout`, 5 s there):
/// a client that stopped sending is waiting for the answer it already has.
const LINGER_IDLE: Duration = Duration::from_secs(1);
/// At most this many connections linger at once per core; beyond, a connection is closed
/// right after its answer (as before lingering existed).
const LINGER_PER_CORE: usize = 64;
/// The read buffer of a lingering connection (its input is dropped, so it need not be big):
/// with [`LINGER_PER_CORE`], at most 1 MiB per core.
const LINGER_READ: usize = 16 * 1024;
/// Answers buffered for a pipelining client before they are written.
const PIPELINE_FLUSH_BYTES: usize = 64 * 1024;
/// Requests read but not yet answered, per connection; at the bound the connection stops
/// reading. Deep enough for a few connections to keep every core busy with ingest batches.
pub const PIPELINE_MAX_REQUESTS: usize = 16;
/// Bytes of request bodies read but not yet answered, per connection; at the bound the
/// connection stops reading.
pub const PIPELINE_MAX_BODY_BYTES: usize = 1024 * 1024;

/// A write making no progress for this long closes the connection (never more than the idle
/// timeout, which also bounds a whole flush).
pub fn write_stall_limit(idle: Duration) -> Duration {
    idle.min(Duration::from_secs(10))
}

pub use crate::admission::descriptors::ConnectionSlot;

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
                        Err(BodyError::FramingTooLarge(e)) => {
                            return Err(Response::error(
                                431,
                                &format!(
                                    "chunk extensions and trailer fields count toward the request head limits ({} bytes together, lines of at most {} bytes, {} trailer fields): {e}",
                                    codec::MAX_FRAMING_BYTES,
                                    codec::MAX_CHUNK_LINE,
                                    codec::MAX_HEADERS
                                ),
                            )
                            .closing())
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
/// still sending, so it can read the answer before the close (a close with unread input
/// resets the connection, and the client's stack may drop the answer with it).
///
/// Bounds and policy: bounded by time, not bytes (a client like Python's `http.client`
/// sends its whole body, however large, before it reads the answer): at most [`LINGER_TIME`]
/// in all, and at most [`LINGER_IDLE`] without input. Concurrent lingering connections are
/// bounded per core ([`LINGER_PER_CORE`], each with a [`LINGER_READ`] buffer); beyond the
/// budget a connection is closed at once, so a flood of oversized uploads costs each core at
/// most that many sockets, that much memory, and the CPU of dropping what they send for
/// [`LINGER_TIME`].
async fn linger(framed: Framed, mut write: WriteHalf) {
    let _ = write.shutdown().await;
    let Some(_lingering) = Lingering::try_take() else {
        tracing::debug!(budget = LINGER_PER_CORE, "lingering close budget of this core used up; closing at once");
        return;
    };
    let mut io = framed.into_inner();
    let Some(deadline) = Instant::now().checked_add(LINGER_TIME) else { return };
    let mut buf = vec![0u8; LINGER_READ];
    loop {
        let left = deadline.saturating_duration_since(Instant::now()).min(LINGER_IDLE);
        // Abandoning the read on timeout is safe: the connection is closed right after.
        match monoio::time::timeout(left, io.read(buf)).await {
            Ok((Ok(n), b)) if n > 0 && Instant::now() < deadline => buf = b,
            _ => break,
        }
    }
}

thread_local! {
    /// Connections lingering on this core (one thread per core).
    static LINGERING: Cell<usize> = const { Cell::new(0) };
}

/// One of this core's [`LINGER_PER_CORE`] lingering connections; given back when dropped.
struct Lingering(());

impl Lingering {
    fn try_take() -> Option<Self> {
        LINGERING.with(|n| (n.get() < LINGER_PER_CORE).then(|| n.set(n.get() + 1))).map(|()| Self(()))
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        LINGERING.with(|n| n.set(n.get() - 1));
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

/// An answer being computed (`POST /ingest` waiting for its cores) or ready.
enum Pending {
    Ready(Answer),
    Applying(Pin<Box<dyn Future<Output = Answer>>>),
}

/// What the reader hands the writer, in request order.
enum Entry {
    /// `100 Continue` for the request being read (after every earlier answer).
    Continue,
    Answer {
        answer: Pending,
        body_bytes: usize,
        /// A request in hand until its answer is written: a graceful shutdown waits for it.
        in_hand: Busy,
    },
}

/// The state a connection's reader and writer share (one task, so plain cells).
struct Pipeline {
    entries: RefCell<VecDeque<Entry>>,
    /// Requests read whose answers are not written yet (queued, awaited or being written).
    unanswered: Cell<usize>,
    /// The bodies of those requests, in bytes.
    body_bytes: Cell<usize>,
    /// The reader holds a request it has not queued yet.
    in_hand: Cell<bool>,
    /// The reader has ended: nothing more will be queued.
    reader_done: Cell<bool>,
    /// When the reader last began waiting for a request, or answers were last written.
    last_activity: Cell<Instant>,
    reader: RefCell<Option<Waker>>,
    writer: RefCell<Option<Waker>>,
}

fn wake(slot: &RefCell<Option<Waker>>) {
    if let Some(w) = slot.borrow_mut().take() {
        w.wake();
    }
}

impl Pipeline {
    fn new() -> Self {
        Self {
            entries: RefCell::new(VecDeque::new()),
            unanswered: Cell::new(0),
            body_bytes: Cell::new(0),
            in_hand: Cell::new(false),
            reader_done: Cell::new(false),
            last_activity: Cell::new(Instant::now()),
            reader: RefCell::new(None),
            writer: RefCell::new(None),
        }
    }

    fn push(&self, entry: Entry) {
        if let Entry::Answer { body_bytes, .. } = &entry {
            self.unanswered.set(self.unanswered.get() + 1);
            self.body_bytes.set(self.body_bytes.get() + body_bytes);
            self.in_hand.set(false);
        }
        self.entries.borrow_mut().push_back(entry);
        wake(&self.writer);
    }

    fn push_ready(&self, answer: Answer, in_hand: Busy) {
        self.push(Entry::Answer { answer: Pending::Ready(answer), body_bytes: 0, in_hand });
    }

    fn finish_reading(&self) {
        self.reader_done.set(true);
        wake(&self.writer);
    }

    /// `n` answers holding `body_bytes` of requests were written.
    fn answered(&self, n: usize, body_bytes: usize) {
        self.unanswered.set(self.unanswered.get() - n);
        self.body_bytes.set(self.body_bytes.get() - body_bytes);
        self.last_activity.set(Instant::now());
        wake(&self.reader);
    }

    fn full(&self) -> bool {
        self.unanswered.get() >= PIPELINE_MAX_REQUESTS || self.body_bytes.get() >= PIPELINE_MAX_BODY_BYTES
    }

    /// The reader waits until `ready` holds (woken whenever answers are written).
    async fn reader_waits(&self, ready: impl Fn(&Self) -> bool) {
        poll_fn(|cx| {
            if ready(self) {
                return Poll::Ready(());
            }
            *self.reader.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// The next entry in request order; `None` once the reader has ended and all are taken.
    async fn next(&self) -> Option<Entry> {
        poll_fn(|cx| {
            if let Some(entry) = self.entries.borrow_mut().pop_front() {
                return Poll::Ready(Some(entry));
            }
            if self.reader_done.get() {
                return Poll::Ready(None);
            }
            *self.writer.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Resolves once the connection has been idle for `idle`: nothing in hand, no answer
    /// unwritten, and no request begun or answer written for that long.
    async fn idle_out(&self, idle: Duration) {
        loop {
            let Some(deadline) = self.last_activity.get().checked_add(idle) else { return std::future::pending().await };
            let now = Instant::now();
            if now < deadline {
                monoio::time::sleep(deadline - now).await;
            } else if self.unanswered.get() == 0 && !self.in_hand.get() {
                return;
            } else {
                // Busy (a slow handler, answers waiting for their cores): look again later.
                monoio::time::sleep(idle).await;
            }
        }
    }
}

/// Why the reader stopped.
enum ReaderEnd<K> {
    /// The client closed or went quiet, asked to close, or sent something that ends the
    /// connection (its answer is queued).
    Stopped,
    /// A WebSocket or Engine.IO upgrade, to take over once every earlier answer is written.
    Upgrade { head: Box<RequestHead>, kind: K, in_hand: Busy },
}

/// Why the writer stopped.
enum WriterEnd {
    /// Every answer is written and the reader has ended; the connection is still usable.
    Open,
    /// An answer closed the connection; `linger` if its request was not read whole.
    Closed { linger: bool },
    /// The client is gone or does not read.
    Failed,
}

/// The reader: reads requests in order, begins `POST /ingest` at once and runs any other
/// request once every earlier answer is written, and queues the answers for the writer.
async fn read_requests<S: Service, U: Upgrades>(
    core: &Rc<Core>,
    framed: &mut Framed,
    pipe: &Pipeline,
    idle: Duration,
    peer: Option<std::net::IpAddr>,
) -> ReaderEnd<U::Kind> {
    let limit = core.settings.config.max_body_bytes;
    loop {
        if pipe.full() {
            // Back-pressure: stop reading until answers are written (module docs).
            core.metrics.http_pipeline_paused();
            tracing::debug!(core = core.index, unanswered = pipe.unanswered.get(), body_bytes = pipe.body_bytes.get(), "HTTP pipeline full; reading paused");
            pipe.reader_waits(|p| !p.full()).await;
        }
        pipe.last_activity.set(Instant::now());
        let next = framed.read_head().await;
        let in_hand = core.drain.request();
        pipe.in_hand.set(true);
        let (head, framing) = match next {
            Err(ReadError::Gone) => return ReaderEnd::Stopped,
            Err(ReadError::Head(e)) => {
                pipe.push_ready(Answer::early(head_error(e)), in_hand);
                return ReaderEnd::Stopped;
            }
            Ok(request) => request,
        };
        if is_upgrade(&head) {
            match U::check(&head) {
                Ok(kind) => match U::admit(core, peer, &head, &kind) {
                    Ok(()) => return ReaderEnd::Upgrade { head: Box::new(head), kind, in_hand },
                    Err(limited) => {
                        let answer = Answer { response: limited.closing(), keep_alive: false, head_only: false, unread_input: false };
                        pipe.push_ready(answer, in_hand);
                        return ReaderEnd::Stopped;
                    }
                },
                Err(response) => {
                    let answer = Answer { response: response.closing(), keep_alive: false, head_only: false, unread_input: false };
                    pipe.push_ready(answer, in_hand);
                    return ReaderEnd::Stopped;
                }
            }
        }
        let keep_alive = wants_keep_alive(&head);
        let head_only = head.method == http::Method::HEAD;
        // Clients that wait for permission before sending a body (curl does, past 1 KiB):
        // refuse an oversized one at once, otherwise invite it.
        let refused = matches!(framing, Framing::Length(n) if n > limit);
        if expects_continue(&head) && !refused && framing != Framing::None {
            pipe.push(Entry::Continue);
        }
        let body = match monoio::time::timeout(idle, framed.read_body(framing, limit)).await {
            Ok(Ok(body)) => body,
            Err(_) => {
                pipe.push_ready(Answer::early(Response::error(408, "timed out reading the request body").closing()), in_hand);
                return ReaderEnd::Stopped;
            }
            Ok(Err(response)) => {
                pipe.push_ready(Answer::early(response), in_hand);
                return ReaderEnd::Stopped;
            }
        };
        let body_bytes = body.len();
        let request = Request {
            path: head.uri.path().to_string(),
            query: head.uri.query().map(str::to_string),
            // HEAD is answered as GET would be, without the body (RFC 9110 §9.3.2).
            method: if head_only { http::Method::GET } else { head.method },
            headers: head.headers,
            body,
            peer,
        };
        let answer = if S::pipelines(&request) {
            let applied = S::begin(core, request).await;
            Pending::Applying(Box::pin(async move {
                Answer { response: applied.await, keep_alive, head_only, unread_input: false }
            }))
        } else {
            // Read-your-writes: every earlier answer is written (so its change is applied)
            // before this request runs.
            pipe.reader_waits(|p| p.unanswered.get() == 0).await;
            let response = S::handle(core, request).await;
            Pending::Ready(Answer { response, keep_alive, head_only, unread_input: false })
        };
        pipe.push(Entry::Answer { answer, body_bytes, in_hand });
        // While shutting down, no request is read after this one (its answer closes).
        if !keep_alive || crate::shutdown::STOPPING.is_stopping() {
            return ReaderEnd::Stopped;
        }
    }
}

/// The writer: writes the answers in request order, as many per write as are ready.
async fn write_answers(core: &Rc<Core>, write: &mut WriteHalf, pipe: &Pipeline, idle: Duration) -> WriterEnd {
    let stall = write_stall_limit(idle);
    let mut out: Vec<u8> = Vec::with_capacity(4 * 1024);
    // Answers in `out`: how many, their request bodies' bytes, their in-flight guards.
    let mut buffered = (0, 0);
    let mut guards: Vec<Busy> = Vec::new();
    macro_rules! flush {
        () => {{
            match flush(write, std::mem::take(&mut out), stall, idle).await {
                Ok(buf) => out = buf,
                Err(WriteFailed::Stalled) => {
                    tracing::info!(core = core.index, ?stall, "closing an HTTP connection whose client does not read its answers");
                    return WriterEnd::Failed;
                }
                Err(WriteFailed::Io) => return WriterEnd::Failed,
            }
            pipe.answered(buffered.0, buffered.1);
            buffered = (0, 0);
            guards.clear();
        }};
    }
    loop {
        let Some(entry) = pipe.next().await else {
            // Nothing is buffered here: the last answer taken was flushed, the queue being empty.
            debug_assert!(out.is_empty());
            return WriterEnd::Open;
        };
        let (answer, body_bytes, in_hand) = match entry {
            Entry::Continue => {
                out.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
                flush!();
                continue;
            }
            Entry::Answer { answer, body_bytes, in_hand } => (answer, body_bytes, in_hand),
        };
        let answer = match answer {
            Pending::Ready(answer) => answer,
            Pending::Applying(mut applying) => match poll_fn(|cx| Poll::Ready(applying.as_mut().poll(cx))).await {
                Poll::Ready(answer) => answer,
                Poll::Pending => {
                    // Write what is ready before waiting for this one.
                    if !out.is_empty() {
                        flush!();
                    }
                    applying.await
                }
            },
        };
        // While shutting down, the last answer closes the connection (the reader queues
        // nothing after a request read while stopping; one in hand is answered first).
        let stopping = crate::shutdown::STOPPING.is_stopping() && pipe.entries.borrow().is_empty() && !pipe.in_hand.get();
        let close = !answer.keep_alive || answer.response.close || stopping;
        answer.response.encode_for(&mut out, !close, !answer.head_only);
        buffered = (buffered.0 + 1, buffered.1 + body_bytes);
        guards.push(in_hand);
        if close || out.len() >= PIPELINE_FLUSH_BYTES || pipe.entries.borrow().is_empty() {
            flush!();
        }
        if close {
            return WriterEnd::Closed { linger: answer.unread_input };
        }
    }
}

/// Serves one client connection (plain or TLS) until it closes, errs or idles out: its
/// reader and writer run together until one ends (module docs). `S` answers its requests, `U`
/// takes over an upgrade.
pub async fn serve<S: Service, U: Upgrades>(core: Rc<Core>, stream: Stream, peer: Option<std::net::IpAddr>) {
    let _ = stream.set_nodelay(true);
    let (read, mut write) = stream.into_split();
    let mut framed = Framed::new(read);
    let idle = Duration::from_secs(core.settings.config.http_idle_timeout);
    let pipe = Pipeline::new();
    let (reader_end, writer_end) = {
        let mut reader = pin!(async {
            let end = read_requests::<S, U>(&core, &mut framed, &pipe, idle, peer).await;
            pipe.finish_reading();
            end
        });
        let mut writer = pin!(write_answers(&core, &mut write, &pipe, idle));
        let mut idle_out = pin!(pipe.idle_out(idle));
        enum First<R, W> {
            Reader(R),
            Writer(W),
            Idle,
        }
        let first = poll_fn(|cx| {
            if let Poll::Ready(w) = writer.as_mut().poll(cx) {
                return Poll::Ready(First::Writer(w));
            }
            if let Poll::Ready(r) = reader.as_mut().poll(cx) {
                return Poll::Ready(First::Reader(r));
            }
            match idle_out.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(First::Idle),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        match first {
            // Everything read is answered before the connection is closed or taken over.
            First::Reader(end) => (Some(end), writer.await),
            // The writer closed or failed: a read still pending is abandoned with the
            // connection (monoio reads are not cancel-safe, and nothing more is read).
            First::Writer(end) => (None, end),
            First::Idle => return,
        }
    };
    match (reader_end, writer_end) {
        (Some(ReaderEnd::Upgrade { head, kind, in_hand }), WriterEnd::Open) => {
            U::upgrade(core, *head, kind, framed, write).await;
            drop(in_hand);
        }
        (_, WriterEnd::Closed { linger: true }) => linger(framed, write).await,
        _ => {}
    }
}

/// Accepts connections on this core's listener, within the process-wide connection cap
/// (`admission::descriptors`: what happens at it and when accept fails); `S` answers their
/// requests, `U` takes over their upgrades (WebSocket, Engine.IO).
pub async fn accept_loop<S: Service, U: Upgrades>(core: Rc<Core>, listener: Rc<TcpListener>) {
    let cap = crate::admission::descriptors::connection_cap(&core.settings.config);
    let mut errors = crate::admission::descriptors::AcceptErrors::new(core.index);
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let Some(slot) = ConnectionSlot::try_acquire(cap) else {
                    monoio::spawn(over_cap::answer::<S>(core.clone(), stream, peer.ip()));
                    continue;
                };
                let core = core.clone();
                monoio::spawn(async move {
                    if let Some(stream) = handshake(&core, stream).await {
                        serve::<S, U>(core, stream, Some(peer.ip())).await;
                    }
                    drop(slot);
                });
            }
            Err(_) if crate::shutdown::STOPPING.is_stopping() => return, // listener shut down
            Err(e) => {
                if errors.failed(&e) {
                    // Out of descriptors, the spare given up: the waiting connection is taken
                    // and closed at once rather than left in the backlog.
                    if let Ok((stream, _)) = listener.accept().await {
                        drop(stream);
                    }
                    errors.restore_spare();
                } else {
                    // Back off instead of spinning.
                    monoio::time::sleep(Duration::from_millis(20)).await;
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_the_budget_of_connections_linger_per_core() {
        let taken: Vec<Lingering> = (0..LINGER_PER_CORE).map_while(|_| Lingering::try_take()).collect();
        assert_eq!(taken.len(), LINGER_PER_CORE);
        assert!(Lingering::try_take().is_none(), "one past the budget");
        drop(taken);
        let again = Lingering::try_take();
        assert!(again.is_some(), "the budget comes back when they end");
        // Another core (thread) has its own budget.
        let held: Vec<Lingering> = (0..LINGER_PER_CORE - 1).map_while(|_| Lingering::try_take()).collect();
        assert!(std::thread::spawn(|| Lingering::try_take().is_some()).join().unwrap());
        drop(held);
    }
}
