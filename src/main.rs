//! The `hubcast` binary: configuration, start-up, and the signal-driven graceful shutdown.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hubcast::config::normalise_environment;
use hubcast::logging::{self, LogLevel};
use hubcast::status::StatusBoard;
use hubcast::app::Shared;

/// mimalloc instead of glibc's malloc (feature `mimalloc`, on by default). The cores allocate
/// and free many small short-lived things per message (values, envelopes, queue and write
/// buffers) and fe2o3 decodes every AMQP message into owned maps and strings, some freed on
/// another thread; glibc spent 9-21 % of a core in `_int_malloc`, `unlink_chunk`,
/// `malloc_consolidate` and `_int_free` in the fan-out and ingest profiles. Measured side by side
/// in docs/benchmarks/2026-11-27-allocator.md: fan-out 1.3-1.5x per CPU-second, idle sockets alike,
/// 8.5 MB more at start. `cargo build --no-default-features` keeps glibc's.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // A core's state lives only in that core: if one panics, the gateway cannot go on half
    // alive (its devices and sessions gone, its listener still accepting). Stop the whole
    // process instead, with the panic logged, so a supervisor restarts it.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        tracing::error!("panic: {info}; stopping");
        std::process::abort();
    }));
    normalise_environment();
    let settings = Arc::new(hubcast::cli::parse().settle());
    let log = logging::init_with(
        LogLevel::parse(&settings.config.log_level).expect("validated by clap"),
        logging::LogFormat::parse(&settings.config.log_format).expect("validated by clap"),
    );
    // TLS files are read before anything starts: a missing or bad one stops start-up.
    let tls = hubcast::tls::setup(settings.config.tls_cert.as_deref(), settings.config.tls_key.as_deref());
    if let Err(message) = tls.and_then(|()| hubcast::tls::watch()) {
        eprintln!("hubcast: {message}");
        return ExitCode::FAILURE;
    }
    // Registered before anything starts: a signal during start-up is read once serving.
    let mut signals = match signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("hubcast: cannot handle SIGTERM/SIGINT: {e}");
            return ExitCode::FAILURE;
        }
    };

    let mut status = StatusBoard::default();
    // The event stream: a malformed connection string keeps the gateway up with GET /status
    // answering 500 (as ux4iot does); a good one starts the AMQP consumer once the cores run.
    let mut consumer = None;
    match settings.event_hub.as_ref().map(|c| c.clone().and_then(|c| hubcast::amqp::Plan::new(&c, &settings))) {
        Some(Err(message)) => {
            tracing::error!("{message}");
            status.misconfigured(message);
        }
        Some(Ok(plan)) => consumer = Some((plan, status.add_source("the event hub consumer"))),
        None => {}
    }
    if let Some(Err(message)) = &settings.service {
        tracing::error!("{message}");
        status.misconfigured(message.clone());
    }
    let hub = match hubcast::hub::HubOptions::from_settings(&settings) {
        Ok(None) => None,
        Ok(Some(options)) => match hubcast::hub::HubClient::start(options) {
            Ok(client) => Some(client),
            Err(e) => {
                eprintln!("hubcast: cannot start the IoT Hub service client: {e}");
                return ExitCode::FAILURE;
            }
        },
        Err(message) => {
            eprintln!("hubcast: {message}");
            return ExitCode::FAILURE;
        }
    };
    let hub_metrics = hub.clone();
    // Several instances on Redis: its link shows on GET /status like a source.
    // `--redis-url` or `--redis-cluster-nodes`, never both: the rest never knows which.
    let engine = match (&settings.config.redis_url, &settings.config.redis_cluster_nodes) {
        (Some(_), Some(_)) => {
            eprintln!("hubcast: --redis-url and --redis-cluster-nodes cannot be used together: give one Redis or one Redis Cluster");
            return ExitCode::FAILURE;
        }
        (Some(url), None) => Some(hubcast::cluster::Engine::Single(url.clone())),
        (None, Some(seeds)) => Some(hubcast::cluster::Engine::Sharded(seeds.0.clone())),
        (None, None) => None,
    };
    let cluster = match engine.map(|engine| hubcast::cluster::Cluster::new(&settings, engine)) {
        Some(Ok(cluster)) => Some((cluster, status.add_source("redis"))),
        Some(Err(message)) => {
            eprintln!("hubcast: {message}");
            return ExitCode::FAILURE;
        }
        None => None,
    };
    // Started beside every core, in this order.
    let mut plugins: Vec<Arc<dyn hubcast::app::relay::CorePlugin>> = Vec::new();
    if let Some((c, _)) = &cluster {
        plugins.push(c.clone());
    }
    if settings.config.simulate > 0 {
        plugins.push(Arc::new(hubcast::simulate::Simulator { devices: settings.config.simulate }));
    }
    let shared = Arc::new(Shared { log, status, hub, external_metrics: Default::default(), plugins });
    if let Some((cluster, slot)) = &cluster {
        let (board, slot) = (shared.clone(), *slot);
        let status = move |down: Option<String>| match down {
            None => board.status.source(slot).set_connected(),
            Some(reason) => board.status.source(slot).set_connecting(reason),
        };
        if let Err(e) = cluster.run(status) {
            eprintln!("hubcast: cannot start the Redis link: {e}");
            return ExitCode::FAILURE;
        }
        tracing::info!(instance = %cluster.instance, "running as one of several instances on Redis");
    }
    let cluster_metrics = cluster.map(|(c, _)| c);
    // The event stream consumer reads only the partitions leased to this instance.
    let leases = cluster_metrics.clone().map(|c| c as Arc<dyn hubcast::app::directory::Leases>);
    let metrics_cluster = cluster_metrics.clone();
    let with_amqp = consumer.is_some();
    let with_store = settings.config.data_dir != hubcast::store::DataDir::Memory;
    let _ = shared.external_metrics.set(Box::new(move || {
        let mut series = hubcast::ingest::faults::FAULTS.series();
        series.extend(hubcast::admission::STATS.series());
        if let Some(hub) = &hub_metrics {
            series.extend(hub.series());
        }
        if with_amqp {
            series.extend(hubcast::amqp::STATS.series());
        }
        if with_store {
            series.extend(hubcast::store::log::STATS.series());
        }
        if let Some(cluster) = &metrics_cluster {
            series.extend(cluster.series());
        }
        series
    }));
    // The network face: every core serves its listener with the HTTP server (WebSocket and
    // Engine.IO upgrades, the REST API).
    let wiring = hubcast::app::Wiring {
        accept: |core, listener| Box::pin(hubcast::http::accept_loop::<hubcast::api::Rest, hubcast::transport::Sockets>(core, listener)),
        tls: hubcast::tls::enabled(),
    };
    match hubcast::app::start(settings.clone(), shared.clone(), wiring) {
        Ok(running) => {
            let mut amqp = None;
            if let Some((plan, source)) = consumer {
                let board = shared.clone();
                let status: hubcast::amqp::ReportStatus = Arc::new(move |state| match state {
                    Ok(()) => board.status.source(source).set_connected(),
                    Err(reason) => board.status.source(source).set_connecting(reason),
                });
                match hubcast::amqp::start(plan, status, leases.clone(), running.ingress.clone()) {
                    Ok(thread) => amqp = Some(thread),
                    Err(e) => {
                        eprintln!("hubcast: cannot start the event hub consumer: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            let signal = signals.forever().next().unwrap_or(libc::SIGTERM);
            let timeout = settings.config.shutdown_timeout;
            tracing::info!(signal = signal_name(signal), timeout_s = timeout, "shutdown started: a second signal exits at once");
            hubcast::shutdown::STOPPING.begin();
            std::thread::spawn(move || {
                if let Some(again) = signals.forever().next() {
                    tracing::warn!(signal = signal_name(again), "second signal: exiting at once");
                    std::process::exit(128 + again);
                }
            });
            let handover = cluster_metrics.clone().map(|c| Box::new(move |deadline| c.leave(deadline)) as Box<dyn FnOnce(Instant) + Send>);
            match running.shutdown(amqp, handover, Instant::now() + Duration::from_secs(timeout)) {
                Ok(()) => {
                    tracing::info!("shutdown complete");
                    ExitCode::SUCCESS
                }
                Err(pending) => {
                    tracing::error!(pending = %pending, "shutdown did not finish within --shutdown-timeout ({timeout} s); exiting anyway");
                    ExitCode::FAILURE
                }
            }
        }
        Err(e) => {
            eprintln!("hubcast: {e}");
            ExitCode::FAILURE
        }
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        _ => "signal",
    }
}
