//! The REST API of SPEC.md: routing, authentication, and one module per resource.
//!
//! Handlers validate the request completely before changing anything, then run the change on
//! the core that owns the data (see `app::core`). Every error is `{"errorMessage": …}`.

mod auth;
mod console;
#[cfg(debug_assertions)]
mod debug;
mod devices;
mod device_hub;
mod grants;
mod ingest;
mod last_values;
mod meta;
mod metrics;
mod openapi;
mod sessions;
mod subscriptions;

use std::rc::Rc;

use http::Method;

use crate::http::{Request, Response};
use crate::model::{Checked, Rejection};
use crate::app::Core;

pub use auth::admin_key_matches;

/// The REST API as the HTTP connection loop sees it (`http::accept_loop::<Rest>`).
pub struct Rest;

impl crate::http::Service for Rest {
    fn pipelines(req: &Request) -> bool {
        pipelines(req)
    }

    async fn begin(core: &Rc<Core>, req: Request) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response>>> {
        begin_ingest(core, req).await
    }

    async fn handle(core: &Rc<Core>, req: Request) -> Response {
        handle(core, req).await
    }
}

/// The routes of SPEC.md plus hubcast's own (`POST /ingest`, `/metrics`, `/openapi.json`, …).
enum Route {
    Version,
    Status,
    StatusDetails,
    LogLevel(String),
    Session,
    AllSessions,
    OneSession(String),
    Grants,
    Subscription,
    Subscriptions,
    LastValue(String, Option<String>),
    DeviceTwin(String),
    ConnectionState(String),
    DirectMethod,
    DesiredProperties,
    Ingest,
    Metrics,
    OpenApi,
    Console,
    Devices,
    /// Debug builds only (api/debug.rs).
    #[cfg(debug_assertions)]
    DebugStall,
}

impl Route {
    /// The route's label in metrics.
    fn label(&self) -> &'static str {
        match self {
            Route::Version => "version",
            // One label for both: the details are the admin's view of the same health.
            Route::Status | Route::StatusDetails => "status",
            Route::LogLevel(_) => "logLevel",
            Route::Session => "session",
            Route::AllSessions | Route::OneSession(_) => "sessions",
            Route::Grants => "grants",
            Route::Subscription => "subscription",
            Route::Subscriptions => "subscriptions",
            Route::LastValue(..) => "lastValue",
            Route::DeviceTwin(_) => "deviceTwin",
            Route::ConnectionState(_) => "connectionState",
            Route::DirectMethod => "directMethod",
            Route::DesiredProperties => "deviceTwinDesiredProperties",
            Route::Ingest => "ingest",
            Route::Metrics => "metrics",
            Route::OpenApi => "openapi",
            Route::Console => "console",
            Route::Devices => "devices",
            #[cfg(debug_assertions)]
            Route::DebugStall => "other",
        }
    }

    fn find(segments: Vec<String>) -> Option<Route> {
        let mut it = segments.into_iter();
        let first = it.next()?;
        let second = it.next();
        let third = it.next();
        if it.next().is_some() {
            return None;
        }
        Some(match (first.as_str(), second, third) {
            ("version", None, None) => Route::Version,
            ("status", None, None) => Route::Status,
            ("status", Some(details), None) if details == "details" => Route::StatusDetails,
            ("logLevel", Some(level), None) => Route::LogLevel(level),
            ("session", None, None) => Route::Session,
            ("sessions", None, None) => Route::AllSessions,
            ("sessions", Some(id), None) => Route::OneSession(id),
            ("grants", None, None) => Route::Grants,
            ("subscription", None, None) => Route::Subscription,
            ("subscriptions", None, None) => Route::Subscriptions,
            ("lastValue", Some(device), key) => Route::LastValue(device, key),
            ("deviceTwin", Some(device), None) => Route::DeviceTwin(device),
            ("connectionState", Some(device), None) => Route::ConnectionState(device),
            ("directMethod", None, None) => Route::DirectMethod,
            ("deviceTwinDesiredProperties", None, None) => Route::DesiredProperties,
            ("ingest", None, None) => Route::Ingest,
            ("metrics", None, None) => Route::Metrics,
            ("openapi.json", None, None) => Route::OpenApi,
            ("console", None, None) => Route::Console,
            ("devices", None, None) => Route::Devices,
            #[cfg(debug_assertions)]
            ("_debug", Some(what), None) if what == "stall" => Route::DebugStall,
            _ => return None,
        })
    }

    fn allowed(&self) -> &'static str {
        match self {
            Route::Version | Route::Status | Route::StatusDetails | Route::DeviceTwin(_) | Route::ConnectionState(_) | Route::Metrics
            | Route::OpenApi | Route::Console | Route::Devices => "GET",
            Route::LastValue(_, None) => "GET, DELETE",
            Route::LastValue(_, Some(_)) => "GET",
            Route::LogLevel(_) => "PUT",
            Route::Session | Route::DirectMethod | Route::Ingest => "POST",
            #[cfg(debug_assertions)]
            Route::DebugStall => "POST",
            Route::AllSessions | Route::OneSession(_) => "DELETE",
            Route::Grants | Route::Subscription | Route::Subscriptions => "PUT, DELETE",
            Route::DesiredProperties => "PATCH",
        }
    }
}

const CORS_METHODS: &str = "GET, PUT, POST, PATCH, DELETE, OPTIONS";
const CORS_HEADERS: &str = "sessionId, Shared-Access-Key, Content-Type";

fn preflight() -> Response {
    Response::no_content()
        .with_header("access-control-allow-methods", CORS_METHODS)
        .with_header("access-control-allow-headers", CORS_HEADERS)
        .with_header("access-control-max-age", "86400")
}

/// Runs one device operation for `viewer` and waits for its typed answer: with the admin key
/// on the device's core at once; for a session through the session's core (404 when there is
/// no such session; with several instances the session is loaded from Redis first).
pub(crate) async fn on_device<T>(
    core: &Rc<Core>,
    viewer: crate::shard::Viewer,
    (op, answer): (crate::shard::DeviceOp, futures_channel::oneshot::Receiver<T>),
) -> Checked<T> {
    match viewer {
        crate::shard::Viewer::Admin => core.ask_device((op, answer)).await.ok_or_else(stopping),
        crate::shard::Viewer::Session(session) => {
            scoped(core, session, false, vec![op]).await?;
            answer.await.map_err(|_| stopping())
        }
    }
}

/// Sends `ops` through the session's core (which keeps the session alive, and with
/// `register_devices` remembers their devices); 404 when there is no such session.
pub(crate) async fn scoped(core: &Rc<Core>, session: crate::ids::SessionId, register_devices: bool, ops: Vec<crate::shard::DeviceOp>) -> Checked<()> {
    match core.directory().scoped(core, session, register_devices, ops).await? {
        true => Ok(()),
        false => Err(auth::no_such_session()),
    }
}

/// A device operation that was never answered: its core stopped (a graceful shutdown).
pub(crate) fn stopping() -> crate::model::Rejection {
    crate::model::Rejection::new(503, "shutting down: try again (another node)")
}

pub async fn handle(core: &Rc<Core>, req: Request) -> Response {
    let started = std::time::Instant::now();
    let (label, response) = route_and_run(core, req).await;
    core.metrics.request(label, started.elapsed());
    response
}

/// Whether `req` is `POST /ingest`: the one request a pipelining connection begins while
/// earlier answers are pending ([`begin_ingest`]); any other waits for them (`http::serve`, through [`Rest`]).
pub fn pipelines(req: &Request) -> bool {
    req.method == Method::POST && matches!(req.segments().ok().and_then(Route::find), Some(Route::Ingest))
}

/// Begins `POST /ingest`: validates it and hands its messages to their cores now, in the
/// order the connection read the requests; the returned future resolves with the answer
/// once they are applied (an invalid batch: at once, with its error).
pub async fn begin_ingest(core: &Rc<Core>, req: Request) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response>>> {
    let started = std::time::Instant::now();
    let index = crate::metrics::ROUTES.iter().position(|r| *r == Route::Ingest.label()).unwrap_or(crate::metrics::ROUTES.len() - 1);
    match ingest::begin(core, &req).await {
        Ok((accepted, applied)) => {
            let core = core.clone();
            Box::pin(async move {
                applied.await;
                core.metrics.request(index, started.elapsed());
                ingest::accepted_response(accepted)
            })
        }
        Err(rejection) => {
            core.metrics.request(index, started.elapsed());
            Box::pin(std::future::ready(Response::rejection(rejection)))
        }
    }
}

/// Runs the request; returns the route's index in `metrics::ROUTES` with the response.
async fn route_and_run(core: &Rc<Core>, req: Request) -> (usize, Response) {
    let label = |name: &str| crate::metrics::ROUTES.iter().position(|r| *r == name).unwrap_or(crate::metrics::ROUTES.len() - 1);
    if req.method == Method::OPTIONS {
        return (label("preflight"), preflight());
    }
    if req.path.trim_end_matches('/') == "/socket.io" {
        return (label("socket.io"), crate::transport::socketio_polling::http(core, &req).await);
    }
    let route = match req.segments() {
        Ok(segments) => Route::find(segments),
        Err(r) => return (label("other"), Response::rejection(r)),
    };
    let Some(route) = route else {
        return (label("other"), Response::error(404, &format!("Not found: {} {}", req.method, req.path)));
    };
    let index = label(route.label());
    (index, dispatch(core, route, req).await.unwrap_or_else(Response::rejection))
}

async fn dispatch(core: &Rc<Core>, route: Route, req: Request) -> Checked<Response> {
    use Method as M;
    match (&route, &req.method) {
        (Route::Version, &M::GET) => Ok(meta::version()),
        (Route::Status, &M::GET) => Ok(meta::status(core)),
        (Route::StatusDetails, &M::GET) => meta::status_details(core, &req),
        (Route::LogLevel(level), &M::PUT) => meta::set_log_level(core, &req, level),
        (Route::Session, &M::POST) => sessions::create(core, &req).await,
        (Route::AllSessions, &M::DELETE) => sessions::delete_all(core, &req).await,
        (Route::OneSession(id), &M::DELETE) => sessions::delete(core, &req, id).await,
        (Route::Grants, &M::PUT) => grants::change(core, &req, true).await,
        (Route::Grants, &M::DELETE) => grants::change(core, &req, false).await,
        (Route::Subscription, &M::PUT) => subscriptions::single(core, &req, true).await,
        (Route::Subscription, &M::DELETE) => subscriptions::single(core, &req, false).await,
        (Route::Subscriptions, &M::PUT) => subscriptions::bulk(core, &req, true).await,
        (Route::Subscriptions, &M::DELETE) => subscriptions::bulk(core, &req, false).await,
        (Route::LastValue(device, key), &M::GET) => last_values::read_telemetry(core, &req, device, key.as_deref()).await,
        (Route::LastValue(device, None), &M::DELETE) => last_values::delete_telemetry(core, &req, device).await,
        (Route::DeviceTwin(device), &M::GET) => last_values::read_twin(core, &req, device).await,
        (Route::ConnectionState(device), &M::GET) => last_values::read_connection_state(core, &req, device).await,
        (Route::DirectMethod, &M::POST) => device_hub::direct_method(core, &req).await,
        (Route::DesiredProperties, &M::PATCH) => device_hub::desired_properties(core, &req).await,
        (Route::Ingest, &M::POST) => ingest::post(core, &req).await,
        (Route::Metrics, &M::GET) => metrics::get(core, &req).await,
        (Route::OpenApi, &M::GET) => Ok(openapi::get()),
        (Route::Console, &M::GET) => Ok(console::get()),
        (Route::Devices, &M::GET) => devices::list(core, &req).await,
        #[cfg(debug_assertions)]
        (Route::DebugStall, &M::POST) => debug::stall(core, &req).await,
        _ => Ok(Response::error(405, &format!("Method {} not allowed on {}", req.method, req.path))
            .with_header("allow", route.allowed())),
    }
}

/// A device id taken from the path, within the length limit.
fn path_device(device: &str) -> Checked<&str> {
    if device.len() > crate::config::MAX_DEVICE_ID_LEN {
        return Err(Rejection::bad_request(format!(
            "deviceId is longer than {} bytes",
            crate::config::MAX_DEVICE_ID_LEN
        )));
    }
    Ok(device)
}
