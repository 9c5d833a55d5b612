//! `PUT /grants` and `DELETE /grants` (admin key): the security backend's permissions.

use std::rc::Rc;

use super::auth::{parse_session, require_admin};
use crate::http::{Request, Response};
use crate::model::{Checked, GrantRequest, Rejection};
use crate::app::Core;
use crate::shard::{ask, DeviceOp};

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
    let grant = request.grant;
    let (op, done) = if add {
        ask(|done| DeviceOp::Grant { device, session, grant, done })
    } else {
        ask(|done| DeviceOp::Revoke { device, session, grant, done })
    };
    super::scoped(core, session, add, vec![op]).await?;
    // Answered once the change is in force on the device's core.
    done.await.map_err(|_| super::stopping())?;
    Ok(Response::no_content())
}
