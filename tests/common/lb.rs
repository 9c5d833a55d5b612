//! A plain TCP load balancer for the scale-out tests: round-robin over the backends, each
//! new connection to the next backend that accepts it (a dead one is skipped), no
//! stickiness, bytes copied both ways. What an ordinary L4 balancer does.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

pub struct Balancer {
    pub port: u16,
}

impl Balancer {
    pub fn start(backends: &[u16]) -> Balancer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
        let port = listener.local_addr().unwrap().port();
        let backends: Arc<Vec<u16>> = Arc::new(backends.to_vec());
        let next = Arc::new(AtomicUsize::new(0));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let start = next.fetch_add(1, Ordering::Relaxed);
                let backend = (0..backends.len())
                    .map(|i| backends[(start + i) % backends.len()])
                    .find_map(|port| TcpStream::connect(("127.0.0.1", port)).ok());
                let Some(backend) = backend else { continue };
                pipe(client.try_clone().unwrap(), backend.try_clone().unwrap());
                pipe(backend, client);
            }
        });
        Balancer { port }
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// Copies `from` → `to` until EOF or an error, then closes both directions of `to`'s write.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Write);
        let _ = from.shutdown(Shutdown::Read);
    });
}

/// A TCP proxy to one backend that can cut its clients off the network (connection state
/// recovery tests): [`Cutter::cut`] closes every proxied connection both ways, as a network
/// that drops them (each side sees its peer go); [`Cutter::hold`] makes new connections fail
/// (accepted and closed at once, so a client's reconnects fail fast) until [`Cutter::release`].
/// Tests wait on its counters ([`Cutter::refused`], [`Cutter::live`]), never on time.
pub struct Cutter {
    pub port: u16,
    state: Arc<CutState>,
}

#[derive(Default)]
struct CutState {
    holding: std::sync::atomic::AtomicBool,
    /// Both ends of each proxied connection (clones), to cut them.
    conns: std::sync::Mutex<Vec<(TcpStream, TcpStream)>>,
    accepted: AtomicUsize,
    refused: AtomicUsize,
    /// The backend's port ([`Cutter::retarget`]).
    backend: std::sync::atomic::AtomicU16,
}

impl Cutter {
    pub fn start(backend: u16) -> Cutter {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(CutState::default());
        state.backend.store(backend, Ordering::SeqCst);
        let st = state.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if st.holding.load(Ordering::SeqCst) {
                    st.refused.fetch_add(1, Ordering::SeqCst);
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", st.backend.load(Ordering::SeqCst))) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                {
                    // Checked again under the lock `cut` takes: a connection accepted while
                    // a cut runs is cut too, never left open behind it.
                    let mut conns = st.conns.lock().unwrap();
                    if st.holding.load(Ordering::SeqCst) {
                        st.refused.fetch_add(1, Ordering::SeqCst);
                        let _ = client.shutdown(Shutdown::Both);
                        let _ = server.shutdown(Shutdown::Both);
                        continue;
                    }
                    conns.push((client.try_clone().unwrap(), server.try_clone().unwrap()));
                }
                st.accepted.fetch_add(1, Ordering::SeqCst);
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
                pipe(server, client);
            }
        });
        Cutter { port, state }
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Refuses new connections until [`Cutter::release`].
    pub fn hold(&self) {
        self.state.holding.store(true, Ordering::SeqCst);
    }

    pub fn release(&self) {
        self.state.holding.store(false, Ordering::SeqCst);
    }

    /// Holds, then closes every connection proxied so far, both ways.
    pub fn cut(&self) {
        self.hold();
        for (client, server) in self.state.conns.lock().unwrap().drain(..) {
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
        }
    }

    /// New connections go to `port` from now on (the instance a load balancer would pick once
    /// the first is gone).
    pub fn retarget(&self, port: u16) {
        self.state.backend.store(port, Ordering::SeqCst);
    }

    /// Connections refused while held.
    pub fn refused(&self) -> usize {
        self.state.refused.load(Ordering::SeqCst)
    }

    /// Connections proxied since start.
    pub fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// Waits until `pred(self)` holds; false after `timeout`.
    pub fn wait(&self, timeout: std::time::Duration, pred: impl Fn(&Cutter) -> bool) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while !pred(self) {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        true
    }
}
