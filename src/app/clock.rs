//! The per-core clock: one task per core that sleeps until the earliest deadline of the core's
//! shard (trailing throttle flushes and connection-state TTL checks in
//! [`DeviceTable::next_deadline`](crate::shard::DeviceTable::next_deadline), session expiry in
//! [`SessionTable::next_deadline`](crate::shard::SessionTable::next_deadline)) and is woken early
//! when an earlier deadline is added. No fixed tick: an idle core with throttling on and sessions
//! open does not wake at all until something is due.
//!
//! The deadlines themselves live in the shard's min-heaps (the shard stays pure and synchronous);
//! the core calls [`Core::arm_clock`] after every change that may add one, which wakes the task
//! only when the new earliest deadline is earlier than the one it sleeps until. Everything is
//! on one thread (monoio tasks are `!Send`), so the wake-up is a plain `Cell<Option<Waker>>`.
//!
//! The same [`Clock`] (runtime/clock.rs) drives the core's socket timers (pings, ping answers, silent clients,
//! stalled writes: src/transport/timers.rs), one more task per core with its own deadline
//! heap; its wake-ups count in `hubcast_core_timer_wakeups_total` with this task's.

use std::rc::Rc;
use std::time::Instant;

use crate::app::core::Core;

impl Core {
    /// The earliest deadline of this core's shard.
    fn next_deadline(&self) -> Option<Instant> {
        let devices = self.devices.borrow().next_deadline();
        let sessions = self.sessions.borrow().next_deadline();
        let recovery = self.recovery.next_deadline();
        devices.into_iter().chain(sessions).chain(recovery).min()
    }

    /// Call after a change that may have added a deadline (telemetry held back by throttling, a
    /// device seen connected, a session created or left without sockets): wakes the timer task
    /// if that deadline is earlier than the one it sleeps until. Two heap peeks.
    pub fn arm_clock(&self) {
        if let Some(at) = self.next_deadline() {
            self.clock.arm(at);
        }
    }

    /// The core's timer task: sleeps until the next deadline, then runs what is due: trailing
    /// throttle flushes, connection-state TTL expiry, session expiry.
    pub async fn run_timers(self: Rc<Self>) {
        loop {
            self.clock.sleep(self.next_deadline()).await;
            let now = Instant::now();
            let expired = self.sessions.borrow_mut().expire(now);
            self.expire_recovery(now);
            let mut deliveries = Vec::new();
            {
                let mut devices = self.devices.borrow_mut();
                devices.flush_throttled(now, &mut deliveries);
                devices.expire_connections(now, &mut deliveries);
            }
            self.recovery_posting(&deliveries);
            self.persist(None);
            for (id, record) in expired {
                tracing::debug!(session = %id, "session expired");
                self.end_session(id, record, "session expired");
            }
            self.dispatch(deliveries);
        }
    }
}
