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
use crate::app::Core;

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

/// The pid and offset of a CONNECT's auth object (`{"pid":…,"offset":…}`, what
/// socket.io-client ≥ 4.6 sends when it reconnects after a server gave it a pid). A pid with no
/// offset (no event reached the client) restores from where the pid began.
fn restore_request(auth: &str) -> Option<(String, Option<String>)> {
    let auth: serde_json::Value = serde_json::from_str(auth).ok()?;
    let pid = auth.get("pid")?.as_str()?.to_string();
    let offset = auth.get("offset").and_then(|o| o.as_str()).map(str::to_string);
    Some((pid, offset))
}

/// A CONNECT that restores a pid this instance does not know, on a session whose history
/// another instance may hold (design step 6b): the session to ask for before answering.
pub fn restores_elsewhere(conn: &Conn, text: &str) -> Option<SessionId> {
    let ClientPacket::Connect(packet) = parse_client_packet(text)? else { return None };
    connect_restores_elsewhere(&conn.core, conn.session, conn.attached.get(), packet)
}

/// [`restores_elsewhere`] for a CONNECT packet (`0…`, what `ClientPacket::Connect` holds) of a
/// socket on `session`, over either transport.
pub fn connect_restores_elsewhere(core: &Core, session: Option<SessionId>, attached: bool, packet: &str) -> Option<SessionId> {
    let session = session.filter(|_| !attached)?;
    let (pid, _) = connect_auth(packet)?;
    core.recovery_elsewhere(session, &pid).then_some(session)
}

/// The `{pid, offset}` of a CONNECT packet, if it has them.
fn connect_auth(packet: &str) -> Option<(String, Option<String>)> {
    let rest = packet.get(1..)?;
    restore_request(rest.strip_prefix("/,").unwrap_or(rest))
}

/// Once [`restores_elsewhere`] named the session, before the CONNECT `packet` is answered,
/// over either transport: its history is asked of the instance that holds it (design step
/// 6b, at most 2 s); when none came and the pid is still unknown here, it is rebuilt from the
/// device rings here if the offset carries a device part (design step 11). Callers box it:
/// a socket's task stays small while it is not needed (issue 25 item 3).
pub async fn fetch_history(core: Rc<Core>, session: SessionId, packet: &str) {
    core.take_stream(session).await;
    // None came: its instance may have died (`kill -9`).
    let Some((pid, Some(offset))) = connect_auth(packet) else { return };
    if core.rebuild_wanted(session, &pid, &offset) {
        core.rebuild_stream(session, &pid, &offset).await;
    }
}

/// [`fetch_history`] for a plain WebSocket's `since=` offset, once `Core::since_elsewhere`
/// said its history is not here: the take from the instance holding it (design step 6b),
/// then, when none came, the rebuild from the device rings (step 11). A plain socket has no
/// pid: its resume finds the stream by the offset's epoch, so the rebuild is given a pid
/// nobody will ever send (its entry only keeps the stream a window, as a pid away does).
pub async fn fetch_since(core: Rc<Core>, session: SessionId, since: &str) {
    core.take_stream(session).await;
    if !core.since_elsewhere(session) {
        return; // taken from its holder (or a stream was made here meanwhile)
    }
    let pid = random_token(16);
    if core.rebuild_wanted(session, &pid, since) {
        core.rebuild_stream(session, &pid, since).await;
    }
}

/// The reply to a Socket.IO CONNECT (without the Engine.IO `4`): an ack after attaching the
/// socket to its session, or an error for a bad namespace or an unknown session; and the
/// frames to replay after it when the CONNECT recovered a connection (connection state
/// recovery: `40{"sid","pid"}` with the pid the client sent, then what it missed).
/// `transport` indexes `metrics::TRANSPORTS`.
pub fn connect_reply(
    core: &Rc<Core>,
    session: Option<SessionId>,
    outlet: &Rc<Outlet>,
    attached: &Cell<bool>,
    packet: &str,
    transport: usize,
) -> (String, bool, Vec<Out>) {
    // `0` + optional namespace (`/nsp,`) + optional auth JSON.
    let rest = &packet[1..];
    if rest.starts_with('/') && !rest.starts_with("/,") && rest != "/" {
        let nsp = rest.split(',').next().unwrap_or(rest);
        return (format!("4{nsp},{}", json!({"message": "Invalid namespace"})), false, Vec::new());
    }
    if attached.get() {
        return (format!("0{}", json!({"sid": random_token(15)})), true, Vec::new());
    }
    let auth = rest.strip_prefix("/,").unwrap_or(rest);
    let restore = restore_request(auth);
    let restore = restore.as_ref().map(|(pid, offset)| (pid.as_str(), offset.as_deref()));
    let connected = session.and_then(|s| core.attach_socketio(s, outlet, restore, transport));
    attached.set(connected.is_some());
    if connected.is_none() && restore.is_some() {
        // Its session is gone (deleted or expired meanwhile): so are its pids.
        core.recovery_session_unknown(transport);
    }
    match connected {
        Some(c) => {
            let answer = match &c.pid {
                Some(pid) => json!({"sid": c.sid, "pid": pid}),
                None => json!({"sid": c.sid}),
            };
            let replay = c.replay.into_iter().map(|(frame, seq)| Out::Envelope(frame, seq)).collect();
            (format!("0{answer}"), true, replay)
        }
        None => (
            format!("4{}", json!({"message": "unknown or expired session: open a new one with POST /session"})),
            false,
            Vec::new(),
        ),
    }
}

/// Queues the answer to a CONNECT and, after it, the replay of a recovered connection; a
/// refused CONNECT closes the socket once its answer is out.
pub fn answer_connect(outlet: &Outlet, (reply, ok, replay): (String, bool, Vec<Out>)) {
    outlet.push(Out::Packet(format!("4{reply}").into()));
    if !replay.is_empty() {
        outlet.start_replay(replay);
    }
    if !ok {
        outlet.finish(CloseReason::new(1000, "connection refused"));
    }
}

/// An Engine.IO packet from a client, parsed from one text frame or polling record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientPacket<'a> {
    /// `1`: the client closes the transport.
    Close,
    /// `2probe`: the probe of a transport upgrade (the only ping a v4 client sends).
    Probe,
    /// `2…` other than the probe: in Engine.IO 4 the server pings, never the client.
    Ping,
    /// `3…`: the answer to our ping.
    Pong,
    /// `5`: the upgrade is complete.
    Upgrade,
    /// `6`.
    Noop,
    /// `40…`: Socket.IO CONNECT (the text after `4`, namespace and auth included).
    Connect(&'a str),
    /// `41…`: Socket.IO DISCONNECT.
    Disconnect,
    /// Any other Socket.IO packet (events, acks): nothing the server needs.
    Other,
}

/// Parses a client packet; `None` for text that is not an Engine.IO packet a client may send.
pub fn parse_client_packet(text: &str) -> Option<ClientPacket<'_>> {
    let (&kind, rest) = text.as_bytes().split_first()?;
    Some(match kind {
        b'1' => ClientPacket::Close,
        b'2' if rest == b"probe" => ClientPacket::Probe,
        b'2' => ClientPacket::Ping,
        b'3' => ClientPacket::Pong,
        b'5' => ClientPacket::Upgrade,
        b'6' => ClientPacket::Noop,
        b'4' => match rest.first() {
            Some(b'0') => ClientPacket::Connect(&text[1..]),
            Some(b'1') => ClientPacket::Disconnect,
            Some(_) => ClientPacket::Other,
            None => return None,
        },
        _ => return None,
    })
}

/// Whether a packet may arrive before the socket is connected to a valid session: only what
/// the handshake needs (the CONNECT, pongs, closing, and an upgrade's probe and completion).
/// Anything else closes the socket, so an unauthenticated socket can make us queue nothing.
pub fn allowed_before_connect(packet: ClientPacket<'_>, upgrading: bool) -> bool {
    match packet {
        ClientPacket::Connect(_) | ClientPacket::Pong | ClientPacket::Noop => true,
        ClientPacket::Close | ClientPacket::Disconnect => true,
        ClientPacket::Probe | ClientPacket::Upgrade => upgrading,
        ClientPacket::Ping | ClientPacket::Other => false,
    }
}

/// A text frame from a Socket.IO client over WebSocket.
pub fn on_websocket_text(conn: &Conn, text: &str) {
    let Some(packet) = parse_client_packet(text) else {
        return conn.outlet.close(CloseReason::new(1002, "not an Engine.IO packet"));
    };
    let upgrading = conn.upgrading.borrow().is_some();
    if !conn.attached.get() && !allowed_before_connect(packet, upgrading) {
        return conn.outlet.close(CloseReason::new(1008, "only the Socket.IO handshake is accepted before CONNECT"));
    }
    match packet {
        ClientPacket::Probe => super::socketio_polling::on_probe(conn),
        ClientPacket::Ping => conn.outlet.close(CloseReason::new(1002, "invalid heartbeat direction (Engine.IO 4)")),
        ClientPacket::Upgrade => super::socketio_polling::complete_upgrade(conn),
        ClientPacket::Pong | ClientPacket::Noop | ClientPacket::Other => {}
        ClientPacket::Close => conn.outlet.close(CloseReason::new(1000, "client closed")),
        ClientPacket::Connect(packet) => {
            let answer = connect_reply(&conn.core, conn.session, &conn.outlet, &conn.attached, packet, 1);
            answer_connect(&conn.outlet, answer);
        }
        ClientPacket::Disconnect => conn.outlet.finish(CloseReason::new(1000, "client disconnected")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_packets_parse_and_only_the_handshake_passes_before_connect() {
        assert_eq!(parse_client_packet("40"), Some(ClientPacket::Connect("0")));
        assert_eq!(parse_client_packet("40{\"a\":1}"), Some(ClientPacket::Connect("0{\"a\":1}")));
        assert_eq!(parse_client_packet("2probe"), Some(ClientPacket::Probe));
        assert_eq!(parse_client_packet("2xxxx"), Some(ClientPacket::Ping));
        assert_eq!(parse_client_packet("42[\"e\"]"), Some(ClientPacket::Other));
        for bad in ["", "0", "4", "7", "x", "é"] {
            assert_eq!(parse_client_packet(bad), None, "{bad:?}");
        }
        assert!(!allowed_before_connect(ClientPacket::Ping, false));
        assert!(!allowed_before_connect(ClientPacket::Probe, false));
        assert!(allowed_before_connect(ClientPacket::Probe, true));
        assert!(!allowed_before_connect(ClientPacket::Other, true));
    }

    #[test]
    fn a_connect_names_a_restore_only_with_a_string_pid() {
        assert_eq!(restore_request(r#"{"pid":"p","offset":"h1.1.2"}"#), Some(("p".into(), Some("h1.1.2".into()))));
        assert_eq!(restore_request(r#"{"pid":"p","token":"x"}"#), Some(("p".into(), None)));
        assert_eq!(restore_request(r#"{"pid":"p","offset":3}"#), Some(("p".into(), None)));
        for none in ["", "{}", r#"{"pid":1,"offset":"o"}"#, "[]", "not json", r#"{"offset":"h1.1.2"}"#] {
            assert_eq!(restore_request(none), None, "{none:?}");
        }
    }

    /// Arbitrary input never panics, and every packet it accepts starts with a packet type.
    #[test]
    fn arbitrary_text_never_panics_the_packet_parser() {
        let mut rng = fastrand::Rng::with_seed(0x05ee_de10);
        let alphabet: Vec<char> = "0123456789{}[]\",/probeé\u{1e}\u{0} ".chars().collect();
        for _ in 0..200_000 {
            let len = rng.usize(0..12);
            let text: String = (0..len).map(|_| alphabet[rng.usize(..alphabet.len())]).collect();
            if let Some(packet) = parse_client_packet(&text) {
                assert!(matches!(text.as_bytes()[0], b'1'..=b'6'), "{text:?} gave {packet:?}");
                let _ = allowed_before_connect(packet, rng.bool());
            }
        }
    }
}
