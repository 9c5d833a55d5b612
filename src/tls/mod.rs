//! TLS: with `--tls-cert` and `--tls-key` (PEM) the one port serves HTTPS and WSS (rustls,
//! TLS 1.2 and 1.3, ALPN `http/1.1`); without them it serves plain HTTP and none of this runs.
//!
//! The certificate is reloaded on SIGHUP and when either file changes (checked every
//! [`FILE_CHECK_INTERVAL`] by its modification time, size and inode, so a Kubernetes secret
//! volume's symlink swap and an editor's rename are seen; a `stat` every few seconds costs
//! nothing and needs no inotify dependency). New handshakes get the new certificate at once;
//! connections already open keep the session they have. A reload that fails (a file half
//! written, a key that does not fit) is logged and the previous certificate stays in use.
//!
//! Handshakes run in the connection's task before its first request is read, bounded by
//! `httpIdleTimeout` (a client that connects and says nothing is dropped then).

pub mod stream;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, SystemTime};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;

pub use stream::{ReadHalf, Stream, TlsState, WriteHalf};

/// How often the certificate files are checked for changes.
pub const FILE_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// The server's TLS settings, set once at start when TLS is on.
static CONFIG: OnceLock<Arc<ServerConfig>> = OnceLock::new();
static RESOLVER: OnceLock<Arc<Resolver>> = OnceLock::new();

/// The rustls configuration for new connections; `None` serves plain HTTP.
pub fn server_config() -> Option<Arc<ServerConfig>> {
    CONFIG.get().cloned()
}

pub fn enabled() -> bool {
    CONFIG.get().is_some()
}

/// Hands every handshake the current certificate (swapped by a reload).
#[derive(Debug)]
struct Resolver {
    current: RwLock<Arc<CertifiedKey>>,
    cert: PathBuf,
    key: PathBuf,
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads the certificate chain and key; the error names the flag and the file.
fn load(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("--tls-cert {}: cannot read a PEM certificate chain: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("--tls-cert {}: no PEM certificate (BEGIN CERTIFICATE) in the file", cert.display()));
    }
    let private = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("--tls-key {}: cannot read a PEM private key: {e}", key.display()))?;
    CertifiedKey::from_der(certs, private, &provider()).map_err(|e| {
        format!("--tls-key {}: not a usable key for the certificate of --tls-cert {}: {e}", key.display(), cert.display())
    })
}

/// Turns TLS on (when both flags are given): loads the files, or says what is wrong.
pub fn setup(cert: Option<&Path>, key: Option<&Path>) -> Result<(), String> {
    let (cert, key) = match (cert, key) {
        (None, None) => return Ok(()),
        (Some(_), None) => return Err("--tls-cert needs --tls-key (the certificate's private key)".into()),
        (None, Some(_)) => return Err("--tls-key needs --tls-cert (the certificate chain)".into()),
        (Some(c), Some(k)) => (c, k),
    };
    let certified = load(cert, key)?;
    let resolver = Arc::new(Resolver { current: RwLock::new(Arc::new(certified)), cert: cert.into(), key: key.into() });
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?
        .with_no_client_auth()
        .with_cert_resolver(resolver.clone());
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let _ = RESOLVER.set(resolver);
    let _ = CONFIG.set(Arc::new(config));
    Ok(())
}

/// Loads the files again; on failure the previous certificate stays in use.
pub fn reload(trigger: &str) {
    let Some(resolver) = RESOLVER.get() else { return };
    match load(&resolver.cert, &resolver.key) {
        Ok(certified) => {
            *resolver.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(certified);
            tracing::info!(trigger, cert = %resolver.cert.display(), "TLS certificate reloaded");
        }
        Err(message) => {
            tracing::warn!(trigger, "TLS certificate reload failed, still serving the previous certificate: {message}");
        }
    }
}

/// What identifies a file's current content without reading it.
fn stamp(path: &Path) -> Option<(SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

/// Starts the reload triggers (when TLS is on): SIGHUP, and a check of the files.
pub fn watch() -> Result<(), String> {
    let Some(resolver) = RESOLVER.get() else { return Ok(()) };
    // Registered only with TLS on: otherwise SIGHUP keeps its default action.
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGHUP])
        .map_err(|e| format!("cannot handle SIGHUP for certificate reloads: {e}"))?;
    std::thread::Builder::new()
        .name("hubcast-tls-sighup".into())
        .spawn(move || {
            for _ in signals.forever() {
                reload("SIGHUP");
            }
        })
        .map_err(|e| format!("cannot start the certificate reload thread: {e}"))?;
    let files = [resolver.cert.clone(), resolver.key.clone()];
    std::thread::Builder::new()
        .name("hubcast-tls-files".into())
        .spawn(move || {
            let mut seen = files.each_ref().map(|f| stamp(f));
            loop {
                std::thread::sleep(FILE_CHECK_INTERVAL);
                let now = files.each_ref().map(|f| stamp(f));
                if now != seen {
                    seen = now;
                    reload("files changed");
                }
            }
        })
        .map_err(|e| format!("cannot start the certificate file watcher: {e}"))?;
    Ok(())
}
