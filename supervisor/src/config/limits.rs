//! The bounds a configuration is held to, whatever the file asks for: how much of a file is read, how
//! many workers one service and one supervisor run, how often the load sampler may sample, how
//! short a run may count as healthy, and how long a socket's path may be.
//!
//! Invariant: each bound is written here once; the checks and their error messages read it from here.
//! The balancing options' bounds (weights, ring and table sizes) live with them in
//! [`balancing`](super::balancing), since they are Envoy's limits rather than the supervisor's.

use std::time::Duration;

/// The largest config file [`Config::load`](super::Config::load) reads: far more than any real one
/// needs, and a bound on what a wrong path (`/dev/zero`) can make it read.
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// The most workers a service may ask for.
pub(super) const MAX_WORKERS: u32 = 4096;

/// The most workers one supervisor runs, all services together.
pub const MAX_TOTAL_WORKERS: u64 = 16384;

/// The shortest `supervisor.sample_interval_ms`: below it, sampling costs more than it tells.
pub const MIN_SAMPLE_INTERVAL: Duration = Duration::from_millis(10);

/// The shortest `supervisor.healthy_after_ms`. A run that long resets a slot's restart delay, so at
/// 0 every exit would count as healthy and a crashing worker would restart without backoff (and never
/// show as crash-looping). 100 ms is `restart_delay_ms`'s default and the floor of the other timeouts
/// that wait on a worker (`register_timeout_ms`); a benchmark that wants every kill restarted after the
/// first delay still can (150 ms).
pub(super) const MIN_HEALTHY_AFTER: Duration = Duration::from_millis(100);

/// The longest path a Unix socket may be bound at, in bytes: `sun_path` holds 108 with its NUL. The
/// worker socket of a service with a `user` (`<control>.<service>.workers`) is held to it.
pub const MAX_SOCKET_PATH: usize = 107;

/// The longest interval between two ORCA reports on a stream, whatever Envoy asks for, and the most
/// `orca.min_report_interval_ms` may say. Envoy drops a weight it has had no report for within its
/// weight expiration period (`orca.weight_expiration_period_ms`, 30 s by default), so a longer
/// interval only leaves a worker without a weight; the bound keeps the report timer from overflowing.
pub const MAX_REPORT_INTERVAL: Duration = Duration::from_secs(3600);
