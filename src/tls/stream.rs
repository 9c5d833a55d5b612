//! A client connection that is either plain TCP or TLS, and its read and write halves.
//!
//! The TLS side drives `rustls::ServerConnection` over monoio's owned-buffer reads and writes
//! itself instead of using `monoio-rustls`: hubcast moves an upgraded socket's descriptor to
//! its session's core, and the TLS session has to move with it *whole*. `monoio-rustls`
//! 0.4's `into_parts` drops the ciphertext it has read from the socket but not yet handed to
//! rustls, and its split halves share one stream through an `UnsafeCell`. Here the whole
//! session state is [`TlsState`] (rustls' connection plus the ciphertext not yet processed):
//! it is `Send`, so it travels with the descriptor, and nothing read from the socket is left
//! behind.
//!
//! The halves share the state through an `Rc<RefCell<…>>`, borrowed only between awaits (a
//! core is one thread, so there is no lock and no contention). The reader never writes: what
//! rustls wants to send after processing input (a TLS 1.3 KeyUpdate answer, an alert) goes
//! out with the writer's next write (a live socket's writer sends a ping at least every
//! `pingInterval`). On a TLS error the connection is closed without an alert.
//!
//! Like monoio's own reads, these are not cancel-safe: a read or write raced against a
//! timeout may only be abandoned together with the connection.

use std::cell::RefCell;
use std::io::{self, BufRead, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;

use monoio::buf::{IoBuf, IoBufMut, IoVecBuf, IoVecBufMut, RawBuf};
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt, OwnedReadHalf, OwnedWriteHalf, Splitable};
use monoio::net::TcpStream;
use monoio::BufResult;
use rustls::{ServerConfig, ServerConnection};

/// Ciphertext asked of one socket read: starts small (an idle socket's pending read holds its
/// buffer for as long as it waits, and clients mostly send small packets), doubles while
/// reads fill it, and goes back once they are small again.
const CIPHER_MIN: usize = 4 * 1024;
const CIPHER_MAX: usize = 32 * 1024;

/// Everything of a TLS session that lives outside the socket: moves with its descriptor.
pub struct TlsState {
    conn: ServerConnection,
    /// Ciphertext read from the socket and not yet handed to rustls.
    cipher_in: Vec<u8>,
    /// Bytes the last socket read brought (sizes the next one).
    last_read: usize,
}

impl TlsState {
    /// Hands buffered ciphertext to rustls and processes it.
    fn feed(&mut self) -> io::Result<()> {
        let n = self.conn.read_tls(&mut &self.cipher_in[..])?;
        self.cipher_in.drain(..n);
        self.conn.process_new_packets().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if n == 0 {
            // rustls took nothing although input was offered: never spin on it.
            return Err(io::Error::new(io::ErrorKind::InvalidData, "TLS input not accepted"));
        }
        Ok(())
    }

    /// Copies decrypted input into `buf`; `None` when there is none yet.
    fn take_plaintext<T: IoBufMut>(&mut self, buf: &mut T) -> Option<io::Result<usize>> {
        let mut reader = self.conn.reader();
        let n = match reader.fill_buf() {
            Ok(chunk) => {
                // An empty chunk: the client sent close_notify (end of input).
                let n = chunk.len().min(buf.bytes_total());
                // Safety: `write_ptr` points to `bytes_total` writable bytes of `buf`, which
                // do not overlap rustls' buffer; `set_init` covers exactly what was copied.
                unsafe {
                    std::ptr::copy_nonoverlapping(chunk.as_ptr(), buf.write_ptr(), n);
                    buf.set_init(n);
                }
                n
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
            Err(e) => return Some(Err(e)),
        };
        reader.consume(n);
        Some(Ok(n))
    }

    /// The (empty) buffer for the next socket read, sized after the last one.
    fn read_buffer(&mut self) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.cipher_in);
        let cap = buf.capacity();
        let want = if self.last_read >= cap { (cap * 2).clamp(CIPHER_MIN, CIPHER_MAX) } else if self.last_read < cap / 4 { CIPHER_MIN } else { cap };
        if want < cap {
            buf = Vec::with_capacity(want);
        } else {
            buf.reserve(want);
        }
        buf
    }

    /// Takes back the buffer of a socket read of `n` bytes (`Ok(0)`: end of input).
    fn read_done(&mut self, buf: Vec<u8>, result: &io::Result<usize>) {
        self.cipher_in = buf;
        if let Ok(n) = result {
            self.last_read = *n;
        }
    }

    /// Moves what rustls wants to send into `out`.
    fn take_ciphertext(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        while self.conn.wants_write() {
            self.conn.write_tls(out)?;
        }
        Ok(())
    }
}

/// Runs the server side of a TLS handshake on a fresh connection.
pub async fn accept(mut tcp: TcpStream, config: Arc<ServerConfig>) -> io::Result<Stream> {
    let conn = ServerConnection::new(config).map_err(io::Error::other)?;
    let mut state = Box::new(TlsState { conn, cipher_in: Vec::new(), last_read: 0 });
    let mut out = Vec::new();
    loop {
        state.take_ciphertext(&mut out)?;
        if !out.is_empty() {
            let (result, buf) = tcp.write_all(std::mem::take(&mut out)).await;
            result?;
            out = buf;
            out.clear();
        }
        if !state.conn.is_handshaking() {
            // Application data sent right behind the handshake stays in `state`.
            return Ok(Stream::Tls(tcp, state));
        }
        if state.cipher_in.is_empty() {
            let (result, buf) = tcp.read(state.read_buffer()).await;
            state.read_done(buf, &result);
            if result? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        if let Err(e) = state.feed() {
            // Tell the client why (rustls queued an alert), then give up.
            let _ = state.take_ciphertext(&mut out);
            let _ = tcp.write_all(out).await;
            return Err(e);
        }
    }
}

/// A client connection: plain TCP, or TCP with its TLS session.
pub enum Stream {
    Plain(TcpStream),
    Tls(TcpStream, Box<TlsState>),
}

impl Stream {
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.tcp().set_nodelay(on)
    }

    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(tcp) | Stream::Tls(tcp, _) => tcp,
        }
    }

    /// The socket and the TLS session, to move to another core.
    pub fn into_parts(self) -> (TcpStream, Option<Box<TlsState>>) {
        match self {
            Stream::Plain(tcp) => (tcp, None),
            Stream::Tls(tcp, state) => (tcp, Some(state)),
        }
    }

    pub fn from_parts(tcp: TcpStream, tls: Option<Box<TlsState>>) -> Self {
        match tls {
            None => Stream::Plain(tcp),
            Some(state) => Stream::Tls(tcp, state),
        }
    }

    pub fn into_split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Stream::Plain(tcp) => {
                let (r, w) = tcp.into_split();
                (ReadHalf::Plain(r), WriteHalf::Plain(w))
            }
            Stream::Tls(tcp, state) => {
                let (r, w) = tcp.into_split();
                let state = Rc::new(RefCell::new(state));
                (ReadHalf::Tls(r, state.clone()), WriteHalf::Tls(w, state, Vec::new()))
            }
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        self.tcp().as_raw_fd()
    }
}

/// The halves of one connection, split by [`Stream::into_split`], back together.
pub fn reunite(read: ReadHalf, write: WriteHalf) -> Option<Stream> {
    match (read, write) {
        (ReadHalf::Plain(r), WriteHalf::Plain(w)) => r.reunite(w).ok().map(Stream::Plain),
        (ReadHalf::Tls(r, a), WriteHalf::Tls(w, b, _)) => {
            drop(b);
            let state = Rc::try_unwrap(a).ok()?.into_inner();
            r.reunite(w).ok().map(|tcp| Stream::Tls(tcp, state))
        }
        _ => None,
    }
}

type Shared = Rc<RefCell<Box<TlsState>>>;

pub enum ReadHalf {
    Plain(OwnedReadHalf<TcpStream>),
    Tls(OwnedReadHalf<TcpStream>, Shared),
}

pub enum WriteHalf {
    Plain(OwnedWriteHalf<TcpStream>),
    /// The last field is the reused ciphertext buffer.
    Tls(OwnedWriteHalf<TcpStream>, Shared, Vec<u8>),
}

async fn tls_read<T: IoBufMut>(tcp: &mut OwnedReadHalf<TcpStream>, state: &Shared, mut buf: T) -> BufResult<usize, T> {
    loop {
        let cipher = {
            let mut st = state.borrow_mut();
            if let Some(result) = st.take_plaintext(&mut buf) {
                return (result, buf);
            }
            if !st.cipher_in.is_empty() {
                if let Err(e) = st.feed() {
                    return (Err(e), buf);
                }
                continue;
            }
            st.read_buffer()
        };
        let (result, cipher) = tcp.read(cipher).await;
        state.borrow_mut().read_done(cipher, &result);
        match result {
            // End of input without close_notify: an end all the same (the HTTP framing and
            // WebSocket close frames say whether anything was cut short).
            Ok(0) => return (Ok(0), buf),
            Err(e) => return (Err(e), buf),
            Ok(_) => {}
        }
    }
}

/// Sends whatever rustls has queued.
async fn tls_flush(tcp: &mut OwnedWriteHalf<TcpStream>, state: &Shared, out: &mut Vec<u8>) -> io::Result<()> {
    loop {
        out.clear();
        state.borrow_mut().take_ciphertext(out)?;
        if out.is_empty() {
            return Ok(());
        }
        let (result, buf) = tcp.write_all(std::mem::take(out)).await;
        *out = buf;
        result?;
    }
}

async fn tls_write<T: IoBuf>(tcp: &mut OwnedWriteHalf<TcpStream>, state: &Shared, out: &mut Vec<u8>, buf: T) -> BufResult<usize, T> {
    if let Err(e) = tls_flush(tcp, state, out).await {
        return (Err(e), buf);
    }
    // Safety: `read_ptr` points to `bytes_init` initialised bytes of `buf`, which we own.
    let data = unsafe { std::slice::from_raw_parts(buf.read_ptr(), buf.bytes_init()) };
    // rustls takes what fits its outgoing buffer (64 KiB by default); the caller writes the
    // rest with its next call, once this is on the wire.
    let accepted = state.borrow_mut().conn.writer().write(data);
    match accepted {
        Ok(n) => match tls_flush(tcp, state, out).await {
            Ok(()) => (Ok(n), buf),
            Err(e) => (Err(e), buf),
        },
        Err(e) => (Err(e), buf),
    }
}

impl AsyncReadRent for ReadHalf {
    async fn read<T: IoBufMut>(&mut self, buf: T) -> BufResult<usize, T> {
        match self {
            ReadHalf::Plain(r) => r.read(buf).await,
            // Boxed: the TLS read's state (~210 bytes) would otherwise size the reader task of
            // every idle socket, plain ones too (issue 25 item 3); a TLS read costs far more
            // than the allocation.
            ReadHalf::Tls(r, state) => Box::pin(tls_read(r, state, buf)).await,
        }
    }

    async fn readv<T: IoVecBufMut>(&mut self, mut buf: T) -> BufResult<usize, T> {
        if let ReadHalf::Plain(r) = self {
            return r.readv(buf).await;
        }
        // Safety: the raw buffer points into `buf`'s first vector, which lives until the end.
        let n = match unsafe { RawBuf::new_from_iovec_mut(&mut buf) } {
            Some(raw) => self.read(raw).await.0,
            None => Ok(0),
        };
        if let Ok(n) = n {
            unsafe { buf.set_init(n) };
        }
        (n, buf)
    }
}

impl AsyncWriteRent for WriteHalf {
    async fn write<T: IoBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        match self {
            WriteHalf::Plain(w) => w.write(buf).await,
            // Boxed, as the TLS read: ~460 bytes in every socket's writer task otherwise.
            WriteHalf::Tls(w, state, out) => Box::pin(tls_write(w, state, out, buf)).await,
        }
    }

    async fn writev<T: IoVecBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        if let WriteHalf::Plain(w) = self {
            return w.writev(buf).await;
        }
        // Safety: the raw buffer points into `buf`'s first vector, which lives until the end.
        let n = match unsafe { RawBuf::new_from_iovec(&buf) } {
            Some(raw) => self.write(raw).await.0,
            None => Ok(0),
        };
        (n, buf)
    }

    async fn flush(&mut self) -> io::Result<()> {
        match self {
            WriteHalf::Plain(w) => w.flush().await,
            WriteHalf::Tls(w, state, out) => tls_flush(w, state, out).await,
        }
    }

    /// TLS: close_notify, then the TCP write side.
    async fn shutdown(&mut self) -> io::Result<()> {
        match self {
            WriteHalf::Plain(w) => w.shutdown().await,
            WriteHalf::Tls(w, state, out) => {
                state.borrow_mut().conn.send_close_notify();
                tls_flush(w, state, out).await?;
                w.shutdown().await
            }
        }
    }
}
