//! `PUT /grants` and `DELETE /grants` (admin key): the security backend's permissions.

use std::rc::Rc;

use super::auth::{no_such_session, parse_session, require_admin};
use crate::http::{Request, Response};
use crate::model::{Checked, GrantRequest, Rejection};
use crate::runtime::Core;
use crate::shard::{DeviceOp, SessionOp, SessionReply};

pub async fn change(core: &Rc<Core>, req: &Request, add: bool) -> Checked<Response> {
    require_admin(&core.settings, req)?;
    let request = GrantRequest::parse(&req.json()?)?;
    if add && request.grant.kind.needs_hub() && !core.settings.iot_hub_api_enabled() {
        return Err(Rejection::bad_request(
            "Grant unavailable: IoT Hub API disabled (no iotHubServiceConnectionString configured)",
        ));
    }
    let session = parse_session(&request.session)?;
    let device = request.device.into_boxed_str();
    let op = if add {
        DeviceOp::Grant { device, session, grant: request.grant }
    } else {
        DeviceOp::Revoke { device, session, grant: request.grant }
    };
    match crate::cluster::session_op(core, session, SessionOp::Scoped { session, register_devices: add, ops: vec![op] }).await? {
        Some(SessionReply::Scoped(Some(_))) => Ok(Response::no_content()),
        _ => Err(no_such_session()),
    }
}
