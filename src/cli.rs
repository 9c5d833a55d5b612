//! The command line as people meet it: `hubcast --help` grouped by concern, and errors that
//! name the flag (and the environment variable when the value came from there), the value,
//! and what would be valid.
//!
//! The flags themselves are declared in `config.rs`; the groups are a table here, so adding a
//! flag there does not touch this file until it is placed in a group (a unit test fails until
//! every visible flag has one: the help must not grow an "Other" section unnoticed).

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Arg, Command, CommandFactory, FromArgMatches};

use crate::config::Config;

/// Help sections in display order, each with the ids (field names) of its flags.
pub const GROUPS: &[(&str, &[&str])] = &[
    ("Network", &["bind", "port", "public_url", "cores", "io_driver", "http_idle_timeout", "shutdown_timeout", "tls_cert", "tls_key"]),
    ("Admin access", &["primary_admin_secret", "secondary_admin_secret", "metrics_open"]),
    (
        "Event stream (IoT Hub / Event Hubs over AMQP)",
        &[
            "iot_hub_event_hub_connection_string",
            "event_hub_consumer_group",
            "event_hub_start_position",
            "event_hub_auth",
            "event_hub_token_ttl",
            "event_hub_prefetch",
            "event_hub_queue_bytes",
            "event_hub_linger_ms",
            "event_hub_read_raw",
            "event_hub_ca_file",
            "max_message_bytes",
        ],
    ),
    (
        "IoT Hub service API (twins, direct methods, desired properties)",
        &[
            "iot_hub_service_connection_string",
            "iot_hub_service_url",
            "iot_hub_allow_insecure_http",
            "iot_hub_max_concurrency",
            "iot_hub_queue_size",
            "iot_hub_timeout",
            "iot_hub_sas_token_lifetime",
            "device_twin_cache_ttl",
        ],
    ),
    (
        "Device data",
        &[
            "custom_timestamp_key",
            "custom_device_id_key",
            "custom_connection_state_key",
            "connection_state_on_telemetry",
            "connection_state_cache_ttl",
            "simulate",
        ],
    ),
    (
        "Sessions and live sockets",
        &[
            "session_grace_period",
            "throttling_interval",
            "ping_interval",
            "ping_timeout",
            "socket_queue_soft_limit",
            "socket_queue_hard_limit",
            "socket_queue_soft_bytes",
            "socket_queue_hard_bytes",
            "socket_linger_us",
            "recovery_window",
            "recovery_session_bytes",
            "recovery_core_bytes",
            "recovery_durable",
            "recovery_handoff",
            "recovery_handoff_wait",
        ],
    ),
    (
        "Limits",
        &[
            "max_body_bytes",
            "max_connections",
            "fd_reserve",
            "max_sessions",
            "unused_session_ttl",
            "client_rate",
            "client_burst",
            "trusted_proxies",
            "mesh_inbox_messages",
            "mesh_inbox_bytes",
        ],
    ),
    ("Logs", &["log_level", "log_format"]),
    ("Durable state", &["data_dir", "fsync_interval", "snapshot_log_bytes", "snapshot_slice_devices", "store_start_damaged"]),
    ("Several instances (Redis)", &["redis_url", "redis_cluster_nodes", "redis_prefix", "instance_id", "lease_ttl", "redis_ca_file", "redis_inbound_bytes", "redis_command_bytes"]),
];

/// Heading of flags no group names yet (the unit test keeps it empty).
const OTHER: &str = "Other";

/// The command with its help grouped: the flags of `Config`, in the order of `GROUPS` (clap
/// lists sections in the order their first flag appears), each under its heading.
pub fn command() -> Command {
    let derived = Config::command();
    let place = |id: &str| -> (usize, &'static str) {
        GROUPS
            .iter()
            .flat_map(|(heading, members)| members.iter().map(move |m| (*m, *heading)))
            .enumerate()
            .find(|(_, (m, _))| *m == id)
            .map_or((usize::MAX, OTHER), |(order, (_, heading))| (order, heading))
    };
    let mut args: Vec<Arg> = derived.get_arguments().cloned().collect();
    args.sort_by_key(|a| place(a.get_id().as_str()).0);
    let mut cmd = Command::new("hubcast").version(env!("CARGO_PKG_VERSION")).next_display_order(None);
    if let Some(about) = derived.get_about() {
        cmd = cmd.about(about.clone());
    }
    cmd
        .args(args.into_iter().map(|a| {
            let heading = place(a.get_id().as_str()).1;
            a.help_heading(heading)
        }))
}

/// Parses `std::env::args`, or prints the error (or help) and exits.
pub fn parse() -> Config {
    try_parse_from(std::env::args_os()).unwrap_or_else(|e| e.exit())
}

pub fn try_parse_from<I, T>(args: I) -> Result<Config, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    let mut cmd = command();
    let matches = cmd.try_get_matches_from_mut(args.clone()).map_err(|e| explain(&mut cmd, &args, e))?;
    Config::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))
}

/// Adds to a bad-value error where the value came from and what would be valid.
fn explain(cmd: &mut Command, args: &[std::ffi::OsString], e: clap::Error) -> clap::Error {
    if !matches!(e.kind(), ErrorKind::ValueValidation | ErrorKind::InvalidValue) {
        return e;
    }
    let (Some(ContextValue::String(shown)), Some(ContextValue::String(value))) =
        (e.get(ContextKind::InvalidArg), e.get(ContextKind::InvalidValue))
    else {
        return e;
    };
    let long = shown.split_whitespace().next().unwrap_or(shown).trim_start_matches("--").to_string();
    let Some(arg) = cmd.get_arguments().find(|a| a.get_long() == Some(long.as_str())).cloned() else {
        return e;
    };
    let given_as_flag = arg.get_long_and_visible_aliases().unwrap_or_default().iter().any(|name| {
        args.iter().any(|a| a.to_str().is_some_and(|a| a == format!("--{name}") || a.starts_with(&format!("--{name}="))))
    });
    let origin = match arg.get_env().and_then(|v| v.to_str()) {
        Some(var) if !given_as_flag => format!(" (from the environment variable {var})"),
        _ => String::new(),
    };
    let reason = std::error::Error::source(&e).map(|s| s.to_string());
    let valid = valid_values(&arg);
    let mut message = format!("invalid value '{value}' for '--{long}'{origin}");
    // clap's own "N is not in A..=B" is said again, in words, by `valid`.
    let repeated = |r: &str| r.contains(" is not in ") && valid.is_some();
    if let Some(reason) = reason.filter(|r| !r.is_empty() && !repeated(r)) {
        message.push_str(&format!(": {reason}"));
    }
    if let Some(valid) = valid {
        message.push_str(&format!("; expected {valid}"));
    }
    cmd.error(ErrorKind::ValueValidation, message)
}

/// What the flag accepts: its possible values, or its numeric range found by asking its own
/// value parser about extreme numbers (clap's ranged parsers name the range when refusing).
fn valid_values(arg: &Arg) -> Option<String> {
    let possible: Vec<String> = arg.get_possible_values().iter().map(|p| p.get_name().to_string()).collect();
    if !possible.is_empty() {
        return Some(format!("one of: {}", possible.join(", ")));
    }
    let long = arg.get_long()?;
    for probe in ["18446744073709551615", "9223372036854775807", "-9223372036854775808", "0"] {
        let alone = Command::new("hubcast").arg(arg.clone());
        if let Err(refusal) = alone.try_get_matches_from(["hubcast".to_string(), format!("--{long}={probe}")]) {
            let text = std::error::Error::source(&refusal).map(|s| s.to_string()).unwrap_or_default();
            if let Some(range) = text.split(" is not in ").nth(1) {
                return Some(describe_range(range.trim()));
            }
        }
    }
    None
}

/// `1..=1024` → "a whole number from 1 to 1024"; `-1..` → "a whole number of at least -1".
fn describe_range(range: &str) -> String {
    match range.split_once("..") {
        Some((low, high)) => {
            let high = high.trim_start_matches('=');
            // The type's own maximum is no real bound.
            let high = if [i64::MAX.to_string(), u64::MAX.to_string(), u32::MAX.to_string()].iter().any(|m| m == high) { "" } else { high };
            match (low.is_empty(), high.is_empty()) {
                (false, false) => format!("a whole number from {low} to {high}"),
                (false, true) => format!("a whole number of at least {low}"),
                (true, false) => format!("a whole number of at most {high}"),
                (true, true) => "a whole number".into(),
            }
        }
        None => format!("a number in {range}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_visible_flag_is_in_a_help_group() {
        let cmd = command();
        let ungrouped: Vec<String> = cmd
            .get_arguments()
            .filter(|a| !a.is_hide_set() && a.get_long().is_some())
            .filter(|a| a.get_help_heading() == Some(OTHER))
            .map(|a| a.get_id().to_string())
            .collect();
        assert!(ungrouped.is_empty(), "add these flags to a group in src/cli.rs GROUPS: {ungrouped:?}");
        for (_, members) in GROUPS {
            for id in *members {
                assert!(cmd.get_arguments().any(|a| a.get_id() == *id), "GROUPS names `{id}`, which is no flag");
            }
        }
    }

    #[test]
    fn ranges_read_as_words() {
        assert_eq!(describe_range("1..=1024"), "a whole number from 1 to 1024");
        assert_eq!(describe_range("-1.."), "a whole number of at least -1");
        assert_eq!(describe_range("-1..=9223372036854775807"), "a whole number of at least -1");
    }
}
