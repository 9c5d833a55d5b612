//! `PUT/DELETE /subscription` and the bulk `PUT/DELETE /subscriptions`.
//!
//! Bulk rules (SPEC 11/12): every element is validated before anything is applied (one bad
//! element: 400, nothing applied); elements without a grant are skipped; the answer lists
//! the applied elements exactly as sent. Bodies: a bare array, or `{"subscriptionRequests": […]}`
//! as the Node admin SDK sends it (with the session in a `sessionId` header).

use std::rc::Rc;

use serde_json::Value;

use super::auth::parse_session;
use futures_channel::oneshot::Receiver;
use crate::http::{Request, Response};
use crate::ids::SessionId;
use crate::model::{Checked, Rejection, SubscriptionRequest};
use crate::app::Core;
use crate::shard::{ask, DeviceOp};

fn op(session: SessionId, r: SubscriptionRequest, add: bool) -> (DeviceOp, Receiver<bool>) {
    let device = r.device.into_boxed_str();
    let sub = r.subscription;
    if add {
        ask(|permitted| DeviceOp::Subscribe { device, session, sub, permitted })
    } else {
        ask(|permitted| DeviceOp::Unsubscribe { device, session, sub, permitted })
    }
}

/// Runs the session's subscription changes; whether each was permitted, in order.
async fn run(core: &Rc<Core>, session: SessionId, asked: Vec<(DeviceOp, Receiver<bool>)>) -> Checked<Vec<bool>> {
    let (ops, answers): (Vec<DeviceOp>, Vec<Receiver<bool>>) = asked.into_iter().unzip();
    super::scoped(core, session, false, ops).await?;
    let mut permitted = Vec::with_capacity(answers.len());
    for answer in answers {
        permitted.push(answer.await.map_err(|_| super::stopping())?);
    }
    Ok(permitted)
}

pub async fn single(core: &Rc<Core>, req: &Request, add: bool) -> Checked<Response> {
    let request = SubscriptionRequest::parse(&req.json()?, req.header("sessionid"))?;
    let session = parse_session(&request.session)?;
    // With several instances the permission is decided on Redis's copy of the session.
    match run(core, session, vec![op(session, request, add)]).await?.first() {
        Some(true) => Ok(Response::no_content()),
        _ => Err(Rejection::new(403, "subscription request not granted")),
    }
}

pub async fn bulk(core: &Rc<Core>, req: &Request, add: bool) -> Checked<Response> {
    let body = req.json()?;
    let elements = match body {
        Value::Array(items) => items,
        Value::Object(mut obj) => match obj.remove("subscriptionRequests") {
            Some(Value::Array(items)) => items,
            _ => return Err(Rejection::bad_request(
                "body must be an array of subscription requests or {\"subscriptionRequests\": [...]}",
            )),
        },
        _ => return Err(Rejection::bad_request("body must be an array of subscription requests")),
    };
    let header_session = req.header("sessionid");
    let mut parsed = Vec::with_capacity(elements.len());
    for (i, element) in elements.iter().enumerate() {
        let request = SubscriptionRequest::parse(element, header_session).map_err(|e| {
            Rejection::bad_request(format!(
                "Not all elements in the request body are subscription requests: element {i}: {}",
                e.message
            ))
        })?;
        parsed.push(request);
    }
    // Group by session (normally one), keeping each element's position.
    let mut groups: Vec<(SessionId, Vec<(usize, SubscriptionRequest)>)> = Vec::new();
    for (i, request) in parsed.into_iter().enumerate() {
        let session = parse_session(&request.session)?;
        match groups.iter_mut().find(|(s, _)| *s == session) {
            Some((_, members)) => members.push((i, request)),
            None => groups.push((session, vec![(i, request)])),
        }
    }
    if groups.len() > 1 {
        // Every session must exist before anything is applied.
        for (session, _) in &groups {
            run(core, *session, Vec::new()).await?;
        }
    }
    let mut applied = vec![false; elements.len()];
    for (session, members) in groups {
        let (positions, asked): (Vec<usize>, Vec<_>) = members.into_iter().map(|(i, r)| (i, op(session, r, add))).unzip();
        for (i, permitted) in positions.into_iter().zip(run(core, session, asked).await?) {
            applied[i] = permitted;
        }
    }
    let echoed: Vec<Value> = elements.into_iter().zip(applied).filter(|(_, ok)| *ok).map(|(e, _)| e).collect();
    Ok(Response::json(200, Value::Array(echoed).to_string()))
}
