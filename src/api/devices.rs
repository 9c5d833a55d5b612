//! `GET /devices?q=&after=&limit=` (admin key): the console's device list, paged by cursor.
//!
//! Each core returns its first `limit` matches after the cursor (`shard::listing`); they are
//! merged here in id order. Answer: `{"total", "devices": [...], "next"}` where `next` is the
//! cursor of the following page, or null on the last one.

use std::rc::Rc;

use serde::Serialize;
use serde_json::value::RawValue;

use super::auth::require_admin;
use crate::config::MAX_DEVICE_ID_LEN;
use crate::http::{Request, Response};
use crate::model::{Checked, Rejection};
use crate::app::Core;
use crate::shard::listing::{Page, PageRequest, MAX_LIMIT};
use crate::shard::{ask_session, SessionOp};
use crate::timefmt::iso;

const DEFAULT_LIMIT: usize = 50;

fn parse(req: &Request) -> Checked<PageRequest> {
    let query = req.query_param("q").unwrap_or_default();
    if query.len() > MAX_DEVICE_ID_LEN {
        return Err(Rejection::bad_request(format!("query parameter `q` is longer than {MAX_DEVICE_ID_LEN} bytes")));
    }
    let after = req.query_param("after").filter(|a| !a.is_empty());
    if after.as_ref().is_some_and(|a| a.len() > MAX_DEVICE_ID_LEN) {
        return Err(Rejection::bad_request(format!("query parameter `after` is longer than {MAX_DEVICE_ID_LEN} bytes")));
    }
    let limit = match req.query_param("limit") {
        None => DEFAULT_LIMIT,
        Some(raw) => match raw.parse::<usize>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
            _ => {
                return Err(Rejection::bad_request(format!(
                    "query parameter `limit` is `{raw}`; it must be a whole number from 1 to {MAX_LIMIT}"
                )))
            }
        },
    };
    Ok(PageRequest { query: query.into(), after: after.map(Into::into), limit })
}

pub async fn list(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    require_admin(&core.settings, req)?;
    let request = parse(req)?;
    // Every core at once, then every page.
    let answers: Vec<_> = (0..core.cores())
        .map(|target| {
            let (op, page) = ask_session(|page| SessionOp::ListDevices { request: request.clone(), page });
            core.session_op_on(target, op);
            page
        })
        .collect();
    let mut pages = Vec::with_capacity(answers.len());
    for page in answers {
        pages.push(page.await.map_err(|_| super::stopping())?);
    }
    Ok(Response::json(200, render(pages, request.limit)))
}

/// The page as JSON text. Telemetry values go out as the JSON text the device sent, as in
/// every other read (`/lastValue`): a number no machine type holds (`18446744073709551616`,
/// `1e309`) is neither rounded nor turned into `null`.
fn render(pages: Vec<Page>, limit: usize) -> String {
    let total: u64 = pages.iter().map(|p| p.total).sum();
    let after_cursor: u64 = pages.iter().map(|p| p.after_cursor).sum();
    let mut devices: Vec<_> = pages.into_iter().flat_map(|p| p.devices).collect();
    devices.sort_unstable_by(|a, b| a.id.cmp(&b.id));
    devices.truncate(limit);
    let next = (after_cursor > limit as u64).then(|| devices.last().map(|d| d.id.to_string())).flatten();
    let devices: Vec<DeviceOut<'_>> = devices
        .iter()
        .map(|d| DeviceOut {
            device_id: &d.id,
            connected: d.connected,
            last_seen: d.last.map(iso),
            telemetry: Telemetry(&d.telemetry),
            telemetry_keys: d.keys,
            has_twin: d.has_twin,
        })
        .collect();
    serde_json::to_string(&PageOut { total, devices, next }).unwrap_or_else(|_| String::from("{}"))
}

#[derive(Serialize)]
struct PageOut<'a> {
    total: u64,
    devices: Vec<DeviceOut<'a>>,
    next: Option<String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DeviceOut<'a> {
    device_id: &'a str,
    connected: Option<bool>,
    last_seen: Option<String>,
    telemetry: Telemetry<'a>,
    telemetry_keys: usize,
    has_twin: bool,
}

/// Last values as an object of their stored JSON texts, unchanged.
struct Telemetry<'a>(&'a [(Box<str>, crate::ingest::JsonText)]);

impl Serialize for Telemetry<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, json) in self.0 {
            let raw: Option<&RawValue> = serde_json::from_str(json).ok();
            map.serialize_entry(&**key, &raw)?;
        }
        map.end()
    }
}
