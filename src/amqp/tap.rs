//! A frame tap under fe2o3-amqp: device messages read from the wire, not decoded by fe2o3.
//!
//! fe2o3's receiver decodes every message whole (annotations into maps of `Value`s) and moves
//! the large `Delivery` and `Message` values through its tasks: most of the AMQP thread's CPU
//! (docs/BENCHMARKS.md, "AMQP ingest with a sender that is not the bottleneck"). fe2o3 stays
//! an unpatched dependency, so instead [`Tap`] sits between fe2o3 and the socket (TCP or
//! TLS): writes pass through untouched; reads are parsed frame by frame (AMQP 1.0 §2.3),
//! whatever way the bytes are split. A `transfer` of the tapped session that carries a whole
//! message in one frame (`more`, `aborted`, `resume` false, message format 0, a delivery id
//! and a tag of at most [`MAX_TAG`] bytes, the usual encodings) has its payload (the message
//! sections) moved to the connection's side table ([`TapHandle`]), keyed by delivery id, and
//! the frame is rewritten with one empty `Data` section ([`STUB`]) and its size corrected.
//! fe2o3 keeps every piece of protocol state (windows, credit, delivery ids, settlement) and
//! decodes a 5-byte message; the partition task then takes the payload by the delivery's id
//! ([`TapHandle::take`], checked against the tag) and reads it with [`super::encoded`].
//!
//! Everything else passes through unchanged: protocol headers, SASL frames, other
//! performatives, transfers of other sessions (`$cbs` and `$management` replies), multi-frame
//! transfers (all their frames), anything unusual. A transfer performative the tap cannot
//! parse at all turns the tap off for the rest of the connection (fe2o3 sees the raw bytes
//! and judges them). So correctness never depends on the tap: a delivery without a tapped
//! payload is one fe2o3 decoded whole, and is mapped from that as before.
//!
//! **Key.** Delivery ids are numbered per session (§2.6.12), and only one session is tapped:
//! the one whose `begin` arrives next after [`TapHandle::arm`] (hubcast begins its receivers'
//! session right after arming; the control session, begun before, is never tapped). Within a
//! session no two unsettled deliveries share an id, and every tapped delivery is taken (or the
//! connection, and with it the table, is dropped) before its id could come round again
//! (2^32 deliveries later). The tag is kept with the payload and compared when taken: a
//! mismatch means a bug, and is treated as a delivery without a tapped payload.
//!
//! **Threads and locks.** The tap runs inside fe2o3's connection task, the partitions in
//! their own tasks, all on the AMQP thread's current-thread runtime: the table's `Mutex` is
//! never contended (fe2o3 needs its stream `Send`, hence not a `RefCell`).
//!
//! **Bound and back-pressure.** The table holds at most `count` payloads (set by
//! [`TapHandle::arm`]: the receivers' link credit in total, plus [`MARGIN`]) and
//! [`MAX_BYTES`] bytes. Link credit already bounds what is in flight, so the table is full
//! only if the partitions stopped taking payloads; then the tap passes transfers through
//! unchanged (fe2o3 decodes them, holding them as it always did) instead of growing. Payloads
//! of a link that detaches are freed when its `detach` passes; the whole table dies with the
//! connection.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::reader::Reader;

/// What a tapped transfer carries instead of its message: one `Data` section, empty.
pub const STUB: [u8; 5] = [0x00, 0x53, 0x75, 0xa0, 0x00];
/// Longest delivery tag kept inline (Event Hubs' are 16 bytes); a longer one passes through.
pub const MAX_TAG: usize = 32;
/// Payloads held beyond the link credit of every tapped link (slack for the order in which
/// fe2o3 grants credit and the partitions take payloads).
pub const MARGIN: usize = 256;
/// Most payload bytes held at once; beyond, transfers pass through (see the module docs).
pub const MAX_BYTES: usize = 64 << 20;
/// Largest frame the tap buffers whole to look at (the connection's `max-frame-size` is 64 KiB);
/// a larger one passes through as it streams in.
const MAX_INSPECT: usize = 1 << 20;
/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 64 * 1024;

const BEGIN: u8 = 0x11;
const TRANSFER: u8 = 0x14;
const DETACH: u8 = 0x16;
const END: u8 = 0x17;

struct Entry {
    handle: u32,
    tag: [u8; MAX_TAG],
    tag_len: u8,
    payload: Bytes,
}

/// Hashes a delivery id with one multiplication (Fibonacci hashing): ids are sequential and
/// chosen by the peer per session, and SipHash cost ~3 % of the AMQP thread in a profile.
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, id: u32) {
        self.0 = u64::from(id).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type IdMap = HashMap<u32, Entry, std::hash::BuildHasherDefault<IdHasher>>;

#[derive(Default)]
struct Table {
    entries: IdMap,
    bytes: usize,
    max_count: usize,
    /// The next `begin` received names the tapped session.
    armed: bool,
    /// The tapped session's channel (as the peer numbers its frames).
    channel: Option<u16>,
    /// Transfers passed through because the table was full.
    passed_full: u64,
}

impl Table {
    fn remove(&mut self, id: u32) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        self.bytes -= e.payload.len();
        Some(e)
    }
}

/// The side table of one connection, shared by its [`Tap`] and its partition tasks.
#[derive(Clone, Default)]
pub struct TapHandle(Arc<Mutex<Table>>);

impl TapHandle {
    pub fn new() -> Self {
        Self::default()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Taps the session whose `begin` the peer sends next, holding at most `credit + MARGIN`
    /// payloads (`credit`: the link credit of all its receivers together).
    pub fn arm(&self, credit: usize) {
        let mut t = self.table();
        t.armed = true;
        t.max_count = credit.saturating_add(MARGIN);
    }

    /// The payload of delivery `id` of the tapped session if the tap took it from the wire
    /// (and its tag is `tag`); `None`: fe2o3 received the message whole.
    pub fn take(&self, id: u32, tag: &[u8]) -> Option<Bytes> {
        let mut t = self.table();
        let e = t.remove(id)?;
        if &e.tag[..usize::from(e.tag_len)] != tag {
            tracing::error!(delivery_id = id, "AMQP tap: a tapped payload's tag does not match its delivery; dropped");
            return None;
        }
        Some(e.payload)
    }

    /// Payloads held now (tests, and a check that nothing stays behind).
    pub fn held(&self) -> usize {
        self.table().entries.len()
    }

    /// Transfers passed through because the table was full.
    pub fn passed_full(&self) -> u64 {
        self.table().passed_full
    }
}

enum Mode {
    /// At a frame boundary (or a protocol header).
    Frame,
    /// This many more bytes of the current frame pass through unchanged.
    Pass(usize),
    /// Everything passes through unchanged (the stream could not be followed).
    Off,
}

/// The socket as fe2o3 sees it (see the module docs).
pub struct Tap<S> {
    inner: S,
    handle: TapHandle,
    /// Read from the socket, not yet looked at. Bounded without a check of its own: the tap
    /// reads the socket only when fe2o3 has taken all of `out` (fe2o3's reads pace the
    /// socket, so a fast peer waits in the kernel, not here), and a frame is held whole only
    /// up to [`MAX_INSPECT`] (a larger one streams through): at most one such frame plus one
    /// [`READ_CHUNK`]. `out` holds what one read yielded; `continuing` one entry per link.
    raw: BytesMut,
    /// What one socket read fills (then appended to `raw`).
    scratch: Box<[u8]>,
    /// Ready for fe2o3.
    out: BytesMut,
    mode: Mode,
    eof: bool,
    /// (channel, handle) of links in the middle of a multi-frame transfer.
    continuing: Vec<(u16, u32)>,
}

impl<S> Tap<S> {
    pub fn new(inner: S, handle: TapHandle) -> Self {
        Tap { inner, handle, raw: BytesMut::new(), scratch: vec![0; READ_CHUNK].into_boxed_slice(), out: BytesMut::new(), mode: Mode::Frame, eof: false, continuing: Vec::new() }
    }

    /// Moves what can be decided from `raw` to `out` (and payloads to the table).
    fn process(&mut self) {
        loop {
            match self.mode {
                Mode::Off => {
                    let n = self.raw.len();
                    self.out.extend_from_slice(&self.raw.split_to(n));
                    return;
                }
                Mode::Pass(left) => {
                    let n = left.min(self.raw.len());
                    if n == 0 && left > 0 {
                        return;
                    }
                    self.out.extend_from_slice(&self.raw.split_to(n));
                    self.mode = if left == n { Mode::Frame } else { Mode::Pass(left - n) };
                    if left > n {
                        return;
                    }
                }
                Mode::Frame => {
                    if self.raw.len() < 8 {
                        return;
                    }
                    if &self.raw[..4] == b"AMQP" {
                        self.mode = Mode::Pass(8);
                        continue;
                    }
                    let size = u32::from_be_bytes([self.raw[0], self.raw[1], self.raw[2], self.raw[3]]) as usize;
                    let doff = usize::from(self.raw[4]) * 4;
                    if size < 8 || doff < 8 || doff > size {
                        self.mode = Mode::Off;
                        continue;
                    }
                    if self.raw[5] != 0 || size > MAX_INSPECT || size == doff {
                        // SASL, oversized (fe2o3 refuses it), or an empty (heartbeat) frame.
                        self.mode = Mode::Pass(size);
                        continue;
                    }
                    if self.raw.len() < size {
                        return;
                    }
                    let frame = self.raw.split_to(size);
                    self.frame(&frame, doff);
                }
            }
        }
    }

    /// One whole AMQP frame with a body: to `out` as it is, or tapped.
    fn frame(&mut self, frame: &[u8], doff: usize) {
        let channel = u16::from_be_bytes([frame[6], frame[7]]);
        let body = &frame[doff..];
        let code = match body {
            [0x00, 0x53, code, ..] => *code,
            _ => {
                self.out.extend_from_slice(frame);
                return;
            }
        };
        match code {
            TRANSFER => {
                if let Some(len) = self.transfer(frame, doff, channel) {
                    // Tapped: header, performative, then the stub.
                    let end = doff + len;
                    self.out.put_u32((end + STUB.len()) as u32);
                    self.out.extend_from_slice(&frame[4..end]);
                    self.out.extend_from_slice(&STUB);
                    return;
                }
            }
            BEGIN => {
                let mut t = self.handle.table();
                if t.armed {
                    t.armed = false;
                    t.channel = Some(channel);
                }
            }
            DETACH => {
                let mut t = self.handle.table();
                if t.channel == Some(channel) {
                    if let Some(handle) = first_uint(&body[3..]) {
                        let gone: Vec<u32> = t.entries.iter().filter(|(_, e)| e.handle == handle).map(|(id, _)| *id).collect();
                        for id in gone {
                            t.remove(id);
                        }
                    }
                }
                self.continuing.retain(|c| c.0 != channel || Some(c.1) != first_uint(&body[3..]));
            }
            END => {
                let mut t = self.handle.table();
                if t.channel == Some(channel) {
                    t.channel = None;
                    t.entries.clear();
                    t.bytes = 0;
                }
                self.continuing.retain(|c| c.0 != channel);
            }
            _ => {}
        }
        self.out.extend_from_slice(frame);
    }

    /// Looks at a transfer; `Some(performative length)` if its payload went to the table.
    fn transfer(&mut self, frame: &[u8], doff: usize, channel: u16) -> Option<usize> {
        let Some(t) = parse_transfer(&frame[doff..]) else {
            // Cannot follow multi-frame deliveries past a transfer not understood: off.
            tracing::debug!(channel, "AMQP tap: a transfer performative not understood; tap off for this connection");
            self.mode = Mode::Off;
            return None;
        };
        let key = (channel, t.handle);
        let was_continuing = self.continuing.contains(&key);
        if t.more && !t.aborted {
            if !was_continuing {
                self.continuing.push(key);
            }
        } else if was_continuing {
            self.continuing.retain(|c| *c != key);
        }
        let mut table = self.handle.table();
        if table.channel != Some(channel) {
            return None;
        }
        let payload = &frame[doff + t.len..];
        let tappable = !was_continuing && !t.more && !t.aborted && !t.resume && t.format_zero && !payload.is_empty();
        let (Some(id), Some(tag)) = (t.delivery_id, t.tag.filter(|_| tappable)) else {
            // Passed through: no payload of an earlier delivery with this id may stay.
            if let Some(id) = t.delivery_id {
                table.remove(id);
            }
            return None;
        };
        if table.entries.len() >= table.max_count || table.bytes + payload.len() > MAX_BYTES {
            table.remove(id);
            table.passed_full += 1;
            return None;
        }
        let mut entry = Entry { handle: t.handle, tag: [0; MAX_TAG], tag_len: tag.len() as u8, payload: Bytes::copy_from_slice(payload) };
        entry.tag[..tag.len()].copy_from_slice(tag);
        table.bytes += payload.len();
        // An earlier payload with this id (never taken) is replaced.
        if let Some(old) = table.entries.insert(id, entry) {
            table.bytes -= old.payload.len();
        }
        Some(t.len)
    }
}

/// The parts of a `transfer` performative (§2.7.5) the tap needs.
#[derive(Debug, PartialEq)]
struct TransferHead<'a> {
    /// Bytes of the performative (descriptor and list).
    len: usize,
    handle: u32,
    delivery_id: Option<u32>,
    /// `None` also when longer than [`MAX_TAG`].
    tag: Option<&'a [u8]>,
    /// Message format absent or 0 (a plain AMQP message).
    format_zero: bool,
    more: bool,
    resume: bool,
    aborted: bool,
}

/// Reads a transfer performative by hand; `None` if its encoding is not one this reads.
fn parse_transfer(body: &[u8]) -> Option<TransferHead<'_>> {
    if body.get(..3)? != [0x00, 0x53, TRANSFER] {
        return None;
    }
    let (start, size, count) = match *body.get(3)? {
        0xc0 => (6usize, usize::from(*body.get(4)?).checked_sub(1)?, usize::from(*body.get(5)?)),
        0xd0 => {
            let size = u32::from_be_bytes(body.get(4..8)?.try_into().ok()?) as usize;
            let count = u32::from_be_bytes(body.get(8..12)?.try_into().ok()?) as usize;
            (12, size.checked_sub(4)?, count)
        }
        _ => return None,
    };
    if count == 0 || count > 11 {
        return None;
    }
    let end = start.checked_add(size)?;
    let list = body.get(start..end)?;
    let mut r = Reader::new(list);
    let mut head = TransferHead { len: end, handle: 0, delivery_id: None, tag: None, format_zero: true, more: false, resume: false, aborted: false };
    for i in 0..count {
        match i {
            0 => head.handle = r.uint()??,
            1 => head.delivery_id = r.uint()?,
            2 => {
                head.tag = match r.u8()? {
                    0x40 => None,
                    0xa0 => {
                        let n = usize::from(r.u8()?);
                        Some(r.take(n)?)
                    }
                    0xb0 => {
                        let n = u32::from_be_bytes(r.take(4)?.try_into().ok()?) as usize;
                        Some(r.take(n)?)
                    }
                    _ => return None,
                }
                .filter(|t| t.len() <= MAX_TAG)
            }
            3 => head.format_zero = r.uint()?.unwrap_or(0) == 0,
            5 => head.more = r.bool()?,
            8 => head.resume = r.bool()?,
            9 => head.aborted = r.bool()?,
            // settled, rcv-settle-mode, state, batchable: not needed, skipped.
            _ => {
                r.skip(0)?;
            }
        }
    }
    (r.pos == list.len()).then_some(head)
}

/// The first field of a performative's list if it is a uint (a `detach`'s handle).
fn first_uint(list: &[u8]) -> Option<u32> {
    let skip = match *list.first()? {
        0xc0 => 3,
        0xd0 => 9,
        _ => return None,
    };
    Reader::new(list.get(skip..)?).uint()?
}


// fe2o3 wants its stream `Debug`.
impl<S> std::fmt::Debug for Tap<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap").field("buffered", &self.raw.len()).field("ready", &self.out.len()).finish_non_exhaustive()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tap<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.out.is_empty() {
                let n = this.out.len().min(buf.remaining());
                buf.put_slice(&this.out[..n]);
                this.out.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // A partial frame at the end goes to fe2o3 as it is (it reports the cut).
                let n = this.raw.len();
                this.out.extend_from_slice(&this.raw.split_to(n));
                if this.out.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let read = {
                let mut rb = ReadBuf::new(&mut this.scratch[..]);
                match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                    Poll::Ready(Ok(())) => rb.filled().len(),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            };
            this.raw.extend_from_slice(&this.scratch[..read]);
            if read == 0 {
                this.eof = true;
            } else {
                this.process();
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tap<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fe2o3_amqp::types::definitions::Handle;
    use fe2o3_amqp::types::performatives::{Begin, Detach, Flow, Transfer};
    use fe2o3_amqp::types::primitives::Binary;
    use tokio::io::AsyncReadExt;

    /// A socket that hands its bytes over `chunk` at a time.
    struct Chunks {
        bytes: Vec<u8>,
        pos: usize,
        chunk: usize,
    }

    impl AsyncRead for Chunks {
        fn poll_read(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
            let n = self.chunk.min(self.bytes.len() - self.pos).min(buf.remaining());
            let pos = self.pos;
            buf.put_slice(&self.bytes[pos..pos + n]);
            self.pos += n;
            Poll::Ready(Ok(()))
        }
    }

    fn frame(kind: u8, channel: u16, body: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&((8 + body.len()) as u32).to_be_bytes());
        f.extend_from_slice(&[2, kind]);
        f.extend_from_slice(&channel.to_be_bytes());
        f.extend_from_slice(body);
        f
    }

    fn transfer(handle: u32, id: Option<u32>, tag: &[u8], more: bool) -> Transfer {
        Transfer {
            handle: Handle(handle),
            delivery_id: id,
            delivery_tag: id.map(|_| Binary::from(tag.to_vec())),
            message_format: Some(0),
            settled: Some(false),
            more,
            rcv_settle_mode: None,
            state: None,
            resume: false,
            aborted: false,
            batchable: false,
        }
    }

    fn amqp(performative: &impl serde::Serialize, payload: &[u8], channel: u16) -> Vec<u8> {
        let mut body = serde_amqp::to_vec(performative).unwrap();
        body.extend_from_slice(payload);
        frame(0, channel, &body)
    }

    fn message(n: u8) -> Vec<u8> {
        // An application-properties-less message: annotations then a Data body.
        let mut m = vec![0x00, 0x53, 0x72, 0xc1, 0x0a, 0x02, 0xa3, 0x01, b'k', 0xa1, 0x04, b'v', b'a', b'l', n];
        m.extend_from_slice(&[0x00, 0x53, 0x75, 0xa0, 0x03, b'{', n, b'}']);
        m
    }

    /// Runs `input` through a tap in reads of `chunk` bytes; what fe2o3 reads.
    fn through(input: &[u8], chunk: usize, handle: &TapHandle) -> Vec<u8> {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let mut tap = Tap::new(Chunks { bytes: input.to_vec(), pos: 0, chunk }, handle.clone());
        let mut out = Vec::new();
        rt.block_on(tap.read_to_end(&mut out)).unwrap();
        out
    }

    fn begin() -> Begin {
        Begin { remote_channel: Some(1), next_outgoing_id: 0, incoming_window: 100, outgoing_window: 100, handle_max: Handle(u32::MAX), offered_capabilities: None, desired_capabilities: None, properties: None }
    }

    fn flow() -> Flow {
        Flow {
            next_incoming_id: Some(0),
            incoming_window: 100,
            next_outgoing_id: 0,
            outgoing_window: 100,
            handle: Some(Handle(0)),
            delivery_count: Some(0),
            link_credit: Some(300),
            available: None,
            drain: false,
            echo: false,
            properties: None,
        }
    }

    /// A recorded-like session: headers, SASL, begin of an untapped and a tapped session, a
    /// flow, transfers (single-frame, multi-frame, on the untapped session), a heartbeat.
    fn stream() -> (Vec<u8>, Vec<u8>) {
        let mut input = b"AMQP\x03\x01\x00\x00".to_vec();
        let mut expected = input.clone();
        let mut both = |i: &[u8], e: &[u8]| {
            input.extend_from_slice(i);
            expected.extend_from_slice(e);
        };
        let sasl = frame(1, 0, &[0x00, 0x53, 0x40, 0xc0, 0x03, 0x01, 0xe0, 0x00]);
        both(&sasl, &sasl);
        both(b"AMQP\x00\x01\x00\x00", b"AMQP\x00\x01\x00\x00");
        // The control session (channel 0 of the peer) begins before arming: never tapped.
        let b0 = amqp(&begin(), &[], 0);
        both(&b0, &b0);
        let control = amqp(&transfer(0, Some(0), b"c", false), &message(9), 0);
        both(&control, &control);
        (input, expected)
    }

    /// What follows [`stream`] once armed: the receivers' session.
    fn tapped_stream() -> (Vec<u8>, Vec<u8>) {
        let (mut input, mut expected) = (Vec::new(), Vec::new());
        let mut both = |i: &[u8], e: &[u8]| {
            input.extend_from_slice(i);
            expected.extend_from_slice(e);
        };
        // (arm happens here, see the tests) The receivers' session is the peer's channel 3.
        let b = amqp(&begin(), &[], 3);
        both(&b, &b);
        let f = amqp(&flow(), &[], 3);
        both(&f, &f);
        both(&frame(0, 3, &[]), &frame(0, 3, &[])); // heartbeat
        for id in 0..5u32 {
            let t = transfer(id % 2, Some(id), &id.to_be_bytes(), false);
            both(&amqp(&t, &message(id as u8), 3), &amqp(&t, &STUB, 3));
        }
        // A message in two frames passes through, both frames.
        let first = amqp(&transfer(1, Some(5), b"five", true), &message(5)[..6], 3);
        let mut t2 = transfer(1, None, b"", false);
        t2.delivery_tag = None;
        let second = amqp(&t2, &message(5)[6..], 3);
        both(&first, &first);
        both(&second, &second);
        // An aborted transfer, a resumed one, a tag longer than MAX_TAG, another message format.
        let mut aborted = transfer(0, Some(6), b"six", false);
        aborted.aborted = true;
        let mut resumed = transfer(0, Some(7), b"seven", false);
        resumed.resume = true;
        let long_tag = transfer(0, Some(8), &[7; 40], false);
        let mut format = transfer(0, Some(9), b"nine", false);
        format.message_format = Some(1);
        for t in [aborted, resumed, long_tag, format] {
            let f = amqp(&t, &message(6), 3);
            both(&f, &f);
        }
        let t = transfer(0, Some(10), b"ten", false);
        both(&amqp(&t, &message(10), 3), &amqp(&t, &STUB, 3));
        (input, expected)
    }

    #[test]
    fn fe2o3_sees_the_same_frames_but_tapped_payloads_in_every_split() {
        let (head, head_expected) = stream();
        let (rest, rest_expected) = tapped_stream();
        for chunk in [1, 2, 3, 7, 8, 9, 13, 64, 100, 1000, 1 << 20] {
            // Armed as hubcast does: after the control session began, before the receivers'
            // session's begin is sent (so before the peer's answer can arrive).
            let handle = TapHandle::new();
            assert!(through(&head, chunk, &handle) == head_expected, "chunk {chunk}");
            handle.arm(10);
            assert!(through(&rest, chunk, &handle) == rest_expected, "chunk {chunk}");
            for id in [0u32, 1, 2, 3, 4] {
                assert_eq!(handle.take(id, &id.to_be_bytes()).as_deref(), Some(&message(id as u8)[..]), "chunk {chunk} id {id}");
            }
            assert_eq!(handle.take(10, b"ten").as_deref(), Some(&message(10)[..]));
            assert_eq!(handle.take(5, b"five"), None, "multi-frame: fe2o3 decodes it");
            assert_eq!(handle.held(), 0);
        }
    }

    #[test]
    fn nothing_is_tapped_unless_armed_and_a_wrong_tag_is_no_match() {
        let (mut all, _) = stream();
        all.extend(tapped_stream().0);
        let handle = TapHandle::new();
        assert!(through(&all, 5, &handle) == all, "not armed: all bytes pass unchanged");
        assert_eq!(handle.held(), 0);

        let handle = TapHandle::new();
        handle.arm(10);
        // Armed from the start: the control session (channel 0) is the tapped one here.
        let (input, _) = stream();
        let out = through(&input, 3, &handle);
        assert_ne!(out, input);
        assert_eq!(handle.take(0, b"other tag"), None);
        assert_eq!(handle.held(), 0);
    }

    #[test]
    fn a_full_table_passes_transfers_through_and_a_detach_frees_its_link() {
        let handle = TapHandle::new();
        handle.arm(0);
        let mut input = amqp(&begin(), &[], 3);
        let mut expected = input.clone();
        // MARGIN payloads fit; the next ones pass through unchanged.
        for id in 0..(MARGIN as u32 + 3) {
            let t = transfer(id % 2, Some(id), &id.to_be_bytes(), false);
            input.extend(amqp(&t, &message(1), 3));
            expected.extend(if (id as usize) < MARGIN { amqp(&t, &STUB, 3) } else { amqp(&t, &message(1), 3) });
        }
        let out = through(&input, 64, &handle);
        assert!(out == expected);
        assert_eq!(handle.held(), MARGIN);
        assert_eq!(handle.passed_full(), 3);
        // A detach of link 1 frees its payloads (the odd ids).
        let detach = Detach { handle: Handle(1), closed: true, error: None };
        let frame = amqp(&detach, &[], 3);
        assert_eq!(through(&frame, 4, &handle), frame);
        assert_eq!(handle.held(), MARGIN / 2);
        assert!(handle.take(1, &1u32.to_be_bytes()).is_none());
        assert!(handle.take(2, &2u32.to_be_bytes()).is_some());
    }

    #[test]
    fn transfer_encodings_the_tap_does_not_read_pass_through_or_turn_it_off() {
        // The hand reader reads what fe2o3 writes, in both list widths.
        let t = transfer(70_000, Some(u32::MAX), &[1; 16], false);
        let encoded = serde_amqp::to_vec(&t).unwrap();
        let head = parse_transfer(&encoded).unwrap();
        assert_eq!((head.len, head.handle, head.delivery_id, head.tag), (encoded.len(), 70_000, Some(u32::MAX), Some(&[1u8; 16][..])));
        let mut wide = transfer(1, Some(2), &[3; 300], true);
        wide.rcv_settle_mode = Some(fe2o3_amqp::types::definitions::ReceiverSettleMode::Second);
        wide.state = Some(fe2o3_amqp::types::messaging::DeliveryState::Accepted(fe2o3_amqp::types::messaging::Accepted {}));
        let encoded = serde_amqp::to_vec(&wide).unwrap();
        let head = parse_transfer(&encoded).unwrap();
        assert_eq!((head.len, head.more, head.tag), (encoded.len(), true, None));
        // A handle encoded as a ulong is not read: the tap turns off, every byte passes.
        let mut odd = serde_amqp::to_vec(&transfer(0, Some(0), b"t", false)).unwrap();
        assert_eq!(&odd[..4], &[0x00, 0x53, 0x14, 0xc0]);
        let pos = 6; // first field: the handle
        assert_eq!(odd[pos], 0x43);
        odd[pos] = 0x44; // ulong 0
        assert!(parse_transfer(&odd).is_none());
        let handle = TapHandle::new();
        handle.arm(10);
        let mut input = amqp(&begin(), &[], 3);
        let mut body = odd.clone();
        body.extend(message(1));
        input.extend(frame(0, 3, &body));
        input.extend(amqp(&transfer(0, Some(1), b"u", false), &message(2), 3));
        assert_eq!(through(&input, 2, &handle), input);
        assert_eq!(handle.held(), 0);
    }
}
