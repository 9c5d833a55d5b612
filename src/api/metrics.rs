//! `GET /metrics`: Prometheus text format, gathered from every core. Needs the admin key
//! unless `--metrics-open` is set.

use std::rc::Rc;

use futures_channel::oneshot;

use super::auth::require_admin;
use crate::http::{Request, Response};
use crate::model::Checked;
use crate::app::mesh::{await_reply, CoreMsg};
use crate::app::Core;

pub async fn get(core: &Rc<Core>, req: &Request) -> Checked<Response> {
    if !core.settings.config.metrics_open {
        require_admin(&core.settings, req)?;
    }
    let mut waits = Vec::new();
    for target in 0..core.cores() {
        if target != core.index {
            let (tx, rx) = oneshot::channel();
            core.mesh.post(target, CoreMsg::Metrics(tx));
            waits.push((target, rx));
        }
    }
    let mut snapshots = vec![None; core.cores()];
    snapshots[core.index] = Some(core.metrics_snapshot());
    for (target, rx) in waits {
        snapshots[target] = await_reply(rx).await;
    }
    let snapshots: Vec<_> = snapshots.into_iter().flatten().collect();
    let external = core.shared.external_metrics.get().map(|f| f()).unwrap_or_default();
    Ok(Response::new(200, "text/plain; version=0.0.4; charset=utf-8", crate::metrics::render(&snapshots, &external)))
}
