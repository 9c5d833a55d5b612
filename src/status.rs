//! Health of the configured sources, for `GET /status`.
//!
//! Each source owns one slot and updates it with a single atomic store; `/status` reads
//! them. Configuration errors are fixed at start-up and reported as 500 (ux4iot's
//! behaviour: the operator reads /status after deploying).

use std::sync::atomic::{AtomicU8, Ordering};

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
}

impl SourceSlot {
    pub fn set_connected(&self, connected: bool) {
        self.state.store(if connected { CONNECTED } else { CONNECTING }, Ordering::Release);
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
        self.sources.push(SourceSlot { name, state: AtomicU8::new(CONNECTING) });
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
            Some(s) => Health::Starting(format!("{} is connecting", s.name)),
            None => Health::Ok,
        }
    }
}
