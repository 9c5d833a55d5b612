//! A deadline clock for one thread's timer task: the task sleeps until the earliest deadline
//! it knows of, and whoever adds an earlier one wakes it early. No fixed tick, nothing armed
//! per event: a deadline later than the one slept until costs one comparison. One thread
//! only (monoio tasks are `!Send`), so the wake-up is a plain `Cell<Option<Waker>>`.
//!
//! Used per core by the shard's timers (app/clock.rs) and the socket timers
//! (transport/timers.rs); the deadlines themselves live in their owners' heaps.

use std::cell::Cell;
use std::future::{poll_fn, Future};
use std::task::{Poll, Waker};
use std::time::Instant;

/// Where a timer task sleeps, and how it is woken early.
#[derive(Default)]
pub struct Clock {
    /// The deadline the task sleeps until (`None`: no deadline, it waits to be woken).
    armed: Cell<Option<Instant>>,
    /// Set when an earlier deadline was armed while the task slept.
    nudged: Cell<bool>,
    waker: Cell<Option<Waker>>,
    /// Times the task woke (deadline reached or nudged), for `hubcast_core_timer_wakeups_total`.
    pub wakeups: Cell<u64>,
}

impl Clock {
    /// Makes sure the task wakes by `at`: wakes it now when `at` is earlier than its deadline.
    pub fn arm(&self, at: Instant) {
        if self.armed.get().is_some_and(|armed| armed <= at) {
            return;
        }
        self.armed.set(Some(at));
        self.nudged.set(true);
        if let Some(waker) = self.waker.take() {
            waker.wake();
        }
    }

    /// Sleeps until `until` (forever when `None`) or until [`Clock::arm`] asks for earlier.
    pub async fn sleep(&self, until: Option<Instant>) {
        self.armed.set(until);
        self.nudged.set(false);
        let mut timer = until.map(|t| Box::pin(monoio::time::sleep_until(t.into())));
        poll_fn(|cx| {
            if self.nudged.get() {
                return Poll::Ready(());
            }
            if let Some(timer) = timer.as_mut() {
                if timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(());
                }
            }
            self.waker.set(Some(cx.waker().clone()));
            Poll::Pending
        })
        .await;
        self.waker.take();
        self.wakeups.set(self.wakeups.get() + 1);
    }
}
