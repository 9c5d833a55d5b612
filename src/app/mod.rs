//! The per-core application: what each core of the runtime runs. A [`Core`] owns its shard
//! (devices, sessions), its view of the cross-core mesh (the one enum of cross-core
//! messages, [`mesh::CoreMsg`]), its clock, its durable store and its door for outside sources ([`ingress`]).
//!
//! Below it: the shard (pure state), push (envelopes, outlets), the store engines and the
//! generic runtime (threads, io drivers, listeners, routing). Above it, and plugged in at
//! start ([`Wiring`], [`relay::CorePlugin`]): the network face (HTTP, WebSocket, Engine.IO,
//! the REST API), which serves the connections a core accepts and sends the cores its own
//! work as [`mesh::CoreTask`]s; scale-out on Redis (which implements [`directory::Directory`],
//! the session directory every core holds); the sources (AMQP, the simulator).

pub mod clock;
pub mod core;
pub mod directory;
pub mod durable;
pub mod ingress;
pub mod mesh;
pub mod record;
pub mod rebuild;
pub mod recovery;
pub mod relay;
pub mod stop;

pub use self::core::Core;
pub use self::ingress::Ingress;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{mpsc, Arc};

use crate::config::Settings;
use crate::runtime::CoreMain;
use mesh::Mesh;

/// Accept tasks per core listener: several, so a connection storm drains the backlog fast.
const ACCEPTORS_PER_CORE: usize = 4;

/// Process-wide services every core can reach; none of them is on the message path.
pub struct Shared {
    pub log: crate::logging::LogControl,
    pub status: crate::status::StatusBoard,
    /// Metrics of sources running outside the cores (the AMQP consumer), read at scrape time.
    pub external_metrics: std::sync::OnceLock<Box<dyn Fn() -> crate::metrics::ExternalSeries + Send + Sync>>,
    /// The IoT Hub service client; `None` without a (well-formed) service connection string.
    pub hub: Option<crate::hub::HubClient>,
    /// Started beside every core, in this order (scale-out on Redis, the simulated fleet).
    pub plugins: Vec<Arc<dyn relay::CorePlugin>>,
}

/// Serves the connections accepted on a core's listener (the HTTP server, `src/http`).
pub type Acceptor = fn(Rc<Core>, Rc<monoio::net::TcpListener>) -> Pin<Box<dyn Future<Output = ()>>>;

/// What the network face above the application plugs into every core (main.rs wires it).
pub struct Wiring {
    /// Run [`ACCEPTORS_PER_CORE`] times on every core's listener.
    pub accept: Acceptor,
    /// Whether the listeners speak TLS (the URL printed at start says `https`).
    pub tls: bool,
}

/// A started gateway: its address, the door for outside sources, and the core threads.
pub struct Running {
    pub addr: SocketAddr,
    pub ingress: Ingress,
    _cores: crate::runtime::Cores,
    /// The cores' shutdown progress, and the word that lets each of them flush.
    reports: mpsc::Receiver<crate::shutdown::Report>,
    flush: Vec<async_channel::Sender<()>>,
}

impl Running {
    /// Runs the graceful shutdown once [`crate::shutdown::STOPPING`] is set (see
    /// [`crate::shutdown`]); `amqp` is the consumer's thread. `Err` says what was still
    /// pending at `deadline`.
    /// `handover` runs once the event stream consumer has stopped, before the cores' final
    /// flush (scale-out: checkpoint and give the partition leases up).
    pub fn shutdown(
        self,
        amqp: Option<std::thread::JoinHandle<()>>,
        handover: Option<Box<dyn FnOnce(std::time::Instant) + Send>>,
        deadline: std::time::Instant,
    ) -> Result<(), String> {
        // The core threads park after flushing; the process exits without tearing down
        // their runtimes.
        crate::shutdown::drive(&self.reports, &self.flush, amqp, handover, deadline)
    }
}

type CoreStore = Option<(Box<dyn crate::store::StateStore + Send>, crate::store::Loaded)>;

/// Opens `--data-dir` (unless memory only): one store and its loaded state per core, and the
/// stored source positions handed to the ingress.
fn open_store(settings: &Settings, lock: Option<crate::store::DirLock>, ingress: Ingress) -> io::Result<(Ingress, Vec<CoreStore>)> {
    let (crate::store::DataDir::Dir(dir), Some(lock)) = (&settings.config.data_dir, lock) else {
        tracing::info!("memory only (--data-dir none): nothing is kept across a restart");
        return Ok((ingress, (0..settings.cores).map(|_| None).collect()));
    };
    let options = crate::store::Options {
        fsync_interval: std::time::Duration::from_millis(settings.config.fsync_interval),
        snapshot_log_bytes: settings.config.snapshot_log_bytes,
        start_damaged: settings.config.store_start_damaged,
        stream_bytes: settings.config.recovery_session_bytes as usize,
    };
    let opened = crate::store::open_locked(dir, lock, settings.cores, options).map_err(io::Error::other)?;
    let prefix = source_prefix(settings);
    let resume = opened
        .resume_positions()
        .into_iter()
        .filter_map(|(k, seq)| k.strip_prefix(&*prefix).map(|p| (p.to_string(), seq)))
        .collect();
    let ingress = ingress.with_source(ingress::SourcePositions { prefix, resume });
    Ok((ingress, opened.stores.into_iter().zip(opened.loaded).map(Some).collect()))
}

/// Names the event stream and consumer group in stored position keys: positions of another
/// stream or group are never used.
pub fn source_prefix(settings: &Settings) -> String {
    let stream = match &settings.event_hub {
        Some(Ok(c)) => format!(
            "{}/{}",
            c.endpoint.as_deref().or(c.host_name.as_deref()).unwrap_or("").trim_end_matches('/'),
            c.entity_path.as_deref().unwrap_or("")
        ),
        _ => String::new(),
    };
    format!("{stream}|{}|", settings.config.event_hub_consumer_group)
}

/// Starts every core; returns once all of them are serving.
pub fn start(settings: Arc<Settings>, shared: Arc<Shared>, wiring: Wiring) -> io::Result<Running> {
    let bind = SocketAddr::new(settings.config.bind, settings.config.port);
    // The data dir's lock before the port: once it is ours, no other live hubcast owns this
    // data dir, and a held port is most likely our own previous run's listener that the kernel
    // is still closing after a kill -9 (src/owner.rs): it is waited for, within a bound.
    let lock = match &settings.config.data_dir {
        crate::store::DataDir::Dir(dir) => Some(crate::store::lock(dir).map_err(io::Error::other)?),
        crate::store::DataDir::Memory => None,
    };
    let patience = if lock.is_some() { crate::owner::RESTART_PATIENCE } else { std::time::Duration::ZERO };
    let bound = crate::runtime::bind(bind, settings.cores, settings.config.max_connections + settings.config.fd_reserve, patience)?;
    let addr = bound.addr();
    let (report_tx, reports) = mpsc::channel();
    let (flush, flush_rx): (Vec<_>, Vec<_>) = (0..settings.cores).map(|_| async_channel::bounded::<()>(1)).unzip();
    let mut flush_rx = flush_rx.into_iter();
    let (ingress, mut ingress_queues) = Ingress::new(settings.cores, settings.config.event_hub_queue_bytes as u32);
    let (ingress, mut stores) = open_store(&settings, lock, ingress)?;
    let (inboxes, receivers) = mesh::inboxes(settings.cores);
    let limits = mesh::MeshLimits::new(
        settings.config.mesh_inbox_messages as usize,
        settings.config.mesh_inbox_bytes as usize,
    );
    let mut mains: Vec<CoreMain> = Vec::new();
    for inbox in receivers {
        let settings = settings.clone();
        let shared = shared.clone();
        let inboxes = inboxes.clone();
        let ingress_queue = ingress_queues.remove(0);
        let (report, flush_rx) = (report_tx.clone(), flush_rx.next().expect("one per core"));
        let store = stores.remove(0);
        let accept = wiring.accept;
        mains.push(Box::new(move |start: crate::runtime::CoreStart| {
            Box::pin(async move {
                let crate::runtime::CoreStart { index, listener, ready } = start;
                let core = Core::new(index, settings.clone(), shared, Mesh::new(index, &inboxes, limits));
                if let Some((store, loaded)) = store {
                    core.attach_store(store, loaded);
                }
                *core.queues.borrow_mut() = Some((inbox.clone(), ingress_queue.clone()));
                monoio::spawn(core.clone().serve_inbox(inbox));
                monoio::spawn(ingress::serve(core.clone(), ingress_queue));
                monoio::spawn(core.clone().run_timers());
                for plugin in &core.shared.plugins {
                    plugin.clone().start(&core);
                }
                core.watch_restored_streams();
                for _ in 0..ACCEPTORS_PER_CORE {
                    monoio::spawn(accept(core.clone(), listener.clone()));
                }
                tracing::debug!(core = index, "core started");
                ready.serving();
                // The core runs until its part of a graceful shutdown is done.
                stop::core_task(core, listener, report, flush_rx).await;
            })
        }));
    }
    let cores = crate::runtime::run(bound, &settings.config.io_driver, mains)?;
    let driver = cores.driver;
    let scheme = if wiring.tls { "https" } else { "http" };
    let url = format!("{scheme}://{addr}");
    println!("hubcast {} listening on {url} ({} cores, {driver})", env!("CARGO_PKG_VERSION"), settings.cores);
    let endpoint = settings.config.public_url.clone().unwrap_or_else(|| {
        if addr.ip().is_unspecified() { format!("{scheme}://127.0.0.1:{}", addr.port()) } else { url.clone() }
    });
    if settings.config.primary_admin_secret.is_none() && settings.config.secondary_admin_secret.is_none() {
        println!("Admin connection string: Endpoint={endpoint};SharedAccessKey={}", settings.admin_secrets[0]);
    }
    println!("Console: {}/console", endpoint.trim_end_matches('/'));
    tracing::info!(%addr, cores = settings.cores, driver, "hubcast started");
    Ok(Running { addr, ingress, _cores: cores, reports, flush })
}
