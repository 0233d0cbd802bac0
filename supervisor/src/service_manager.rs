//! What the service manager is told: systemd's readiness protocol (`sd_notify(3)`, a datagram per
//! state change to `$NOTIFY_SOCKET`), through the `sd-notify` crate, for `Type=notify` units.
//!
//! - `READY=1` once xDS serves (the gRPC port is bound and its server runs, adopted workers
//!   registered again), with a `STATUS=` line;
//! - `RELOADING=1` (with `MONOTONIC_USEC=`, as `Type=notify-reload` requires) when a reload or
//!   restart begins, `READY=1` when it is done, whether it applied or was refused;
//! - `STOPPING=1` when the supervisor begins to stop;
//! - `WATCHDOG=1` every half `$WATCHDOG_USEC`, from the supervisor's main loop, when the unit sets
//!   `WatchdogSec=`: a wedged main loop stops the pings and systemd acts.
//!
//! Without `$NOTIFY_SOCKET` every call is a no-op. A notification that cannot be sent is logged
//! (once: the watchdog would repeat it) and changes nothing else. Workers never inherit these
//! variables ([`INHERITED`]): only the supervisor speaks for the unit.
//!
//! Invariant: writes only to the notify socket; knows nothing of workers or xDS.

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use sd_notify::NotifyState;

/// The variables of the protocol, which the manager removes from every worker's environment.
pub const INHERITED: [&str; 3] = ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"];

/// Whether a failed notification was logged already.
static WARNED: AtomicBool = AtomicBool::new(false);

/// `READY=1`, with `status` as the unit's status line.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// `RELOADING=1` and the monotonic clock: a reload or restart begins.
pub fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[NotifyState::Reloading, now]),
        Err(_) => send(&[NotifyState::Reloading]),
    }
}

/// `READY=1` again after a reload or restart, with `status`.
pub fn reloaded(status: &str) {
    ready(status);
}

/// `STOPPING=1`: the supervisor stops its workers and exits.
pub fn stopping() {
    send(&[
        NotifyState::Stopping,
        NotifyState::Status("stopping workers"),
    ]);
}

/// How often to ping the watchdog: half `$WATCHDOG_USEC` (if it is meant for this process), as
/// `sd_watchdog_enabled(3)` advises; `None` without a watchdog.
pub fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled()
        .filter(|usec| !usec.is_zero())
        .map(|usec| usec / 2)
}

/// `WATCHDOG=1`.
pub fn watchdog() {
    send(&[NotifyState::Watchdog]);
}

fn send(states: &[NotifyState<'_>]) {
    if let Err(error) = sd_notify::notify(states)
        && !WARNED.swap(true, Ordering::Relaxed)
    {
        let socket = std::env::var("NOTIFY_SOCKET").unwrap_or_default();
        tracing::warn!(%error, %socket, "Cannot notify the service manager (further failures are not logged)");
    }
}
