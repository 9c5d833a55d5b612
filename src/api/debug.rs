//! Debug builds only (`cfg(debug_assertions)`): routes the tests use to put the process in a
//! state no client can, never compiled into a release build.
//!
//! `POST /_debug/stall?core=N&ms=M` (admin key): blocks core N's thread for M ms (at most
//! 60 s), as a core stuck in a long computation would be; answered once it is over. The
//! Redis link's lease task must renew leases through it, and give them up cleanly past
//! 3 × `--lease-ttl` (tests/cluster_amqp.rs).

use std::rc::Rc;
use std::time::Duration;

use super::auth::require_admin;
use crate::app::mesh::{CoreMsg, CoreTask};
use crate::app::Core;
use crate::http::{Request, Response};
use crate::model::{Checked, Rejection};

pub async fn stall(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    require_admin(&core.settings, req)?;
    let target = req
        .query_param("core")
        .and_then(|c| c.parse::<usize>().ok())
        .filter(|c| *c < core.cores())
        .ok_or_else(|| Rejection::bad_request(format!("core must be a core index below {}", core.cores())))?;
    let ms = req
        .query_param("ms")
        .and_then(|m| m.parse::<u64>().ok())
        .filter(|m| *m <= 60_000)
        .ok_or_else(|| Rejection::bad_request("ms must be a number of milliseconds up to 60000"))?;
    let (done, over) = futures_channel::oneshot::channel();
    let stall = Box::new(Stall { ms, done });
    if target == core.index {
        stall.run(core);
    } else {
        core.mesh.post(target, CoreMsg::Task(stall));
    }
    tracing::warn!(core = target, ms, "debug: blocking a core on request");
    let _ = over.await;
    Ok(Response::no_content())
}

struct Stall {
    ms: u64,
    done: futures_channel::oneshot::Sender<()>,
}

impl CoreTask for Stall {
    fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
    }

    /// Blocks the thread from a task of its own (the one thing a core must never do).
    fn run(self: Box<Self>, _: &Rc<Core>) {
        monoio::spawn(async move {
            std::thread::sleep(Duration::from_millis(self.ms));
            let _ = self.done.send(());
        });
    }
}
