//! A socket's outgoing queue, on the socket's core.
//!
//! Producers (the fan-out, protocol pings) push; one writer drains everything queued into a
//! single write. When the consumer falls behind (more than `soft` frames waiting), telemetry
//! is conflated: only the newest telemetry frame per device is kept. Connection state, twin
//! and protocol frames are never dropped; past `hard` frames waiting the socket is closed
//! with a reason. A slow socket therefore costs bounded memory and never slows the others.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};

use hashbrown::HashMap;

use super::{Delivery, FrameKind};

/// Something for the writer to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    /// A `data` envelope (JSON); the transport wraps it.
    Envelope(Arc<str>),
    /// A transport-level text packet sent as is (Engine.IO packets).
    Packet(Box<str>),
    /// WebSocket control frames.
    Ping,
    Pong(Vec<u8>),
}

#[derive(Debug, Clone, Copy)]
pub struct QueueLimits {
    pub soft: usize,
    pub hard: usize,
}

/// Why a socket is being closed: WebSocket close code and reason text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloseReason {
    pub code: u16,
    pub text: String,
}

impl CloseReason {
    pub fn new(code: u16, text: impl Into<String>) -> Self {
        Self { code, text: text.into() }
    }
}

#[derive(Default)]
struct State {
    queue: VecDeque<Out>,
    /// Newest telemetry per device, kept while the consumer is behind (sent after `queue`).
    conflated: HashMap<Arc<str>, Arc<str>>,
    closing: Option<CloseReason>,
}

pub struct Outlet {
    pub id: u64,
    limits: QueueLimits,
    state: RefCell<State>,
    waker: RefCell<Option<Waker>>,
    /// Frames replaced by newer ones while behind (for metrics).
    pub conflated_count: Cell<u64>,
}

/// What the writer got from one drain.
pub struct Drained {
    pub items: Vec<Out>,
    pub closing: Option<CloseReason>,
    /// Telemetry frames replaced by newer ones since the last drain.
    pub conflated: u64,
}

impl Outlet {
    pub fn new(id: u64, limits: QueueLimits) -> Rc<Self> {
        Rc::new(Self {
            id,
            limits,
            state: RefCell::default(),
            waker: RefCell::new(None),
            conflated_count: Cell::new(0),
        })
    }

    fn wake(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    pub fn is_closing(&self) -> bool {
        self.state.borrow().closing.is_some()
    }

    /// Frames waiting (queued plus conflated).
    pub fn backlog(&self) -> usize {
        let s = self.state.borrow();
        s.queue.len() + s.conflated.len()
    }

    /// Queues a protocol item; never dropped (but counts towards the hard limit).
    pub fn push(&self, item: Out) {
        let mut s = self.state.borrow_mut();
        if s.closing.is_some() {
            return;
        }
        s.queue.push_back(item);
        let over = s.queue.len() + s.conflated.len() > self.limits.hard;
        drop(s);
        if over {
            self.close(CloseReason::new(1008, format!("slow consumer: more than {} messages waiting", self.limits.hard)));
        } else {
            self.wake();
        }
    }

    /// Queues a delivery, conflating telemetry when the consumer is behind.
    pub fn deliver(&self, d: &Delivery) {
        let mut s = self.state.borrow_mut();
        if s.closing.is_some() {
            return;
        }
        let waiting = s.queue.len() + s.conflated.len();
        if waiting >= self.limits.soft && d.kind == FrameKind::Telemetry {
            if s.conflated.insert(d.device.clone(), d.frame.clone()).is_some() {
                self.conflated_count.set(self.conflated_count.get() + 1);
            }
        } else {
            s.queue.push_back(Out::Envelope(d.frame.clone()));
        }
        let over = s.queue.len() + s.conflated.len() > self.limits.hard;
        drop(s);
        if over {
            self.close(CloseReason::new(1008, format!("slow consumer: more than {} messages waiting", self.limits.hard)));
        } else {
            self.wake();
        }
    }

    /// Asks the writer to close the socket now; what is still queued is dropped.
    pub fn close(&self, reason: CloseReason) {
        let mut s = self.state.borrow_mut();
        if s.closing.is_none() {
            s.queue.clear();
            s.conflated.clear();
            s.closing = Some(reason);
        }
        drop(s);
        self.wake();
    }

    /// Asks the writer to send what is queued, then close; nothing more is accepted.
    pub fn finish(&self, reason: CloseReason) {
        let mut s = self.state.borrow_mut();
        if s.closing.is_none() {
            s.closing = Some(reason);
        }
        drop(s);
        self.wake();
    }

    /// Takes everything queued, waiting until there is something (or a close).
    pub async fn drain(&self) -> Drained {
        poll_fn(|cx| {
            let mut s = self.state.borrow_mut();
            if s.closing.is_some() || !s.queue.is_empty() || !s.conflated.is_empty() {
                let mut items: Vec<Out> = s.queue.drain(..).collect();
                items.extend(s.conflated.drain().map(|(_, frame)| Out::Envelope(frame)));
                let conflated = self.conflated_count.replace(0);
                return Poll::Ready(Drained { items, closing: s.closing.clone(), conflated });
            }
            *self.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Takes what is queued without waiting (long-polling).
    pub fn try_drain(&self) -> Drained {
        let mut s = self.state.borrow_mut();
        let mut items: Vec<Out> = s.queue.drain(..).collect();
        items.extend(s.conflated.drain().map(|(_, frame)| Out::Envelope(frame)));
        Drained { items, closing: s.closing.clone(), conflated: self.conflated_count.replace(0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::SessionId;

    fn delivery(device: &str, kind: FrameKind, frame: &str) -> Delivery {
        Delivery { session: SessionId(1), device: device.into(), kind, frame: frame.into() }
    }

    #[test]
    fn behind_consumer_gets_newest_telemetry_per_device_and_every_state_change() {
        let o = Outlet::new(1, QueueLimits { soft: 2, hard: 100 });
        o.deliver(&delivery("a", FrameKind::Telemetry, "t1"));
        o.deliver(&delivery("a", FrameKind::Telemetry, "t2"));
        o.deliver(&delivery("a", FrameKind::Telemetry, "t3"));
        o.deliver(&delivery("a", FrameKind::ConnectionState, "c1"));
        o.deliver(&delivery("a", FrameKind::Telemetry, "t4"));
        let d = o.try_drain();
        let frames: Vec<_> = d.items.iter().map(|i| match i { Out::Envelope(f) => f.to_string(), _ => unreachable!() }).collect();
        assert_eq!(frames, vec!["t1", "t2", "c1", "t4"]);
        assert_eq!(d.conflated, 1);
    }

    #[test]
    fn past_the_hard_limit_the_socket_closes() {
        let o = Outlet::new(1, QueueLimits { soft: 1, hard: 3 });
        for i in 0..5 {
            o.deliver(&delivery("a", FrameKind::ConnectionState, &format!("c{i}")));
        }
        assert!(o.is_closing());
        assert!(o.try_drain().closing.unwrap().text.contains("slow consumer"));
    }
}
