//! One core's share of the console's device list (`GET /devices`): devices whose id contains
//! the query, in id order after a cursor, with their connection state and last values.
//!
//! Paging is by cursor (`after` = the last id of the previous page), not by offset: each core
//! returns at most `limit` devices after the cursor and the API merges them, so a page costs
//! one pass over each core's devices and `cores × limit` summaries, however deep it is
//! (100,000 devices: a few ms per core; the console asks every 2 s at most).

use crate::shard::devices::DeviceTable;
use crate::timefmt::Millis;

/// Most devices on one page.
pub const MAX_LIMIT: usize = 200;
/// Most telemetry keys shown per device (the rest is counted).
pub const MAX_KEYS: usize = 12;

#[derive(Debug, Clone)]
pub struct PageRequest {
    /// Substring of the device id (case-sensitive); empty = all.
    pub query: Box<str>,
    /// Only ids after this one.
    pub after: Option<Box<str>>,
    pub limit: usize,
}

#[derive(Debug, Clone)]
pub struct DeviceSummary {
    pub id: Box<str>,
    pub connected: Option<bool>,
    /// Newest time among its values and connection state.
    pub last: Option<Millis>,
    /// Up to `MAX_KEYS` telemetry keys (sorted) with their value as JSON text.
    pub telemetry: Vec<(Box<str>, crate::ingest::JsonText)>,
    pub keys: usize,
    pub has_twin: bool,
}

/// A core's matches: how many in all, and the first `limit` after the cursor, in id order.
#[derive(Debug, Clone, Default)]
pub struct Page {
    pub total: u64,
    /// Matches after the cursor (so the API knows whether a next page exists).
    pub after_cursor: u64,
    pub devices: Vec<DeviceSummary>,
}

pub fn page(table: &DeviceTable, request: &PageRequest) -> Page {
    let mut total = 0u64;
    let mut after_cursor = 0u64;
    let mut found = Vec::new();
    for (id, device) in table.iter() {
        if !id.contains(&*request.query) {
            continue;
        }
        total += 1;
        if request.after.as_deref().is_none_or(|after| id > after) {
            after_cursor += 1;
            found.push((id, device));
        }
    }
    let limit = request.limit.min(MAX_LIMIT);
    if found.len() > limit {
        found.select_nth_unstable_by(limit, |a, b| a.0.cmp(b.0));
        found.truncate(limit);
    }
    found.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let devices = found
        .into_iter()
        .map(|(id, d)| {
            let mut keys: Vec<_> = d.telemetry.iter().collect();
            keys.sort_unstable_by(|a, b| a.0.cmp(b.0));
            let last = d.telemetry.newest().into_iter().chain(d.connection.as_ref().map(|c| c.at)).max();
            DeviceSummary {
                id: id.into(),
                connected: d.connection.as_ref().map(|c| c.connected),
                last,
                keys: keys.len(),
                telemetry: keys.into_iter().take(MAX_KEYS).map(|(k, v, _)| (k.into(), crate::ingest::JsonText::new(v))).collect(),
                has_twin: d.twin.is_some(),
            }
        })
        .collect();
    Page { total, after_cursor, devices }
}
