//! The thread-per-core runtime: N monoio runtimes, one per core, each with its own
//! SO_REUSEPORT listener, its own shard of state and an inbox for cross-core messages.

pub mod relay;
pub mod clock;
pub mod core;
pub mod durable;
pub mod ingress;
pub mod mesh;
pub mod routing;

pub use self::core::Core;
pub use self::ingress::Ingress;

use std::io;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::rc::Rc;
use std::sync::{mpsc, Arc};

use socket2::{Domain, Protocol, Socket, Type};

use crate::config::Settings;
use crate::Shared;
use mesh::Mesh;

/// Accept tasks per core listener: several, so a connection storm drains the backlog fast.
const ACCEPTORS_PER_CORE: usize = 4;

/// One listening socket with SO_REUSEPORT; the kernel spreads connections over the cores.
fn reuseport_listener(addr: SocketAddr) -> io::Result<StdListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(4096)?;
    Ok(socket.into())
}

/// Claims the port for this process (see [`crate::owner`]), then binds one listener per core
/// on it.
fn bind_all(settings: &Settings) -> io::Result<(Vec<StdListener>, crate::owner::PortClaim)> {
    let claim = crate::owner::claim(SocketAddr::new(settings.config.bind, settings.config.port))?;
    let listeners = (0..settings.cores).map(|_| reuseport_listener(claim.addr)).collect::<io::Result<_>>()?;
    Ok((listeners, claim))
}

type UringRuntime = monoio::FusionRuntime<
    monoio::time::TimeDriver<monoio::IoUringDriver>,
    monoio::time::TimeDriver<monoio::LegacyDriver>,
>;

/// Builds a core's runtime: io_uring when the kernel allows it (unless `epoll` is forced).
fn build_runtime(driver: &str) -> io::Result<(UringRuntime, &'static str)> {
    let entries = 1024;
    if driver != "epoll" {
        let uring = monoio::RuntimeBuilder::<monoio::IoUringDriver>::new().with_entries(entries).enable_timer().build();
        match uring {
            Ok(rt) => return Ok((rt.into(), "io_uring")),
            Err(e) if driver == "uring" => return Err(e),
            Err(e) => tracing::warn!(error = %e, "io_uring refused; falling back to epoll"),
        }
    }
    let legacy = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new().enable_timer().build()?;
    Ok((legacy.into(), "epoll"))
}

/// A started gateway: its address, the door for outside sources, and the core threads.
pub struct Running {
    pub addr: SocketAddr,
    pub ingress: Ingress,
    _threads: Vec<std::thread::JoinHandle<()>>,
    /// Held for the life of the process: no other hubcast may take the port.
    _port: crate::owner::PortClaim,
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

/// Raises the open-file limit to fit `maxConnections` (every socket is a file descriptor):
/// the soft limit up to the hard one, and the hard one too where the process may (root).
fn raise_file_limit(wanted: u64) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // Safety: plain syscalls on a local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(limit.rlim_max);
    let target = wanted.min(nr_open);
    if target > limit.rlim_max {
        let raised = libc::rlimit { rlim_cur: target, rlim_max: target };
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            tracing::debug!(limit = target, "open-file limit raised");
            return;
        }
    }
    let soft = libc::rlimit { rlim_cur: target.min(limit.rlim_max).max(limit.rlim_cur), rlim_max: limit.rlim_max };
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &soft) };
    if soft.rlim_cur < wanted {
        tracing::warn!(limit = soft.rlim_cur, wanted, "the open-file limit caps connections below maxConnections");
    }
}

type CoreStore = Option<(Box<dyn crate::store::StateStore + Send>, crate::store::Loaded)>;

/// Opens `--data-dir` (unless memory only): one store and its loaded state per core, and the
/// stored source positions handed to the ingress.
fn open_store(settings: &Settings, ingress: Ingress) -> io::Result<(Ingress, Vec<CoreStore>)> {
    let crate::store::DataDir::Dir(dir) = &settings.config.data_dir else {
        tracing::info!("memory only (--data-dir none): nothing is kept across a restart");
        return Ok((ingress, (0..settings.cores).map(|_| None).collect()));
    };
    let fsync = std::time::Duration::from_millis(settings.config.fsync_interval);
    let opened = crate::store::open(dir, settings.cores, fsync).map_err(io::Error::other)?;
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
pub fn start(settings: Arc<Settings>, shared: Arc<Shared>) -> io::Result<Running> {
    raise_file_limit(settings.config.max_connections + 1024);
    let (listeners, port) = bind_all(&settings)?;
    let addr = port.addr;
    let (report_tx, reports) = mpsc::channel();
    let (flush, flush_rx): (Vec<_>, Vec<_>) = (0..settings.cores).map(|_| async_channel::bounded::<()>(1)).unzip();
    let mut flush_rx = flush_rx.into_iter();
    let (ingress, mut ingress_queues) = Ingress::new(settings.cores);
    let (ingress, mut stores) = open_store(&settings, ingress)?;
    let (inboxes, receivers) = mesh::inboxes(settings.cores);
    let limits = mesh::MeshLimits::new(
        settings.config.mesh_inbox_messages as usize,
        settings.config.mesh_inbox_bytes as usize,
    );
    let (ready_tx, ready_rx) = mpsc::channel::<io::Result<&'static str>>();
    let mut threads = Vec::new();
    for (index, (listener, inbox)) in listeners.into_iter().zip(receivers).enumerate() {
        let settings = settings.clone();
        let shared = shared.clone();
        let inboxes = inboxes.clone();
        let ready = ready_tx.clone();
        let ingress_queue = ingress_queues.remove(0);
        let (report, flush_rx) = (report_tx.clone(), flush_rx.next().expect("one per core"));
        let store = stores.remove(0);
        let thread = std::thread::Builder::new().name(format!("hubcast-core-{index}")).spawn(move || {
            let (mut runtime, driver) = match build_runtime(&settings.config.io_driver) {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match monoio::net::TcpListener::from_std(listener) {
                    Ok(l) => Rc::new(l),
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let core = Core::new(index, settings.clone(), shared, Mesh::new(index, &inboxes, limits));
                if let Some((store, loaded)) = store {
                    core.attach_store(store, loaded);
                }
                *core.queues.borrow_mut() = Some((inbox.clone(), ingress_queue.clone()));
                monoio::spawn(core.clone().serve_inbox(inbox));
                monoio::spawn(ingress::serve(core.clone(), ingress_queue));
                monoio::spawn(core.clone().run_timers());
                if let Some(plugin) = &core.shared.plugin {
                    plugin.start(&core);
                }
                if index == 0 && settings.config.simulate > 0 {
                    monoio::spawn(crate::ingest::simulate::run(core.clone(), settings.config.simulate));
                }
                for _ in 0..ACCEPTORS_PER_CORE {
                    monoio::spawn(crate::http::accept_loop(core.clone(), listener.clone()));
                }
                tracing::debug!(core = index, driver, "core started");
                let _ = ready.send(Ok(driver));
                // The core runs until its part of a graceful shutdown is done.
                crate::shutdown::core_task(core, listener, report, flush_rx).await;
            });
        })?;
        threads.push(thread);
    }
    drop(ready_tx);
    let mut driver = "";
    for _ in 0..settings.cores {
        driver = ready_rx.recv().map_err(|_| io::Error::other("a core failed to start"))??;
    }
    let scheme = if crate::tls::enabled() { "https" } else { "http" };
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
    Ok(Running { addr, ingress, _threads: threads, _port: port, reports, flush })
}
