//! A connection accepted over the connection cap (`admission::descriptors`): never left in
//! the backlog. A few at a time have their first request read briefly so that `GET /status`,
//! a load balancer's health check, is answered as usual; anything else, and every connection
//! past those few, gets 503 with a JSON error and `Connection: close`. Over TLS it is closed
//! at once: the handshake is the expensive part the cap protects against.

use std::net::IpAddr;
use std::rc::Rc;
use std::time::Duration;

use monoio::net::TcpStream;

use super::{flush, Framed, Framing, Request, Response, Service};
use crate::admission::descriptors::{OverflowSlot, OVERFLOW_READ};
use crate::app::Core;
use crate::tls::Stream;

fn full() -> Response {
    Response::error(503, "connection limit reached (maxConnections, or the open-file limit less fdReserve); retry later")
        .with_header("retry-after", "1")
        .closing()
}

pub(super) async fn answer<S: Service>(core: Rc<Core>, stream: TcpStream, peer: IpAddr) {
    crate::admission::STATS.over_cap();
    if crate::tls::enabled() {
        return;
    }
    let (read, mut write) = Stream::Plain(stream).into_split();
    let response = match OverflowSlot::try_acquire() {
        None => full(),
        Some(_reading) => {
            let mut framed = Framed::new(read);
            // Abandoning the read on timeout is safe: the connection is closed right after.
            match monoio::time::timeout(OVERFLOW_READ, framed.read_head()).await {
                Ok(Ok((head, Framing::None))) if head.method == http::Method::GET && head.uri.path() == "/status" => {
                    let request = Request {
                        method: head.method,
                        path: head.uri.path().to_string(),
                        query: head.uri.query().map(str::to_string),
                        headers: head.headers,
                        body: Default::default(),
                        peer: Some(peer),
                    };
                    S::handle(&core, request).await.closing()
                }
                _ => full(),
            }
        }
    };
    let mut out = Vec::new();
    response.encode(&mut out, false);
    let _ = flush(&mut write, out, Duration::from_secs(1), Duration::from_secs(1)).await;
}
