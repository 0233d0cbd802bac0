//! Propagation: a worker change on one host, until every Envoy of the fleet holds the new endpoint
//! set.
//!
//! Each change kills one worker (SIGKILL) on one host, the hosts taken in turn and their slots in
//! turn; the host's supervisor notices the exit (its key is deleted), restarts the slot after the
//! first backoff (100 ms) and registers the replacement (new pid, new port: its key is put). That is
//! two worker changes, each timed until every Envoy shows it:
//!
//! - **exit**: from the SIGKILL until no Envoy lists the dead worker;
//! - **registration**: from the supervisor's `Worker registered` line (its timestamp) until every
//!   Envoy lists the replacement, healthy, beside every other worker and without the dead one;
//!
//! each also until the host's own Envoy (served by its supervisor directly), until the benchmark's
//! own watcher of etcd saw the key's event ([`KeyWatch`]), and until every other host's registry
//! (its `Fleet view changed` line). Every Envoy's admin `/clusters` is polled from a thread of its
//! own every `--poll-ms`.

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    time::{Duration, SystemTime},
};

use anyhow::{Context, bail, ensure};
use peregrine_contract::procfs;
use peregrine_e2e::Host;
use rustix::process::{Pid, Signal, kill_process};
use xtask::{
    interrupt,
    logs::{self, EXITED, REGISTERED, VIEW_CHANGED},
};

use super::{
    Options,
    host::{FleetHost, SERVICE, worker_key},
    poll::{self, Seen, Watched},
    watcher::{self, KeyWatch},
};

/// How long one change may take to reach every Envoy.
const DEADLINE: Duration = Duration::from_secs(10);
/// Between one change's end and the next kill.
const PAUSE: Duration = Duration::from_millis(200);

/// One killed worker and what followed.
#[derive(Clone, Debug)]
pub(super) struct Kill {
    /// The host it ran on.
    pub(super) host: usize,
    pub(super) killed: SystemTime,
    /// The supervisor's `Worker exited` line.
    pub(super) exited: SystemTime,
    /// The supervisor's `Worker registered` line of the replacement.
    pub(super) registered: SystemTime,
    /// Per Envoy (by host): when the dead worker was gone, and when the new set was whole.
    pub(super) removed: Vec<Seen>,
    pub(super) added: Vec<Seen>,
    /// Per other host's supervisor: its view changed after the exit, and after the registration.
    pub(super) remote_removed: Vec<SystemTime>,
    pub(super) remote_added: Vec<SystemTime>,
    /// The benchmark's own etcd watcher saw the delete, and the put (when it runs).
    pub(super) etcd_removed: Option<SystemTime>,
    pub(super) etcd_added: Option<SystemTime>,
}

/// `to - from`, in milliseconds (negative if `to` came first).
pub(super) fn ms(from: SystemTime, to: SystemTime) -> f64 {
    match to.duration_since(from) {
        Ok(d) => d.as_secs_f64() * 1e3,
        Err(e) => -e.duration().as_secs_f64() * 1e3,
    }
}

fn latest(times: impl Iterator<Item = SystemTime>) -> SystemTime {
    times.max().expect("at least one host")
}

impl Kill {
    /// SIGKILL -> every Envoy without the dead worker.
    pub(super) fn exit_everywhere(&self) -> f64 {
        ms(self.killed, latest(self.removed.iter().map(|s| s.at)))
    }

    /// SIGKILL -> the supervisor's `Worker exited` line.
    pub(super) fn exit_noticed(&self) -> f64 {
        ms(self.killed, self.exited)
    }

    /// SIGKILL -> the delete at etcd's watchers (the benchmark's own); NaN when not seen.
    pub(super) fn exit_etcd(&self) -> f64 {
        self.etcd_removed.map_or(f64::NAN, |t| ms(self.killed, t))
    }

    /// Registration -> the put at etcd's watchers; NaN when not seen.
    pub(super) fn registration_etcd(&self) -> f64 {
        self.etcd_added.map_or(f64::NAN, |t| ms(self.registered, t))
    }

    /// SIGKILL -> the host's own Envoy without it.
    pub(super) fn exit_own(&self) -> f64 {
        ms(self.killed, self.removed[self.host].at)
    }

    /// SIGKILL -> every other host's registry without it.
    pub(super) fn exit_remote_registries(&self) -> f64 {
        ms(self.killed, latest(self.remote_removed.iter().copied()))
    }

    /// Registration -> every Envoy with the new set.
    pub(super) fn registration_everywhere(&self) -> f64 {
        ms(self.registered, latest(self.added.iter().map(|s| s.at)))
    }

    /// Registration -> the host's own Envoy with it.
    pub(super) fn registration_own(&self) -> f64 {
        ms(self.registered, self.added[self.host].at)
    }

    /// Registration -> every other host's registry with it.
    pub(super) fn registration_remote_registries(&self) -> f64 {
        ms(self.registered, latest(self.remote_added.iter().copied()))
    }

    /// SIGKILL -> registration: exit noticed, the backoff, spawn, bind, register.
    pub(super) fn restart(&self) -> f64 {
        ms(self.killed, self.registered)
    }

    /// The poll resolutions of the moments that ended each measure.
    pub(super) fn resolutions(&self) -> impl Iterator<Item = Duration> + '_ {
        self.removed.iter().chain(&self.added).map(|s| s.resolution)
    }
}

/// What the propagation runs measured.
#[derive(Clone, Debug)]
pub(super) struct Propagation {
    pub(super) kills: Vec<Kill>,
    /// CPU time (on-CPU, from `schedstat`) each supervisor spent per kill, in ms: two worker changes,
    /// one of them on its own host every `hosts` kills.
    pub(super) cpu_per_kill_ms: Vec<f64>,
}

/// Waits until every Envoy lists `expected` healthy hosts of the service, none of them in `gone`,
/// the same ones; returns them.
/// Every host's Envoy admin address, how many workers the fleet has, and their hostnames once
/// every Envoy holds them all (within a minute).
pub(super) fn whole_fleet(
    fleet: &[FleetHost],
    options: &Options,
) -> anyhow::Result<(Vec<SocketAddr>, usize, BTreeSet<String>)> {
    let admins: Vec<SocketAddr> = fleet
        .iter()
        .map(FleetHost::admin)
        .collect::<Result<_, _>>()?;
    let total = fleet.len() * options.fleet_workers as usize;
    let current = wait_for_fleet(&admins, total, &BTreeSet::new(), Duration::from_secs(60))?;
    Ok((admins, total, current))
}

pub(super) fn wait_for_fleet(
    admins: &[SocketAddr],
    expected: usize,
    gone: &BTreeSet<String>,
    deadline: Duration,
) -> anyhow::Result<BTreeSet<String>> {
    let whole = move |hosts: &[Host]| {
        hosts.len() == expected
            && hosts
                .iter()
                .all(|h| h.healthy && !gone.contains(&h.hostname))
    };
    let watched = poll::watch(admins, Duration::from_millis(20), deadline, &[&whole])
        .with_context(|| format!("every Envoy to hold all {expected} workers"))?;
    let sets: Vec<BTreeSet<String>> = watched.iter().map(hostnames).collect();
    ensure!(
        sets.windows(2).all(|w| w[0] == w[1]),
        "the Envoys hold different workers: {sets:?}"
    );
    Ok(sets.into_iter().next().unwrap_or_default())
}

fn hostnames(watched: &Watched) -> BTreeSet<String> {
    watched.last.iter().map(|h| h.hostname.clone()).collect()
}

/// `options.changes` kills on `fleet`, every host with an Envoy; `watch`, when there, times each
/// change at etcd's watchers.
pub(super) fn run(
    fleet: &[FleetHost],
    watch: Option<&KeyWatch>,
    options: &Options,
) -> anyhow::Result<Propagation> {
    let (admins, total, mut current) = whole_fleet(fleet, options)?;
    let supervisors: Vec<u32> = fleet.iter().map(|h| h.supervisor().pid()).collect();
    let cpu_before = on_cpu_ns(&supervisors)?;
    let mut kills = Vec::with_capacity(options.changes);
    for change in 0..options.changes {
        let host = change % fleet.len();
        let slot = (change / fleet.len()) % options.fleet_workers as usize;
        let kill = kill_one(fleet, watch, &admins, &current, host, slot, options)
            .with_context(|| format!("change {change} (host {}, slot {slot})", fleet[host].name))?;
        current = wait_for_fleet(&admins, total, &BTreeSet::new(), DEADLINE)?;
        eprintln!(
            "change {change:>3} on {}: exit -> every Envoy {:.1} ms, registration -> every Envoy {:.1} ms (own {:.1} ms, other registries {:.1} ms)",
            fleet[host].name,
            kill.exit_everywhere(),
            kill.registration_everywhere(),
            kill.registration_own(),
            kill.registration_remote_registries(),
        );
        kills.push(kill);
        interrupt::sleep(PAUSE)?;
    }
    let cpu_after = on_cpu_ns(&supervisors)?;
    let cpu_per_kill_ms = cpu_before
        .iter()
        .zip(&cpu_after)
        .map(|(b, a)| a.saturating_sub(*b) as f64 / 1e6 / options.changes.max(1) as f64)
        .collect();
    Ok(Propagation {
        kills,
        cpu_per_kill_ms,
    })
}

/// On-CPU time of each process, in ns (every thread's `schedstat`).
pub(super) fn on_cpu_ns(pids: &[u32]) -> anyhow::Result<Vec<u64>> {
    pids.iter()
        .map(|&pid| {
            Ok(procfs::process_schedstat(pid)
                .with_context(|| format!("schedstat of {pid}"))?
                .on_cpu_ns)
        })
        .collect()
}

/// Kills the worker of `slot` on `host` and times its exit and its replacement.
fn kill_one(
    fleet: &[FleetHost],
    watch: Option<&KeyWatch>,
    admins: &[SocketAddr],
    current: &BTreeSet<String>,
    host: usize,
    slot: usize,
    options: &Options,
) -> anyhow::Result<Kill> {
    let own = poll::service_hosts(admins[host])?;
    // In a fleet a worker's hostname names its host: `<host>-<service>-<index>-<pid>`.
    let prefix = format!("{}-{SERVICE}-{slot}-", fleet[host].name);
    let victim = own
        .iter()
        .find(|h| fleet[host].owns(&h.address) && h.hostname.starts_with(&prefix))
        .with_context(|| {
            format!(
                "no worker {prefix}* of host {} in its Envoy",
                fleet[host].name
            )
        })?
        .hostname
        .clone();
    let pid: u32 = victim
        .rsplit('-')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no pid in {victim:?}"))?;

    let gone = |hosts: &[Host]| !hosts.iter().any(|h| h.hostname == victim);
    let replaced = |hosts: &[Host]| {
        hosts.len() == current.len()
            && hosts.iter().all(|h| h.healthy && h.hostname != victim)
            && hosts
                .iter()
                .filter(|h| !current.contains(&h.hostname))
                .all(|h| h.hostname.starts_with(&prefix))
    };
    let killed = SystemTime::now();
    kill_process(Pid::from_raw(pid as i32).context("a pid")?, Signal::KILL)
        .with_context(|| format!("killing worker {pid}"))?;
    let watched = poll::watch(admins, options.poll, DEADLINE, &[&gone, &replaced])?;

    let fresh: BTreeSet<String> = hostnames(&watched[host])
        .difference(current)
        .cloned()
        .collect();
    let fresh: Vec<String> = fresh.into_iter().collect();
    let [new] = &fresh[..] else {
        bail!(
            "not one new worker in the Envoy of host {}",
            fleet[host].name
        );
    };
    let new_pid: u64 = new
        .rsplit('-')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no pid in {new:?}"))?;

    // The log lines are written before the xDS push they cause reaches an Envoy, but on a busy
    // machine the writer may lag: wait a little for them.
    let own_logs = |what: &str| {
        interrupt::wait_until(
            Duration::from_secs(2),
            Duration::from_millis(10),
            what,
            || Ok(Some(fleet[host].logs())),
        )
    };
    let logs_of_host = own_logs("the host's log")?;
    let line_of = |message: &str, pid: u64| {
        logs::first_after(&logs_of_host, message, killed, |l| {
            l.number("pid") == Some(pid)
        })
        .map(|l| l.at)
    };
    let exited =
        line_of(EXITED, u64::from(pid)).with_context(|| format!("no {EXITED:?} line for {pid}"))?;
    let registered = line_of(REGISTERED, new_pid)
        .with_context(|| format!("no {REGISTERED:?} line for {new_pid}"))?;
    let mut remote_removed = Vec::new();
    let mut remote_added = Vec::new();
    // Every other host's view holds this many workers when whole.
    let whole = (current.len() - options.fleet_workers as usize) as u64;
    for (j, other) in fleet.iter().enumerate().filter(|(j, _)| *j != host) {
        let (removed, added) = interrupt::wait_until(
            Duration::from_secs(2),
            Duration::from_millis(10),
            &format!("host {j}'s view to lose the worker and hold its replacement"),
            || {
                // After the kill: the exit's change (its delete may precede the `Worker exited`
                // line: the registration connection closing deregisters too), then the first whole
                // view, with the replacement; a view that lagged may have applied both at once.
                let logs = other.logs();
                let since = || logs::lines(&logs, VIEW_CHANGED).filter(|l| l.at >= killed);
                let Some(added) = since().find(|l| l.number("workers") == Some(whole)) else {
                    return Ok(None);
                };
                let removed = since().next().unwrap_or(added);
                Ok(Some((removed.at, added.at)))
            },
        )?;
        remote_removed.push(removed);
        remote_added.push(added);
    }
    let name = &fleet[host].name;
    let at_etcd = |pid: u64| {
        let watch = watch?;
        let key = worker_key(name, slot, pid);
        interrupt::wait_until(
            Duration::from_secs(1),
            watcher::EVERY,
            "etcd's watch event",
            || Ok(watch.first_after(killed, &key)),
        )
        .ok()
    };
    Ok(Kill {
        host,
        killed,
        exited,
        registered,
        etcd_removed: at_etcd(u64::from(pid)),
        etcd_added: at_etcd(new_pid),
        removed: watched.iter().map(|w| w.seen[0]).collect(),
        added: watched.iter().map(|w| w.seen[1]).collect(),
        remote_removed,
        remote_added,
    })
}
