//! One core: its shard, its view of the mesh, and the helpers that run an operation wherever
//! its data lives (in place when local, over the mesh otherwise).

use std::any::{Any, TypeId};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_channel::oneshot;

use crate::config::Settings;
use crate::hub::HubCall;
use crate::ids::SessionId;
use crate::ingest::{IngestMessage, IngestSettings};
use crate::push::outlet::{CloseReason, Delivered, Outlet};
use crate::push::Delivery;
use crate::shard::devices::{PushTiming, Source};
use crate::app::mesh::{await_reply, CoreMsg, Inbox, Mesh};
use crate::runtime::routing::{core_of_device, core_of_session};
use crate::shard::{DeviceOp, DeviceTable, SessionOp, SessionTable};
use crate::app::Shared;

pub struct Core {
    pub index: usize,
    pub settings: Arc<Settings>,
    pub shared: Arc<Shared>,
    pub mesh: Rc<Mesh>,
    pub devices: RefCell<DeviceTable>,
    pub sessions: RefCell<SessionTable>,
    pub metrics: crate::metrics::CoreMetrics,
    /// This core's queues, for their depth in metrics.
    pub queues: RefCell<Option<(Inbox, crate::app::ingress::IngressQueue)>>,
    /// Requests in hand and live sockets, for a graceful shutdown ([`crate::shutdown`]).
    pub drain: Rc<crate::shutdown::CoreDrain>,
    /// This core's durable store (`None`: memory only). See src/app/durable.rs.
    pub store: RefCell<Option<Box<dyn crate::store::StateStore + Send>>>,
    /// A snapshot being written a slice at a time (app/durable.rs).
    pub snapshot: crate::app::durable::SnapshotRun,
    /// Source partition → the highest sequence number this core has applied.
    pub applied: RefCell<hashbrown::HashMap<Box<str>, i64>>,
    /// This core's timers: one task sleeping until the shard's next deadline (app/clock.rs).
    pub clock: crate::runtime::clock::Clock,
    /// Scale-out: the link to the other instances (`None`: one instance). app/relay.rs.
    pub relay: RefCell<Option<Rc<dyn crate::app::relay::Relay>>>,
    /// Where sessions live (app/directory.rs): this process alone, or Redis scale-out.
    directory: RefCell<Rc<dyn crate::app::directory::Directory>>,
    /// This core's state of the layers above the application (the Engine.IO polling
    /// sessions), one value per type.
    pub ext: Extensions,
    /// Socket writes held back while the core is saturated (src/push/linger.rs).
    pub linger: Rc<crate::push::linger::Linger>,
    /// How many deliveries the last ingest batch made (at most [`DELIVERIES_RESERVE`]): the
    /// next batch's list starts that large instead of doubling its way up from empty.
    deliveries_hint: Cell<usize>,
    /// Connection state recovery: settings, the streams' byte total and deadlines (app/recovery.rs).
    pub recovery: crate::app::recovery::CoreRecovery,
}

/// The most deliveries an ingest batch reserves room for up front (~40 bytes each).
const DELIVERIES_RESERVE: usize = 4096;

/// Per-core state of the layers above the application, one value per type: those layers
/// keep their own state on the core without the application naming their types.
#[derive(Default)]
pub struct Extensions(RefCell<hashbrown::HashMap<TypeId, Rc<dyn Any>>>);

impl Extensions {
    /// This core's `T`, made with `T::default()` on first use.
    pub fn get<T: Default + 'static>(&self) -> Rc<T> {
        let any = self.0.borrow_mut().entry(TypeId::of::<T>()).or_insert_with(|| Rc::new(T::default())).clone();
        any.downcast::<T>().unwrap_or_else(|_| unreachable!("keyed by its type"))
    }

    /// Sets this core's `T`.
    pub fn set<T: 'static>(&self, value: T) {
        self.0.borrow_mut().insert(TypeId::of::<T>(), Rc::new(value));
    }
}

impl Core {
    pub fn new(index: usize, settings: Arc<Settings>, shared: Arc<Shared>, mesh: Rc<Mesh>) -> Rc<Self> {
        let c = &settings.config;
        let ingest = IngestSettings {
            custom_timestamp_key: c.custom_timestamp_key.clone(),
            custom_device_id_key: c.custom_device_id_key.clone(),
            custom_connection_state_key: c.custom_connection_state_key.clone(),
            connection_state_on_telemetry: c.connection_state_on_telemetry,
        };
        let timing = PushTiming {
            throttle: (c.throttling_interval > 0).then(|| Duration::from_millis(c.throttling_interval as u64)),
            connection_ttl: settings.connection_state_ttl(),
        };
        let linger = crate::push::linger::Linger::new(Duration::from_micros(c.socket_linger_us));
        let sessions = SessionTable::new(settings.session_grace_period(), c.max_sessions as usize)
            .with_unused_ttl(Duration::from_secs(c.unused_session_ttl))
            .process_total();
        let mut devices = DeviceTable::new(ingest, timing);
        if shared.hub.is_some() {
            devices = devices.with_hub_twins(settings.twin_cache_ttl());
        }
        let recovery = crate::app::recovery::CoreRecovery::new(&settings);
        Rc::new(Self {
            index,
            shared,
            mesh,
            devices: RefCell::new(devices),
            sessions: RefCell::new(sessions),
            metrics: Default::default(),
            queues: RefCell::default(),
            settings,
            drain: Rc::default(),
            store: RefCell::default(),
            snapshot: Default::default(),
            applied: RefCell::default(),
            clock: Default::default(),
            relay: RefCell::default(),
            directory: RefCell::new(Rc::new(crate::app::directory::Local)),
            ext: Extensions::default(),
            linger,
            deliveries_hint: Cell::new(0),
            recovery,
        })
    }

    /// Hands the devices whose watch changed to the relay (scale-out only).
    fn relay_watch(&self) {
        let relay = self.relay.borrow();
        if let Some(relay) = relay.as_ref() {
            let changes = self.devices.borrow_mut().take_watch_changes();
            if !changes.is_empty() {
                relay.watch(changes);
            }
        }
    }

    /// The session directory of this core (app/directory.rs).
    pub fn directory(&self) -> Rc<dyn crate::app::directory::Directory> {
        self.directory.borrow().clone()
    }

    /// Installs a scale-out engine of the session directory; at start, before the core serves.
    pub fn set_directory(&self, directory: Rc<dyn crate::app::directory::Directory>) {
        *self.directory.borrow_mut() = directory;
    }

    pub fn cores(&self) -> usize {
        self.settings.cores
    }

    pub fn device_core(&self, device: &str) -> usize {
        core_of_device(device, self.cores())
    }

    pub fn session_core(&self, session: SessionId) -> usize {
        core_of_session(session, self.cores())
    }

    /// Sends device operations (all owned by core `target`) to that core, in order; each one
    /// with a reply answers its own caller there.
    pub fn device_ops(self: &Rc<Self>, target: usize, ops: Vec<DeviceOp>) {
        if target != self.index {
            self.mesh.post(target, CoreMsg::Devices { ops });
            return;
        }
        {
            let mut devices = self.devices.borrow_mut();
            for op in ops {
                devices.apply(op);
            }
        }
        self.persist(None);
        self.arm_clock();
        self.relay_watch();
    }

    /// Sends device operations to their devices' cores (in order per core).
    pub fn device_ops_anywhere(self: &Rc<Self>, ops: Vec<DeviceOp>) {
        if self.cores() == 1 {
            return self.device_ops(0, ops);
        }
        let mut per_core: Vec<Vec<DeviceOp>> = (0..self.cores()).map(|_| Vec::new()).collect();
        for op in ops {
            per_core[self.device_core(op.device())].push(op);
        }
        for (core, ops) in per_core.into_iter().enumerate() {
            if !ops.is_empty() {
                self.device_ops(core, ops);
            }
        }
    }

    /// Sends one device operation to its device's core and waits for its typed answer;
    /// `None` only when the core has stopped (shutdown).
    pub async fn ask_device<T>(self: &Rc<Self>, (op, answer): (DeviceOp, oneshot::Receiver<T>)) -> Option<T> {
        let target = self.device_core(op.device());
        self.device_ops(target, vec![op]);
        answer.await.ok()
    }

    /// Sends a session operation to the session's core; it answers its own caller there.
    pub fn session_op(self: &Rc<Self>, session: SessionId, op: SessionOp) {
        self.session_op_on(self.session_core(session), op);
    }

    /// Sends a session operation to core `target`.
    pub fn session_op_on(self: &Rc<Self>, target: usize, op: SessionOp) {
        if target == self.index {
            self.run_session_op(op);
        } else {
            self.mesh.post(target, CoreMsg::Session { op });
        }
    }

    /// Sends a session operation to core `target` and waits for its typed answer; `None`
    /// only when that core has stopped (shutdown).
    pub async fn ask_session<T>(self: &Rc<Self>, target: usize, (op, answer): (SessionOp, oneshot::Receiver<T>)) -> Option<T> {
        self.session_op_on(target, op);
        answer.await.ok()
    }

    /// Session operations run here, on the session's core; their device steps go out from
    /// here too, so they stay ordered with this session's clean-up messages.
    fn run_session_op(self: &Rc<Self>, op: SessionOp) {
        let now = Instant::now();
        match op {
            SessionOp::Create { id, created } => {
                let ok = self.sessions.borrow_mut().create(id, now);
                if ok {
                    tracing::debug!(session = %id, "session opened");
                }
                self.committed();
                let _ = created.send(ok);
            }
            SessionOp::Delete { id, found } => {
                let record = self.sessions.borrow_mut().remove(id);
                let existed = record.is_some();
                if let Some(record) = record {
                    self.end_session(id, record, "session deleted");
                }
                self.committed();
                let _ = found.send(existed);
            }
            SessionOp::DeleteAll { any } => {
                let all = self.sessions.borrow_mut().drain();
                let some = !all.is_empty();
                for (id, record) in all {
                    self.end_session(id, record, "session deleted");
                }
                self.committed();
                let _ = any.send(some);
            }
            SessionOp::ListDevices { request, page } => {
                let _ = page.send(crate::shard::listing::page(&self.devices.borrow(), &request));
            }
            SessionOp::Scoped { session, register_devices, mut ops, found } => {
                {
                    let mut sessions = self.sessions.borrow_mut();
                    let Some(record) = sessions.touch(session, now) else {
                        drop(sessions);
                        let _ = found.send(false);
                        return;
                    };
                    // Scale-out: a session with a socket here (or a history its clients may
                    // recover) watches what it subscribes to.
                    let streamed = record.recovery.as_ref().is_some_and(|r| r.stream.is_some());
                    if (!record.sockets.is_empty() || streamed) && self.relay.borrow().is_some() {
                        let present: Vec<DeviceOp> = ops
                            .iter()
                            .filter(|op| matches!(op, DeviceOp::Subscribe { .. } | DeviceOp::SetAccess { .. }))
                            .map(|op| DeviceOp::Presence { device: op.device().into(), session, here: true })
                            .collect();
                        ops.extend(present);
                    }
                    if register_devices {
                        let mut added = false;
                        for op in &ops {
                            added |= record.devices.insert(op.device());
                        }
                        if added {
                            sessions.dirty.mark(session);
                        }
                    }
                }
                // Session changes are committed before the device steps leave this core.
                self.committed();
                self.device_ops_anywhere(ops);
                let _ = found.send(true);
            }
        }
    }

    /// After a session-table change: commit it and re-arm the clock.
    fn committed(&self) {
        self.persist(None);
        self.arm_clock();
    }

    /// A session is gone: close its sockets and drop its grants and subscriptions.
    pub(crate) fn end_session(self: &Rc<Self>, id: SessionId, record: crate::shard::sessions::SessionRecord, why: &str) {
        for outlet in &record.sockets {
            outlet.close(CloseReason::disconnect(1000, why));
        }
        self.recovery_session_gone(id);
        self.forget_session(id, record.devices);
    }

    /// Drops a gone session's grants and subscriptions on every device it touched.
    fn forget_session(self: &Rc<Self>, session: SessionId, devices: crate::shard::sessions::DeviceSet) {
        let ops: Vec<DeviceOp> = devices.iter().map(|device| DeviceOp::ForgetSession { device: device.into(), session }).collect();
        if ops.is_empty() {
            return;
        }
        self.device_ops_anywhere(ops);
    }

    /// Applies device messages owned by this core and pushes what they changed.
    pub fn ingest_local(self: &Rc<Self>, batch: Vec<IngestMessage>) {
        self.ingest_from(batch, None)
    }

    /// [`Core::ingest_local`] of messages of one event stream partition (`None`: a source
    /// without partitions).
    pub fn ingest_from(self: &Rc<Self>, batch: Vec<IngestMessage>, partition: Option<&str>) {
        let deliveries = self.apply_ingest(batch, partition);
        self.recovery_posting(&deliveries);
        self.persist(None);
        self.dispatch(deliveries);
        self.read_whole_twins();
    }

    /// Reads from the IoT Hub the whole twin of each device whose twin changes wait for one
    /// (`DeviceTable::take_twin_fetches`), then merges and pushes them on this, the device's,
    /// core. One read per device at a time; the hub client's bounded queue bounds the rest.
    fn read_whole_twins(self: &Rc<Self>) {
        let devices = self.devices.borrow_mut().take_twin_fetches();
        for device in devices {
            let me = self.clone();
            monoio::spawn(async move {
                loop {
                    let read = match me.shared.hub.as_ref() {
                        Some(hub) => hub.call(HubCall::GetTwin { device: device.to_string() }, hub.timeout()).await,
                        None => Err(crate::model::Rejection::new(503, "IoT Hub service client not running")),
                    };
                    let mut deliveries = Vec::new();
                    let again = me.devices.borrow_mut().hub_twin_fetched(&device, read.map(|a| a.body), Instant::now(), &mut deliveries);
                    me.recovery_posting(&deliveries);
                    me.persist(None);
                    me.arm_clock();
                    me.dispatch(deliveries);
                    if !again {
                        break;
                    }
                }
            });
        }
    }

    /// Applies device messages owned by this core, from a source of this instance (offered
    /// to the relay first, with scale-out), of one event stream partition or none; returns
    /// what to push.
    pub fn apply_ingest(&self, batch: Vec<IngestMessage>, partition: Option<&str>) -> Vec<Delivery> {
        self.apply_ingest_from(batch, Some(partition))
    }

    /// Applies another instance's device messages, received through the relay (never
    /// relayed again), and pushes what they changed to this instance's sockets.
    pub fn ingest_replicas(self: &Rc<Self>, batch: Vec<IngestMessage>) {
        let deliveries = self.apply_ingest_from(batch, None);
        self.recovery_posting(&deliveries);
        self.persist(None);
        self.dispatch(deliveries);
        self.read_whole_twins();
    }

    /// `local`: from a source of this instance, of a partition (`Some(Some(p))`) or none;
    /// `None`: another instance's messages.
    fn apply_ingest_from(&self, batch: Vec<IngestMessage>, local: Option<Option<&str>>) -> Vec<Delivery> {
        let now = Instant::now();
        let mut deliveries = Vec::with_capacity(self.deliveries_hint.get());
        let any_relay = self.relay.borrow().clone();
        let relay = if local.is_some() { any_relay.clone() } else { None };
        {
            let mut devices = self.devices.borrow_mut();
            devices.ingest_from(match local {
                None => Source::Elsewhere,
                Some(None) => Source::Here,
                // Without a relay (one instance) every partition is read here.
                Some(Some(p)) => Source::Partition(p, relay.as_ref().is_none_or(|r| r.reads_partition(p))),
            });
            // With a store, a device is handed to it as it is ingested, while its entry is in
            // cache (`DeviceTable::ingest_recording`); the unit is committed by `persist`.
            let storing = self.store.borrow().is_some();
            let mut store = self.store.borrow_mut();
            let mut put = |c: crate::store::Change<'_>| {
                if let Some(s) = store.as_mut() {
                    s.put(c);
                }
            };
            for msg in batch {
                self.metrics.message_in(msg.source as usize);
                let record: Option<&mut dyn FnMut(crate::store::Change<'_>)> = if storing { Some(&mut put) } else { None };
                // A message read again from its partition (design step 9) is not relayed
                // either: whoever watches the device had it from the first read.
                if devices.ingest_recording(&msg, now, &mut deliveries, record) {
                    if let Some(relay) = &relay {
                        relay.offer(&msg);
                    }
                    // Kept for a rebuild on this instance (design step 10): after `offer`,
                    // which does not move it.
                    if let Some(relay) = &any_relay {
                        relay.ring(&msg, local.is_some(), now, &|| devices.decided(&msg));
                    }
                }
            }
        }
        if let Some(relay) = &relay {
            relay.flush();
        }
        self.deliveries_hint.set(deliveries.len().min(DELIVERIES_RESERVE));
        // Held-back telemetry and devices seen connected add deadlines.
        self.arm_clock();
        deliveries
    }

    /// Sends deliveries to their sessions' cores, one batch per core.
    pub fn dispatch(self: &Rc<Self>, deliveries: Vec<Delivery>) {
        if deliveries.is_empty() {
            return;
        }
        if self.cores() == 1 {
            return self.deliver_local(deliveries);
        }
        let mut per_core: Vec<Vec<Delivery>> = (0..self.cores()).map(|_| Vec::new()).collect();
        for d in deliveries {
            per_core[self.session_core(d.session)].push(d);
        }
        for (core, batch) in per_core.into_iter().enumerate() {
            if batch.is_empty() {
                continue;
            }
            if core == self.index {
                self.deliver_local(batch);
            } else {
                self.mesh.post(core, CoreMsg::Deliver(batch));
            }
        }
    }

    /// Hands deliveries to the sockets of sessions this core owns; a session with a recovery
    /// stream keeps each frame there first, and its sockets get the frame's seq
    /// (app/recovery.rs).
    pub fn deliver_local(&self, deliveries: Vec<Delivery>) {
        let mut sessions = self.sessions.borrow_mut();
        let mut now = None;
        let mut trimmed = crate::push::stream::Trimmed::default();
        // A session whose history is being rebuilt here (design step 11) has its deliveries
        // held until the rebuild is in (app/rebuild.rs).
        let holding = !self.recovery.rebuilding.borrow().is_empty();
        for d in &deliveries {
            if holding && self.rebuild_hold(d) {
                continue;
            }
            if let Some(record) = sessions.get_mut(d.session) {
                let (seq, part) = self.recovery_push(d.session, record, d, &mut now, &mut trimmed);
                for outlet in &record.sockets {
                    if outlet.deliver_seq(d, seq) == Delivered::Conflated {
                        self.metrics.conflated(1);
                    }
                    if let Some(part) = &part {
                        outlet.set_part(seq, part);
                    }
                }
            }
        }
        drop(sessions);
        if let Some(batch) = now {
            let at = batch.clock.now;
            drop(batch);
            self.recovery_after_batch(trimmed, at);
        }
        // Before any writer runs: the appended frames and the count taken in (design step 7).
        self.recovery_taken_in(deliveries.len());
        // Held socket writes wait for the core's next inbound batch (push/linger.rs).
        self.linger.inbound_applied();
    }

    /// Attaches a socket to its session (on the session's core); false if there is no such session.
    pub fn attach_socket(self: &Rc<Self>, session: SessionId, outlet: Rc<Outlet>) -> bool {
        let first = match self.sessions.borrow_mut().touch(session, Instant::now()) {
            Some(record) => {
                record.sockets.push(outlet);
                record.had_socket = true;
                (record.sockets.len() == 1).then(|| record.devices.iter().map(Box::from).collect::<Vec<_>>())
            }
            None => return false,
        };
        if let Some(devices) = first {
            self.presence(session, devices, true);
        }
        true
    }

    /// Detaches a closed socket; the session's grace period starts when its last socket goes.
    pub fn detach_socket(self: &Rc<Self>, session: SessionId, outlet_id: u64) {
        let last = {
            let now = Instant::now();
            let mut sessions = self.sessions.borrow_mut();
            sessions.detach_socket(session, outlet_id, now);
            if let Some(record) = sessions.get_mut(session) {
                self.recovery_left(record, session, outlet_id, now);
            }
            // A session whose clients may still recover keeps its devices watched (scale-out)
            // until its history goes (app/recovery.rs): what other instances take in meanwhile
            // must reach its stream.
            sessions
                .get(session)
                .filter(|r| r.sockets.is_empty() && r.recovery.as_ref().is_none_or(|x| x.stream.is_none()))
                .map(|r| r.devices.iter().map(Box::from).collect::<Vec<_>>())
        };
        self.arm_clock();
        if let Some(devices) = last {
            self.presence(session, devices, false);
        }
    }

    /// Scale-out: tells the session's devices whether it has a socket on this instance.
    pub(crate) fn presence(self: &Rc<Self>, session: SessionId, devices: Vec<Box<str>>, here: bool) {
        if self.relay.borrow().is_none() || devices.is_empty() {
            return;
        }
        let ops = devices.into_iter().map(|device| DeviceOp::Presence { device, session, here }).collect();
        self.device_ops_anywhere(ops);
    }

    /// Whether the session exists (on the session's core), keeping it alive.
    pub fn session_alive(&self, session: SessionId) -> bool {
        self.sessions.borrow_mut().touch(session, Instant::now()).is_some()
    }

    /// Routes device messages to their owning cores; resolves when all are applied (and the
    /// cores that applied them have room in their cross-core backlogs).
    pub async fn ingest(self: &Rc<Self>, batch: Vec<IngestMessage>) {
        self.ingest_begin(batch).await.await;
    }

    /// The first half of [`Core::ingest`]: waits for room, applies this core's share and
    /// posts the others' (in call order, so batches begun one after the other on this core
    /// reach every owning core in that order). The returned future resolves once every
    /// share is applied; it needs no polling to make progress.
    pub async fn ingest_begin(self: &Rc<Self>, batch: Vec<IngestMessage>) -> impl std::future::Future<Output = ()> {
        self.mesh.wait_for_room().await;
        let per_core = self.split_by_core(batch);
        let mut waits = Vec::new();
        for (core, batch) in per_core.into_iter().enumerate() {
            if batch.is_empty() {
                continue;
            }
            if core == self.index {
                self.ingest_local(batch);
            } else {
                let (tx, rx) = oneshot::channel();
                self.mesh.post(core, CoreMsg::Ingest { batch, done: Some(tx) });
                waits.push(rx);
            }
        }
        async move {
            for rx in waits {
                await_reply(rx).await;
            }
        }
    }

    /// Splits a batch by owning core, each share allocated once at its size: pushed one by
    /// one, each share grew 4, 8, … 512 messages, copying them at every step (~240
    /// instructions per message of a 500-message `POST /ingest`, callgrind). A batch whose
    /// messages all belong to one core (always, with one core) is that core's share as it is.
    fn split_by_core(&self, batch: Vec<IngestMessage>) -> Vec<Vec<IngestMessage>> {
        let cores = self.cores();
        if cores == 1 {
            return vec![batch];
        }
        let owners: Vec<u32> = batch.iter().map(|m| self.device_core(&m.device_id) as u32).collect();
        let mut counts = vec![0usize; cores];
        for &c in &owners {
            counts[c as usize] += 1;
        }
        if let Some(only) = counts.iter().position(|&n| n == batch.len()) {
            let mut per_core: Vec<Vec<IngestMessage>> = (0..cores).map(|_| Vec::new()).collect();
            per_core[only] = batch;
            return per_core;
        }
        let mut per_core: Vec<Vec<IngestMessage>> = counts.iter().map(|&n| Vec::with_capacity(n)).collect();
        for (msg, c) in batch.into_iter().zip(owners) {
            per_core[c as usize].push(msg);
        }
        per_core
    }

    /// Routes device messages without waiting (sources that do not need an acknowledgement).
    pub fn ingest_detached(self: &Rc<Self>, batch: Vec<IngestMessage>) {
        let per_core = self.split_by_core(batch);
        for (core, batch) in per_core.into_iter().enumerate() {
            if batch.is_empty() {
                continue;
            }
            if core == self.index {
                self.ingest_local(batch);
            } else {
                self.mesh.post(core, CoreMsg::Ingest { batch, done: None });
            }
        }
    }

    /// Serves this core's inbox: work other cores sent here.
    pub async fn serve_inbox(self: Rc<Self>, inbox: Inbox) {
        while let Ok(batch) = inbox.recv().await {
            self.mesh.taken(batch.iter().map(CoreMsg::items).sum());
            for msg in batch {
                match msg {
                    CoreMsg::Ingest { batch, done } => {
                        self.ingest_local(batch);
                        if let Some(done) = done {
                            // `POST /ingest` is answered once this core's backlog has room
                            // again (never awaited here: this task must keep draining).
                            if self.mesh.has_room() {
                                let _ = done.send(());
                            } else {
                                let me = self.clone();
                                monoio::spawn(async move {
                                    me.mesh.wait_for_room().await;
                                    let _ = done.send(());
                                });
                            }
                        }
                    }
                    CoreMsg::Devices { ops } => self.device_ops(self.index, ops),
                    CoreMsg::Session { op } => self.run_session_op(op),
                    CoreMsg::Deliver(deliveries) => self.deliver_local(deliveries),
                    CoreMsg::Metrics(reply) => {
                        let _ = reply.send(self.metrics_snapshot());
                    }
                    CoreMsg::Task(task) => task.run(&self),
                }
            }
        }
    }

    /// This core's metrics, with the sizes of its shard.
    pub fn metrics_snapshot(&self) -> crate::metrics::Snapshot {
        let (grants, subscriptions) = self.devices.borrow().access_counts();
        let queues = self.queues.borrow();
        let state = crate::metrics::StateCounts {
            devices: self.devices.borrow().len() as u64,
            sessions: self.sessions.borrow().len() as u64,
            grants,
            subscriptions,
            inbox_depth: queues.as_ref().map_or(0, |(inbox, _)| inbox.len() as u64),
            ingress_depth: queues.as_ref().map_or(0, |(_, ingress)| ingress.len() as u64),
            ingress_bytes: queues.as_ref().map_or(0, |(_, ingress)| ingress.bytes()),
            inbox_messages: self.mesh.inbox_load(self.index) as u64,
            mesh_backlog: self.mesh.backlog().into_iter().map(|n| n as u64).collect(),
            mesh_backlog_peak: self.mesh.backlog_peak.get() as u64,
            mesh_conflated: self.mesh.conflated.get(),
            timer_wakeups: self.clock.wakeups.get(),
            socket_writes_held: self.linger.holds.get(),
            recovery_history_bytes: self.recovery.history.held() as u64,
            ingest_rereads: self.devices.borrow().rereads(),
        };
        self.metrics.snapshot(state)
    }
}
