//! Logging through tracing, with SPEC's level names and a filter that can change at runtime.
//!
//! SPEC levels map to tracing levels: error, warn, info; `verbose` = DEBUG; `debug` = TRACE.
//! hubcast's own targets log at the chosen level; dependencies at most at info.

use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::reload;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Registry;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Verbose,
    Debug,
}

impl LogLevel {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "error" => Self::Error,
            "warn" => Self::Warn,
            "info" => Self::Info,
            "verbose" => Self::Verbose,
            "debug" => Self::Debug,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Warn => "warn",
            Self::Info => "info",
            Self::Verbose => "verbose",
            Self::Debug => "debug",
        }
    }

    fn filter(self) -> Targets {
        let own = match self {
            Self::Error => LevelFilter::ERROR,
            Self::Warn => LevelFilter::WARN,
            Self::Info => LevelFilter::INFO,
            Self::Verbose => LevelFilter::DEBUG,
            Self::Debug => LevelFilter::TRACE,
        };
        Targets::new().with_target("hubcast", own).with_default(own.min(LevelFilter::INFO))
    }
}

/// Changes the live log filter (shared by all cores; used only by `PUT /logLevel`).
pub struct LogControl {
    handle: Option<reload::Handle<Targets, Registry>>,
}

impl LogControl {
    pub fn set(&self, level: LogLevel) {
        if let Some(handle) = &self.handle {
            if let Err(e) = handle.reload(level.filter()) {
                tracing::warn!(error = %e, "could not change the log level");
            }
        }
    }

    /// For tests and benches that do not install a subscriber.
    pub fn detached() -> Self {
        Self { handle: None }
    }
}

/// Installs the global subscriber (logs to stderr) and returns its control.
pub fn init(level: LogLevel) -> LogControl {
    let (filter, handle) = reload::Layer::new(level.filter());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(true);
    let _ = tracing_subscriber::registry().with(filter).with(fmt).try_init();
    LogControl { handle: Some(handle) }
}
