//! `GET /version`, `GET /status`, `GET /status/details`, `PUT /logLevel/:level`.

use std::rc::Rc;

use super::auth::require_admin;
use crate::http::{Request, Response};
use crate::logging::LogLevel;
use crate::model::{Checked, Rejection};
use crate::app::Core;
use crate::status::Health;

pub fn version() -> Response {
    Response::text(200, env!("CARGO_PKG_VERSION"))
}

/// 200 `OK` (text, whatever the headers: ux4iot's admin SDK sends its key and returns the body
/// as its string result); 500 naming a malformed connection string; 503 while a source is
/// connecting or while shutting down (a load balancer's cue to take the node out).
pub fn status(core: &Rc<Core>) -> Response {
    match health(core) {
        Ok(()) => Response::text(200, "OK"),
        Err(answer) => answer,
    }
}

/// `GET /status/details` (admin key): the same health as `/status`, and when it is OK, JSON
/// naming the instance that answers: `status`, and with Redis the instance id, the live
/// instances and the partitions it holds leases on.
pub fn status_details(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    require_admin(&core.settings, req)?;
    if let Err(answer) = health(core) {
        return Ok(answer);
    }
    let body = match core.directory().membership() {
        Some(m) => serde_json::json!({
            "status": "OK",
            "instance": &*m.instance,
            "instances": m.instances,
            "partitions": m.partitions,
        }),
        None => serde_json::json!({ "status": "OK" }),
    };
    Ok(Response::json(200, body.to_string()))
}

/// `Ok` when every source is connected; else the error answer (500 or 503).
fn health(core: &Rc<Core>) -> Result<(), Response> {
    if crate::shutdown::STOPPING.is_stopping() {
        return Err(Response::error(503, "shutting down"));
    }
    match core.shared.status.health() {
        Health::Ok => Ok(()),
        Health::Misconfigured(message) => Err(Response::error(500, &message)),
        Health::Starting(message) => Err(Response::error(503, &format!("Still initializing: {message}"))),
    }
}

pub fn set_log_level(core: &Rc<Core>, req: &Request, level: &str) -> Checked<Response> {
    require_admin(&core.settings, req)?;
    let level = LogLevel::parse(level).ok_or_else(|| {
        Rejection::bad_request("Unknown log level (use error, warn, info, verbose or debug)")
    })?;
    core.shared.log.set(level);
    tracing::info!(level = level.name(), "log level changed");
    Ok(Response::no_content())
}
