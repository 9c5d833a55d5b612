//! `hubcast --help` grouped by concern, configuration errors that name the flag (or the
//! environment variable), the value and what is valid, and the console URL printed at start.

mod common;

use std::process::Command;

use common::*;

fn hubcast(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    run_expecting_exit(&full_args(args, true), env)
}

#[test]
fn help_lists_every_flag_under_a_heading_in_concern_order() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let headings = [
        "Network:", "Admin access:", "Event stream (IoT Hub / Event Hubs over AMQP):",
        "IoT Hub service API (twins, direct methods, desired properties):", "Device data:",
        "Sessions and live sockets:", "Limits:", "Logs:",
    ];
    let positions: Vec<usize> =
        headings.iter().map(|h| help.find(&format!("\n{h}\n")).unwrap_or_else(|| panic!("no {h} in\n{help}"))).collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "sections out of order:\n{help}");
    assert!(!help.contains("\nOther:"), "a flag is in no group:\n{help}");
    // A flag sits in its section: --port under Network, --log-format under Logs.
    let section = |name: &str| {
        let start = help.find(&format!("\n{name}\n")).unwrap();
        let end = help[start + 1..].find("\n\n").map_or(help.len(), |e| start + 1 + e);
        help[start..end].to_string()
    };
    assert!(section("Network:").contains("--port <PORT>"));
    assert!(section("Logs:").contains("--log-format <LOG_FORMAT>"));
    assert!(section("Limits:").contains("--max-sessions"));
}

#[test]
fn a_bad_number_names_the_flag_the_value_and_the_range() {
    let (ok, _, stderr) = hubcast(&["--cores", "0"], &[]);
    assert!(!ok);
    assert!(stderr.contains("'0'") && stderr.contains("'--cores'") && stderr.contains("a whole number from 1 to 1024"), "{stderr}");
    let (ok, _, stderr) = hubcast(&["--throttling-interval", "soon"], &[]);
    assert!(!ok);
    assert!(stderr.contains("'soon'") && stderr.contains("--throttling-interval") && stderr.contains("a whole number from -1 to "), "{stderr}");
}

#[test]
fn a_bad_value_from_the_environment_names_the_variable() {
    let (ok, _, stderr) = hubcast(&[], &[("MAX_SESSIONS", "lots")]);
    assert!(!ok);
    assert!(stderr.contains("'lots'") && stderr.contains("environment variable MAX_SESSIONS") && stderr.contains("at least 1"), "{stderr}");
}

#[test]
fn a_bad_choice_lists_the_choices() {
    let (ok, _, stderr) = hubcast(&["--io-driver", "kqueue"], &[]);
    assert!(!ok);
    assert!(stderr.contains("'kqueue'") && stderr.contains("--io-driver") && stderr.contains("one of: auto, uring, epoll"), "{stderr}");
}

#[test]
fn the_console_url_is_printed_at_start() {
    let server = Server::start(&[]);
    let line = server
        .wait_for_stdout(TIMEOUT, |l| l.starts_with("Console: "))
        .unwrap_or_else(|| panic!("no console line in {:?}", server.stdout_lines()));
    assert_eq!(line, format!("Console: {}/console", server.base));
    let (status, _, headers) = server.call_raw("GET", "/console", &[], b"");
    assert_eq!(status, 200);
    assert!(headers.get("content-type").unwrap_or("").starts_with("text/html"));
}
