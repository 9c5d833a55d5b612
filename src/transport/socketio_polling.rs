//! Engine.IO HTTP long-polling (placeholder until the polling transport lands).

use super::Conn;
use crate::push::outlet::CloseReason;

/// A WebSocket asking to take over a polling session.
pub fn take_over(conn: &Conn, _sid: &str) -> bool {
    conn.outlet.close(CloseReason::new(1008, "unknown Engine.IO session id"));
    false
}
