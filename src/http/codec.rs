//! Sans-IO HTTP/1.1 request framing (RFC 9112): the request head and the body framer.
//!
//! Nothing here reads a socket, so every rule is testable on byte slices (and fuzzed in the
//! tests below). The head is parsed by `httparse`; the framing rules on top of it are ours
//! and strict, because hubcast may run behind a proxy that reads the same bytes differently
//! (request smuggling):
//! - `Transfer-Encoding` and `Content-Length` together, `Transfer-Encoding` in HTTP/1.0, or a
//!   coding list not ending in `chunked` → 400 and close; another coding before `chunked`
//!   (e.g. `gzip, chunked`) → 501 and close (§6.1, §6.3).
//! - `Content-Length` must be digits only; several values (repeated header or a list) must
//!   all be equal (§6.3).
//! - Empty lines before a request are skipped (§2.2); HTTP/1.1 needs exactly one `Host` (§3.2).
//!
//! The chunked framer never holds more than the body limit: a chunk's declared size is
//! checked against what is left of the limit as soon as its size line arrives, before any of
//! its data is buffered, and the data is moved out of the input as it comes.
//!
//! Chunk extensions (`5;name=value`, RFC 9112 §7.1.1) are accepted and ignored; trailer fields
//! (§7.1.2) are checked for shape and dropped. Neither is buffered past its line, and together
//! they count toward the request head's limits: at most [`MAX_FRAMING_BYTES`] of extension
//! and trailer bytes per request (the head's own byte limit), at most [`MAX_HEADERS`] trailer
//! fields, and no line longer than [`MAX_CHUNK_LINE`]. Beyond: 431 (`BodyError::FramingTooLarge`),
//! so a client cannot make the server read unbounded framing around a small body.

use bytes::{Buf, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri, Version};

use crate::config::MAX_REQUEST_HEAD_BYTES;

/// Method, target, version and headers of a request.
pub type RequestHead = http::request::Parts;

/// Most header fields in one request head (more: 431).
pub const MAX_HEADERS: usize = 100;
/// Longest chunk-size line (size plus extensions), in bytes.
pub const MAX_CHUNK_LINE: usize = 4 * 1024;
/// Most bytes of chunk extensions and trailer fields together in one request body: the same
/// bound as a request head (extensions without their size digits and line ends, trailer lines
/// with theirs).
pub const MAX_FRAMING_BYTES: usize = MAX_REQUEST_HEAD_BYTES;

/// Why a request head was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadError {
    /// 431: the head (or its number of fields) is over the limit.
    TooLarge,
    /// 400: not a valid request, or framing that cannot be trusted.
    Malformed(String),
    /// 501: a transfer coding hubcast does not implement.
    NotImplemented(String),
}

/// How the body of a request is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    None,
    Length(u64),
    Chunked,
}

/// Number of bytes of empty lines (`CRLF` or a bare `LF`) at the start of `buf`.
pub fn leading_empty_lines(buf: &[u8]) -> usize {
    let mut i = 0;
    loop {
        match buf.get(i..) {
            Some([b'\r', b'\n', ..]) => i += 2,
            Some([b'\n', ..]) => i += 1,
            _ => return i,
        }
    }
}

/// Parses one request head at the start of `buf` (empty lines before it must already be gone).
/// `Ok(None)`: not complete yet. `Ok(Some((head, framing, n)))`: the head took `n` bytes.
pub fn parse_head(buf: &[u8]) -> Result<Option<(RequestHead, Framing, usize)>, HeadError> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut fields);
    let n = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_REQUEST_HEAD_BYTES => return Err(HeadError::TooLarge),
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Err(e) => return Err(HeadError::Malformed(e.to_string())),
    };
    if n > MAX_REQUEST_HEAD_BYTES {
        return Err(HeadError::TooLarge);
    }
    let malformed = |what: &str| HeadError::Malformed(what.to_string());
    let method = Method::from_bytes(req.method.unwrap_or_default().as_bytes()).map_err(|_| malformed("invalid method"))?;
    let uri: Uri = req.path.unwrap_or_default().parse().map_err(|_| malformed("invalid request target"))?;
    let version = if req.version == Some(0) { Version::HTTP_10 } else { Version::HTTP_11 };
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    for field in req.headers.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes()).map_err(|_| malformed("invalid header name"))?;
        let value = HeaderValue::from_bytes(field.value).map_err(|_| malformed("invalid header value"))?;
        headers.append(name, value);
    }
    // RFC 9112 §3.2: exactly one Host in HTTP/1.1 (at most one in HTTP/1.0).
    let hosts = headers.get_all(http::header::HOST).iter().count();
    if hosts > 1 || (hosts == 0 && version == Version::HTTP_11) {
        return Err(malformed("an HTTP/1.1 request needs exactly one Host header"));
    }
    let framing = framing(version, &headers)?;
    let mut head = http::Request::new(()).into_parts().0;
    head.method = method;
    head.uri = uri;
    head.version = version;
    head.headers = headers;
    Ok(Some((head, framing, n)))
}

/// The elements of a comma-separated list over every field named `name` (empty ones dropped).
fn list<'a>(headers: &'a HeaderMap, name: &http::header::HeaderName) -> impl Iterator<Item = &'a [u8]> {
    headers
        .get_all(name)
        .into_iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(|e| e.trim_ascii())
        .filter(|e| !e.is_empty())
}

/// The body framing of a request, refusing every ambiguous shape (RFC 9112 §6).
pub fn framing(version: Version, headers: &HeaderMap) -> Result<Framing, HeadError> {
    use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
    let malformed = |what: &str| Err(HeadError::Malformed(what.to_string()));
    if headers.contains_key(TRANSFER_ENCODING) {
        if headers.contains_key(CONTENT_LENGTH) {
            return malformed("both Transfer-Encoding and Content-Length");
        }
        if version == Version::HTTP_10 {
            return malformed("Transfer-Encoding in an HTTP/1.0 request");
        }
        let codings: Vec<&[u8]> = list(headers, &TRANSFER_ENCODING).collect();
        let chunked = |c: &&[u8]| c.eq_ignore_ascii_case(b"chunked");
        return match codings.as_slice() {
            [only] if chunked(only) => Ok(Framing::Chunked),
            [before @ .., last] if chunked(last) && !before.iter().any(chunked) => {
                let first = String::from_utf8_lossy(before[0]).into_owned();
                Err(HeadError::NotImplemented(format!("unsupported transfer coding {first:?}")))
            }
            _ => malformed("Transfer-Encoding must be chunked, once, as the final coding"),
        };
    }
    let mut length = None;
    for value in list(headers, &CONTENT_LENGTH) {
        if !value.iter().all(u8::is_ascii_digit) {
            return malformed("Content-Length must be a number of digits");
        }
        // All digits: too many of them can only mean more than any limit.
        let n = std::str::from_utf8(value).ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or(u64::MAX);
        if length.is_some_and(|l| l != n) {
            return malformed("conflicting Content-Length values");
        }
        length = Some(n);
    }
    match (length, headers.contains_key(CONTENT_LENGTH)) {
        (None, true) => malformed("empty Content-Length"),
        (None | Some(0), _) => Ok(Framing::None),
        (Some(n), _) => Ok(Framing::Length(n)),
    }
}

/// Why a chunked body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// 413: the declared or received data passes the limit.
    TooLarge,
    /// 400: not valid chunked coding.
    Malformed(&'static str),
    /// 431: chunk extensions or trailer fields over the head limits (module docs).
    FramingTooLarge(&'static str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Waiting for a chunk-size line.
    Size,
    /// This many bytes of chunk data still to come.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer fields after the last chunk, until an empty line.
    Trailers,
    Done,
}

/// Decodes a chunked body incrementally (RFC 9112 §7.1) within a byte limit.
#[derive(Debug)]
pub struct ChunkedDecoder {
    state: ChunkState,
    limit: u64,
    received: u64,
    /// Bytes of chunk extensions and trailer lines so far (against [`MAX_FRAMING_BYTES`]).
    framing_bytes: usize,
    trailer_fields: usize,
}

impl ChunkedDecoder {
    pub fn new(limit: u64) -> Self {
        Self { state: ChunkState::Size, limit, received: 0, framing_bytes: 0, trailer_fields: 0 }
    }

    /// Moves what it can from `src` into `body` (consuming framing bytes); `Ok(true)` once the
    /// body is complete (what follows it in `src` is the next request).
    pub fn decode(&mut self, src: &mut BytesMut, body: &mut BytesMut) -> Result<bool, BodyError> {
        loop {
            match self.state {
                ChunkState::Done => return Ok(true),
                ChunkState::Size => {
                    let Some(line) = take_line(src, MAX_CHUNK_LINE)? else { return Ok(false) };
                    let (size, extensions) = chunk_size(&line)?;
                    self.framing_bytes += extensions;
                    if self.framing_bytes > MAX_FRAMING_BYTES {
                        return Err(BodyError::FramingTooLarge("chunk extensions over the limit"));
                    }
                    if size > self.limit - self.received {
                        return Err(BodyError::TooLarge);
                    }
                    self.state = if size == 0 { ChunkState::Trailers } else { ChunkState::Data(size) };
                }
                ChunkState::Data(left) => {
                    if src.is_empty() {
                        return Ok(false);
                    }
                    let n = (left.min(src.len() as u64)) as usize;
                    body.extend_from_slice(&src[..n]);
                    src.advance(n);
                    self.received += n as u64;
                    self.state = if n as u64 == left { ChunkState::DataEnd } else { ChunkState::Data(left - n as u64) };
                }
                ChunkState::DataEnd => {
                    if src.len() < 2 {
                        return Ok(false);
                    }
                    if &src[..2] != b"\r\n" {
                        return Err(BodyError::Malformed("chunk data not followed by CRLF"));
                    }
                    src.advance(2);
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailers => {
                    // What is left of the budget, and the empty line that ends the section.
                    let room = MAX_FRAMING_BYTES - self.framing_bytes + 2;
                    let Some(line) = take_line(src, room)? else { return Ok(false) };
                    if line.len() > 2 {
                        self.framing_bytes += line.len();
                        self.trailer_fields += 1;
                        if self.framing_bytes > MAX_FRAMING_BYTES || self.trailer_fields > MAX_HEADERS {
                            return Err(BodyError::FramingTooLarge("trailer fields over the limit"));
                        }
                        trailer_field(&line[..line.len() - 2])?;
                    } else {
                        self.state = ChunkState::Done;
                    }
                }
            }
        }
    }
}

/// Takes one CRLF-terminated line (CRLF included) off `src`, if complete within `max` bytes.
fn take_line(src: &mut BytesMut, max: usize) -> Result<Option<BytesMut>, BodyError> {
    match memchr::memchr(b'\n', &src[..src.len().min(max)]) {
        Some(0) => Err(BodyError::Malformed("bare LF in chunked framing")),
        Some(lf) if src[lf - 1] != b'\r' => Err(BodyError::Malformed("bare LF in chunked framing")),
        Some(lf) => Ok(Some(src.split_to(lf + 1))),
        None if src.len() >= max => Err(BodyError::FramingTooLarge("a chunk-size or trailer line over the limit")),
        None => Ok(None),
    }
}

/// `chunk-size [ chunk-ext ] CRLF`: 1*HEXDIG, then optional `;`-extensions (ignored). The size
/// and the bytes of its extensions.
fn chunk_size(line: &[u8]) -> Result<(u64, usize), BodyError> {
    let line = &line[..line.len() - 2];
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return Err(BodyError::Malformed("empty or invalid chunk size"));
    }
    let rest = &line[digits..];
    let ext_ok = rest.is_empty()
        || (rest.trim_ascii_start().first() == Some(&b';')
            && rest.iter().all(|b| *b == b'\t' || (*b >= 0x20 && *b != 0x7f)));
    if !ext_ok {
        return Err(BodyError::Malformed("invalid chunk extension"));
    }
    let hex = &line[..digits];
    let significant = &hex[hex.iter().take_while(|b| **b == b'0').count()..];
    if significant.len() > 15 {
        // More than 2^60 bytes: over any limit.
        return Err(BodyError::TooLarge);
    }
    let size = significant.iter().fold(0u64, |n, b| n * 16 + (*b as char).to_digit(16).unwrap_or(0) as u64);
    Ok((size, rest.len()))
}

/// A trailer field line must at least look like `name: value`.
fn trailer_field(line: &[u8]) -> Result<(), BodyError> {
    let colon = memchr::memchr(b':', line).unwrap_or(0);
    if colon == 0 || HeaderName::from_bytes(&line[..colon]).is_err() || HeaderValue::from_bytes(line[colon + 1..].trim_ascii()).is_err() {
        return Err(BodyError::Malformed("invalid trailer field"));
    }
    Ok(())
}

/// Encodes `body` in chunked coding with chunks of the given sizes (cycled; the last chunk
/// takes the rest). For tests and benchmarks.
pub fn encode_chunked(body: &[u8], sizes: &[usize]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 64);
    let mut rest = body;
    let mut i = 0;
    while !rest.is_empty() {
        let n = sizes.get(i % sizes.len().max(1)).copied().unwrap_or(rest.len()).clamp(1, rest.len());
        out.extend_from_slice(format!("{n:x}\r\n").as_bytes());
        out.extend_from_slice(&rest[..n]);
        out.extend_from_slice(b"\r\n");
        rest = &rest[n..];
        i += 1;
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

#[cfg(test)]
mod tests;
