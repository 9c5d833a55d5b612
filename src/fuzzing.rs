//! Entry points for coverage-guided fuzzing (`fuzz/`, docs/FUZZING.md): one function per
//! parser of untrusted input, each checking what it can beyond "no panic" (an oracle, a round
//! trip through the encoder, the same answer whatever way the input is split). The fuzz
//! targets are one line each; the functions live here, built by the stable toolchain, so they
//! cannot drift from the code they drive, and the unit test below replays every seed and
//! every past crash of `fuzz/corpus/` in the normal `cargo test`.
//!
//! Not part of the product's interface (`#[doc(hidden)]` in lib.rs): it only reads.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::BytesMut;

/// Bytes of the input, taken from the front (an empty input gives zeros).
struct Take<'a>(&'a [u8]);

impl<'a> Take<'a> {
    fn byte(&mut self) -> u8 {
        let (first, rest) = self.0.split_first().map_or((0, &[][..]), |(f, r)| (*f, r));
        self.0 = rest;
        first
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }
}

/// Cut points of `len` bytes derived from `seed` (1 to 16 pieces, each at least one byte).
fn pieces(len: usize, seed: u8) -> Vec<std::ops::Range<usize>> {
    let step = usize::from(seed % 16) + 1;
    let mut out = Vec::new();
    let mut at = 0;
    let mut i = 0usize;
    while at < len {
        // Uneven pieces: 1, step, 2, step+1, ...
        let n = if i.is_multiple_of(2) { i / 2 + 1 } else { step + i / 2 };
        let end = (at + n).min(len);
        out.push(at..end);
        at = end;
        i += 1;
    }
    out
}

// ---------------------------------------------------------------------------------------
// The JSON span scanner (src/ingest/json.rs)

use crate::ingest::oracle;

/// The scanner reads any bytes exactly as serde_json does: validity, the members of an
/// object (keys decoded, values as their exact text), the items of a batch, string texts.
pub fn json(body: &[u8]) {
    use crate::ingest::{self, json};
    let shown = String::from_utf8_lossy(body);
    assert_eq!(ingest::is_json(body), oracle::is_json(body), "is_json of {shown:?}");
    let expected = oracle::members(body);
    let got = ingest::top_level_members(body).map(|m| m.into_iter().map(|(k, v)| (k.into_owned(), v.to_owned())).collect::<Vec<_>>());
    assert_eq!(got, expected, "members of {shown:?}");
    let settings = ingest::IngestSettings {
        custom_timestamp_key: "ts".into(),
        custom_device_id_key: "id".into(),
        custom_connection_state_key: "on".into(),
        connection_state_on_telemetry: true,
    };
    match ingest::parse_telemetry_checked(body, &settings) {
        Ok(parsed) => assert!(expected.as_ref().is_ok_and(|m| parsed.values.len() <= m.len()), "{shown:?}"),
        Err(fault) => assert_eq!(Err(&fault), expected.as_ref().map(|_| ()), "{shown:?}"),
    }
    let last_k = expected.as_ref().ok().and_then(|m| m.iter().rev().find(|(k, _)| k == "k"));
    assert_eq!(ingest::device_id_in_body(body, "k"), last_k.and_then(|(_, v)| serde_json::from_str::<String>(v).ok()), "{shown:?}");
    let message = ingest::message_json(body);
    assert!(oracle::is_json(message.as_bytes()), "message_json of {shown:?} is not JSON: {message}");
    // Every string value's text, as serde_json decodes it (a lone surrogate: no text).
    for (_, v) in expected.iter().flatten().filter(|(_, v)| v.starts_with('"')) {
        let want = serde_json::from_str::<String>(v).ok();
        assert_eq!(json::string_text(v).map(Cow::into_owned), want, "string_text of {v:?}");
    }
    // A batch: one item, or an array's elements, each as serde_json splits it.
    let mut items = Vec::new();
    let scanned = json::for_each_item(body, |item| {
        items.push(match item {
            json::Item::Object(m) => Ok(m.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>()),
            json::Item::Other(text) => Err(text.to_owned()),
        });
        Ok::<(), ()>(())
    });
    let texts: Option<Vec<String>> = oracle::is_json(body).then(|| match serde_json::from_slice::<Vec<&serde_json::value::RawValue>>(body) {
        Ok(elements) => elements.into_iter().map(|e| e.get().to_owned()).collect(),
        Err(_) => vec![String::from_utf8(body.to_vec()).expect("JSON is UTF-8").trim_matches([' ', '\n', '\r', '\t']).to_owned()],
    });
    let expected_ok = texts.as_ref().is_some_and(|t| t.iter().all(|t| !t.starts_with('{') || oracle::members(t.as_bytes()).is_ok()));
    assert_eq!(scanned.is_ok(), expected_ok, "for_each_item of {shown:?}");
    if let Some(texts) = texts.filter(|_| scanned.is_ok()) {
        assert_eq!(items.len(), texts.len(), "{shown:?}");
        for (item, text) in items.into_iter().zip(texts) {
            match item {
                Ok(members) => assert_eq!(Ok(members), oracle::members(text.as_bytes()), "{shown:?}"),
                Err(other) => assert_eq!(other, text, "{shown:?}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The HTTP/1.1 codec (src/http/codec.rs)

/// A request head and, when chunked, its body: a complete head is complete at exactly its
/// length and incomplete before it; a chunked body decodes the same whether it arrives at once
/// or in pieces, never past its limit; any bytes chunked-encoded decode back to themselves.
pub fn http(input: &[u8]) {
    use crate::http::codec::{encode_chunked, leading_empty_lines, parse_head, ChunkedDecoder, Framing};
    let mut take = Take(input);
    let (seed, limit_byte) = (take.byte(), take.byte());
    let data = take.0;
    let limit = [0u64, 1, 7, 64, 1000, 1 << 20][usize::from(limit_byte) % 6];
    let skip = leading_empty_lines(data);
    assert!(skip <= data.len());
    let buf = &data[skip..];
    let parsed = parse_head(buf);
    if let Ok(Some((head, framing, n))) = &parsed {
        assert!(*n <= buf.len() && *n > 0);
        let again = parse_head(&buf[..*n]).expect("the same head").expect("complete at its length");
        assert_eq!((&again.0.method, &again.0.uri, again.0.version, &again.0.headers, again.1, again.2), (&head.method, &head.uri, head.version, &head.headers, *framing, *n));
        for cut in [n - 1, n / 2, usize::from(seed) % n] {
            assert!(matches!(parse_head(&buf[..cut]), Ok(None)), "a head cut at {cut} of {n} is not incomplete: {:?}", String::from_utf8_lossy(&buf[..cut]));
        }
        if *framing == Framing::Chunked {
            chunked(&buf[*n..], limit, seed);
        }
    } else if buf.starts_with(b"0") || buf.first().is_some_and(u8::is_ascii_hexdigit) {
        // Not a head: reads it as a chunked body (seeds of chunked bodies alone).
        chunked(buf, limit, seed);
    }
    // Round trip through the encoder.
    let sizes: Vec<usize> = input.iter().take(4).map(|b| usize::from(*b) + 1).collect();
    let encoded = encode_chunked(data, &sizes);
    let mut src = BytesMut::from(&encoded[..]);
    let mut body = BytesMut::new();
    let mut decoder = ChunkedDecoder::new(data.len() as u64);
    assert_eq!(decoder.decode(&mut src, &mut body), Ok(true));
    assert!(src.is_empty());
    assert_eq!(&body[..], data);

    fn chunked(rest: &[u8], limit: u64, seed: u8) {
        let mut whole_src = BytesMut::from(rest);
        let mut whole_body = BytesMut::new();
        let whole = ChunkedDecoder::new(limit).decode(&mut whole_src, &mut whole_body);
        assert!(whole_body.len() as u64 <= limit);
        let mut decoder = ChunkedDecoder::new(limit);
        let (mut src, mut body) = (BytesMut::new(), BytesMut::new());
        let mut split = Ok(false);
        let mut fed = 0;
        for piece in pieces(rest.len(), seed) {
            fed = piece.end;
            src.extend_from_slice(&rest[piece]);
            split = decoder.decode(&mut src, &mut body);
            if !matches!(split, Ok(false)) {
                break;
            }
        }
        if rest.is_empty() {
            split = decoder.decode(&mut src, &mut body);
        }
        assert_eq!(split, whole, "chunked body in pieces vs at once: {:?}", String::from_utf8_lossy(rest));
        if whole.is_ok() {
            assert_eq!(body, whole_body);
            // What follows a finished body is the next request's, as it was.
            if whole == Ok(true) {
                src.extend_from_slice(&rest[fed..]);
                assert_eq!(src, whole_src);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// WebSocket frames and Engine.IO / Socket.IO packets (src/transport)

/// Client WebSocket frames reassembled the same whether they arrive at once or in pieces,
/// each text message parsed as an Engine.IO packet (as is each record of a polling body); a
/// text frame masked and written by the encoder reads back as itself.
pub fn engine_io(input: &[u8]) {
    use crate::transport::frame::{write_frame, FrameReader, Incoming};
    use crate::transport::socketio::{allowed_before_connect, parse_client_packet, ClientPacket};
    use tungstenite::protocol::frame::coding::{Data, OpCode};
    let mut take = Take(input);
    let seed = take.byte();
    let data = take.0;
    let packet = |text: &str| {
        let parsed = parse_client_packet(text);
        if let Some(p) = parsed {
            if let ClientPacket::Connect(rest) = p {
                assert!(text.starts_with('4') && rest.starts_with('0') && &text[1..] == rest);
            }
            let _ = allowed_before_connect(p, seed & 1 == 0);
        } else {
            assert!(!matches!(text.as_bytes().first(), Some(b'1' | b'2' | b'3' | b'5' | b'6')), "{text:?}");
        }
    };
    // At once.
    let mut whole_buf = data.to_vec();
    let mut whole = Vec::new();
    let whole_result = FrameReader::default().parse(&mut whole_buf, &mut whole);
    // In pieces, as a socket's reads give them.
    let mut reader = FrameReader::default();
    let mut buf = Vec::new();
    let mut split = Vec::new();
    let mut consumed = 0;
    let mut split_result = Ok(0);
    for piece in pieces(data.len(), seed) {
        buf.extend_from_slice(&data[piece]);
        match reader.parse(&mut buf, &mut split) {
            Ok(n) => {
                buf.drain(..n);
                consumed += n;
                split_result = Ok(consumed);
            }
            Err(e) => {
                split_result = Err(e);
                break;
            }
        }
    }
    match (&whole_result, &split_result) {
        (Ok(a), Ok(b)) => assert_eq!((a, &whole), (b, &split)),
        (Err(a), Err(b)) => {
            assert_eq!(a, b);
            // Messages before the violation were delivered either way.
            assert_eq!(whole, split);
        }
        _ => panic!("at once {whole_result:?} vs in pieces {split_result:?}"),
    }
    for message in &whole {
        if let Incoming::Text(text) = message {
            packet(text);
        }
    }
    // A polling POST body: packets separated by the record separator.
    for record in data.split(|b| *b == 0x1e) {
        if let Ok(text) = std::str::from_utf8(record) {
            packet(text);
        }
    }
    // Round trip: a masked client text frame of the data, as a client writes it.
    if let Ok(text) = std::str::from_utf8(data) {
        if text.len() <= crate::transport::frame::MAX_INCOMING_MESSAGE {
            let mut frame = Vec::new();
            write_frame(&mut frame, OpCode::Data(Data::Text), &[data]);
            let header = match frame[1] {
                126 => 4,
                127 => 10,
                _ => 2,
            };
            frame[1] |= 0x80;
            let mask = [seed, seed ^ 0x5a, 0xa5, 0x3c];
            let mut masked = frame[..header].to_vec();
            masked.extend_from_slice(&mask);
            masked.extend(frame[header..].iter().enumerate().map(|(i, b)| b ^ mask[i & 3]));
            let mut out = Vec::new();
            let n = FrameReader::default().parse(&mut masked, &mut out).expect("a valid frame");
            assert_eq!((n, out), (masked.len(), vec![Incoming::Text(text.to_owned())]));
        }
    }
}

// ---------------------------------------------------------------------------------------
// The AMQP tap (src/amqp/tap.rs)

/// A socket for the tap: reads hand over what was queued, `chunk` bytes at a time (pending
/// when empty); writes are kept.
struct Socket {
    input: Rc<RefCell<VecDeque<u8>>>,
    chunk: usize,
    written: Vec<u8>,
}

impl tokio::io::AsyncRead for Socket {
    fn poll_read(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut tokio::io::ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let mut input = self.input.borrow_mut();
        if input.is_empty() {
            return Poll::Pending;
        }
        let n = self.chunk.min(input.len()).min(buf.remaining());
        let bytes: Vec<u8> = input.drain(..n).collect();
        buf.put_slice(&bytes);
        Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for Socket {
    fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.written.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// An AMQP frame (type 0) on `channel`: the performative, then `payload`.
pub fn amqp_frame(channel: u16, performative: &impl serde::Serialize, payload: &[u8]) -> Vec<u8> {
    let mut body = serde_amqp::to_vec(performative).expect("a performative encodes");
    body.extend_from_slice(payload);
    let mut f = Vec::with_capacity(8 + body.len());
    f.extend_from_slice(&((8 + body.len()) as u32).to_be_bytes());
    f.extend_from_slice(&[2, 0]);
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&body);
    f
}

/// The handshake of a served link, as the tap's unit tests set it up: fe2o3's session on
/// channel 1 (the peer's 3), link `p0` (our handle 0, the peer's 5, delivery-count from 10,
/// credit 4). (fe2o3's bytes, the peer's bytes, fe2o3's first flow.)
pub fn amqp_handshake() -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    use fe2o3_amqp::types::definitions::{Handle, ReceiverSettleMode, Role, SenderSettleMode};
    use fe2o3_amqp::types::performatives::{Attach, Begin, Flow};
    let begin = |remote: Option<u16>, next_outgoing_id: u32| Begin {
        remote_channel: remote,
        next_outgoing_id,
        incoming_window: 5000,
        outgoing_window: 5000,
        handle_max: Handle(u32::MAX),
        offered_capabilities: None,
        desired_capabilities: None,
        properties: None,
    };
    let attach = |handle: u32, role: Role, initial: Option<u32>| Attach {
        name: "p0".into(),
        handle: Handle(handle),
        role,
        snd_settle_mode: SenderSettleMode::Mixed,
        rcv_settle_mode: ReceiverSettleMode::First,
        source: None,
        target: None,
        unsettled: None,
        incomplete_unsettled: false,
        initial_delivery_count: initial,
        max_message_size: None,
        offered_capabilities: None,
        desired_capabilities: None,
        properties: None,
    };
    let ours = [b"AMQP\x00\x01\x00\x00".to_vec(), amqp_frame(1, &begin(None, 7), &[]), amqp_frame(1, &attach(0, Role::Receiver, None), &[])].concat();
    let peer = [
        b"AMQP\x00\x01\x00\x00".to_vec(),
        amqp_frame(3, &begin(Some(1), 100), &[]),
        amqp_frame(3, &attach(5, Role::Sender, Some(10)), &[]),
    ]
    .concat();
    let flow = Flow {
        next_incoming_id: Some(100),
        incoming_window: 5000,
        next_outgoing_id: 1,
        outgoing_window: 5000,
        handle: Some(Handle(0)),
        delivery_count: Some(10),
        link_credit: Some(4),
        available: None,
        drain: false,
        echo: false,
        properties: None,
    };
    (ours, peer, amqp_frame(1, &flow, &[]))
}

/// What fe2o3 read, the messages the link got (id, settled, bytes or size), and the error.
type TapRun = (Vec<u8>, Vec<(u32, bool, Result<Vec<u8>, usize>)>, Option<String>);

/// The peer's `input` after the handshake, read `chunk` bytes at a time.
fn tap_run(input: &[u8], chunk: usize, max_message: usize) -> TapRun {
    use crate::amqp::tap::{Tap, TapHandle};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    let handle = TapHandle::new();
    let input_queue = Rc::new(RefCell::new(VecDeque::new()));
    let mut tap = Tap::new(Socket { input: input_queue.clone(), chunk, written: Vec::new() }, handle.clone());
    let mut cx = Context::from_waker(Waker::noop());
    let (ours, peer, flow) = amqp_handshake();
    handle.arm(max_message);
    let mut write = |tap: &mut Tap<Socket>, bytes: &[u8]| {
        for piece in bytes.chunks(7) {
            assert!(matches!(Pin::new(&mut *tap).poll_write(&mut cx, piece), Poll::Ready(Ok(n)) if n == piece.len()));
        }
        assert!(matches!(Pin::new(&mut *tap).poll_flush(&mut cx), Poll::Ready(Ok(()))));
    };
    write(&mut tap, &ours);
    let read = |tap: &mut Tap<Socket>, bytes: &[u8], got: &mut Vec<u8>| -> Option<String> {
        let mut cx = Context::from_waker(Waker::noop());
        input_queue.borrow_mut().extend(bytes);
        let mut buf = [0u8; 97];
        loop {
            let mut rb = ReadBuf::new(&mut buf);
            match Pin::new(&mut *tap).poll_read(&mut cx, &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => return None,
                Poll::Ready(Ok(())) => got.extend_from_slice(rb.filled()),
                Poll::Ready(Err(e)) => return Some(e.to_string()),
                Poll::Pending => return None,
            }
        }
    };
    let mut seen = Vec::new();
    assert_eq!(read(&mut tap, &peer, &mut seen), None);
    assert_eq!(seen, peer, "the handshake passes unchanged");
    write(&mut tap, &flow);
    let link = handle.link("p0").expect("the link is served");
    let mut seen = Vec::new();
    let error = read(&mut tap, input, &mut seen);
    let mut got = Vec::new();
    link.try_recv(&mut got, usize::MAX);
    let held: usize = got.iter().map(|d| d.message.as_ref().map_or(0, |m| m.len())).sum();
    assert_eq!(handle.bytes(), held, "the bytes held are the messages queued");
    link.done(&got);
    assert_eq!(handle.bytes(), 0, "done releases every byte");
    // What the tap writes for them (dispositions, flows) are whole frames.
    write(&mut tap, &[]);
    let messages = got.into_iter().map(|d| (d.id, d.settled, d.message.map(|m| m.to_vec()))).collect();
    (seen, messages, error)
}

/// The transfer parser agrees with serde_amqp on every transfer both read, reads back every
/// transfer serde_amqp writes; a served link's frames give the same messages, the same bytes
/// to fe2o3 and the same error however the socket splits them, and hold no byte after
/// `done`.
pub fn amqp(input: &[u8]) {
    use crate::amqp::tap::parse_transfer_fields;
    use fe2o3_amqp::types::definitions::Handle;
    use fe2o3_amqp::types::performatives::Transfer;
    use fe2o3_amqp::types::primitives::Binary;
    let mut take = Take(input);
    let (seed, cap) = (take.byte(), take.byte());
    let data = take.0;
    // The parser against serde_amqp on the input as a frame body.
    if let Some(head) = parse_transfer_fields(data) {
        assert!(head.0 <= data.len());
        if let Ok(t) = serde_amqp::from_slice::<Transfer>(&data[..head.0]) {
            let theirs = (head.0, t.handle.0, t.delivery_id, t.settled.unwrap_or(false), t.more, t.aborted);
            assert_eq!(head, theirs, "parse_transfer vs serde_amqp");
        }
    }
    // Round trip: a transfer made of the input's bytes, as serde_amqp writes it.
    let mut t = Take(data);
    let flags = t.byte();
    let handle = t.u32();
    let id = t.u32();
    let transfer = Transfer {
        handle: Handle(handle),
        delivery_id: (flags & 1 != 0).then_some(id),
        delivery_tag: (flags & 2 != 0).then(|| Binary::from(t.0.iter().take(usize::from(flags >> 3)).copied().collect::<Vec<u8>>())),
        message_format: (flags & 4 != 0).then_some(0),
        settled: (flags & 8 != 0).then_some(flags & 16 != 0),
        more: flags & 32 != 0,
        rcv_settle_mode: None,
        state: None,
        resume: false,
        aborted: flags & 64 != 0,
        batchable: flags & 128 != 0,
    };
    let encoded = serde_amqp::to_vec(&transfer).expect("a transfer encodes");
    let want = (encoded.len(), handle, transfer.delivery_id, transfer.settled.unwrap_or(false), transfer.more, transfer.aborted);
    assert_eq!(parse_transfer_fields(&encoded), Some(want), "{transfer:?}");
    // The stream: at once and in the pieces the seed says.
    let max_message = usize::from(cap) * 16;
    let chunk = usize::from(seed % 64) + 1;
    let whole = tap_run(data, 1 << 20, max_message);
    let split = tap_run(data, chunk, max_message);
    assert_eq!(whole.2, split.2, "the error at once vs {chunk} bytes at a time");
    if whole.2.is_none() {
        assert_eq!(whole, split, "a served link's frames at once vs {chunk} bytes at a time");
    } else {
        // The connection fails at the first broken frame; what the tap read at once after it
        // is never used.
        assert!(whole.0.starts_with(&split.0) && whole.1.starts_with(&split.1), "before the error, at once vs {chunk} bytes at a time");
    }
}

// ---------------------------------------------------------------------------------------
// The store's records (src/store/format.rs)

/// A log file of frames from the input (each piece between `FRAME_MARK`s a payload with its
/// checksum made right, so the records are reached), or of the raw input when it starts with
/// an odd byte: the start-up paths (records decoded whole, in place, newest first) end in the
/// same state and read the file alike (the same damaged spans skipped, the same tail); what was loaded, written again by the encoder and read back,
/// is the same state.
pub fn store(input: &[u8]) {
    use crate::store::format::{begin_frame, end_frame, header, read_frames, read_frames_into, NewestFirst, KIND_LOG};
    use crate::store::Loaded;
    let mut file = header(KIND_LOG).to_vec();
    match input.split_first() {
        Some((mode, rest)) if mode & 1 == 1 => file.extend_from_slice(rest),
        _ => {
            for payload in input.get(1..).unwrap_or_default().split_str(FRAME_MARK) {
                let at = begin_frame(&mut file);
                file.extend_from_slice(payload);
                end_frame(&mut file, at);
            }
        }
    }
    let mut in_order = Loaded::default();
    let tail = read_frames(&file, &mut |r| in_order.apply(r));
    let mut in_place = Loaded::default();
    let (tail_in_place, _) = read_frames_into(&file, &mut in_place, false);
    assert_eq!(tail_in_place, tail, "read_frames_into vs read_frames");
    let mut newest = Loaded::default();
    let mut nf = NewestFirst::default();
    let tail_newest = nf.apply_log(&file, &mut newest);
    nf.finish(&mut newest);
    assert_eq!(tail_newest, tail, "apply_log vs read_frames");
    let view = store_view(&in_order);
    assert_eq!(store_view(&in_place), view, "in place vs in order");
    assert_eq!(store_view(&newest), view, "newest first vs in order");
    // Round trip: the state as the encoder writes it reads back the same.
    let written = store_write(&in_order);
    let mut again = Loaded::default();
    assert!(read_frames(&written, &mut |r| again.apply(r)).is_clean());
    assert_eq!(store_view(&again), view, "written again and read back");
}

/// The separator of frames in a [`store`] input.
pub const FRAME_MARK: &[u8] = b"\xffFRAME\xff";

trait SplitStr {
    fn split_str<'a>(&'a self, mark: &'a [u8]) -> Vec<&'a [u8]>;
}

impl SplitStr for [u8] {
    fn split_str<'a>(&'a self, mark: &'a [u8]) -> Vec<&'a [u8]> {
        let mut out = Vec::new();
        let mut rest = self;
        while let Some(i) = rest.windows(mark.len()).position(|w| w == mark) {
            out.push(&rest[..i]);
            rest = &rest[i + mark.len()..];
        }
        out.push(rest);
        out
    }
}

type StoreView = (Vec<(String, crate::store::DeviceData)>, Vec<String>, Vec<String>, Vec<(String, i64)>, Vec<String>, Vec<(u32, u64)>, u64);

/// A loaded state in a comparable order.
fn store_view(l: &crate::store::Loaded) -> StoreView {
    let mut devices: Vec<_> = l.devices.iter().map(|(id, d)| (id.to_string(), crate::store::data_of_device(d))).collect();
    devices.sort_by(|a, b| a.0.cmp(&b.0));
    let mut access: Vec<_> = l.access.iter().map(|(k, v)| format!("{k:?} {v:?}")).collect();
    access.sort();
    let mut sessions: Vec<_> = l
        .sessions
        .iter()
        .map(|(id, d)| {
            let mut d: Vec<&str> = d.iter().map(|d| &**d).collect();
            d.sort();
            d.dedup();
            format!("{id:?} {d:?}")
        })
        .collect();
    sessions.sort();
    let mut applied: Vec<_> = l.applied.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    applied.sort();
    let mut streams: Vec<_> = l.streams.iter().map(|(id, r)| format!("{id:?} {r:?}")).collect();
    streams.sort();
    let mut posted: Vec<_> = l.posted.iter().map(|(k, v)| (*k, *v)).collect();
    posted.sort();
    (devices, access, sessions, applied, streams, posted, l.received)
}

/// A loaded state as a log file of one frame, written by the encoder.
pub fn store_write(l: &crate::store::Loaded) -> Vec<u8> {
    use crate::shard::access::Access;
    use crate::store::format::{begin_frame, encode, end_frame, header, Change, KIND_LOG};
    let mut file = header(KIND_LOG).to_vec();
    let at = begin_frame(&mut file);
    for (id, device) in &l.devices {
        encode(&mut file, Change::Device { id, device: Some(device) });
    }
    for ((device, session), (grants, subs)) in &l.access {
        let access = Access::new(grants.clone(), subs.clone());
        encode(&mut file, Change::Access { device, session: *session, access: Some(&access) });
    }
    for (id, devices) in &l.sessions {
        let set: crate::shard::sessions::DeviceSet = devices.iter().collect();
        encode(&mut file, Change::Session { id: *id, devices: Some(&set) });
    }
    for (id, stream) in &l.streams {
        encode(&mut file, Change::Stream { id: *id, recovery: Some(stream) });
    }
    for (key, seq) in &l.applied {
        encode(&mut file, Change::Applied { key, seq: *seq });
    }
    for (to, n) in &l.posted {
        encode(&mut file, Change::Posted { to: *to as usize, n: *n });
    }
    encode(&mut file, Change::Received { n: l.received });
    end_frame(&mut file, at);
    file
}

/// A fuzz target: its name and its entry point.
pub type Target = (&'static str, fn(&[u8]));

/// The targets by name (the directories of `fuzz/corpus/`).
pub const TARGETS: [Target; 5] = [("json", json), ("http", http), ("engine_io", engine_io), ("amqp", amqp), ("store", store)];

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Every seed and every past crash in `fuzz/corpus/<target>/` passes its target: the
    /// regression inputs of the fuzzers run in every `cargo test`.
    #[test]
    fn every_input_of_the_fuzz_corpora_passes_its_target() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
        for (name, target) in super::TARGETS {
            let dir = root.join(name);
            let mut n = 0;
            for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
                let path = entry.unwrap().path();
                let input = std::fs::read(&path).unwrap();
                if std::panic::catch_unwind(|| target(&input)).is_err() {
                    panic!("fuzz target {name} fails on {}", path.display());
                }
                n += 1;
            }
            assert!(n >= 3, "only {n} seeds for {name}");
        }
    }

    /// Writes the seed corpora from the encoders and the tests' examples
    /// (`cargo test --lib fuzzing::tests::write_seeds -- --ignored`; docs/FUZZING.md).
    #[test]
    #[ignore]
    fn write_seeds() {
        super::seeds::write(&Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus"));
    }
}

#[cfg(test)]
mod seeds;
