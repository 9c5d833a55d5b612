//! `GET /version`, `GET /status`, `PUT /logLevel/:level`.

use std::rc::Rc;

use super::auth::{admin_key_matches, require_admin};
use crate::http::{Request, Response};
use crate::logging::LogLevel;
use crate::model::{Checked, Rejection};
use crate::app::Core;
use crate::status::Health;

pub fn version() -> Response {
    Response::text(200, env!("CARGO_PKG_VERSION"))
}

/// 200 `OK`; 500 naming a malformed connection string; 503 while a source is connecting
/// or while shutting down (a load balancer's cue to take the node out). With the admin key a
/// 200 is JSON: `status`, and with Redis the instance id, live instances and leased partitions.
pub fn status(core: &Rc<Core>, req: &Request) -> Response {
    if crate::shutdown::STOPPING.is_stopping() {
        return Response::error(503, "shutting down");
    }
    match core.shared.status.health() {
        // With the admin key: which instance answers, and (several instances) what it reads.
        Health::Ok if req.header("shared-access-key").is_some_and(|k| admin_key_matches(&core.settings, k)) => {
            let body = match crate::cluster::of(core) {
                Some(cluster) => serde_json::json!({
                    "status": "OK",
                    "instance": &*cluster.instance,
                    "instances": cluster.stats.instances.load(std::sync::atomic::Ordering::Relaxed),
                    "partitions": cluster.owned().borrow().partitions.keys().collect::<Vec<_>>(),
                }),
                None => serde_json::json!({ "status": "OK" }),
            };
            Response::json(200, body.to_string())
        }
        Health::Ok => Response::text(200, "OK"),
        Health::Misconfigured(message) => Response::error(500, &message),
        Health::Starting(message) => Response::error(503, &format!("Still initializing: {message}")),
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
