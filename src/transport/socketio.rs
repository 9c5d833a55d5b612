//! Socket.IO v4 on Engine.IO protocol 4: what ux4iot's React client speaks.
//!
//! Engine.IO packets are text: `0` open, `1` close, `2` ping, `3` pong, `4` message,
//! `5` upgrade, `6` noop. A Socket.IO packet rides in a message: `40` CONNECT to namespace
//! `/`, `44` CONNECT_ERROR, `42` EVENT. The server pings (`2`), the client answers (`3`).
//! The only event the server emits is `data`: `42["data",<envelope>]`. The session comes
//! from the handshake query (`?sessionId=…`); an unknown or expired one gets a CONNECT_ERROR
//! and the socket is closed.

use std::cell::Cell;
use std::rc::Rc;

use serde_json::json;

use super::Conn;
use crate::ids::{random_token, SessionId};
use crate::push::outlet::{CloseReason, Out, Outlet};
use crate::runtime::Core;

/// What precedes an envelope in a `data` event (the envelope and `]` follow).
pub const EVENT_PREFIX: &[u8] = b"42[\"data\",";

/// Largest payload we accept from a client (announced in the open packet).
pub const MAX_PAYLOAD: usize = 64 * 1024;

/// The Engine.IO open packet.
pub fn open_packet(sid: &str, upgrades: &[&str], ping_interval: u64, ping_timeout: u64) -> String {
    format!(
        "0{}",
        json!({
            "sid": sid,
            "upgrades": upgrades,
            "pingInterval": ping_interval,
            "pingTimeout": ping_timeout,
            "maxPayload": MAX_PAYLOAD,
        })
    )
}

/// First packets on a fresh Socket.IO WebSocket: the open packet (the client then sends `40`).
pub fn greet_websocket(conn: &Conn, upgrade_sid: Option<&str>) -> bool {
    if upgrade_sid.is_some() {
        // Upgrades of polling sessions are handled by the polling module.
        return super::socketio_polling::take_over(conn, upgrade_sid.unwrap_or_default());
    }
    let c = &conn.core.settings.config;
    conn.outlet.push(Out::Packet(open_packet(&random_token(15), &[], c.ping_interval, c.ping_timeout).into()));
    true
}

/// The reply to a Socket.IO CONNECT (without the Engine.IO `4`): an ack after attaching the
/// socket to its session, or an error for a bad namespace or an unknown session.
pub fn connect_reply(
    core: &Rc<Core>,
    session: Option<SessionId>,
    outlet: &Rc<Outlet>,
    attached: &Cell<bool>,
    packet: &str,
) -> (String, bool) {
    // `0` + optional namespace (`/nsp,`) + optional auth JSON.
    let rest = &packet[1..];
    if rest.starts_with('/') && !rest.starts_with("/,") && rest != "/" {
        let nsp = rest.split(',').next().unwrap_or(rest);
        return (format!("4{nsp},{}", json!({"message": "Invalid namespace"})), false);
    }
    if !attached.get() {
        attached.set(session.is_some_and(|s| core.attach_socket(s, outlet.clone())));
    }
    if attached.get() {
        (format!("0{}", json!({"sid": random_token(15)})), true)
    } else {
        (format!("4{}", json!({"message": "unknown or expired session: open a new one with POST /session"})), false)
    }
}

/// A text frame from a Socket.IO client over WebSocket.
pub fn on_websocket_text(conn: &Conn, text: &str) {
    let mut chars = text.chars();
    match chars.next() {
        Some('2') if chars.as_str() == "probe" => super::socketio_polling::on_probe(conn),
        Some('2') => conn.outlet.push(Out::Packet(format!("3{}", chars.as_str()).into())),
        Some('5') => super::socketio_polling::complete_upgrade(conn),
        Some('3') | Some('6') => {} // pong, noop
        Some('1') => conn.outlet.close(CloseReason::new(1000, "client closed")),
        Some('4') => on_socketio_packet(conn, chars.as_str()),
        _ => conn.outlet.close(CloseReason::new(1002, "not an Engine.IO packet")),
    }
}

/// A Socket.IO packet (inside an Engine.IO message) from a client.
pub fn on_socketio_packet(conn: &Conn, packet: &str) {
    match packet.as_bytes().first() {
        Some(b'0') => {
            let (reply, ok) = connect_reply(&conn.core, conn.session, &conn.outlet, &conn.attached, packet);
            conn.outlet.push(Out::Packet(format!("4{reply}").into()));
            if !ok {
                conn.outlet.finish(CloseReason::new(1000, "connection refused"));
            }
        }
        Some(b'1') => conn.outlet.finish(CloseReason::new(1000, "client disconnected")),
        // Clients emit nothing the server needs; events and acks are ignored.
        _ => {}
    }
}
