//! `POST /directMethod` and `PATCH /deviceTwinDesiredProperties`: relayed to the IoT Hub
//! service API when `iotHubServiceConnectionString` is configured (hub client: issue #5).

use std::rc::Rc;

use crate::http::{Request, Response};
use crate::model::{Checked, Rejection};
use crate::runtime::Core;

pub async fn direct_method(core: &Rc<Core>, _req: &Request) -> Checked<Response> {
    if !core.settings.iot_hub_api_enabled() {
        return Err(Rejection::bad_request("IoT Hub API disabled, cannot invoke direct method (no iotHubServiceConnectionString configured)"));
    }
    Err(Rejection::new(501, "the IoT Hub service client is not available in this build"))
}

pub async fn desired_properties(core: &Rc<Core>, _req: &Request) -> Checked<Response> {
    if !core.settings.iot_hub_api_enabled() {
        return Err(Rejection::bad_request("IoT Hub API disabled, cannot patch desired properties (no iotHubServiceConnectionString configured)"));
    }
    Err(Rejection::new(501, "the IoT Hub service client is not available in this build"))
}
