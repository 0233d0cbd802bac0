//! The other hosts of a fleet, as their supervisors published them in etcd: the part of the endpoint
//! snapshot that this supervisor does not run but serves to its Envoys.
//!
//! Invariant: only the fleet membership task writes it ([`Registry::set_fleet`]), and it holds other
//! hosts only, never this one's workers (those are the registry's own, registered here).
//!
//! [`Registry::set_fleet`]: super::Registry::set_fleet

use std::{collections::BTreeMap, time::SystemTime};

use super::{Address, Protocol};
use crate::config::Locality;

/// How a remote worker is to be sent requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Health {
    /// Registered and serving.
    Serving,
    /// About to stop: no new requests (EDS `DRAINING`).
    Draining,
    /// Stalled on its host: no new requests until it moves again (EDS `UNHEALTHY`).
    Unhealthy,
}

impl Health {
    /// `serving`, `draining` or `unhealthy`, as stored in etcd.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Serving => "serving",
            Health::Draining => "draining",
            Health::Unhealthy => "unhealthy",
        }
    }

    /// The health named `text`.
    pub fn parse(text: &str) -> Option<Health> {
        [Health::Serving, Health::Draining, Health::Unhealthy]
            .into_iter()
            .find(|h| h.as_str() == text)
    }
}

/// One worker instance of another host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteWorker {
    /// Its service.
    pub service: String,
    /// Its slot in the service on its host.
    pub index: u32,
    /// Its process id on its host.
    pub pid: u32,
    /// Its EDS hostname (the ORCA `:authority`), unique in the fleet.
    pub hostname: String,
    /// The protocols it speaks.
    pub protocols: Vec<Protocol>,
    /// Where it listens: IP sockets only (another host cannot reach a Unix socket).
    pub addresses: Vec<Address>,
    /// Its state.
    pub health: Health,
    /// Its load-balancing weight.
    pub weight: u32,
    /// Its consistent-hashing key, stable per (host, service, slot).
    pub hash_key: String,
}

/// Another host of the fleet.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemoteHost {
    /// Where its workers are.
    pub locality: Locality,
    /// Its supervisor's gRPC port (0 before its host record is seen).
    pub grpc_port: u16,
    /// Its workers, by (service, index, pid).
    pub workers: BTreeMap<(String, u32, u32), RemoteWorker>,
}

/// Every other host of the fleet, by name.
pub type Fleet = BTreeMap<String, RemoteHost>;

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
