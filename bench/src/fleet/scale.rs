//! Scale: `--hosts` supervisors of `--workers` workers each, against the benchmark's etcd, without
//! Envoys (what is measured is the supervisors' and etcd's side), sampler off.
//!
//! 1. **Bring-up**: every host started at once; done when every supervisor's view holds every other
//!    host's workers (its last `Fleet view changed` line) and etcd holds every key. How many times
//!    each view changed on the way is counted.
//! 2. **Idle** (`IDLE`): each supervisor's CPU (on-CPU time from `schedstat`), RSS and peak RSS
//!    (`/proc/PID/status`), etcd's members' CPU and RSS, and etcd's counters: what the fleet costs
//!    when nothing changes (lease keep-alives).
//! 3. **Changes** (`--scale-changes`): a worker SIGKILLed on one host after another; each is an exit
//!    and a registration (two worker changes), each awaited in every other supervisor's view. Over
//!    the whole window: etcd's writes (revisions, puts, deletes, proposals) and the watch events it
//!    sent, per change; each supervisor's CPU beyond its idle rate, and its view changes, per change;
//!    and from the registration (the host's log) to the last other supervisor's view holding it.
//! 4. **Sync**: one more host started; from its start until its registry holds every other host's
//!    workers (its `Fleet view changed` line, and `peregrine status --json`, polled), and until every
//!    other supervisor holds its workers.

use std::{
    collections::BTreeMap,
    path::Path,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, ensure};
use peregrine_contract::procfs;
use peregrine_e2e::EtcdCluster;
use rustix::process::{Pid, Signal, kill_process};
use xtask::{
    interrupt,
    logs::{self, JOINED, Line, REGISTERED, Tail, VIEW_CHANGED},
};

use super::{
    Options,
    host::{self, FleetHost, Spec},
    metrics::{Disk, EtcdCounters},
    noise::{Load, Noise},
    propagation::{ms, on_cpu_ns},
};
use crate::table::median;

/// The fleet's addresses: `127.2.x.y`.
const FLEET: u8 = 2;
/// The idle window.
const IDLE: Duration = Duration::from_secs(10);
/// How long the fleet may take to come up.
const BRING_UP: Duration = Duration::from_secs(300);
/// How long one change may take to reach every supervisor.
const CHANGE: Duration = Duration::from_secs(60);
/// Between changes, once the last one is everywhere.
const PAUSE: Duration = Duration::from_millis(300);

/// What the scale runs measured.
#[derive(Clone, Debug)]
pub(super) struct Scale {
    pub(super) hosts: usize,
    pub(super) workers: u32,
    pub(super) bring_up_s: f64,
    /// Per supervisor: how many times its view changed during the bring-up.
    pub(super) bring_up_views: Vec<f64>,
    pub(super) bring_up_noise: Load,
    /// Per supervisor, at the end of the idle window, in KiB.
    pub(super) rss_kib: Vec<f64>,
    pub(super) peak_rss_kib: Vec<f64>,
    /// Per supervisor: on-CPU time per second of the idle window, in ms.
    pub(super) idle_cpu_ms_per_s: Vec<f64>,
    /// The first host's workers, in KiB.
    pub(super) worker_rss_kib: Vec<f64>,
    /// Per etcd member.
    pub(super) etcd_rss_kib: Vec<f64>,
    pub(super) etcd_idle_cpu_ms_per_s: Vec<f64>,
    /// etcd's counters over the idle window, and its length.
    pub(super) idle_etcd: EtcdCounters,
    pub(super) idle_s: f64,
    pub(super) idle_noise: Load,
    pub(super) kills: Vec<ScaleKill>,
    /// etcd's counters and disk over the change window.
    pub(super) change_etcd: EtcdCounters,
    pub(super) change_disk: Disk,
    pub(super) change_s: f64,
    /// Per supervisor: on-CPU time beyond its idle rate, per kill (two worker changes), in ms.
    pub(super) cpu_per_kill_ms: Vec<f64>,
    /// Per supervisor (other than the killing host's): view changes per kill.
    pub(super) views_per_kill: Vec<f64>,
    pub(super) etcd_cpu_per_kill_ms: Vec<f64>,
    pub(super) change_noise: Load,
    pub(super) sync: Sync,
}

/// One kill in the large fleet.
#[derive(Clone, Debug)]
pub(super) struct ScaleKill {
    pub(super) host: usize,
    pub(super) killed: SystemTime,
    pub(super) registered: SystemTime,
    /// The last other supervisor whose view lost the worker, and that held its replacement.
    pub(super) removed_everywhere: SystemTime,
    pub(super) added_everywhere: SystemTime,
}

/// The new host's sync, in ms from its start.
#[derive(Clone, Copy, Debug)]
pub(super) struct Sync {
    /// Its registry held every other host's workers (its `Fleet view changed` line).
    pub(super) view_ms: f64,
    /// It logged `Joined the fleet`.
    pub(super) joined_ms: f64,
    /// `peregrine status --json` listed them (polled).
    pub(super) status_ms: f64,
    /// How long one `peregrine status --json` took (the resolution of `status_ms`).
    pub(super) status_call_ms: f64,
    /// Every other supervisor's registry held the new host's workers.
    pub(super) everywhere_ms: f64,
}

/// The last view change a host logged: `(hosts, workers)`.
#[derive(Debug)]
struct Views {
    tail: Tail,
    changes: Vec<(SystemTime, u64, u64)>,
}

impl Views {
    fn new(host: &mut FleetHost) -> Views {
        Views {
            tail: Tail::new(host.log_path()),
            changes: Vec::new(),
        }
    }

    /// Reads what the host logged since the last call.
    fn refresh(&mut self) -> anyhow::Result<()> {
        let text = self.tail.read()?;
        self.changes.extend(
            logs::lines(&text, VIEW_CHANGED)
                .filter_map(|l: Line<'_>| Some((l.at, l.number("hosts")?, l.number("workers")?))),
        );
        Ok(())
    }

    fn last(&self) -> Option<(u64, u64)> {
        self.changes.last().map(|&(_, h, w)| (h, w))
    }

    /// The view changes at or after `t`.
    fn since(&self, t: SystemTime) -> impl Iterator<Item = &(SystemTime, u64, u64)> {
        self.changes.iter().filter(move |c| c.0 >= t)
    }
}

/// Runs the scale phases on `etcd`.
pub(super) fn run(
    peregrine: &Path,
    etcd: &EtcdCluster,
    options: &Options,
) -> anyhow::Result<Scale> {
    let (n, w) = (options.hosts, options.workers);
    let endpoints = etcd.endpoints();
    let grpc_port = peregrine_e2e::free_port();
    let spec = |i: usize| Spec {
        name: format!("s{i}"),
        ip: host::address(FLEET, i),
        grpc_port,
        workers: w,
        etcd: &endpoints,
    };

    // 1. Bring-up.
    eprintln!("scale: starting {n} supervisors of {w} workers");
    let noise = Noise::start()?;
    let started = Instant::now();
    let mut fleet = Vec::with_capacity(n + 1);
    for i in 0..n {
        interrupt::check()?;
        fleet.push(FleetHost::start(peregrine, &spec(i))?);
    }
    let mut views: Vec<Views> = fleet.iter_mut().map(Views::new).collect();
    // Per host: its host record, its service's spec, its acks (written once the session has listed
    // the fleet) and one key per worker.
    let keys = (n * (w as usize + 3)) as f64;
    let whole = ((n - 1) as u64, (n - 1) as u64 * u64::from(w));
    interrupt::wait_until(
        BRING_UP,
        Duration::from_millis(250),
        "every supervisor to hold the whole fleet",
        || {
            for v in &mut views {
                v.refresh()?;
            }
            let done = views.iter().all(|v| v.last() == Some(whole))
                && EtcdCounters::read(etcd)?.keys == keys;
            Ok(done.then_some(()))
        },
    )?;
    let bring_up_s = started.elapsed().as_secs_f64();
    let bring_up_noise = noise.stop()?;
    let bring_up_views = views.iter().map(|v| v.changes.len() as f64).collect();
    eprintln!("scale: the fleet is whole after {bring_up_s:.1} s");
    interrupt::sleep(Duration::from_secs(2))?;

    // 2. Idle.
    let supervisors: Vec<u32> = fleet.iter().map(|h| h.supervisor().pid()).collect();
    let members: Vec<u32> = (0..etcd.size())
        .map(|i| {
            etcd.pid(i)
                .with_context(|| format!("etcd member {i} is not running"))
        })
        .collect::<anyhow::Result<_>>()?;
    let noise = Noise::start()?;
    let (cpu0, etcd_cpu0, counters0, t0) = (
        on_cpu_ns(&supervisors)?,
        on_cpu_ns(&members)?,
        EtcdCounters::read(etcd)?,
        Instant::now(),
    );
    interrupt::sleep(IDLE)?;
    let (cpu1, etcd_cpu1, counters1) = (
        on_cpu_ns(&supervisors)?,
        on_cpu_ns(&members)?,
        EtcdCounters::read(etcd)?,
    );
    let idle_s = t0.elapsed().as_secs_f64();
    let idle_noise = noise.stop()?;
    let rate = |before: &[u64], after: &[u64], secs: f64| -> Vec<f64> {
        before
            .iter()
            .zip(after)
            .map(|(b, a)| a.saturating_sub(*b) as f64 / 1e6 / secs)
            .collect()
    };
    let idle_cpu_ms_per_s = rate(&cpu0, &cpu1, idle_s);
    let etcd_idle_cpu_ms_per_s = rate(&etcd_cpu0, &etcd_cpu1, idle_s);
    let kib = |pids: &[u32], field: fn(&procfs::Status) -> u64| -> anyhow::Result<Vec<f64>> {
        pids.iter()
            .map(|&p| Ok(field(&procfs::status(p)?) as f64))
            .collect()
    };
    let rss_kib = kib(&supervisors, |s| s.rss_kib)?;
    let peak_rss_kib = kib(&supervisors, |s| s.hwm_kib)?;
    let worker_rss_kib = kib(&fleet[0].worker_pids(), |s| s.rss_kib)?;
    let etcd_rss_kib = kib(&members, |s| s.rss_kib)?;

    // 3. Changes.
    let m = options.scale_changes;
    let noise = Noise::start()?;
    let (cpu0, etcd_cpu0, counters_before, disk_before, t0) = (
        on_cpu_ns(&supervisors)?,
        on_cpu_ns(&members)?,
        EtcdCounters::read(etcd)?,
        Disk::read(etcd)?,
        Instant::now(),
    );
    let mut kills = Vec::with_capacity(m);
    let mut views_in_window = vec![0usize; n];
    for k in 0..m {
        let host = k * n / m.max(1);
        let kill = kill_one(&mut fleet, &mut views, host, whole, &mut views_in_window)
            .with_context(|| format!("scale change {k} (host s{host})"))?;
        eprintln!(
            "scale change {k:>2} on s{host}: registration -> every other registry {:.1} ms",
            ms(kill.registered, kill.added_everywhere)
        );
        kills.push(kill);
        interrupt::sleep(PAUSE)?;
    }
    let (cpu1, etcd_cpu1, counters_after, disk_after) = (
        on_cpu_ns(&supervisors)?,
        on_cpu_ns(&members)?,
        EtcdCounters::read(etcd)?,
        Disk::read(etcd)?,
    );
    let change_s = t0.elapsed().as_secs_f64();
    let change_noise = noise.stop()?;
    let beyond_idle = |before: &[u64], after: &[u64], idle: &[f64]| -> Vec<f64> {
        before
            .iter()
            .zip(after)
            .zip(idle)
            .map(|((b, a), idle)| {
                (a.saturating_sub(*b) as f64 / 1e6 - idle * change_s) / m.max(1) as f64
            })
            .collect()
    };
    let cpu_per_kill_ms = beyond_idle(&cpu0, &cpu1, &idle_cpu_ms_per_s);
    let etcd_cpu_per_kill_ms = beyond_idle(&etcd_cpu0, &etcd_cpu1, &etcd_idle_cpu_ms_per_s);
    let killers: BTreeMap<usize, usize> = kills.iter().fold(BTreeMap::new(), |mut c, k| {
        *c.entry(k.host).or_default() += 1;
        c
    });
    let views_per_kill = views_in_window
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let remote = m - killers.get(&i).copied().unwrap_or(0);
            *v as f64 / remote.max(1) as f64
        })
        .collect();

    // 4. Sync.
    let sync = sync(peregrine, &mut fleet, &mut views, &spec(n), whole)?;
    eprintln!(
        "scale: a new supervisor held the whole fleet {:.0} ms after its start (status {:.0} ms)",
        sync.view_ms, sync.status_ms
    );

    let stopping = Instant::now();
    drop(fleet);
    eprintln!("scale: stopped in {:.1?}", stopping.elapsed());
    Ok(Scale {
        hosts: n,
        workers: w,
        bring_up_s,
        bring_up_views,
        bring_up_noise,
        rss_kib,
        peak_rss_kib,
        idle_cpu_ms_per_s,
        worker_rss_kib,
        etcd_rss_kib,
        etcd_idle_cpu_ms_per_s,
        idle_etcd: counters1 - counters0,
        idle_s,
        idle_noise,
        kills,
        change_etcd: counters_after - counters_before,
        change_disk: disk_after.since(&disk_before),
        change_s,
        cpu_per_kill_ms,
        views_per_kill,
        etcd_cpu_per_kill_ms,
        change_noise,
        sync,
    })
}

/// Kills one worker of `host` and waits until every other supervisor's view lost it and holds its
/// replacement; counts each supervisor's view changes meanwhile into `counted`.
fn kill_one(
    fleet: &mut [FleetHost],
    views: &mut [Views],
    host: usize,
    whole: (u64, u64),
    counted: &mut [usize],
) -> anyhow::Result<ScaleKill> {
    let pid = *fleet[host]
        .worker_pids()
        .first()
        .context("the host has no worker")?;
    let killed = SystemTime::now();
    kill_process(Pid::from_raw(pid as i32).context("a pid")?, Signal::KILL)
        .with_context(|| format!("killing worker {pid}"))?;
    let others: Vec<usize> = (0..fleet.len()).filter(|&j| j != host).collect();
    let (mut removed, mut added) = (Vec::new(), Vec::new());
    interrupt::wait_until(
        CHANGE,
        Duration::from_millis(50),
        "every other supervisor to lose the worker and hold its replacement",
        || {
            removed.clear();
            added.clear();
            for &j in &others {
                views[j].refresh()?;
                // The first change after the kill is the exit's (or, for a view that lagged, the
                // exit and the registration applied together); the replacement is in the first
                // whole one.
                let Some(back) = views[j].since(killed).find(|c| c.2 == whole.1) else {
                    return Ok(None);
                };
                let lost = views[j].since(killed).next().unwrap_or(back);
                removed.push(lost.0);
                added.push(back.0);
            }
            Ok(Some(()))
        },
    )?;
    for &j in &others {
        counted[j] += views[j].since(killed).count();
    }
    let logs = fleet[host].logs();
    let registered = logs::first_after(&logs, REGISTERED, killed, |_| true)
        .context("no registration after the kill")?
        .at;
    Ok(ScaleKill {
        host,
        killed,
        registered,
        removed_everywhere: removed.into_iter().max().context("no other host")?,
        added_everywhere: added.into_iter().max().context("no other host")?,
    })
}

/// Starts one more host and times how it and the others sync.
fn sync(
    peregrine: &Path,
    fleet: &mut Vec<FleetHost>,
    views: &mut Vec<Views>,
    spec: &Spec<'_>,
    whole: (u64, u64),
) -> anyhow::Result<Sync> {
    let n = fleet.len() as u64;
    let remote_workers = whole.1 + whole.1 / whole.0.max(1);
    let started = SystemTime::now();
    fleet.push(FleetHost::start(peregrine, spec)?);
    let new = fleet.len() - 1;
    views.push(Views::new(&mut fleet[new]));
    let mut status_ms = None;
    let mut calls = Vec::new();
    interrupt::wait_until(
        CHANGE,
        Duration::from_millis(5),
        "the new supervisor's status to list every other host's workers",
        || {
            let call = Instant::now();
            let Ok(status) = fleet[new].supervisor().status_json() else {
                return Ok(None);
            };
            calls.push(call.elapsed().as_secs_f64() * 1e3);
            let rows = status["workers"].as_array().map_or(0, |rows| {
                rows.iter()
                    .filter(|r| r["host"] != spec.name.as_str())
                    .count()
            });
            if rows as u64 == remote_workers {
                status_ms = Some(ms(started, SystemTime::now()));
            }
            Ok(status_ms)
        },
    )?;
    let logs = fleet[new].logs();
    let view = logs::first_after(&logs, VIEW_CHANGED, started, |l| {
        l.number("workers") == Some(remote_workers)
    })
    .context("the new supervisor logged no whole view")?;
    let joined = logs::first_after(&logs, JOINED, started, |_| true)
        .context("the new supervisor did not log joining")?;
    let grown = (n, remote_workers);
    let everywhere = interrupt::wait_until(
        CHANGE,
        Duration::from_millis(100),
        "every other supervisor to hold the new host's workers",
        || {
            let mut last = started;
            for v in views.iter_mut().take(new) {
                v.refresh()?;
                match v.since(started).find(|c| (c.1, c.2) == grown) {
                    Some(c) => last = last.max(c.0),
                    None => return Ok(None),
                }
            }
            Ok(Some(last))
        },
    )?;
    ensure!(!calls.is_empty(), "no status call answered");
    Ok(Sync {
        view_ms: ms(started, view.at),
        joined_ms: ms(started, joined.at),
        status_ms: status_ms.context("no status")?,
        status_call_ms: median(calls),
        everywhere_ms: ms(started, everywhere),
    })
}
