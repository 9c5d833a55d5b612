//! Logging through tracing, with SPEC's level names and a filter that can change at runtime.
//!
//! SPEC levels map to tracing levels: error, warn, info; `verbose` = DEBUG; `debug` = TRACE.
//! hubcast's own targets log at the chosen level; dependencies at most at info.
//!
//! Two formats (`--log-format`): `text`, tracing's human format, and `json`, one object per
//! line for log shippers: `{"time", "level", "target", "message", "fields", "spans"?}` with
//! SPEC's level names (`verbose`, not DEBUG), so a query on `level` matches `PUT /logLevel`.
//! Both sit behind the same reloadable filter, so the live level switch works in either.

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

    /// The SPEC name of a tracing level.
    pub fn of(level: &tracing::Level) -> Self {
        match *level {
            tracing::Level::ERROR => Self::Error,
            tracing::Level::WARN => Self::Warn,
            tracing::Level::INFO => Self::Info,
            tracing::Level::DEBUG => Self::Verbose,
            tracing::Level::TRACE => Self::Debug,
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

/// Installs the global subscriber (logs to stderr, as text) and returns its control.
pub fn init(level: LogLevel) -> LogControl {
    init_with(level, LogFormat::Text)
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl LogFormat {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "text" => Some(Self::Text),
            "json" => Some(Self::Json),
            _ => None,
        }
    }
}

/// Installs the global subscriber (logs to stderr, in `format`) and returns its control.
pub fn init_with(level: LogLevel, format: LogFormat) -> LogControl {
    let (filter, handle) = reload::Layer::new(level.filter());
    let text = (format == LogFormat::Text).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_target(true)
    });
    let json = (format == LogFormat::Json).then_some(JsonLines);
    let _ = tracing_subscriber::registry().with(filter).with(text).with(json).try_init();
    LogControl { handle: Some(handle) }
}

/// Writes each event as one JSON object on one line of stderr. The whole line is written
/// under stderr's lock, so lines of this process's threads never interleave, even when a long
/// line takes several `write`s (a pipe takes at most `PIPE_BUF` bytes atomically; stderr is
/// unbuffered). Another process writing to the same pipe could still cut into a long line.
struct JsonLines;

impl<S> tracing_subscriber::Layer<S> for JsonLines
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_event(&self, event: &tracing::Event<'_>, ctx: tracing_subscriber::layer::Context<'_, S>) {
        use std::io::Write;
        let meta = event.metadata();
        let mut fields = FieldMap(serde_json::Map::new());
        event.record(&mut fields);
        let mut fields = fields.0;
        let message = fields.remove("message").unwrap_or(serde_json::Value::String(String::new()));
        let mut line = serde_json::Map::new();
        line.insert("time".into(), crate::timefmt::iso(crate::timefmt::now_millis()).into());
        line.insert("level".into(), LogLevel::of(meta.level()).name().into());
        line.insert("target".into(), meta.target().into());
        line.insert("message".into(), message);
        line.insert("fields".into(), serde_json::Value::Object(fields));
        if let Some(scope) = ctx.event_scope(event) {
            let spans: Vec<serde_json::Value> = scope.from_root().map(|span| span.name().into()).collect();
            line.insert("spans".into(), spans.into());
        }
        let mut text = serde_json::Value::Object(line).to_string();
        text.push('\n');
        let _ = std::io::stderr().lock().write_all(text.as_bytes());
    }
}

/// An event's fields as JSON values (numbers and booleans stay typed; the rest as text).
struct FieldMap(serde_json::Map<String, serde_json::Value>);

impl tracing::field::Visit for FieldMap {
    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        self.0.insert(field.name().into(), serde_json::Number::from_f64(value).map_or(serde_json::Value::Null, Into::into));
    }
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_error(&mut self, field: &tracing::field::Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), value.to_string().into());
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}").into());
    }
}
