//! `cargo xtask bench balance --timeline [--rounds N]`: latency over time through a cold start and
//! each transition, per balancing set-up, in the cold-start issue's set-up.
//!
//! **Set-up.** Every run is fresh: its own supervisor with one service `web` of two hello workers
//! (worker `i` pinned to CPU `i`), and its own Envoy (`--concurrency 1`), bootstrapped from the config
//! before the supervisor starts, as in a deploy. This process is pinned to CPU 1 (see
//! [`super::run`]), so Envoy, the supervisor and the clients share CPU 1 with worker 1. The load:
//! [`CLIENTS`] keep-alive clients, each with its own schedule, [`RATE`] requests/s of `?cpu=4` in all,
//! each latency measured from its scheduled send time ([`openloop`](super::openloop)).
//!
//! **Events.** The load runs [`LENGTH`]; the event happens [`EVENT_AT`] into it:
//! - cold start: the hog (a busy loop on CPU 0) runs from the start; the load starts the moment Envoy
//!   holds both hosts, so the first requests meet workers Envoy has no weights for yet;
//! - a hog appears on CPU 0; a hog (there from the start) goes away;
//! - a burst: the rate doubles for [`BURST`], from half of [`RATE`] to [`RATE`] (with the hog);
//! - a replacement: `peregrine restart` replaces both workers one at a time (with the hog), so
//!   worker 0's successor starts on the hogged core with no weight of its own.
//!
//! **Figures** ([`figures`]): each run's requests in [`WINDOW`]s by scheduled time, the p99 of each;
//! the *steady* p99 over the last 4 s; the *settle* time: from the end of the event until every
//! second from then on (1 s spans starting at any window) has a p99 within twice the steady p99 (the
//! goal: at most 1 s); the p99 of each of the cold start's first 10 seconds; failed requests. Envoy's weight of each host is read every
//! [`MONITOR_STEP`] from the admin `/clusters`. Each set-up runs every event `rounds` times.

mod figures;

use std::{
    path::Path,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, ensure};
use peregrine_e2e::{
    PeregrineToml, Supervisor, TempDir, config::OrcaTable, free_port, hosts, http_get,
};

use super::{
    Options, Policy, TIMEOUT,
    openloop::{self, Burst, Plan, Record},
    poll::poll_every,
    run::{pinned_worker, service},
};
use crate::machine::{Busy, cpus_allowed};

/// Requests per second of the set-up (64 clients at 0.52 of two cores' 4 ms requests).
const RATE: f64 = 260.0;
/// Independent clients, one keep-alive connection each.
const CLIENTS: usize = 64;
/// CPU per request.
const CPU_MS: u64 = 4;
/// How long the load runs.
const LENGTH: Duration = Duration::from_secs(14);
/// When a transition happens, after the load's start.
const EVENT_AT: Duration = Duration::from_secs(6);
/// How long the burst lasts. Its run's rate is [`RATE`] / [`BURST_FACTOR`], and the burst's is
/// [`RATE`]: twice [`RATE`] would be 2.08 cores of requests, more than this machine has with the hog
/// (measured: a backlog that was still draining 6 s after such a burst, under every policy).
const BURST: Duration = Duration::from_secs(2);
const BURST_FACTOR: f64 = 2.0;
/// The steady state after an event: from here to the end.
const STEADY_FROM: Duration = Duration::from_secs(10);
/// The windows the p99 is taken over.
const WINDOW: Duration = Duration::from_millis(250);
/// How often Envoy's weights are read.
const MONITOR_STEP: Duration = Duration::from_millis(100);
/// The most a run may wait for Envoy to hold the hosts, or for their weights.
const READY: Duration = Duration::from_secs(30);
/// Other processes' CPU, in cores, above which a run is repeated (once), keeping the quieter.
const NOISY: f64 = 0.1;

/// What happens during a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    ColdStart,
    HogAppears,
    HogLeaves,
    Burst,
    Replacement,
}

impl Event {
    const ALL: [Event; 5] = [
        Event::ColdStart,
        Event::HogAppears,
        Event::HogLeaves,
        Event::Burst,
        Event::Replacement,
    ];

    fn key(self) -> &'static str {
        match self {
            Event::ColdStart => "cold",
            Event::HogAppears => "hog-appears",
            Event::HogLeaves => "hog-leaves",
            Event::Burst => "burst",
            Event::Replacement => "replacement",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Event::ColdStart => "cold start (hog on CPU 0 from the start)",
            Event::HogAppears => "a hog appears on CPU 0",
            Event::HogLeaves => "the hog on CPU 0 goes away",
            Event::Burst => "the rate doubles for 2 s, 130/s to 260/s (hog on CPU 0)",
            Event::Replacement => "both workers replaced, worker 0 onto the hogged core",
        }
    }

    /// Whether the hog runs from the start.
    fn hog_from_start(self) -> bool {
        self != Event::HogAppears
    }

    /// When it happens, after the load's start.
    fn at(self) -> Duration {
        match self {
            Event::ColdStart => Duration::ZERO,
            _ => EVENT_AT,
        }
    }

    /// When the settle time starts counting: when it happens (a burst: when the rate doubles, so
    /// that its settle time covers both of its steps), except for a replacement, whose restart is
    /// over when `peregrine restart` returns (measured per run).
    fn over(self) -> Duration {
        self.at()
    }
}

/// A balancing set-up: what its config says beyond the service.
#[derive(Clone, Copy, Debug)]
struct Variant {
    key: &'static str,
    label: &'static str,
    /// `supervisor.sample_interval_ms`.
    sample_interval_ms: Option<u64>,
    /// `orca.blackout_period_ms` and `orca.weight_update_period_ms`.
    blackout_period_ms: Option<u64>,
    weight_update_period_ms: Option<u64>,
    /// The service's balancing key.
    policy: Policy,
}

impl Variant {
    /// Whether Envoy weighs the hosts on ORCA reports, out of band or in band.
    fn weighted(&self) -> bool {
        self.policy.weighted()
    }

    /// Whether the reports ride on the workers' responses (Envoy's weights move only when a worker
    /// answers).
    fn in_band(&self) -> bool {
        self.policy.in_band()
    }
}

/// The set-ups compared: today's defaults, out of band and in band, the defaults before the
/// cold-start work (1 s samples, 2 s blackout, weights recomputed every 1 s), and least request.
const VARIANTS: [Variant; 4] = [
    Variant {
        key: "orca",
        label: "CSWRR + ORCA, defaults",
        sample_interval_ms: None,
        blackout_period_ms: None,
        weight_update_period_ms: None,
        policy: Policy::Cswrr,
    },
    Variant {
        key: "orca-ib",
        label: "CSWRR + in-band ORCA, defaults",
        sample_interval_ms: None,
        blackout_period_ms: None,
        weight_update_period_ms: None,
        policy: Policy::CswrrInBand,
    },
    Variant {
        key: "orca-1s",
        label: "CSWRR + ORCA, 1 s samples, 2 s blackout",
        sample_interval_ms: Some(1000),
        blackout_period_ms: Some(2000),
        weight_update_period_ms: Some(1000),
        policy: Policy::Cswrr,
    },
    Variant {
        key: "lr",
        label: "LEAST_REQUEST",
        sample_interval_ms: None,
        blackout_period_ms: None,
        weight_update_period_ms: None,
        policy: Policy::LeastRequest,
    },
];

/// One run: every request, Envoy's weights over time, and which worker each pid was.
#[derive(Debug)]
struct Timeline {
    event: Event,
    variant: Variant,
    round: usize,
    records: Vec<Record>,
    /// `(t, [weight of worker 0, of worker 1])` after the load's start; a weight is `None` while
    /// Envoy holds no host of that index.
    weights: Vec<(Duration, [Option<u64>; 2])>,
    /// Every worker pid seen and its index.
    pids: Vec<(u32, usize)>,
    /// `(t, [steal ticks of CPU 0, of CPU 1])` (`/proc/stat`, cumulative) at each monitor step: the
    /// time the hypervisor gave this virtual machine's CPUs to something else.
    steal: Vec<(Duration, [u64; 2])>,
    /// When the event was over (for a replacement, when `peregrine restart` returned).
    over: Duration,
    /// Other processes' CPU during the run, in cores.
    others: f64,
}

/// Runs every event for every set-up `rounds` times (the set-ups in an order rotated per round),
/// prints the tables, writes the report, the CSV and the plot.
pub(super) fn run(
    peregrine: &Path,
    envoy: &Path,
    options: &Options,
    cpu_line: &str,
    command: &str,
) -> anyhow::Result<()> {
    let chosen = |key: &str, list: &[String]| list.is_empty() || list.iter().any(|k| k == key);
    for key in &options.events {
        ensure!(
            Event::ALL.iter().any(|e| e.key() == key),
            "no event {key:?}: {}",
            Event::ALL.map(Event::key).join(", ")
        );
    }
    for key in &options.setups {
        ensure!(
            VARIANTS.iter().any(|v| v.key == key),
            "no set-up {key:?}: {}",
            VARIANTS.map(|v| v.key).join(", ")
        );
    }
    let variants: Vec<Variant> = VARIANTS
        .into_iter()
        .filter(|v| chosen(v.key, &options.setups))
        .collect();
    let started = Instant::now();
    let mut timelines = Vec::new();
    for event in Event::ALL
        .into_iter()
        .filter(|e| chosen(e.key(), &options.events))
    {
        for round in 0..options.rounds {
            for k in 0..variants.len() {
                let variant = variants[(k + round) % variants.len()];
                let mut best = one_run(peregrine, envoy, event, variant, round)?;
                if best.others > NOISY {
                    eprintln!(
                        "  noisy ({:.2} cores used by other processes): once more",
                        best.others
                    );
                    let again = one_run(peregrine, envoy, event, variant, round)?;
                    if again.others < best.others {
                        best = again;
                    }
                }
                eprintln!("{}", figures::describe(&best));
                timelines.push(best);
            }
        }
    }
    figures::write(&timelines, command, cpu_line, started.elapsed())
}

/// One run of `event` under `variant`: set up, load, event, and what was seen.
fn one_run(
    peregrine: &Path,
    envoy_binary: &Path,
    event: Event,
    variant: Variant,
    round: usize,
) -> anyhow::Result<Timeline> {
    let dir = TempDir::new()?;
    let (listen, admin) = (free_port(), free_port());
    let mut config = PeregrineToml::local(free_port())
        .control_in(dir.path())
        .with_envoy(listen, admin);
    config.supervisor.sample_interval_ms = variant.sample_interval_ms;
    config.orca = Some(OrcaTable {
        blackout_period_ms: variant.blackout_period_ms,
        weight_update_period_ms: variant.weight_update_period_ms,
        ..OrcaTable::default()
    });
    config.service(
        "web",
        service("web", variant.policy, &pinned_worker(peregrine)),
    );
    let config = config.toml();
    let before = Busy::now(std::process::id())?;
    let envoy = super::envoy_bootstrapped_from(peregrine, envoy_binary, dir.path(), &config)?;
    let mut hog = event
        .hog_from_start()
        .then(|| super::spawn_hog(dir.path()))
        .transpose()?;
    let supervisor = Supervisor::start_in(peregrine, dir.path(), &config)?;
    let admin = envoy.admin_addr();
    let result = (|| {
        let held = Instant::now() + READY;
        wait(held, "Envoy to hold both workers", || {
            let hosts = hosts(&http_get(admin, "/clusters").ok()?.1, "web");
            (hosts.len() == 2 && hosts.iter().all(|h| h.healthy)).then_some(())
        })?;
        for (index, pid) in supervisor.worker_pids().iter().enumerate() {
            let cpus = cpus_allowed(*pid)?;
            ensure!(
                cpus == index.to_string() || supervisor.worker_pids().len() != 2,
                "worker {index} (pid {pid}) may run on CPUs {cpus}"
            );
        }
        if event != Event::ColdStart && variant.weighted() {
            let web = std::net::SocketAddr::from(([127, 0, 0, 1], listen));
            wait(
                Instant::now() + READY,
                "ORCA weights for both workers",
                || {
                    // In band, Envoy learns the weights from answers.
                    if variant.in_band() {
                        let _ = http_get(web, "/web");
                    }
                    let hosts = hosts(&http_get(admin, "/clusters").ok()?.1, "web");
                    (hosts.len() == 2 && hosts.iter().all(|h| h.weight > 1)).then_some(())
                },
            )?;
        }
        let plan = Plan {
            addrs: vec![([127, 0, 0, 1], listen).into()],
            path: format!("/web?cpu={CPU_MS}"),
            rate: if event == Event::Burst {
                RATE / BURST_FACTOR
            } else {
                RATE
            },
            duration: LENGTH,
            connections: CLIENTS,
            timeout: TIMEOUT,
            per_connection: true,
            burst: (event == Event::Burst).then_some(Burst {
                from: EVENT_AT,
                to: EVENT_AT + BURST,
                factor: BURST_FACTOR,
            }),
            poisson: None,
            mix: None,
        };
        // The clients connect to Envoy in this time; Envoy connects to the workers on the first
        // requests.
        let start = Instant::now() + Duration::from_millis(50);
        let stop = AtomicBool::new(false);
        let seen = Mutex::new(Seen::default());
        let (records, over) = thread::scope(|scope| {
            let monitor = scope.spawn(|| monitor(admin, start, &stop, &seen));
            let happening = scope.spawn(|| -> anyhow::Result<Duration> {
                let at = start + event.at();
                thread::sleep(at.saturating_duration_since(Instant::now()));
                match event {
                    Event::HogAppears => hog = Some(super::spawn_hog(dir.path())?),
                    Event::HogLeaves => hog = None,
                    Event::Replacement => {
                        supervisor.control("restart", &["web"])?;
                    }
                    Event::ColdStart | Event::Burst => {}
                }
                Ok(match event {
                    Event::Replacement => start.elapsed(),
                    other => other.over(),
                })
            });
            let records = openloop::run(&plan, start);
            let over = happening.join();
            stop.store(true, Ordering::Relaxed);
            let _ = monitor.join();
            let over = over
                .map_err(|_| anyhow::anyhow!("the event's thread panicked"))?
                .context(event.title())?;
            Ok::<_, anyhow::Error>((records?, over))
        })?;
        let seen = seen.into_inner().unwrap_or_else(|e| e.into_inner());
        Ok::<_, anyhow::Error>((records, seen, over))
    })();
    let others = Busy::now(std::process::id())?.since(before).1;
    drop(hog);
    let (
        records,
        Seen {
            weights,
            pids,
            steal,
        },
        over,
    ) = match result {
        Ok(seen) => seen,
        Err(error) => {
            eprintln!("{}", supervisor.logs());
            return Err(error.context(format!("{} under {}", event.title(), variant.label)));
        }
    };
    drop(supervisor);
    drop(envoy);
    Ok(Timeline {
        event,
        variant,
        round,
        records,
        weights,
        pids,
        steal,
        over,
        others,
    })
}

/// What the monitor saw (see [`Timeline`]'s fields of the same names).
#[derive(Debug, Default)]
struct Seen {
    weights: Vec<(Duration, [Option<u64>; 2])>,
    pids: Vec<(u32, usize)>,
    steal: Vec<(Duration, [u64; 2])>,
}

/// Every [`MONITOR_STEP`] until `stop`: Envoy's weight of each worker index, the pid of each worker
/// it holds, and the CPUs' steal time, into `seen`.
fn monitor(admin: std::net::SocketAddr, start: Instant, stop: &AtomicBool, seen: &Mutex<Seen>) {
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let t = now.saturating_duration_since(start);
        if let Ok(stat) = peregrine_contract::procfs::cpu_stat() {
            let steal = |cpu: usize| {
                stat.cpus
                    .iter()
                    .find(|(n, _)| *n as usize == cpu)
                    .map_or(0, |(_, ticks)| ticks.steal)
            };
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            seen.steal.push((t, [steal(0), steal(1)]));
        }
        if let Ok((_, text)) = http_get(admin, "/clusters") {
            let mut weights = [None; 2];
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            for host in hosts(&text, "web") {
                // Hostnames are `web-INDEX-PID`.
                let mut parts = host.hostname.rsplitn(3, '-');
                let (Some(pid), Some(index)) = (parts.next(), parts.next()) else {
                    continue;
                };
                let (Ok(pid), Ok(index)) = (pid.parse::<u32>(), index.parse::<usize>()) else {
                    continue;
                };
                if index < 2 && host.healthy {
                    weights[index] = Some(host.weight);
                }
                if !seen.pids.contains(&(pid, index)) {
                    seen.pids.push((pid, index));
                }
            }
            seen.weights.push((t, weights));
        }
        thread::sleep(MONITOR_STEP.saturating_sub(now.elapsed()));
    }
}

/// Polls `f` every 10 ms until it returns `Some` or `deadline` passes.
fn wait<T>(deadline: Instant, what: &str, f: impl FnMut() -> Option<T>) -> anyhow::Result<T> {
    poll_every(Duration::from_millis(10), deadline, what, f)
}
