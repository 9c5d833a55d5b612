//! `POST /session`, `DELETE /sessions/:id`, `DELETE /sessions`.

use std::rc::Rc;

use super::auth::require_admin;
use crate::http::{Request, Response};
use crate::ids::SessionId;
use crate::model::{Checked, Rejection};
use crate::app::Core;

/// `POST /session`: no key needed (browsers call it), so rate-limited per client address
/// (`admission::rate`: 429 with Retry-After beyond it); with the admin key (a backend making
/// sessions for its users from one address) it is not.
pub async fn create(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    let admin = require_admin(&core.settings, req).is_ok();
    if !admin {
        if let Err(retry) = crate::admission::rate::admit(core, req.peer, &req.headers, crate::admission::rate::Work::Session) {
            return Ok(Response::rate_limited(retry));
        }
    }
    let id = SessionId::generate();
    match core.directory().create(core, id).await? {
        true => Ok(Response::json(200, serde_json::json!({ "sessionId": id.to_string() }).to_string())),
        false => Err(Rejection::new(503, "session limit reached (maxSessions)")),
    }
}

pub async fn delete(core: &Rc<Core>, req: &Request, raw: &str) -> Checked<Response> {
    require_admin(&core.settings, req)?;
    let not_found = || Rejection::new(404, "The session was not found");
    let id = SessionId::parse(raw).ok_or_else(not_found)?;
    match core.directory().delete(core, id).await? {
        true => Ok(Response::no_content()),
        false => Err(not_found()),
    }
}

pub async fn delete_all(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    require_admin(&core.settings, req)?;
    core.directory().delete_all(core).await?;
    Ok(Response::no_content())
}
