//! Health of the configured sources, for `GET /status`.
//!
//! Each source owns one slot and updates it when its connection changes (rarely); only
//! `/status` reads them, so the reason's mutex is never on the message path. Configuration errors are fixed at start-up and reported as 500 (ux4iot's
//! behaviour: the operator reads /status after deploying).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

pub enum Health {
    Ok,
    Starting(String),
    Misconfigured(String),
}

const CONNECTING: u8 = 0;
const CONNECTED: u8 = 1;

pub struct SourceSlot {
    pub name: &'static str,
    state: AtomicU8,
    reason: Mutex<String>,
}

impl SourceSlot {
    pub fn set_connected(&self) {
        self.state.store(CONNECTED, Ordering::Release);
    }

    /// Not (or no longer) connected, and why: shown by `GET /status`.
    pub fn set_connecting(&self, reason: impl Into<String>) {
        *self.reason.lock().unwrap_or_else(|e| e.into_inner()) = reason.into();
        self.state.store(CONNECTING, Ordering::Release);
    }

    fn describe(&self) -> String {
        let reason = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if reason.is_empty() {
            format!("{} is connecting", self.name)
        } else {
            format!("{} is not connected: {}", self.name, reason)
        }
    }
}

#[derive(Default)]
pub struct StatusBoard {
    misconfigured: Vec<String>,
    sources: Vec<SourceSlot>,
}

impl StatusBoard {
    pub fn misconfigured(&mut self, message: String) {
        self.misconfigured.push(message);
    }

    /// Registers a source that starts out connecting; returns its index.
    pub fn add_source(&mut self, name: &'static str) -> usize {
        self.sources.push(SourceSlot { name, state: AtomicU8::new(CONNECTING), reason: Mutex::new(String::new()) });
        self.sources.len() - 1
    }

    pub fn source(&self, index: usize) -> &SourceSlot {
        &self.sources[index]
    }

    pub fn health(&self) -> Health {
        if let Some(m) = self.misconfigured.first() {
            return Health::Misconfigured(m.clone());
        }
        match self.sources.iter().find(|s| s.state.load(Ordering::Acquire) != CONNECTED) {
            Some(s) => Health::Starting(s.describe()),
            None => Health::Ok,
        }
    }
}
