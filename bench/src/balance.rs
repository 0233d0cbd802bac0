//! `cargo xtask bench balance`: round robin, least request and ORCA-weighted round robin through the
//! real Envoy, side by side, when one worker has less capacity than Envoy can see from the outside.
//!
//! **Set-up.** One supervisor (release build, default sampling: every 200 ms; default `[orca]`: no
//! blackout, weights recomputed every 100 ms) with four services of two hello workers each: `rr`
//! (`lb_policy = "round_robin"`), `lr` (`"least_request"`), `orca` (client-side weighted round robin
//! on ORCA reports out of band, `orca = true`: one stream per worker) and `orca-ib` (the same policy
//! on the reports the workers carry in their responses, `orca = "in-band"`). In every service worker
//! 0 is pinned to CPU 0 and worker 1 to CPU 1 (`taskset -c {index}`). One Envoy (`--concurrency 1`)
//! routes `/rr`, `/lr`, `/orca` and `/orca-ib`. This process pins itself to
//! CPU 1 before it starts anything, so the supervisor, Envoy and the load generator share CPU 1 with
//! worker 1 and CPU 0 holds only worker 0 and what the scenario puts there. Only one service is loaded
//! at a time; the idle ones cost nothing.
//!
//! **The baseline people run today** (scenario A only): two `hyper-baseline --reuseport` processes
//! (`bench/src/bin/hyper-baseline.rs`: the same answer and `?cpu=MS` work as the hello app) on one
//! `SO_REUSEPORT` port, pinned like the workers (CPU 0 and CPU 1), loaded directly by the same
//! generator: the kernel hashes each of the generator's connections, made afresh every run, to one
//! of them, and the split stays for the run, whatever each process's core is doing. Each round is
//! one such split, so the p99 of each round is reported beside the median. With `--per-connection`
//! every connection is a client with its own schedule, so the split of the connections is the split
//! of the requests; without it the generator's one queue hands each request to a free connection,
//! which balances the port by itself.
//!
//! **Scenarios.** A: a CPU hog (`sh -c 'while :; do :; done'`) pinned to CPU 0 for the whole scenario,
//! so worker 0 gets half a core while it is busy. B: no hog; a side load sends CPU-heavy requests
//! (5x the cost of a main request, at a rate that takes half of CPU 0) *directly* to worker 0 of the
//! service under test, bypassing Envoy, so Envoy sees one worker busy with traffic it did not send.
//!
//! **Load.** An open-loop generator ([`openloop`]): requests of `cpu=MS` (4 ms of CPU by default) at a
//! fixed rate, each latency measured from its scheduled send time. The rate loads the two workers to
//! `--load` (60% by default) of their capacity *without* the hog, 2 cores / MS: round robin then sends the
//! slowed worker more than it can serve (a queue that grows for as long as the run lasts), while a
//! policy that follows the workers' load need not overload either. Each run is a warm-up (5 s: ORCA
//! weights settle; every policy gets the same) followed by the measured window (10 s); only requests
//! scheduled in the window count. Every round runs every policy, in an order rotated per round.
//!
//! **Over time.** Every 500 ms during every run: each worker's sampled CPU and run-queue wait and the
//! utilization last reported over ORCA (`peregrine status --json`), and Envoy's weight for each host
//! (admin `/clusters`); the requests each worker got per 500 ms window come from the answers. The
//! series go to `target/bench/balance-*.csv` (with the kernel's own `schedstat` account of each worker
//! beside the sampler's, as a check) and, with matplotlib (pip-installed into `target/bench/venv`), to
//! `target/bench/balance.png`; the report goes to `target/bench/balance.md`.
//!
//! **Noise.** The machine may be shared. Every run measures the CPU that processes other than the
//! benchmark's own (this one with its `peregrine status` children, the supervisor, its workers, Envoy,
//! the hog) took from the two cores (`/proc/stat` minus `/proc/PID/stat`), runs again (twice at most)
//! when that is over 0.1 core, keeps the quietest run, and the report says how noisy the runs were.
//!
//! **Other servers** (`--app gunicorn`): the same with gunicorn serving `tests/apps/wsgi_app.py` as
//! every service's workers (`pass_socket`; `taskset` pins each, and its forked worker with it), to
//! measure how close the kernel's count of their responses gets ORCA to the built-in worker's own
//! request count; the baseline stays hyper's.
//!
//! **First weights** (`--first-weights`): how soon a cold start gets its ORCA weights, per
//! blackout and sample interval ([`first_weights`]); nothing else runs then.
//!
//! **Timeline** (`--timeline`): the latency over time through a cold start, a hog that appears or
//! goes, a burst and a replacement, per set-up ([`timeline`]); nothing else runs then.
//!
//! **Apps that wait** (`--waits`): servers whose requests wait (5 ms or 100 ms, as on a database)
//! under Poisson arrivals, or burn CPU beside a hog, per set-up: the server's own shared socket,
//! ORCA, least request, round robin, `SO_REUSEPORT`, and Peregrine's default ([`waits`]); nothing
//! else runs then. Cells: gunicorn sync workers (`io`, `slow-worker`, `cpu-hog`), `io` behind four
//! Envoys (`four-envoys`), uvicorn (`async-io`, `async-hog`). `--cell KEY` and `--setup KEY` choose
//! (all by default: about 55 min), `--rate R` and `--hog-rate R` set the loads (150/s and 100/s),
//! `--seed N` the arrivals' and the waits' draws (1; round `r` uses `N + r`), `--connections N` the
//! generator's connections (256), and `--duration` is 20 s by default there.
//!
//! **Code.** This module: the options, the policies and scenarios, and what a run gives;
//! [`run`](mod@run): the set-up and the driving of every run; [`measure`]: one measured run and its
//! figures; [`series`]: the over-time series (the monitor, the CSVs, the plot); [`report`]: the
//! tables and goals; [`poll`]: waiting for a condition with a deadline, which the set-up and the
//! timeline share (so `run` calls the timeline, and the timeline needs nothing of `run`).

mod first_weights;
mod measure;
mod openloop;
mod poll;
mod report;
mod run;
mod series;
mod timeline;
mod waits;

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, ensure};
use peregrine_e2e::{ServiceTable, config::Orca};

pub(crate) use self::run::run;
use super::Flags;

const USAGE: &str = "cargo xtask bench balance [--rounds N] [--warmup SECS] [--duration SECS] [--load FRACTION] [--cpu-ms MS] [--connections N] [--per-connection] [--app gunicorn] | --first-weights [--rounds N] | --timeline [--rounds N] [--event cold|hog-appears|hog-leaves|burst|replacement]... [--setup orca|orca-ib|orca-1s|lr]... | --waits [--rounds N] [--warmup SECS] [--duration SECS] [--rate R] [--hog-rate R] [--seed N] [--connections N] [--cell io|slow-worker|cpu-hog|four-envoys|async-io|async-hog]... [--setup shared-socket|orca|lr2|lr4|rr|reuseport|shared]...";

/// The core of every service's worker 0, shared with the hog or the side load.
const SHARED_CPU: usize = 0;
/// The core of worker 1 and of everything else.
const OTHER_CPU: usize = 1;
/// Connections of the main load generator by default (`--connections`): the most requests it has
/// in flight.
const CONNECTIONS: usize = 256;
/// Connections of the side load.
const SIDE_CONNECTIONS: usize = 16;
/// How long an answer may take; also how late a request may still be sent.
const TIMEOUT: Duration = Duration::from_secs(10);
/// A side-load request costs this many main requests.
const SIDE_COST: u64 = 5;
/// The share of worker 0's core the side load takes.
const SIDE_SHARE: f64 = 0.5;
/// Other processes' CPU use, in cores, above which a run is called noisy and repeated.
const NOISY: f64 = 0.1;
/// How many times a noisy run is repeated (the quietest is kept).
const NOISY_RETRIES: usize = 2;

/// The load balancing policies, in table order, and the baseline without Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    RoundRobin,
    LeastRequest,
    /// CSWRR on out-of-band reports (`orca = true`).
    Cswrr,
    /// CSWRR on in-band reports (`orca = "in-band"`): the workers' response headers.
    CswrrInBand,
    /// No balancer: processes on one `SO_REUSEPORT` port, the kernel's hash of each connection.
    ReusePort,
}

impl Policy {
    /// The policies Envoy applies: one service each.
    const ALL: [Policy; 4] = [
        Policy::RoundRobin,
        Policy::LeastRequest,
        Policy::Cswrr,
        Policy::CswrrInBand,
    ];

    /// What each scenario runs, in table order: every policy, and in A the baseline (B's side load
    /// targets one process, which a shared port cannot).
    fn of(scenario: Scenario) -> &'static [Policy] {
        match scenario {
            Scenario::Hog => &[
                Policy::RoundRobin,
                Policy::LeastRequest,
                Policy::Cswrr,
                Policy::CswrrInBand,
                Policy::ReusePort,
            ],
            Scenario::SideLoad => &Policy::ALL,
        }
    }

    /// The service (Envoy cluster, route prefix) balanced by this policy.
    fn service(self) -> &'static str {
        match self {
            Policy::RoundRobin => "rr",
            Policy::LeastRequest => "lr",
            Policy::Cswrr => "orca",
            Policy::CswrrInBand => "orca-ib",
            Policy::ReusePort => "reuseport",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Policy::RoundRobin => "ROUND_ROBIN",
            Policy::LeastRequest => "LEAST_REQUEST",
            Policy::Cswrr => "CSWRR + ORCA",
            Policy::CswrrInBand => "CSWRR + in-band ORCA",
            Policy::ReusePort => "SO_REUSEPORT hyper",
        }
    }

    /// `service` with this policy's balancing key in `peregrine.toml` (the baseline has no
    /// service).
    fn balance(self, service: ServiceTable) -> ServiceTable {
        match self {
            Policy::RoundRobin => ServiceTable {
                lb_policy: Some("round_robin".into()),
                ..service
            },
            Policy::LeastRequest => ServiceTable {
                lb_policy: Some("least_request".into()),
                ..service
            },
            Policy::Cswrr | Policy::ReusePort => service.orca(Orca::On),
            Policy::CswrrInBand => service.orca(Orca::InBand),
        }
    }

    /// Whether Envoy weighs the hosts on ORCA reports (and `/clusters` shows their weights).
    fn weighted(self) -> bool {
        matches!(self, Policy::Cswrr | Policy::CswrrInBand)
    }

    /// Whether the reports ride on the workers' responses: Envoy's weights move only when a worker
    /// answers.
    fn in_band(self) -> bool {
        self == Policy::CswrrInBand
    }
}

/// What takes capacity from worker 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Hog,
    SideLoad,
}

impl Scenario {
    const ALL: [Scenario; 2] = [Scenario::Hog, Scenario::SideLoad];

    fn key(self) -> &'static str {
        match self {
            Scenario::Hog => "hog",
            Scenario::SideLoad => "side",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Scenario::Hog => "A: a CPU hog shares worker 0's core",
            Scenario::SideLoad => "B: CPU-heavy requests sent to worker 0 directly, past Envoy",
        }
    }

    /// What worker 0 is called in the goals.
    fn worker0(self) -> &'static str {
        match self {
            Scenario::Hog => "the hogged worker",
            Scenario::SideLoad => "the side-loaded worker",
        }
    }
}

/// A busy loop pinned to the shared core (scenario A's hog, the timeline's).
fn spawn_hog(dir: &std::path::Path) -> anyhow::Result<peregrine_e2e::ChildGuard> {
    peregrine_e2e::ChildGuard::spawn(
        "hog",
        std::process::Command::new("taskset").args([
            "-c",
            &SHARED_CPU.to_string(),
            "sh",
            "-c",
            "while :; do :; done",
        ]),
        dir,
    )
}

/// Envoy, bootstrapped from `config` alone (`peregrine envoy-bootstrap`), in `dir`: before any
/// supervisor runs, or as one of several Envoys of one supervisor, each from a config with its own
/// `[envoy]`.
fn envoy_bootstrapped_from(
    peregrine: &std::path::Path,
    envoy: &std::path::Path,
    dir: &std::path::Path,
    config: &str,
) -> anyhow::Result<peregrine_e2e::Envoy> {
    let path = dir.join("bootstrap.toml");
    std::fs::write(&path, config).with_context(|| format!("writing {}", path.display()))?;
    let output = std::process::Command::new(peregrine)
        .arg("envoy-bootstrap")
        .arg(&path)
        .output()
        .context("running peregrine envoy-bootstrap")?;
    if !output.status.success() {
        anyhow::bail!(
            "envoy-bootstrap: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    peregrine_e2e::Envoy::start_in(envoy, dir, &String::from_utf8_lossy(&output.stdout))
}

// === options ===

#[derive(Clone, Debug, PartialEq)]
struct Options {
    rounds: usize,
    warmup: u64,
    duration: u64,
    /// The offered load as a share of the two workers' capacity without the hog.
    load: f64,
    cpu_ms: u64,
    /// The main load's connections (each one request at a time; also `--waits`' generator's):
    /// under `SO_REUSEPORT` the kernel splits these, so fewer make a coarser, more variable split.
    connections: usize,
    /// Each connection a client with its own schedule (`--per-connection`) instead of one queue
    /// that hands each request to a free connection (which balances a `SO_REUSEPORT` port by
    /// itself).
    per_connection: bool,
    /// Only how soon a cold start gets its first ORCA weights ([`first_weights`]).
    first_weights: bool,
    /// Only the cold start and the transitions, over time ([`timeline`]).
    timeline: bool,
    /// The timeline's events and set-ups to run (all when empty), by key.
    events: Vec<String>,
    setups: Vec<String>,
    /// The workers are gunicorn serving the WSGI test app (`--app gunicorn`, on listeners the
    /// supervisor passes, their responses counted in the kernel) instead of the built-in worker.
    gunicorn: bool,
    /// Only the apps that wait ([`waits`]), with its cells (all when empty) and `--setup`'s set-ups.
    waits: bool,
    cells: Vec<String>,
    /// Requests per second of the waiting cells (`--rate`) and of the CPU-hog cell (`--hog-rate`).
    waits_rate: f64,
    hog_rate: f64,
    /// The first round's seed of the arrivals and the waits' draws.
    seed: u64,
}

impl Options {
    /// Requests per second: `load` of two cores at `cpu_ms` per request.
    fn rate(&self) -> f64 {
        self.load * 2.0 * 1000.0 / self.cpu_ms as f64
    }

    fn side_cpu_ms(&self) -> u64 {
        self.cpu_ms * SIDE_COST
    }

    /// Side requests per second: [`SIDE_SHARE`] of a core.
    fn side_rate(&self) -> f64 {
        SIDE_SHARE * 1000.0 / self.side_cpu_ms() as f64
    }
}

fn parse_args(args: &[String]) -> anyhow::Result<Options> {
    let mut options = Options {
        rounds: 3,
        warmup: 5,
        duration: 10,
        load: 0.6,
        cpu_ms: 4,
        connections: CONNECTIONS,
        per_connection: false,
        first_weights: false,
        timeline: false,
        events: Vec::new(),
        setups: Vec::new(),
        gunicorn: false,
        waits: false,
        cells: Vec::new(),
        waits_rate: waits::RATE,
        hog_rate: waits::HOG_RATE,
        seed: 1,
    };
    let mut duration_given = false;
    let mut args = Flags::new(args, USAGE);
    while let Some(flag) = args.next() {
        match flag {
            "--rounds" => options.rounds = args.value(flag)?.parse().context("--rounds N")?,
            "--warmup" => options.warmup = args.value(flag)?.parse().context("--warmup SECS")?,
            "--duration" => {
                options.duration = args.value(flag)?.parse().context("--duration SECS")?;
                duration_given = true;
            }
            "--load" => options.load = args.value(flag)?.parse().context("--load FRACTION")?,
            "--cpu-ms" => options.cpu_ms = args.value(flag)?.parse().context("--cpu-ms MS")?,
            "--connections" => {
                options.connections = args.value(flag)?.parse().context("--connections N")?;
            }
            "--per-connection" => options.per_connection = true,
            "--app" => match args.value(flag)? {
                "gunicorn" => options.gunicorn = true,
                "hello" => options.gunicorn = false,
                other => anyhow::bail!("--app takes gunicorn or hello, not {other:?}\n\n{USAGE}"),
            },
            "--first-weights" => options.first_weights = true,
            "--timeline" => options.timeline = true,
            "--event" => options.events.push(args.value(flag)?.to_owned()),
            "--setup" => options.setups.push(args.value(flag)?.to_owned()),
            "--waits" => options.waits = true,
            "--cell" => options.cells.push(args.value(flag)?.to_owned()),
            "--rate" => options.waits_rate = args.value(flag)?.parse().context("--rate R")?,
            "--hog-rate" => options.hog_rate = args.value(flag)?.parse().context("--hog-rate R")?,
            "--seed" => options.seed = args.value(flag)?.parse().context("--seed N")?,
            other => return Err(args.unknown(other)),
        }
    }
    if options.waits {
        if !duration_given {
            options.duration = waits::DURATION;
        }
        waits::check_keys(&options)?;
    }
    ensure!(
        !options.waits || !(options.timeline || options.first_weights),
        "--waits, --timeline and --first-weights each run alone"
    );
    ensure!(
        options.waits || options.cells.is_empty(),
        "--cell is for --waits"
    );
    ensure!(
        options.waits_rate > 0.0
            && options.hog_rate > 0.0
            && options.waits_rate <= 5000.0
            && options.hog_rate <= 5000.0,
        "--rate and --hog-rate are requests per second, above 0 and at most 5000"
    );
    ensure!(
        (1..=4096).contains(&options.connections),
        "--connections must be from 1 to 4096 (one thread each)"
    );
    ensure!(
        options.rounds >= 1 && options.duration >= 1,
        "--rounds and --duration must be at least 1"
    );
    ensure!(
        options.load > 0.0 && options.load < 1.0,
        "--load is a fraction of the workers' capacity, above 0 and below 1"
    );
    ensure!(
        (1..=100).contains(&options.cpu_ms),
        "--cpu-ms must be from 1 to 100 (side requests cost 5x and the worker caps a request at 1000 ms)"
    );
    Ok(options)
}

// === results ===

/// What one run measures: `policy` in `scenario`, in round `round` (from 0), with the hog's pid in
/// scenario A (counted with the benchmark's own processes).
#[derive(Clone, Copy, Debug)]
struct Case {
    scenario: Scenario,
    policy: Policy,
    round: usize,
    hog: Option<u32>,
}

/// A worker of the service under test.
#[derive(Clone, Debug)]
struct WorkerInfo {
    pid: u32,
    hostname: String,
    /// Its listener (for the side load).
    addr: SocketAddr,
}

/// What the monitor saw of one worker at one time; `None` where nothing was known yet.
#[derive(Clone, Copy, Debug, Default)]
struct WorkerSample {
    cpu: Option<f64>,
    wait: Option<f64>,
    /// `application_utilization` of the last ORCA report.
    reported: Option<f64>,
    /// Envoy's weight for the host.
    weight: Option<u64>,
    /// The kernel's own account over the last step (`/proc/PID/task/*/schedstat`): CPU and run-queue
    /// wait in cores, a check on the sampler's figures.
    kernel_cpu: Option<f64>,
    kernel_wait: Option<f64>,
}

impl WorkerSample {
    /// CPU plus run-queue wait, in cores: how much of the time the worker was runnable.
    fn busy(&self) -> Option<f64> {
        Some(self.cpu? + self.wait.unwrap_or(0.0))
    }
}

/// One monitor sample, `t` after the load's start.
#[derive(Clone, Debug)]
struct Sample {
    t: Duration,
    workers: [WorkerSample; 2],
}

/// One run of one policy.
#[derive(Clone, Debug)]
struct Run {
    scenario: Scenario,
    policy: Policy,
    round: usize,
    /// Answers from a worker per second over the measured window (until the last of its answers).
    throughput: f64,
    /// Requests of the measured window without a worker's answer.
    failed: usize,
    /// Latency percentiles of the measured window; `None` when the percentile falls on a failure.
    p50: Option<Duration>,
    p99: Option<Duration>,
    /// Each worker's share of the window's answers.
    shares: [f64; 2],
    /// Median over the window of each worker's CPU + run-queue wait.
    busy: [Option<f64>; 2],
    /// Median over the window of worker 0's share of Envoy's weights (weighted policies only).
    weight0: Option<f64>,
    /// Requests of the window sent more than 1 ms after their schedule.
    late: usize,
    /// CPU used by processes other than the benchmark's during the run, in cores.
    others: f64,
    /// Requests per worker per [`series::STEP`], by send time, over the whole run.
    steps: Vec<[u64; 2]>,
    samples: Vec<Sample>,
}

/// What every run needs (set up by [`run`], used by [`measure`] and the [`series`] monitor).
struct Bench<'a> {
    options: &'a Options,
    /// The benchmark's own processes: this one, the supervisor, Envoy and every worker.
    own: Vec<u32>,
    supervisor: &'a peregrine_e2e::Supervisor,
    /// Envoy's admin listener.
    admin: SocketAddr,
    /// Envoy's listener.
    listen: SocketAddr,
    dir: &'a std::path::Path,
    /// The `SO_REUSEPORT` baseline, once it runs.
    reuseport: Option<ReusePort>,
}

/// The `SO_REUSEPORT` baseline: its shared address and its two processes (CPU 0, CPU 1).
#[derive(Clone, Debug)]
struct ReusePort {
    addr: SocketAddr,
    workers: [WorkerInfo; 2],
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args;

    #[test]
    fn parses_the_options_and_derives_the_rates() {
        let defaults = parse_args(&[]).unwrap();
        assert_eq!(defaults.rounds, 3);
        assert_eq!(defaults.rate(), 300.0);
        assert_eq!(defaults.side_cpu_ms(), 20);
        assert_eq!(defaults.side_rate(), 25.0);
        let other = parse_args(&args(
            "--rounds 1 --warmup 2 --duration 3 --load 0.7 --cpu-ms 2",
        ))
        .unwrap();
        assert_eq!((other.rounds, other.warmup, other.duration), (1, 2, 3));
        assert!((other.rate() - 700.0).abs() < 1e-9);
        assert_eq!(defaults.connections, 256);
        assert_eq!(
            parse_args(&args("--connections 64")).unwrap().connections,
            64
        );
        assert!(!defaults.gunicorn);
        assert!(parse_args(&args("--app gunicorn")).unwrap().gunicorn);
        assert!(parse_args(&args("--app nginx")).is_err());
        assert!(parse_args(&args("--connections 0")).is_err());
        assert!(parse_args(&args("--load 1.5")).is_err());
        assert!(parse_args(&args("--cpu-ms 0")).is_err());
        assert!(parse_args(&args("--rounds")).is_err());
        assert!(parse_args(&args("--fast")).is_err());
    }

    #[test]
    fn in_band_runs_beside_out_of_band_in_both_scenarios() {
        for scenario in Scenario::ALL {
            let policies = Policy::of(scenario);
            assert!(policies.contains(&Policy::Cswrr) && policies.contains(&Policy::CswrrInBand));
        }
        let services: std::collections::BTreeSet<&str> =
            Policy::ALL.iter().map(|p| p.service()).collect();
        assert_eq!(services.len(), Policy::ALL.len());
        assert!(Policy::CswrrInBand.weighted() && Policy::CswrrInBand.in_band());
        assert!(Policy::Cswrr.weighted() && !Policy::Cswrr.in_band());
        let service = |policy: Policy| policy.balance(ServiceTable::default());
        assert_eq!(service(Policy::CswrrInBand).orca, Some(Orca::InBand));
        assert_eq!(service(Policy::Cswrr).orca, Some(Orca::On));
        assert_eq!(
            service(Policy::LeastRequest).lb_policy.as_deref(),
            Some("least_request")
        );
    }
}
