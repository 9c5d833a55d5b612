//! `POST /session`, `DELETE /sessions/:id`, `DELETE /sessions`.

use std::rc::Rc;

use super::auth::require_admin;
use crate::http::{Request, Response};
use crate::ids::SessionId;
use crate::model::{Checked, Rejection};
use crate::runtime::Core;
use crate::shard::{SessionOp, SessionReply};

pub async fn create(core: &Rc<Core>) -> Checked<Response> {
    let id = SessionId::generate();
    match crate::cluster::session_op(core, id, SessionOp::Create(id)).await? {
        Some(SessionReply::Created) => {
            Ok(Response::json(200, serde_json::json!({ "sessionId": id.to_string() }).to_string()))
        }
        _ => Err(Rejection::new(503, "session limit reached (maxSessions)")),
    }
}

pub async fn delete(core: &Rc<Core>, req: &Request, raw: &str) -> Checked<Response> {
    require_admin(&core.settings, req)?;
    let not_found = || Rejection::new(404, "The session was not found");
    let id = SessionId::parse(raw).ok_or_else(not_found)?;
    match crate::cluster::session_op(core, id, SessionOp::Delete(id)).await? {
        Some(SessionReply::Deleted(true)) => Ok(Response::no_content()),
        _ => Err(not_found()),
    }
}

pub async fn delete_all(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    require_admin(&core.settings, req)?;
    if crate::cluster::of(core).is_some() {
        crate::cluster::session_op(core, crate::ids::SessionId(0), SessionOp::DeleteAll).await?;
        return Ok(Response::no_content());
    }
    let handles: Vec<_> = (0..core.cores())
        .map(|target| {
            let core = core.clone();
            monoio::spawn(async move { core.session_op_on(target, SessionOp::DeleteAll).await })
        })
        .collect();
    for h in handles {
        h.await;
    }
    Ok(Response::no_content())
}
