//! The door for sources that run outside the cores (the AMQP consumer on its tokio thread).
//!
//! Each core has a bounded queue of ingest batches. `Ingress::send` routes a batch to the
//! owning cores and waits while a core's queue is full, so a slow core pushes back on the
//! source (which then stops granting AMQP link credit) instead of memory growing without bound.
//! It is `Send + Clone` and works from any async runtime.

use std::rc::Rc;

use crate::ingest::IngestMessage;
use crate::runtime::routing::core_of_device;
use crate::runtime::Core;

/// Batches waiting per core before senders are made to wait.
pub const QUEUE_BATCHES: usize = 64;

#[derive(Clone)]
pub struct Ingress {
    queues: Vec<async_channel::Sender<Vec<IngestMessage>>>,
}

pub type IngressQueue = async_channel::Receiver<Vec<IngestMessage>>;

impl Ingress {
    pub fn new(cores: usize) -> (Self, Vec<IngressQueue>) {
        let (senders, receivers) = (0..cores).map(|_| async_channel::bounded(QUEUE_BATCHES)).unzip();
        (Self { queues: senders }, receivers)
    }

    pub fn cores(&self) -> usize {
        self.queues.len()
    }

    /// The core that owns `device_id`.
    pub fn core_of(&self, device_id: &str) -> usize {
        core_of_device(device_id, self.cores())
    }

    /// Hands a batch to one core (every message must belong to it); waits while it is full.
    pub async fn send_to_core(&self, core: usize, batch: Vec<IngestMessage>) -> bool {
        self.queues[core].send(batch).await.is_ok()
    }

    /// Routes a batch to the owning cores; waits while any of them is full.
    pub async fn send(&self, batch: Vec<IngestMessage>) -> bool {
        let mut per_core: Vec<Vec<IngestMessage>> = (0..self.cores()).map(|_| Vec::new()).collect();
        for msg in batch {
            per_core[self.core_of(&msg.device_id)].push(msg);
        }
        let mut ok = true;
        for (core, batch) in per_core.into_iter().enumerate() {
            if !batch.is_empty() {
                ok &= self.send_to_core(core, batch).await;
            }
        }
        ok
    }
}

/// Drains this core's ingress queue.
pub async fn serve(core: Rc<Core>, queue: IngressQueue) {
    while let Ok(batch) = queue.recv().await {
        // While this core's cross-core backlog is over its bound, batches stay in the queue;
        // once it is full `Ingress::send` waits, and so does the AMQP link's credit.
        core.mesh.wait_for_room().await;
        core.ingest_local(batch);
    }
}
