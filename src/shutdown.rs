//! Graceful shutdown on SIGTERM and SIGINT.
//!
//! A deploy stops the old process with SIGTERM (Kubernetes, systemd, Docker) and expects it to
//! leave cleanly within a grace period; an operator presses Ctrl-C (SIGINT). The sequence,
//! each step logged at info:
//!
//! 1. **Stopping** ([`STOPPING`]): `GET /status` answers 503 "shutting down" so a load
//!    balancer takes the node out; every core and the AMQP consumer, which await it, wake up
//!    (closing a channel wakes every waiter on every thread: nobody polls).
//! 2. **Each core** (`app::stop::core_task`) closes its listener (new connections are refused by the
//!    kernel), says goodbye to every socket it holds and waits until its in-flight requests
//!    have been answered and its sockets are gone ([`CoreDrain`]). New WebSocket upgrades and
//!    Engine.IO handshakes are refused with 503 meanwhile; a request on a kept-alive connection
//!    is still served, with `connection: close`.
//!    - Plain WebSockets get close code 1001 (Going Away).
//!    - Socket.IO clients get their transport closed: the WebSocket with a 1001 close frame,
//!      a pending long poll answered with the Engine.IO close packet `1`. socket.io-client
//!      reports that as `disconnect` with reason `"transport close"` and **reconnects by
//!      itself** (to another node behind the load balancer, or to this one once restarted).
//!      We deliberately do *not* send the Socket.IO DISCONNECT packet `41`: the client reads it
//!      as `"io server disconnect"`, a deliberate kick, and does not reconnect. Sessions are
//!      not deleted: a client that comes back keeps its session (kept across a restart by the
//!      store).
//! 3. **The AMQP consumer** stops reading, detaches its partition links (AMQP `detach`,
//!    closed), ends its sessions and closes the connection. It goes before the flush so that
//!    the flushed state holds everything it handed to the cores and nothing arrives after.
//! 4. **Flush**: once every core is drained and the consumer is gone, each core applies what
//!    is left in its ingress queue and flushes its state (`app::stop::flush_state`, the hook
//!    the durable store plugs into).
//! 5. Exit 0. Past `--shutdown-timeout` the process exits anyway, with a log line and status
//!    1; a second signal exits at once (status 128 + signal number).
//!
//! This module holds what the sequence needs of no core: the flag, the per-core drain
//! bookkeeping ([`CoreDrain`]), the reports and the main thread's half ([`drive`]). The
//! per-core half needs a core (`app::Core`), so it lives in the application (`app::stop`),
//! which imports this module and not the other way round: no import cycle.
//!
//! Signals are read with `signal-hook`: its handler only writes to a self-pipe (the one thing
//! that is async-signal-safe to do) and a plain thread reads the pipe, so none of our code runs
//! in signal context and there is no `unsafe` here.

use std::cell::{Cell, RefCell};
use std::os::fd::RawFd;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::LazyLock;
use std::task::{Poll, Waker};
use std::time::Instant;

use crate::push::outlet::{CloseReason, Outlet};

/// The process's one "stopping" flag, set once by the signal thread.
pub struct Stopping {
    set: AtomicBool,
    /// Never carries a message: closing it wakes every task waiting in [`Stopping::wait`].
    tx: async_channel::Sender<()>,
    rx: async_channel::Receiver<()>,
}

/// A process has one lifetime, so the flag is process-wide (the AMQP partition tasks and the
/// cores reach it without threading a handle through every call).
pub static STOPPING: LazyLock<Stopping> = LazyLock::new(|| {
    let (tx, rx) = async_channel::bounded(1);
    Stopping { set: AtomicBool::new(false), tx, rx }
});

impl Stopping {
    /// Starts the shutdown; true the first time.
    pub fn begin(&self) -> bool {
        let first = !self.set.swap(true, Ordering::AcqRel);
        self.tx.close();
        first
    }

    pub fn is_stopping(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    /// Resolves once the shutdown has begun (at once if it has). Cancel-safe; works on any
    /// runtime (monoio cores, the consumer's tokio thread).
    pub async fn wait(&self) {
        if !self.is_stopping() {
            let _ = self.rx.recv().await;
        }
    }
}

/// The WebSocket close every socket gets on shutdown: 1001 Going Away.
pub fn goodbye() -> CloseReason {
    CloseReason::new(1001, "server shutting down")
}

/// What a core waits for before it counts as drained: requests in hand (read, not yet
/// answered) and live WebSockets. Core-local, so plain cells.
#[derive(Default)]
pub struct CoreDrain {
    busy: Cell<usize>,
    waker: RefCell<Option<Waker>>,
    /// Every live WebSocket on this core (its outlet, to say goodbye to, and its descriptor,
    /// to close one that does not go in time).
    sockets: RefCell<hashbrown::HashMap<u64, (Weak<Outlet>, RawFd)>>,
    /// Goodbyes were sent: a socket registered later gets its goodbye at once.
    said_goodbye: Cell<bool>,
    /// Every Engine.IO polling session on this core (its outlet): a pending long poll is
    /// answered with what is queued and the close packet.
    polls: RefCell<hashbrown::HashMap<u64, Weak<Outlet>>>,
}

/// Held while a request is in hand or a socket lives; the core is drained when none is left.
pub struct Busy {
    drain: Rc<CoreDrain>,
    socket: Option<u64>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(id) = self.socket {
            self.drain.sockets.borrow_mut().remove(&id);
        }
        let left = self.drain.busy.get().saturating_sub(1);
        self.drain.busy.set(left);
        if left == 0 {
            if let Some(w) = self.drain.waker.borrow_mut().take() {
                w.wake();
            }
        }
    }
}

impl CoreDrain {
    /// A request is in hand until the guard drops (after its answer is written).
    pub fn request(self: &Rc<Self>) -> Busy {
        self.busy.set(self.busy.get() + 1);
        Busy { drain: self.clone(), socket: None }
    }

    /// A live WebSocket on descriptor `fd`, until the guard drops (its reader ended, before
    /// the descriptor is closed).
    pub fn socket(self: &Rc<Self>, outlet: &Rc<Outlet>, fd: RawFd) -> Busy {
        if self.said_goodbye.get() {
            outlet.finish(goodbye());
        }
        self.sockets.borrow_mut().insert(outlet.id, (Rc::downgrade(outlet), fd));
        self.busy.set(self.busy.get() + 1);
        Busy { drain: self.clone(), socket: Some(outlet.id) }
    }

    /// An Engine.IO polling session on this core, until [`CoreDrain::polling_gone`].
    pub fn polling(&self, outlet: &Rc<Outlet>) {
        self.polls.borrow_mut().insert(outlet.id, Rc::downgrade(outlet));
    }

    /// The polling session of outlet `id` left this core.
    pub fn polling_gone(&self, id: u64) {
        self.polls.borrow_mut().remove(&id);
    }

    /// The polling sessions' goodbye: their pending long poll is answered with what is
    /// queued and the Engine.IO close packet. Returns how many.
    pub fn say_goodbye_to_polls(&self) -> usize {
        let outlets: Vec<Rc<Outlet>> = self.polls.borrow().values().filter_map(Weak::upgrade).collect();
        for outlet in &outlets {
            outlet.finish(goodbye());
        }
        outlets.len()
    }

    /// Asks every WebSocket to close with 1001 after what is already queued; returns how many.
    pub fn say_goodbye(&self) -> usize {
        self.said_goodbye.set(true);
        let outlets: Vec<Rc<Outlet>> = self.sockets.borrow().values().filter_map(|(o, _)| o.upgrade()).collect();
        for outlet in &outlets {
            outlet.finish(goodbye());
        }
        outlets.len()
    }

    /// Shuts down the sockets still open (a client that does not read, so the goodbye write
    /// is stuck): their tasks see the error and end. Returns how many.
    pub fn cut_sockets(&self) -> usize {
        let sockets = self.sockets.borrow();
        for (_, fd) in sockets.values() {
            // Safety: the descriptor is open: an entry is removed before its socket is closed,
            // and this runs on the socket's own core.
            unsafe { libc::shutdown(*fd, libc::SHUT_RDWR) };
        }
        sockets.len()
    }

    /// Resolves when nothing is in hand.
    pub async fn idle(&self) {
        std::future::poll_fn(|cx| {
            if self.busy.get() == 0 {
                return Poll::Ready(());
            }
            *self.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

/// A core's progress, reported to the main thread.
#[derive(Debug)]
pub enum Report {
    /// In-flight requests answered, sockets closed.
    Drained(usize),
    /// Ingress applied and state flushed: the process may exit.
    Flushed(usize),
}

/// The main thread's half: drives the sequence once the first signal arrived. Returns when
/// every core has flushed, or `Err` with what was still pending at `deadline`.
pub fn drive(
    reports: &std::sync::mpsc::Receiver<Report>,
    flush: &[async_channel::Sender<()>],
    amqp: Option<std::thread::JoinHandle<()>>,
    handover: Option<Box<dyn FnOnce(Instant) + Send>>,
    deadline: Instant,
) -> Result<(), String> {
    let cores = flush.len();
    let wait = |what: &str, want: fn(&Report) -> bool| -> Result<(), String> {
        let mut seen = 0;
        while seen < cores {
            let left = deadline.saturating_duration_since(Instant::now());
            match reports.recv_timeout(left) {
                Ok(r) if want(&r) => seen += 1,
                Ok(_) => {}
                Err(_) => return Err(format!("{} of {cores} cores not {what}", cores - seen)),
            }
        }
        Ok(())
    };
    wait("drained", |r| matches!(r, Report::Drained(_)))?;
    if let Some(amqp) = amqp {
        // The consumer's thread ends once it has detached and closed its connection.
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = amqp.join();
            let _ = done_tx.send(());
        });
        if done_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_err() {
            return Err("the event hub consumer has not closed its connection".into());
        }
    }
    // Several instances: the consumer has stopped and the cores still run, so what they
    // applied can be checkpointed and the partitions handed over before the final flush.
    if let Some(handover) = handover {
        handover(deadline);
    }
    for tx in flush {
        let _ = tx.try_send(());
    }
    wait("flushed", |r| matches!(r, Report::Flushed(_)))
}
