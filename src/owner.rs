//! One owner per port.
//!
//! The cores share the port with SO_REUSEPORT, which would just as well let a second hubcast
//! (same user) bind it: the kernel would then split connections between two processes and a
//! session's requests would land on a process that does not know it (403/404 at random).
//! Before the cores bind, [`claim`] therefore:
//!
//! 1. binds a probe socket *without* SO_REUSEPORT: it fails while any socket (hubcast or any
//!    other program) listens on the port, reuse-port or not. With `--port 0` the probe is what
//!    picks the free port the cores then share.
//! 2. binds the abstract Unix socket `@hubcast/port/<addr>` and keeps it for the life of the
//!    process: this closes the window between dropping the probe and the cores' binds, in
//!    which a second hubcast's probe would succeed. Abstract names belong to the network
//!    namespace, like ports, and vanish with the process (no stale lock file after `kill -9`).
//!
//! The probe is dropped before the cores bind (a socket without SO_REUSEPORT on the port
//! would refuse our own reuse-port binds).
//!
//! **Restart after `kill -9`.** With io_uring the kernel tears a killed process's ring down
//! after the process is gone, and the listening socket its accepts were queued on lives until
//! then: a supervisor that restarts at once finds the port still held (3 starts in 5 failed).
//! With `--data-dir`, start-up takes the data dir's lock first, so no other live hubcast owns
//! that data dir; [`claim`] is then given a `patience` ([`RESTART_PATIENCE`]) during which a
//! held port is retried (logged at WARN). Another program holding the port past it is still
//! refused with the same message; without a data dir nothing is waited for.

use std::time::{Duration, Instant};

use std::io;
use std::net::SocketAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::UnixListener;

use socket2::{Domain, Protocol, Socket, Type};

/// The claim on a port; released when dropped (at exit).
pub struct PortClaim {
    pub addr: SocketAddr,
    _lock: UnixListener,
}

fn in_use(addr: SocketAddr, by: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::AddrInUse,
        format!(
            "port {} on {} is already in use ({by}); hubcast does not share its port, since clients' requests would be \
             split between two processes: stop the other one or choose another --port",
            addr.port(),
            addr.ip()
        ),
    )
}

/// How long a held port is retried when this process owns its data dir (see the module docs).
pub const RESTART_PATIENCE: Duration = Duration::from_secs(5);
/// Between two tries of a held port.
const RETRY_EVERY: Duration = Duration::from_millis(50);

/// Claims `addr` for this process; the result holds the port actually bound (for port 0).
/// A held port is tried again for `patience` (zero: refused at once).
pub fn claim(addr: SocketAddr, patience: Duration) -> io::Result<PortClaim> {
    let started = Instant::now();
    let mut warned = false;
    loop {
        match try_claim(addr) {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && started.elapsed() + RETRY_EVERY <= patience => {
                if !warned {
                    warned = true;
                    tracing::warn!(
                        port = addr.port(),
                        patience_ms = patience.as_millis() as u64,
                        "port still in use; this hubcast owns its data dir, so the holder is likely the previous \
                         run's listener that the kernel is still closing (io_uring teardown after a kill -9): \
                         trying again until the port is free or the patience runs out"
                    );
                }
                std::thread::sleep(RETRY_EVERY);
            }
            Ok(claim) => {
                if warned {
                    tracing::info!(port = claim.addr.port(), waited_ms = started.elapsed().as_millis() as u64, "port free again");
                }
                return Ok(claim);
            }
            Err(e) => return Err(e),
        }
    }
}

fn try_claim(addr: SocketAddr) -> io::Result<PortClaim> {
    let probe = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // SO_REUSEADDR only lets the bind pass over connections of a previous run in TIME_WAIT;
    // a listening socket still makes it fail.
    probe.set_reuse_address(true)?;
    if let Err(e) = probe.bind(&addr.into()) {
        return Err(match e.kind() {
            io::ErrorKind::AddrInUse => in_use(addr, "by another hubcast or another program"),
            _ => e,
        });
    }
    let addr = probe.local_addr()?.as_socket().ok_or_else(|| io::Error::other("the probe socket has no address"))?;
    let name = format!("hubcast/port/{addr}");
    let lock = match std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).and_then(|a| UnixListener::bind_addr(&a)) {
        Ok(l) => l,
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => return Err(in_use(addr, "by another hubcast starting up")),
        Err(e) => return Err(e),
    };
    drop(probe);
    Ok(PortClaim { addr, _lock: lock })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claimed_port_cannot_be_claimed_twice_and_is_free_again_once_released() {
        let first = claim("127.0.0.1:0".parse().unwrap(), Duration::ZERO).unwrap();
        assert_ne!(first.addr.port(), 0);
        let second = claim(first.addr, Duration::ZERO).err().expect("second claim refused");
        assert_eq!(second.kind(), io::ErrorKind::AddrInUse);
        assert!(second.to_string().contains(&format!("port {}", first.addr.port())), "{second}");
        let addr = first.addr;
        drop(first);
        claim(addr, Duration::ZERO).expect("free once released");
    }

    #[test]
    fn a_held_port_is_waited_for_within_the_patience_and_refused_after_it() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap();
        let started = Instant::now();
        let refused = claim(addr, Duration::from_millis(300)).err().expect("refused once the patience is over");
        assert_eq!(refused.kind(), io::ErrorKind::AddrInUse);
        assert!(started.elapsed() >= Duration::from_millis(200), "retried for the patience: {:?}", started.elapsed());
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(held);
        });
        claim(addr, Duration::from_secs(5)).expect("claimed once the holder let go");
        release.join().unwrap();
    }
}
