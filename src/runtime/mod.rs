//! The thread-per-core runtime, and nothing else: N threads, each running one monoio runtime
//! (io_uring, epoll where the kernel refuses io_uring) with its own SO_REUSEPORT listener on
//! the one port, the cross-core [`mesh`] (bounded inboxes, batching, back-pressure; generic
//! over the message type), and the routing function that names the core owning a key
//! ([`routing`]), and the deadline [`clock`] a timer task sleeps on.
//!
//! It knows nothing of HTTP, sockets or devices: each core runs the [`CoreMain`] the
//! application hands it (`src/app` builds one per core: its shard, its inbox, its tasks).
//! Start-up is two steps so that the port is claimed before anything else is opened:
//! [`bind`] (raise the open-file limit, claim the port, one listener per core), then [`run`]
//! (one thread per core; returns once every core said it serves).

pub mod clock;
pub mod mesh;
pub mod routing;

use std::future::Future;
use std::io;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::mpsc;

use socket2::{Domain, Protocol, Socket, Type};

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

/// The port, claimed for this process (see [`crate::owner`]), and one listener per core on it.
pub struct Bound {
    listeners: Vec<StdListener>,
    claim: crate::owner::PortClaim,
}

impl Bound {
    pub fn addr(&self) -> SocketAddr {
        self.claim.addr
    }
}

/// Raises the open-file limit to `max_files`, claims `addr` for this process (a held port
/// tried again for `patience`, see [`crate::owner`]) and binds `cores` listeners on it.
pub fn bind(addr: SocketAddr, cores: usize, max_files: u64, patience: std::time::Duration) -> io::Result<Bound> {
    raise_file_limit(max_files);
    let claim = crate::owner::claim(addr, patience)?;
    let listeners = (0..cores).map(|_| reuseport_listener(claim.addr)).collect::<io::Result<_>>()?;
    Ok(Bound { listeners, claim })
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

/// What a core's body gets when its runtime is up: its index, its listener, and the word
/// to say once it serves.
pub struct CoreStart {
    pub index: usize,
    pub listener: Rc<monoio::net::TcpListener>,
    pub ready: Ready,
}

/// Said once by a core whose tasks are spawned: [`run`] returns when every core has said it.
pub struct Ready {
    tx: mpsc::Sender<io::Result<&'static str>>,
    driver: &'static str,
}

impl Ready {
    pub fn serving(self) {
        let _ = self.tx.send(Ok(self.driver));
    }
}

/// One core's body: built on the starting thread (so it is `Send`), run on the core's own
/// thread inside its runtime for the life of the process.
pub type CoreMain = Box<dyn FnOnce(CoreStart) -> Pin<Box<dyn Future<Output = ()>>> + Send>;

/// The running cores.
pub struct Cores {
    /// The io driver the cores chose (`io_uring` or `epoll`).
    pub driver: &'static str,
    _threads: Vec<std::thread::JoinHandle<()>>,
    /// Held for the life of the process: no other hubcast may take the port.
    _port: crate::owner::PortClaim,
}

/// Starts one thread per listener, each a monoio runtime running its [`CoreMain`]
/// (`io_driver`: `auto`, `uring` or `epoll`); returns once every core serves.
pub fn run(bound: Bound, io_driver: &str, mains: Vec<CoreMain>) -> io::Result<Cores> {
    let Bound { listeners, claim } = bound;
    let cores = listeners.len();
    let (ready_tx, ready_rx) = mpsc::channel::<io::Result<&'static str>>();
    let mut threads = Vec::new();
    for (index, (listener, main)) in listeners.into_iter().zip(mains).enumerate() {
        let ready = ready_tx.clone();
        let io_driver = io_driver.to_string();
        let thread = std::thread::Builder::new().name(format!("hubcast-core-{index}")).spawn(move || {
            let (mut runtime, driver) = match build_runtime(&io_driver) {
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
                main(CoreStart { index, listener, ready: Ready { tx: ready, driver } }).await;
            });
        })?;
        threads.push(thread);
    }
    drop(ready_tx);
    let mut driver = "";
    for _ in 0..cores {
        driver = ready_rx.recv().map_err(|_| io::Error::other("a core failed to start"))??;
    }
    Ok(Cores { driver, _threads: threads, _port: claim })
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
