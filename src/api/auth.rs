//! Authentication: the admin key (`Shared-Access-Key`, primary or secondary secret, compared
//! in constant time) and the session capability (`sessionId`).

use subtle::ConstantTimeEq;

use crate::config::Settings;
use crate::http::Request;
use crate::ids::SessionId;
use crate::model::{Checked, Rejection};
use crate::shard::Viewer;

pub fn admin_key_matches(settings: &Settings, given: &str) -> bool {
    // Every secret is compared, so timing does not tell which one (or whether any) matched.
    settings
        .admin_secrets
        .iter()
        .fold(0u8, |hit, secret| hit | secret.as_bytes().ct_eq(given.as_bytes()).unwrap_u8())
        == 1
}

/// For admin-only endpoints: 401 unless a valid `Shared-Access-Key` is present.
pub fn require_admin(settings: &Settings, req: &Request) -> Checked<()> {
    match req.header("shared-access-key") {
        Some(key) if admin_key_matches(settings, key) => Ok(()),
        Some(_) => Err(Rejection::new(401, "Unauthorized: invalid Shared-Access-Key header")),
        None => Err(Rejection::new(401, "Unauthorized: no Shared-Access-Key header")),
    }
}

/// A session id from a header or body; one that cannot exist is an unknown session.
pub fn parse_session(raw: &str) -> Checked<SessionId> {
    SessionId::parse(raw).ok_or_else(no_such_session)
}

pub fn no_such_session() -> Rejection {
    Rejection::new(404, "No such sessionId")
}

/// For read endpoints: the admin key (no grant checks) wins, else the `sessionId` header.
pub fn viewer(settings: &Settings, req: &Request, what: &str) -> Checked<Viewer> {
    if let Some(key) = req.header("shared-access-key") {
        return if admin_key_matches(settings, key) {
            Ok(Viewer::Admin)
        } else {
            Err(Rejection::new(403, format!("Forbidden to read {what}: invalid shared-access-key")))
        };
    }
    match req.header("sessionid") {
        Some(raw) => Ok(Viewer::Session(parse_session(raw)?)),
        None => Err(Rejection::new(401, "Provide either a Shared-Access-Key or a sessionId header")),
    }
}
