//! The seam between a core and the other instances of a deployment (Redis scale-out,
//! `src/cluster`). The runtime knows only these two traits; without `--redis-url` nothing
//! implements them and no core pays for them.

use std::rc::Rc;

use crate::ingest::IngestMessage;
use crate::runtime::Core;

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
}

/// Something that runs beside every core, started on the core's own thread.
pub trait CorePlugin: Send + Sync {
    fn start(&self, core: &Rc<Core>);
}
