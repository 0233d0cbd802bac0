//! A fleet of hosts: each supervisor keeps its host's workers in etcd under a lease, watches the
//! others, and serves every host's workers to its Envoys.
//!
//! etcd holds **membership** only (hosts, workers, addresses, locality, state), which changes slowly;
//! load never goes into etcd: it stays on ORCA, from each host's supervisor straight to each Envoy.
//! [`records`] is the key layout and the records (pure); [`membership`] is the etcd session, which
//! reads the range in pages ([`listing`]), logs each skipped record once ([`skipped`]) and pauses
//! between failed sessions ([`backoff`]), and gives memory back when the view shrinks ([`trim`]);
//! [`drains`] is what a drain here waits on before it stops a worker the other hosts' Envoys know;
//! [`preflight`] is the check against etcd before any worker starts.
//!
//! Invariant: the registry stays the one source of truth. This module writes exactly one thing in
//! it, the other hosts' view ([`crate::registry::Registry::set_fleet`]), and reads this host's
//! workers from its snapshots; xDS and status read the merged view as they read the rest.

pub mod backoff;
pub mod drains;
pub mod listing;
pub mod membership;
pub mod preflight;
pub mod records;
pub mod session_status;
pub mod skipped;
pub mod trim;

pub use drains::{FleetDrains, FleetOutcome};
pub use membership::Membership;
pub use session_status::{EtcdState, FleetStatus, SessionStatus};
