//! Sessions: creation, deletion (one and all) and expiry of idle sessions.

mod common;

use common::*;
use std::collections::HashSet;
use std::time::Duration;

#[test]
fn session_ids_are_url_safe_long_and_unique() {
    let server = Server::start(&[]);
    let mut seen = HashSet::new();
    for _ in 0..100 {
        let id = server.new_session();
        assert!(id.len() >= 20, "session id {id:?} is shorter than 20 characters");
        assert!(
            id.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-'),
            "session id {id:?} is not URL-safe"
        );
        assert!(seen.insert(id.clone()), "session id {id:?} was handed out twice");
    }
}

#[test]
fn session_creation_answers_json_with_session_id() {
    let server = Server::start(&[]);
    let (status, body) = server.call_json("POST", "/session", &[], None);
    assert_eq!(status, 200);
    assert!(body["sessionId"].is_string(), "body: {body}");
}

#[test]
fn deleted_session_is_gone() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", Some("t")));
    let (status, body, _) = server.call("DELETE", &format!("/sessions/{session}"), &[ADMIN], None);
    assert_eq!(status, 204, "DELETE /sessions/:id: {body}");

    let (status, body) = server.subscribe(&session, telemetry("d1", Some("t")));
    assert_error(status, &body, 404, "");
    let (status, body) = server.try_grant(&session, telemetry("d1", Some("t")));
    assert_error(status, &body, 404, "");
}

#[test]
fn deleting_one_session_keeps_the_others() {
    let server = Server::start(&[]);
    let doomed = server.new_session();
    let kept = server.new_session();
    let (status, _, _) = server.call("DELETE", &format!("/sessions/{doomed}"), &[ADMIN], None);
    assert_eq!(status, 204);
    server.grant(&kept, telemetry("d1", None));
    assert_eq!(server.subscribe(&kept, telemetry("d1", None)).0, 204);
}

#[test]
fn deleting_an_unknown_session_is_404() {
    let server = Server::start(&[]);
    let (status, body, _) = server.call("DELETE", "/sessions/no-such-session-abcdefghij", &[ADMIN], None);
    assert_error(status, &body, 404, "");
}

#[test]
fn deleting_all_sessions_removes_every_session() {
    let server = Server::start(&[]);
    // Fresh connections, so the sessions are created on different cores.
    let sessions: Vec<String> = (0..10).map(|_| server.new_session_on(&new_agent())).collect();
    let (status, body, _) = server.call("DELETE", "/sessions", &[ADMIN], None);
    assert_eq!(status, 204, "DELETE /sessions: {body}");
    for session in &sessions {
        let (status, body) = server.try_grant(session, telemetry("d1", None));
        assert_error(status, &body, 404, "");
    }
    // New sessions can still be opened afterwards.
    let fresh = server.new_session();
    server.grant(&fresh, telemetry("d1", None));
}

#[test]
fn session_deletes_require_the_admin_key() {
    let server = Server::start(&[]);
    let session = server.new_session();
    for headers in [&[][..], &[("Shared-Access-Key", "wrong")][..]] {
        let (status, body, _) = server.call("DELETE", &format!("/sessions/{session}"), headers, None);
        assert_eq!(status, 401, "DELETE /sessions/:id with {headers:?}: {body}");
        assert!(error_message(&body).starts_with("Unauthorized:"), "{body}");
        let (status, body, _) = server.call("DELETE", "/sessions", headers, None);
        assert_eq!(status, 401, "DELETE /sessions with {headers:?}: {body}");
        assert!(error_message(&body).starts_with("Unauthorized:"), "{body}");
    }
    // The session survived the refused deletes.
    server.grant(&session, telemetry("d1", None));
}

#[test]
fn idle_session_expires_after_the_grace_period() {
    let server = Server::start(&["--session-grace-period-ms", "300", "--log-level", "debug"]);
    let session = server.new_session();
    // Alive right after creation.
    server.grant(&session, telemetry("d1", None));
    let expired = server.wait_for_stderr(Duration::from_secs(5), |l| l.contains("session expired") && l.contains(&session));
    assert!(expired.is_some(), "the session expires after the grace period");
    let (status, body) = server.try_grant(&session, telemetry("d1", None));
    assert_error(status, &body, 404, "");
}
