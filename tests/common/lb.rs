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
