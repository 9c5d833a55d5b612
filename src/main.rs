use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use hubcast::config::{normalise_environment, Config};
use hubcast::logging::{self, LogLevel};
use hubcast::status::StatusBoard;
use hubcast::Shared;

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
    let settings = Arc::new(Config::parse().settle());
    let log = logging::init(LogLevel::parse(&settings.config.log_level).expect("validated by clap"));

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
    let shared = Arc::new(Shared { log, status, hub, external_metrics: Default::default() });
    let with_amqp = consumer.is_some();
    let _ = shared.external_metrics.set(Box::new(move || {
        let mut series = hubcast::ingest::faults::FAULTS.series();
        if with_amqp {
            series.extend(hubcast::amqp::STATS.series());
        }
        series
    }));
    match hubcast::runtime::start(settings.clone(), shared.clone()) {
        Ok(running) => {
            if let Some((plan, source)) = consumer {
                if let Err(e) = hubcast::amqp::start(plan, shared, source, running.ingress.clone()) {
                    eprintln!("hubcast: cannot start the event hub consumer: {e}");
                    return ExitCode::FAILURE;
                }
            }
            running.wait();
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("hubcast: {e}");
            ExitCode::FAILURE
        }
    }
}
