//! Envoy's admin `/clusters`, polled at a fixed interval from one thread per Envoy until every Envoy
//! has shown every awaited condition on the service's hosts: the moment each condition was first
//! seen there, and how finely that moment is known (the time since the poll before).

use std::{
    net::SocketAddr,
    thread,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, bail};
use peregrine_e2e::{Host, hosts, http_get};
use xtask::interrupt;

use super::host::SERVICE;

/// A condition on the hosts an Envoy lists for the service.
pub(super) type Condition<'a> = &'a (dyn Fn(&[Host]) -> bool + Sync);

/// When a condition was first seen in one Envoy.
#[derive(Clone, Copy, Debug)]
pub(super) struct Seen {
    /// When the answer that first showed it arrived.
    pub(super) at: SystemTime,
    /// Since the poll before, which did not show it: the condition became true within this.
    pub(super) resolution: Duration,
}

/// What one Envoy showed.
#[derive(Clone, Debug)]
pub(super) struct Watched {
    /// Per condition, in the order given.
    pub(super) seen: Vec<Seen>,
    /// The hosts of its last answer.
    pub(super) last: Vec<Host>,
}

/// The service's hosts in the Envoy whose admin is `admin`.
pub(super) fn service_hosts(admin: SocketAddr) -> anyhow::Result<Vec<Host>> {
    let (status, body) = http_get(admin, "/clusters")?;
    anyhow::ensure!(status == 200, "admin /clusters answered {status}");
    Ok(hosts(&body, SERVICE))
}

/// Polls every Envoy in `admins` every `every` until each has shown every one of `conditions` (a
/// condition that held once counts as seen, whatever follows); an error after `deadline`, naming what
/// the Envoys that had not got there showed.
pub(super) fn watch(
    admins: &[SocketAddr],
    every: Duration,
    deadline: Duration,
    conditions: &[Condition<'_>],
) -> anyhow::Result<Vec<Watched>> {
    thread::scope(|scope| {
        let threads: Vec<_> = admins
            .iter()
            .map(|&admin| scope.spawn(move || watch_one(admin, every, deadline, conditions)))
            .collect();
        threads
            .into_iter()
            .zip(admins)
            .map(|(thread, admin)| {
                thread
                    .join()
                    .map_err(|_| anyhow::anyhow!("the poller of {admin} panicked"))?
                    .with_context(|| format!("the Envoy with admin {admin}"))
            })
            .collect()
    })
}

fn watch_one(
    admin: SocketAddr,
    every: Duration,
    deadline: Duration,
    conditions: &[Condition<'_>],
) -> anyhow::Result<Watched> {
    let start = Instant::now();
    let mut seen: Vec<Option<Seen>> = vec![None; conditions.len()];
    let mut previous: Option<SystemTime> = None;
    loop {
        interrupt::check()?;
        let polled = Instant::now();
        let hosts = service_hosts(admin)?;
        let at = SystemTime::now();
        for (condition, seen) in conditions.iter().zip(&mut seen) {
            if seen.is_none() && condition(&hosts) {
                let resolution = previous
                    .and_then(|p| at.duration_since(p).ok())
                    .unwrap_or_default();
                *seen = Some(Seen { at, resolution });
            }
        }
        if seen.iter().all(Option::is_some) {
            return Ok(Watched {
                seen: seen.into_iter().flatten().collect(),
                last: hosts,
            });
        }
        if start.elapsed() > deadline {
            let names: Vec<_> = hosts
                .iter()
                .map(|h| format!("{} {} {}", h.hostname, h.address, h.health_flags))
                .collect();
            bail!(
                "after {:.2?}, {} of {} conditions seen; its hosts: {names:?}",
                start.elapsed(),
                seen.iter().flatten().count(),
                conditions.len()
            );
        }
        previous = Some(at);
        thread::sleep(every.saturating_sub(polled.elapsed()));
    }
}
