//! The seams between a core and what runs beside it: [`Relay`], the link to the other
//! instances of a deployment (Redis scale-out, `src/cluster`), and [`CorePlugin`], something
//! started on every core's own thread (the cluster, the simulated fleet). The application
//! knows only these two traits; without `--redis-url` nothing implements [`Relay`] and no
//! core pays for it.

use std::rc::Rc;
use std::sync::Arc;

use crate::ingest::IngestMessage;
use crate::app::Core;

/// A core's link to the other instances, installed by a [`CorePlugin`] at start.
pub trait Relay {
    /// A device message from a source of this instance, about to be applied on this, its
    /// device's, core: the relay sends it on if another instance watches the device.
    fn offer(&self, msg: &IngestMessage);
    /// The end of a burst of [`Relay::offer`]s: hand what was offered over.
    fn flush(&self);
    /// Devices this instance started (`true`) or stopped watching: a session with a socket
    /// here subscribes to them (`DeviceTable::take_watch_changes`).
    fn watch(&self, changes: Vec<(Box<str>, bool)>);
    /// Whether this instance reads event stream partition `partition` now (holds its
    /// lease): values ingested from a partition read elsewhere are not current.
    fn reads_partition(&self, partition: &str) -> bool;
}

/// Something that runs beside every core, started on the core's own thread before it serves.
pub trait CorePlugin: Send + Sync {
    fn start(self: Arc<Self>, core: &Rc<Core>);
}
