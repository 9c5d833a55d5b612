use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use hubcast::config::{normalise_environment, Config};
use hubcast::logging::{self, LogLevel};
use hubcast::status::StatusBoard;
use hubcast::Shared;

fn main() -> ExitCode {
    normalise_environment();
    let settings = Config::parse().settle();
    let log = logging::init(LogLevel::parse(&settings.config.log_level).expect("validated by clap"));

    let mut status = StatusBoard::default();
    match &settings.event_hub {
        Some(Err(message)) => {
            tracing::error!("{message}");
            status.misconfigured(message.clone());
        }
        Some(Ok(_)) => {
            // The AMQP consumer is not part of this build yet: the source stays "connecting".
            tracing::warn!("iotHubEventHubConnectionString is set, but AMQP ingest is not available in this build");
            status.add_source("the event hub consumer");
        }
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
    match hubcast::runtime::start(Arc::new(settings), shared) {
        Ok(running) => {
            running.wait();
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("hubcast: {e}");
            ExitCode::FAILURE
        }
    }
}
