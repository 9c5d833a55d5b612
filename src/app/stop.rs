//! The per-core half of the graceful shutdown (the sequence is in `shutdown`'s docs): close
//! the listener, say goodbye to every socket, wait until drained, then apply what is left of
//! the ingress queue and flush the state. It needs a [`Core`], so it lives here in the
//! application; `shutdown` keeps what needs no core (the flag, the drain bookkeeping, the
//! main thread's half) and imports nothing of `app`.

use std::rc::Rc;

use super::Core;
use crate::shutdown::{Report, STOPPING};

/// The per-core half of the sequence: waits for [`STOPPING`], closes the listener, says
/// goodbye, waits until drained, then (told by `flush`) flushes; then it parks.
pub async fn core_task(
    core: Rc<Core>,
    listener: Rc<monoio::net::TcpListener>,
    report: std::sync::mpsc::Sender<Report>,
    flush: async_channel::Receiver<()>,
) {
    STOPPING.wait().await;
    let index = core.index;
    // Refuse new connections at once (the kernel answers RST); the accept loops see an error
    // and end, and the last of them closes the socket.
    // Safety: shutdown(2) on a descriptor this core owns and keeps open until it returns.
    unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&*listener), libc::SHUT_RDWR) };
    drop(listener);
    tracing::info!(core = index, "stopped accepting connections");

    let websockets = core.drain.say_goodbye();
    let polling = core.drain.say_goodbye_to_polls();
    tracing::info!(core = index, websockets, polling, "goodbye sent to every socket (close 1001 / Engine.IO close)");

    // A client that stops reading must not hold the shutdown until its write-stall limit:
    // after half the shutdown timeout its socket is cut.
    let grace = std::time::Duration::from_secs(core.settings.config.shutdown_timeout) / 2;
    if monoio::time::timeout(grace, core.drain.idle()).await.is_err() {
        let cut = core.drain.cut_sockets();
        if cut > 0 {
            tracing::warn!(core = index, sockets = cut, "sockets still open after the goodbye; closed without waiting");
        }
        core.drain.idle().await;
    }
    tracing::info!(core = index, "in-flight requests answered, sockets closed");
    // Several instances: every pid is away now; each history goes to another live instance
    // (design step 6), while the link to Redis is still up (it leaves after every core drained).
    let (handed, kept) = core.hand_off_streams();
    if handed + kept > 0 {
        tracing::info!(core = index, handed, kept, "recovery histories handed to other instances (kept: not sent, see hubcast_redis_adoptions_total)");
    }
    let _ = report.send(Report::Drained(index));

    // Every core drained and the AMQP consumer gone: nothing feeds this core any more.
    let _ = flush.recv().await;
    let ingress = core.queues.borrow().as_ref().map(|(_, ingress)| ingress.clone());
    if let Some(ingress) = ingress {
        let mut applied = 0;
        while let Some(batch) = ingress.try_recv() {
            applied += batch.messages.len();
            super::ingress::apply(&core, batch);
        }
        if applied > 0 {
            tracing::info!(core = index, messages = applied, "applied the event hub messages still queued");
        }
    }
    flush_state(&core);
    tracing::info!(core = index, "state flushed");
    let _ = report.send(Report::Flushed(index));
    // The core stays parked until the process exits: ending its runtime while other threads
    // still hold wakers of its tasks (channels shared with the main and AMQP threads) would
    // wake tasks of a runtime that is gone.
    std::future::pending::<()>().await;
}

/// The durable store's per-core flush plugs in here (state and AMQP positions, on the core
/// that owns them): commit what is pending and sync it to disk. Without a store: a no-op.
pub fn flush_state(core: &Rc<Core>) {
    let streams = core.persist_recovery();
    if streams > 0 {
        tracing::info!(core = core.index, streams, "recovery streams written for the next start");
    }
    if let Err(e) = core.flush_store() {
        tracing::error!(core = core.index, error = %e, "cannot sync the durable state to disk");
    }
}
