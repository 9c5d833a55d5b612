//! Session copies kept in step with Redis when a change to them was missed (issue 23, "a
//! session change missed on the pub/sub connection").
//!
//! Why: another instance's change reaches this one only on the `ops` channel, and Redis
//! pub/sub keeps nothing for a subscriber that is away. A change published while this
//! instance's subscriber was down (an outage, a reconnect after `--redis-inbound-bytes`) or
//! written and never published (a cluster's publication after the write failed) never
//! arrives: the copy here kept its old access on the devices it touched (a revoked grant
//! still delivering) until the session changed again on those very devices.
//!
//! How (chosen over reloading every held session on reconnect, or dropping the copies):
//! every change bumps the session's version `v` in Redis by one and its op carries it, so
//! the link keeps, per session held here, the version up to which it has applied every
//! change **in order** ([`Versions`]; own changes count when their publication comes back).
//! A change whose version skips one is a *gap*. Then:
//! - at every reconnect, each held session's version is read (`HMGET created v`, with its
//!   tombstone's `EXISTS`: two small commands per session, [`CHUNK`] sessions at a time) and
//!   only the sessions Redis holds newer are read whole (`HGETALL`) and put in place of the
//!   copy here (every device the copy knows and Redis no longer holds is emptied at that
//!   version);
//! - a gap still open a heartbeat later (a cluster's publications of two instances may
//!   cross: the missing one usually follows) reloads the session the same way;
//! - sessions held here that the link never saw loaded (restored from the durable store)
//!   are checked at the next heartbeat.
//!
//! Bounded work: a reconnect costs one small read per held session, in chunks, and a full
//! read only of the sessions that changed meanwhile (none after a short blip); it starts at
//! a random point of the first heartbeat, so instances reconnecting together after a Redis
//! restart do not all read at once. Reloading every held session would read every access of
//! every session on every reconnect (a reconnect after `--redis-inbound-bytes` is exactly
//! when the instance is busiest); dropping the copies would close their sockets.
//!
//! A session missing from Redis is dropped here only if it was deleted (its tombstone
//! `P:gone:<id>`, or `P:cleared` after `DELETE /sessions`, both living a session TTL): a
//! Redis that restarted empty lost every key, and the sessions held here keep serving their
//! sockets as before.
//!
//! Bounds: one entry per session held here (entries not refreshed by their core for 3
//! refresh periods are forgotten: a session dropped here; one wrongly forgotten only costs a
//! check), at most [`ABOVE`] out-of-order versions remembered per session.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hashbrown::HashMap;
use tokio::time::Instant;

use super::conn::Conn;
use super::link::{within, Ctx, Failed, State};
use super::wire::SharedOp;
use super::Inbound;
use crate::ids::SessionId;
use crate::runtime::routing::core_of_session;

/// Sessions checked at once (two small commands each, all in flight together).
const CHUNK: usize = 512;
/// Versions past a gap remembered per session (beyond: the session is reloaded anyway).
const ABOVE: usize = 8;

/// One session held here, as far as the link knows.
struct Held {
    /// Every change up to this version is applied here; `None`: unknown (not loaded through
    /// the link), checked at the next heartbeat.
    v: Option<u64>,
    /// Versions applied past a gap (their op came before an earlier one).
    above: Vec<u64>,
    /// Since when a gap is open.
    gap_since: Option<Instant>,
    /// When its core last said it holds it (or it was loaded or created here).
    touched: Instant,
}

/// The sessions held here and the version each is applied up to (see the module's docs).
#[derive(Default)]
pub(super) struct Versions {
    held: HashMap<SessionId, Held>,
    /// Check every held session at the next pass (set at every connect).
    pub check_all: bool,
}

impl Versions {
    fn entry(&mut self, session: SessionId, now: Instant) -> &mut Held {
        let held = self.held.entry(session).or_insert(Held { v: None, above: Vec::new(), gap_since: None, touched: now });
        held.touched = now;
        held
    }

    /// The session as Redis held it at version `v` is in place here (loaded or reloaded).
    pub fn loaded(&mut self, session: SessionId, v: u64) {
        let held = self.entry(session, Instant::now());
        let v = held.v.map_or(v, |w| w.max(v));
        held.v = Some(v);
        held.above.retain(|a| *a > v);
        Self::absorb(held);
    }

    /// Redis holds the session at version `v`, not newer than what is applied here: a gap
    /// left open waits for nothing Redis has (a made-up or foreign version), so it is closed.
    pub fn settled(&mut self, session: SessionId, v: u64) {
        self.loaded(session, v);
        if let Some(held) = self.held.get_mut(&session) {
            held.above.clear();
            held.gap_since = None;
        }
    }

    /// Created here (no version yet).
    pub fn created(&mut self, session: SessionId) {
        let held = self.entry(session, Instant::now());
        held.v.get_or_insert(0);
    }

    /// A core holds these sessions; entries no core spoke of for `keep` are forgotten.
    pub fn refreshed(&mut self, sessions: &[SessionId], keep: Duration) {
        let now = Instant::now();
        for session in sessions {
            self.entry(*session, now);
        }
        self.held.retain(|_, h| now.duration_since(h.touched) < keep);
    }

    /// A change at version `v` was published (seen on `ops`, in the order Redis sent it).
    pub fn applied(&mut self, session: SessionId, v: u64) {
        let Some(held) = self.held.get_mut(&session) else { return };
        let Some(w) = held.v else { return };
        if v <= w || held.above.contains(&v) {
            return;
        }
        if v == w + 1 {
            held.v = Some(v);
            Self::absorb(held);
        } else if held.above.len() < ABOVE {
            held.above.push(v);
            held.gap_since.get_or_insert_with(Instant::now);
        }
    }

    /// Versions past the gap that follow on now.
    fn absorb(held: &mut Held) {
        let mut w = held.v.unwrap_or(0);
        while let Some(i) = held.above.iter().position(|a| *a == w + 1) {
            held.above.swap_remove(i);
            w += 1;
        }
        held.v = Some(w);
        if held.above.is_empty() {
            held.gap_since = None;
        }
    }

    pub fn gone(&mut self, session: SessionId) {
        self.held.remove(&session);
    }

    pub fn clear(&mut self) {
        self.held.clear();
    }

    fn version(&self, session: SessionId) -> Option<Option<u64>> {
        self.held.get(&session).map(|h| h.v)
    }

    /// What the next pass checks: every held session after a connect, else those whose
    /// version is unknown or whose gap is older than `grace`.
    fn due(&self, grace: Duration) -> (Vec<SessionId>, bool) {
        if self.check_all {
            return (self.held.keys().copied().collect(), true);
        }
        let now = Instant::now();
        let due = self
            .held
            .iter()
            .filter(|(_, h)| h.v.is_none() || h.gap_since.is_some_and(|t| now.duration_since(t) >= grace) || h.above.len() >= ABOVE)
            .map(|(s, _)| *s)
            .collect();
        (due, false)
    }
}

/// The resync task of one connection: every heartbeat (the first at a random point of it),
/// checks what [`Versions::due`] names. A failed pass is logged and made again at the next
/// heartbeat (the other tasks notice a Redis that is gone).
pub(super) async fn run(ctx: &Rc<Ctx>, state: &State, conn: Conn) -> Failed {
    let heartbeat = ctx.o.heartbeat();
    let jitter = heartbeat.mul_f64(f64::from(u32::from_le_bytes(super::random8()[..4].try_into().unwrap_or([0; 4]))) / f64::from(u32::MAX));
    let mut tick = tokio::time::interval_at(Instant::now() + jitter, heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (due, all) = state.borrow().versions.due(heartbeat);
        if due.is_empty() {
            if all {
                state.borrow_mut().versions.check_all = false;
            }
            continue;
        }
        match check(ctx, state, &conn, &due).await {
            Ok((reloaded, dropped)) => {
                if all {
                    state.borrow_mut().versions.check_all = false;
                }
                if reloaded + dropped > 0 {
                    tracing::info!(checked = due.len(), reloaded, dropped, "sessions held here had changed in Redis unseen (published while the link was down, or a change skipped): read again");
                } else {
                    tracing::debug!(checked = due.len(), "sessions held here checked against Redis: all current");
                }
            }
            Err(reason) => tracing::warn!(reason = %reason, sessions = due.len(), "sessions held here could not be checked against Redis; tried again next heartbeat"),
        }
    }
}

/// Reads the versions of `sessions` and reloads those Redis holds newer; drops those
/// deleted. How many were reloaded and dropped.
async fn check(ctx: &Rc<Ctx>, state: &State, conn: &Conn, sessions: &[SessionId]) -> Result<(usize, usize), Failed> {
    let (mut reloaded, mut dropped) = (0, 0);
    let cleared: bool = within("EXISTS cleared", redis::cmd("EXISTS").arg(ctx.o.names.cleared()).query_async(&mut conn.clone())).await?;
    for chunk in sessions.chunks(CHUNK) {
        let reads = chunk.iter().map(|session| {
            let (key, gone) = (ctx.o.names.session(*session), ctx.o.names.gone(*session));
            let (mut c, mut d) = (conn.clone(), conn.clone());
            // Two commands, each routed by its key (a cluster: `MOVED`/`ASK` followed during
            // a reshard), sent together on the multiplexed connections.
            async move {
                let (hmget, exists) = (redis::cmd("HMGET").arg(&key).arg("created").arg("v").to_owned(), redis::cmd("EXISTS").arg(gone).to_owned());
                let version = hmget.query_async::<Vec<Option<String>>>(&mut c);
                let deleted = exists.query_async::<bool>(&mut d);
                let (version, deleted) = futures_util::future::join(version, deleted).await;
                Ok::<_, redis::RedisError>((version?, deleted?))
            }
        });
        let answers = within("HMGET versions", async { futures_util::future::join_all(reads).await.into_iter().collect::<redis::RedisResult<Vec<_>>>() }).await?;
        ctx.stats.sessions_checked.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        let mut stale = Vec::new();
        for (session, (fields, gone)) in chunk.iter().zip(answers) {
            let Some(known) = state.borrow().versions.version(*session) else { continue };
            if fields.first().is_none_or(Option::is_none) {
                if gone || cleared {
                    state.borrow_mut().versions.gone(*session);
                    ctx.stats.sessions_reloaded.fetch_add(1, Ordering::Relaxed);
                    dropped += 1;
                    let core = core_of_session(*session, ctx.cores.len());
                    let _ = ctx.cores[core].send(Inbound::Op(SharedOp::Delete(*session), None)).await;
                } else {
                    // Lost with Redis's data, or expired: left as it is (see the module's docs),
                    // and no longer checked.
                    state.borrow_mut().versions.settled(*session, 0);
                }
                continue;
            }
            let v: u64 = fields.get(1).and_then(|v| v.as_deref()?.parse().ok()).unwrap_or(0);
            if known.is_none_or(|w| v > w) {
                stale.push(*session);
            } else {
                // Nothing missed: versions above it are none of Redis's, waited for no more.
                state.borrow_mut().versions.settled(*session, v);
            }
        }
        let loads = stale.iter().map(|session| {
            let key = ctx.o.names.session(*session);
            let mut c = conn.clone();
            async move { redis::cmd("HGETALL").arg(&key).query_async::<std::collections::HashMap<Vec<u8>, Vec<u8>>>(&mut c).await }
        });
        let loaded = within("HGETALL sessions", async { futures_util::future::join_all(loads).await.into_iter().collect::<redis::RedisResult<Vec<_>>>() }).await?;
        for (session, fields) in stale.into_iter().zip(loaded) {
            // Deleted between the two reads: its delete is on its way on `ops`.
            let Some((v, accesses)) = super::link::parse_session(session, &fields) else { continue };
            state.borrow_mut().versions.loaded(session, v);
            ctx.stats.sessions_reloaded.fetch_add(1, Ordering::Relaxed);
            reloaded += 1;
            let core = core_of_session(session, ctx.cores.len());
            let _ = ctx.cores[core].send(Inbound::Reload { session, v, accesses }).await;
        }
    }
    Ok((reloaded, dropped))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(v: &Versions, s: u128) -> Option<u64> {
        v.version(SessionId(s)).flatten()
    }

    #[test]
    fn versions_advance_only_in_order_and_a_gap_is_due_after_its_grace() {
        let mut v = Versions::default();
        let s = SessionId(1);
        v.loaded(s, 4);
        v.applied(s, 5);
        assert_eq!(w(&v, 1), Some(5));
        v.applied(s, 5);
        v.applied(s, 3);
        assert_eq!(w(&v, 1), Some(5), "old and repeated versions change nothing");
        // 6 missed: 7 and 8 wait above the gap.
        v.applied(s, 7);
        v.applied(s, 8);
        assert_eq!(w(&v, 1), Some(5));
        assert_eq!(v.due(Duration::from_secs(3600)).0, Vec::<SessionId>::new(), "a fresh gap waits its grace");
        assert_eq!(v.due(Duration::ZERO).0, vec![s], "an old one is due");
        // The missing one arrives (crossed on a cluster): closed, all applied.
        v.applied(s, 6);
        assert_eq!(w(&v, 1), Some(8));
        assert!(v.due(Duration::ZERO).0.is_empty());
        // A reload at 10 closes any gap.
        v.applied(s, 11);
        v.loaded(s, 10);
        assert_eq!(w(&v, 1), Some(11));
        assert!(v.due(Duration::ZERO).0.is_empty());
    }

    #[test]
    fn unknown_sessions_are_due_created_ones_start_at_zero_and_unrefreshed_ones_are_forgotten() {
        let mut v = Versions::default();
        v.refreshed(&[SessionId(1)], Duration::from_secs(60));
        v.created(SessionId(2));
        v.applied(SessionId(1), 3);
        v.applied(SessionId(9), 1);
        assert_eq!(v.due(Duration::ZERO).0, vec![SessionId(1)], "restored from the store: unknown, checked");
        assert_eq!(w(&v, 2), Some(0));
        assert_eq!(v.version(SessionId(9)), None, "a session not held here is not tracked");
        v.check_all = true;
        let (mut all, full) = v.due(Duration::ZERO);
        all.sort();
        assert_eq!((all, full), (vec![SessionId(1), SessionId(2)], true));
        v.refreshed(&[SessionId(2)], Duration::ZERO);
        assert_eq!(v.held.len(), 0, "not refreshed within `keep`: forgotten");
    }

    #[test]
    fn past_the_bound_of_versions_above_a_gap_the_session_is_due_at_once() {
        let mut v = Versions::default();
        v.loaded(SessionId(1), 0);
        for n in 2..20 {
            v.applied(SessionId(1), n);
        }
        assert_eq!(v.held[&SessionId(1)].above.len(), ABOVE);
        assert_eq!(v.due(Duration::from_secs(3600)).0, vec![SessionId(1)]);
        // Redis holds nothing newer than 0: the versions above were never Redis's.
        v.settled(SessionId(1), 0);
        assert!(v.due(Duration::ZERO).0.is_empty());
        assert_eq!(w(&v, 1), Some(0));
    }
}
