//! Where this host's etcd session is, for `status` and the metrics: the membership task writes it,
//! they read it. It moves no snapshot and is no part of the registry.

use std::{
    collections::BTreeMap,
    sync::{Mutex, MutexGuard},
    time::SystemTime,
};

/// The session's latest [`FleetStatus`]; `None` until the membership task has started.
#[derive(Debug, Default)]
pub struct SessionStatus(Mutex<Option<FleetStatus>>);

impl SessionStatus {
    fn lock(&self) -> MutexGuard<'_, Option<FleetStatus>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the status.
    pub fn set(&self, status: FleetStatus) {
        *self.lock() = Some(status);
    }

    /// Changes the status in place, if there is one.
    pub fn update(&self, change: impl FnOnce(&mut FleetStatus)) {
        if let Some(status) = self.lock().as_mut() {
            change(status);
        }
    }

    /// The latest status; `None` on a single host, or before the session started.
    pub fn get(&self) -> Option<FleetStatus> {
        self.lock().clone()
    }
}

/// The etcd session of this host, for `status`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetStatus {
    /// This host's name.
    pub host: String,
    /// Where the session is.
    pub etcd: EtcdState,
    /// Since when.
    pub since: SystemTime,
    /// The lease of this host's keys, once granted.
    pub lease: Option<i64>,
    /// The services whose spec hosts disagree on, each with the hosts that disagree and whose spec
    /// is served, as one line each.
    pub conflicts: Vec<String>,
    /// The other hosts' records skipped now, by reason (`too_large`, `no_lease`, ...).
    pub skipped: BTreeMap<&'static str, usize>,
}

/// Where the etcd session is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EtcdState {
    /// Not joined yet.
    Connecting,
    /// Joined: this host's keys are in etcd and the view follows the watch.
    Connected,
    /// Away: the view is the last one seen.
    Unavailable {
        /// Why.
        error: String,
    },
}

impl EtcdState {
    /// `connecting`, `connected` or `unavailable`.
    pub fn as_str(&self) -> &'static str {
        match self {
            EtcdState::Connecting => "connecting",
            EtcdState::Connected => "connected",
            EtcdState::Unavailable { .. } => "unavailable",
        }
    }
}
