//! `cargo xtask bench balance`: round robin, least request and ORCA-weighted round robin through the
//! real Envoy, side by side, when one worker has less capacity than Envoy can see from the outside.
//!
//! **Set-up.** One supervisor (release build, default sampling: every 1 s; default `[orca]`: 2 s
//! blackout, weights recomputed every 1 s) with three services of two hello workers each: `rr`
//! (`lb_policy = "round_robin"`), `lr` (`"least_request"`) and `orca` (client-side weighted round robin
//! on ORCA reports). In every service worker 0 is pinned to CPU 0 and worker 1 to CPU 1 (`taskset -c
//! {index}`). One Envoy (`--concurrency 1`) routes `/rr`, `/lr` and `/orca`. This process pins itself to
//! CPU 1 before it starts anything, so the supervisor, Envoy and the load generator share CPU 1 with
//! worker 1 and CPU 0 holds only worker 0 and what the scenario puts there. Only one service is loaded
//! at a time; the idle ones cost nothing.
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

mod openloop;

use std::{
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, bail, ensure};
use peregrine_e2e::{
    ChildGuard, Envoy, Supervisor, TempDir, free_port, hosts, http_get, target_dir,
};
use serde_json::Value;

use self::openloop::{Answer, Plan, Record};
use super::http::{
    clock_ticks_per_second, core_ticks, cpu_model, cpus_allowed, format_duration, machine_lines,
    markdown, median, online_cpus,
};
use crate::{envoy, pip_install, run_checked};

const USAGE: &str = "cargo xtask bench balance [--rounds N] [--warmup SECS] [--duration SECS] [--load FRACTION] [--cpu-ms MS]";

/// The core of every service's worker 0, shared with the hog or the side load.
const SHARED_CPU: usize = 0;
/// The core of worker 1 and of everything else.
const OTHER_CPU: usize = 1;
/// The step of the over-time series.
const STEP: Duration = Duration::from_millis(500);
/// Connections of the main load generator: the most requests it has in flight.
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
/// The pinned plotting library.
const MATPLOTLIB: &str = "matplotlib==3.10.9";
/// The plotting script.
const PLOT_SCRIPT: &str = include_str!("balance/plot.py");

/// The load balancing policies, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    RoundRobin,
    LeastRequest,
    Cswrr,
}

impl Policy {
    const ALL: [Policy; 3] = [Policy::RoundRobin, Policy::LeastRequest, Policy::Cswrr];

    /// The service (Envoy cluster, route prefix) balanced by this policy.
    fn service(self) -> &'static str {
        match self {
            Policy::RoundRobin => "rr",
            Policy::LeastRequest => "lr",
            Policy::Cswrr => "orca",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Policy::RoundRobin => "ROUND_ROBIN",
            Policy::LeastRequest => "LEAST_REQUEST",
            Policy::Cswrr => "CSWRR + ORCA",
        }
    }

    /// The service's balancing line in `peregrine.toml`.
    fn toml(self) -> &'static str {
        match self {
            Policy::RoundRobin => "lb_policy = \"round_robin\"",
            Policy::LeastRequest => "lb_policy = \"least_request\"",
            Policy::Cswrr => "orca = true",
        }
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

// === options ===

#[derive(Clone, Debug, PartialEq)]
struct Options {
    rounds: usize,
    warmup: u64,
    duration: u64,
    /// The offered load as a share of the two workers' capacity without the hog.
    load: f64,
    cpu_ms: u64,
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
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .with_context(|| format!("{name} needs a value\nusage: {USAGE}"))
        };
        match arg.as_str() {
            "--rounds" => options.rounds = value("--rounds")?.parse().context("--rounds N")?,
            "--warmup" => options.warmup = value("--warmup")?.parse().context("--warmup SECS")?,
            "--duration" => {
                options.duration = value("--duration")?.parse().context("--duration SECS")?;
            }
            "--load" => options.load = value("--load")?.parse().context("--load FRACTION")?,
            "--cpu-ms" => options.cpu_ms = value("--cpu-ms")?.parse().context("--cpu-ms MS")?,
            other => bail!("unknown argument {other:?}\nusage: {USAGE}"),
        }
    }
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
    /// Requests per worker per [`STEP`], by send time, over the whole run.
    steps: Vec<[u64; 2]>,
    samples: Vec<Sample>,
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let options = parse_args(args)?;
    let cpus = online_cpus();
    ensure!(
        cpus >= 2,
        "the benchmark pins worker 0 to CPU {SHARED_CPU} and worker 1 to CPU {OTHER_CPU}: it needs 2 CPUs, this machine has {cpus}"
    );
    let peregrine = super::release_peregrine()?;
    let envoy_binary = envoy::install()?;
    let out = target_dir().join("bench");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    // Build and install first, on both cores; from here on everything this process starts inherits
    // CPU 1, except what pins itself (the workers, the hog).
    let mut cpu = rustix::thread::CpuSet::new();
    cpu.set(OTHER_CPU);
    rustix::thread::sched_setaffinity(None, &cpu).context("pinning the benchmark to CPU 1")?;
    let cpu_line = format!("{} ({cpus} online)", cpu_model()?);

    let dir = TempDir::new().context("a temporary directory")?;
    let (listen, admin) = (free_port(), free_port());
    let config = config(&peregrine, dir.path(), listen, admin)?;
    let supervisor = Supervisor::start_in(&peregrine, dir.path(), &config)?;
    let listen = SocketAddr::from(([127, 0, 0, 1], listen));
    let result = (|| {
        let mut envoy = Envoy::start_in(&envoy_binary, dir.path(), &supervisor.envoy_bootstrap()?)?;
        let envoy_pid = envoy.process().id();
        let mut bench = Bench {
            options: &options,
            own: vec![std::process::id(), supervisor.pid(), envoy_pid],
            ticks_per_sec: clock_ticks_per_second()?,
            supervisor: &supervisor,
            admin: envoy.admin_addr(),
            listen,
            dir: dir.path(),
        };
        let workers = bench.ready()?;
        bench.own.extend(workers);
        let started = Instant::now();
        let mut runs = Vec::new();
        for scenario in Scenario::ALL {
            let hog = (scenario == Scenario::Hog)
                .then(|| {
                    ChildGuard::spawn(
                        "hog",
                        Command::new("taskset").args([
                            "-c",
                            &SHARED_CPU.to_string(),
                            "sh",
                            "-c",
                            "while :; do :; done",
                        ]),
                        dir.path(),
                    )
                })
                .transpose()?;
            let hog_pid = hog.as_ref().map(ChildGuard::id);
            for round in 0..options.rounds {
                for k in 0..Policy::ALL.len() {
                    let policy = Policy::ALL[(k + round) % Policy::ALL.len()];
                    let run = bench
                        .run_quietest(scenario, policy, round, hog_pid)
                        .with_context(|| format!("{} in scenario {scenario:?}", policy.label()))?;
                    eprintln!("{}", describe(&run, &options));
                    runs.push(run);
                }
            }
            drop(hog);
        }
        let sampler = supervisor.status_json()?;
        Ok::<_, anyhow::Error>((
            runs,
            started.elapsed(),
            sampler,
            envoy::short_version(&envoy_binary)?,
        ))
    })();
    let (runs, elapsed, status, envoy_version) = match result {
        Ok(result) => result,
        Err(error) => {
            eprintln!("{}", supervisor.logs());
            return Err(error);
        }
    };
    drop(supervisor);

    let mut report = String::new();
    let command = super::command_line("balance", args);
    writeln!(
        report,
        "Command: `{command}` ({} rounds, {} s warm-up + {} s measured per run, {elapsed:.0?} in all)",
        options.rounds, options.warmup, options.duration
    )?;
    machine_lines(&mut report, &cpu_line)?;
    writeln!(report, "Envoy: {envoy_version}")?;
    writeln!(
        report,
        "Sampler: {}, every {} ms",
        status["sampler"].as_str().unwrap_or("?"),
        status["sample_interval_ms"].as_u64().unwrap_or(0)
    )?;
    let others: Vec<f64> = runs.iter().map(|r| r.others).collect();
    writeln!(
        report,
        "Other processes' CPU use during the runs: median {:.2} cores, max {:.2} ({} of {} runs above {NOISY} after up to {NOISY_RETRIES} repeats of a noisy run)",
        median(others.clone()),
        others.iter().copied().fold(0.0, f64::max),
        others.iter().filter(|&&o| o > NOISY).count(),
        others.len(),
    )?;
    writeln!(
        report,
        "Load: {:.0} requests/s of `?cpu={}` ({:.0}% of 2 cores), {CONNECTIONS} keep-alive connections; \
         side load (B): {:.0} requests/s of `?cpu={}` straight to worker 0",
        options.rate(),
        options.cpu_ms,
        options.load * 100.0,
        options.side_rate(),
        options.side_cpu_ms()
    )?;
    for scenario in Scenario::ALL {
        let runs: Vec<&Run> = runs.iter().filter(|r| r.scenario == scenario).collect();
        writeln!(report, "\n### {}\n", scenario.title())?;
        report.push_str(&table(&runs));
        writeln!(report)?;
        report.push_str(&goals(scenario, &runs, options.rate()));
    }
    println!("{report}");
    let report_path = out.join("balance.md");
    std::fs::write(&report_path, &report)
        .with_context(|| format!("writing {}", report_path.display()))?;

    let (requests_csv, samples_csv) = (
        out.join("balance-requests.csv"),
        out.join("balance-samples.csv"),
    );
    write_csvs(&runs, &requests_csv, &samples_csv)?;
    match plot(&out, &requests_csv, &samples_csv, &options) {
        Ok(png) => eprintln!("plot: {}", png.display()),
        Err(error) => eprintln!("warning: no plot: {error:#}"),
    }
    eprintln!(
        "report: {}\nseries: {}, {}",
        report_path.display(),
        requests_csv.display(),
        samples_csv.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The supervisor's config: three services of two workers, worker `i` pinned to CPU `i`.
fn config(peregrine: &Path, dir: &Path, listen: u16, admin: u16) -> anyhow::Result<String> {
    let mut toml = format!(
        r#"[supervisor]
bind = "http://127.0.0.1:{grpc}"
control = "{control}"

[envoy]
listen = "127.0.0.1:{listen}"
admin = "127.0.0.1:{admin}"
"#,
        grpc = free_port(),
        control = dir.join("peregrine.sock").display(),
    );
    for policy in Policy::ALL {
        // `taskset` execs the worker, which keeps the pid the supervisor started.
        write!(
            toml,
            r#"
[service.{name}]
count = 2
url = "http://127.0.0.1:0"
prefix = "/{name}"
{balance}
command = ["taskset", "-c", "{{index}}", "{peregrine}", "worker"]
"#,
            name = policy.service(),
            balance = policy.toml(),
            peregrine = peregrine.display(),
        )?;
    }
    Ok(toml)
}

/// What every run needs.
struct Bench<'a> {
    options: &'a Options,
    /// The benchmark's own processes: this one, the supervisor, Envoy and every worker.
    own: Vec<u32>,
    ticks_per_sec: u64,
    supervisor: &'a Supervisor,
    admin: SocketAddr,
    listen: SocketAddr,
    dir: &'a Path,
}

impl Bench<'_> {
    /// The two workers of `service`, by index, once both are registered.
    fn workers(&self, service: &str) -> anyhow::Result<[WorkerInfo; 2]> {
        let status = self.supervisor.status_json()?;
        let row = |index: u64| -> Option<WorkerInfo> {
            let row = status["workers"]
                .as_array()?
                .iter()
                .find(|row| row["service"] == service && row["index"] == index)?;
            Some(WorkerInfo {
                pid: u32::try_from(row["pid"].as_u64()?).ok()?,
                hostname: row["hostname"].as_str()?.to_owned(),
                addr: row["addresses"]
                    .as_array()?
                    .first()?
                    .as_str()?
                    .parse()
                    .ok()?,
            })
        };
        Ok([
            row(0).with_context(|| format!("no worker 0 of {service} in {status}"))?,
            row(1).with_context(|| format!("no worker 1 of {service} in {status}"))?,
        ])
    }

    /// Waits until every worker is registered and pinned, Envoy routes to every service, and the
    /// ORCA service has weights; returns every worker's pid.
    fn ready(&self) -> anyhow::Result<Vec<u32>> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut pids = Vec::new();
        for policy in Policy::ALL {
            let service = policy.service();
            let workers = poll(deadline, &format!("the workers of {service}"), || {
                self.workers(service).ok()
            })?;
            for (index, worker) in workers.iter().enumerate() {
                let cpus = cpus_allowed(worker.pid)?;
                ensure!(
                    cpus == index.to_string(),
                    "worker {index} of {service} (pid {}) may run on CPUs {cpus}, expected {index}",
                    worker.pid
                );
            }
            poll(deadline, &format!("Envoy routing /{service}"), || {
                let hosts = hosts(&http_get(self.admin, "/clusters").ok()?.1, service);
                let ok = http_get(self.listen, &format!("/{service}"))
                    .is_ok_and(|(status, _)| status == 200);
                (ok && hosts.len() == 2 && hosts.iter().all(|h| h.healthy)).then_some(())
            })?;
            if policy == Policy::Cswrr {
                poll(deadline, "ORCA weights for both workers", || {
                    let hosts = hosts(&http_get(self.admin, "/clusters").ok()?.1, service);
                    (hosts.len() == 2 && hosts.iter().all(|h| h.weight > 1)).then_some(())
                })?;
            }
            eprintln!(
                "{service}: workers {} (CPU 0) and {} (CPU 1), {}",
                workers[0].pid,
                workers[1].pid,
                policy.label()
            );
            pids.extend(workers.iter().map(|w| w.pid));
        }
        Ok(pids)
    }

    /// [`Bench::run`], again (up to [`NOISY_RETRIES`] times) while other processes used more than
    /// [`NOISY`] cores; keeps the quietest.
    fn run_quietest(
        &self,
        scenario: Scenario,
        policy: Policy,
        round: usize,
        hog: Option<u32>,
    ) -> anyhow::Result<Run> {
        let mut best = self.run(scenario, policy, round, hog)?;
        for _ in 0..NOISY_RETRIES {
            if best.others <= NOISY {
                break;
            }
            eprintln!(
                "  other processes used {:.2} cores: running again ({})",
                best.others,
                describe(&best, self.options)
            );
            let again = self.run(scenario, policy, round, hog)?;
            if again.others < best.others {
                best = again;
            }
        }
        Ok(best)
    }

    /// One run: warm-up and measured window of `policy`'s service, with the side load in scenario B.
    fn run(
        &self,
        scenario: Scenario,
        policy: Policy,
        round: usize,
        hog: Option<u32>,
    ) -> anyhow::Result<Run> {
        let options = self.options;
        let service = policy.service();
        let workers = self.workers(service)?;
        let total = Duration::from_secs(options.warmup + options.duration);
        let main = Plan {
            addr: self.listen,
            path: format!("/{service}?cpu={}", options.cpu_ms),
            rate: options.rate(),
            duration: total,
            connections: CONNECTIONS,
            timeout: TIMEOUT,
        };
        let side = (scenario == Scenario::SideLoad).then(|| Plan {
            addr: workers[0].addr,
            path: format!("/?cpu={}", options.side_cpu_ms()),
            rate: options.side_rate(),
            duration: total,
            connections: SIDE_CONNECTIONS,
            timeout: TIMEOUT,
        });
        // Time for the load threads to connect before the first request is due.
        let start = Instant::now() + Duration::from_millis(500);
        let stop = AtomicBool::new(false);
        let own: Vec<u32> = self.own.iter().copied().chain(hog).collect();
        let before = (Instant::now(), machine_busy()?, own_ticks(&own));
        let (records, side_records, samples) = thread::scope(|scope| {
            let monitor = scope.spawn(|| self.monitor(service, &workers, start, &stop));
            let side = side
                .as_ref()
                .map(|plan| scope.spawn(move || openloop::run(plan, start)));
            let records = openloop::run(&main, start);
            stop.store(true, Ordering::Relaxed);
            let side = side.map(|thread| thread.join().expect("the side load panicked"));
            let samples = monitor.join().expect("the monitor panicked");
            (records, side, samples)
        });
        let records = records?;
        let ended = SystemTime::now();
        let (machine, mine) = (
            machine_busy()?.saturating_sub(before.1),
            own_ticks(&own).saturating_sub(before.2),
        );
        let others = machine.saturating_sub(mine) as f64
            / self.ticks_per_sec as f64
            / before.0.elapsed().as_secs_f64();
        if let Some(side) = side_records {
            let side = side?;
            let ok = side
                .iter()
                .filter(|r| matches!(r.answer, Answer::Worker(_)))
                .count();
            eprintln!(
                "  side load: {ok} of {} answered, p50 {}",
                side.len(),
                percentile(&side, 0.5).map_or("failed".into(), format_duration)
            );
        }
        self.quiet(service, &workers, ended)?;
        let mut run = summarize(
            scenario, policy, round, options, &workers, &records, samples,
        );
        run.others = others;
        Ok(run)
    }

    /// Samples the workers of `service` and Envoy's weights every [`STEP`] from `start` until `stop`.
    fn monitor(
        &self,
        service: &str,
        workers: &[WorkerInfo; 2],
        start: Instant,
        stop: &AtomicBool,
    ) -> Vec<Sample> {
        let mut samples = Vec::new();
        let mut next = start;
        let mut kernel_before: [Option<(Instant, (u64, u64))>; 2] = [None, None];
        while !stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            if next > now {
                thread::sleep((next - now).min(Duration::from_millis(50)));
                continue;
            }
            next += STEP;
            let mut sample = Sample {
                t: now.saturating_duration_since(start),
                workers: [WorkerSample::default(); 2],
            };
            // A sample that cannot be taken stays empty: the run's figures do not depend on it.
            for (i, worker) in workers.iter().enumerate() {
                let now = (Instant::now(), schedstat(worker.pid).unwrap_or_default());
                if let Some((then, (cpu, wait))) = kernel_before[i] {
                    let secs = (now.0 - then).as_secs_f64();
                    sample.workers[i].kernel_cpu =
                        Some(now.1.0.saturating_sub(cpu) as f64 / 1e9 / secs);
                    sample.workers[i].kernel_wait =
                        Some(now.1.1.saturating_sub(wait) as f64 / 1e9 / secs);
                }
                kernel_before[i] = Some(now);
            }
            let status = self.supervisor.status_json().unwrap_or_default();
            for row in status["workers"].as_array().into_iter().flatten() {
                if row["service"] != service {
                    continue;
                }
                let Some(i) = workers
                    .iter()
                    .position(|w| row["pid"].as_u64() == Some(u64::from(w.pid)))
                else {
                    continue;
                };
                let s = &mut sample.workers[i];
                s.cpu = row["cpu_cores"].as_f64();
                s.wait = row["runq_wait_cores"].as_f64();
                s.reported = row["orca_last_report"]["application_utilization"].as_f64();
            }
            let clusters =
                http_get(self.admin, "/clusters").map_or_else(|_| String::new(), |a| a.1);
            for host in hosts(&clusters, service) {
                if let Some(i) = workers.iter().position(|w| w.hostname == host.hostname) {
                    sample.workers[i].weight = Some(host.weight);
                }
            }
            samples.push(sample);
        }
        samples
    }

    /// Waits until `service`'s workers served nothing in a sample taken after `since` (a run that
    /// timed out may leave requests queued in a worker), and checks neither was restarted.
    fn quiet(
        &self,
        service: &str,
        workers: &[WorkerInfo; 2],
        since: SystemTime,
    ) -> anyhow::Result<()> {
        let since_ms = since.duration_since(UNIX_EPOCH)?.as_millis() as u64;
        poll(
            Instant::now() + Duration::from_secs(60),
            &format!("{service}'s workers to go idle"),
            || {
                let now = self.workers(service).ok()?;
                let status = self.supervisor.status_json().ok()?;
                let rows: Vec<&Value> = status["workers"]
                    .as_array()?
                    .iter()
                    .filter(|row| row["service"] == service)
                    .collect();
                let idle = rows.iter().all(|row| {
                    row["sampled_at_unix_ms"].as_u64() > Some(since_ms)
                        && row["requests_per_second"].as_f64() < Some(1.0)
                });
                (idle && now.iter().zip(workers).all(|(a, b)| a.pid == b.pid)).then_some(())
            },
        )
        .with_context(|| format!("logs in {}", self.dir.display()))
    }
}

/// Busy clock ticks of all cores together (`/proc/stat`).
fn machine_busy() -> anyhow::Result<u64> {
    Ok(core_ticks()?.iter().map(|(_, ticks)| ticks.busy()).sum())
}

/// Clock ticks of `pids` (all threads), with their children that were waited for (the `peregrine
/// status` calls); a process that is gone counts nothing.
fn own_ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| stat_ticks_with_children(&stat))
        .sum()
}

/// `utime + stime + cutime + cstime` (fields 14 to 17) of a `/proc/PID/stat` line; fields are
/// counted after the command name's last `)`.
fn stat_ticks_with_children(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    // `rest` starts at field 3.
    let fields: Vec<&str> = rest.split_whitespace().skip(14 - 3).take(4).collect();
    if fields.len() < 4 {
        return None;
    }
    fields.iter().map(|field| field.parse::<u64>().ok()).sum()
}

/// The CPU and run-queue wait nanoseconds of every thread of `pid`, summed (threads that exited are
/// missing: fine for a check over 500 ms).
fn schedstat(pid: u32) -> anyhow::Result<(u64, u64)> {
    let mut totals = (0, 0);
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let text = std::fs::read_to_string(entry?.path().join("schedstat"))?;
        let mut fields = text.split_whitespace().map(|f| f.parse::<u64>());
        totals.0 += fields.next().context("empty schedstat")??;
        totals.1 += fields.next().context("short schedstat")??;
    }
    Ok(totals)
}

/// Polls `f` every 250 ms until it returns `Some` or `deadline` passes.
fn poll<T>(deadline: Instant, what: &str, mut f: impl FnMut() -> Option<T>) -> anyhow::Result<T> {
    loop {
        if let Some(value) = f() {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("timed out waiting for {what}");
        }
        thread::sleep(Duration::from_millis(250));
    }
}

/// The run's figures from its records and samples.
fn summarize(
    scenario: Scenario,
    policy: Policy,
    round: usize,
    options: &Options,
    workers: &[WorkerInfo; 2],
    records: &[Record],
    samples: Vec<Sample>,
) -> Run {
    let from = Duration::from_secs(options.warmup);
    let to = from + Duration::from_secs(options.duration);
    let measured: Vec<Record> = records
        .iter()
        .filter(|r| r.scheduled >= from && r.scheduled < to)
        .copied()
        .collect();
    let index = |answer: Answer| match answer {
        Answer::Worker(pid) => workers.iter().position(|w| w.pid == pid),
        _ => None,
    };
    let mut counts = [0u64; 2];
    for record in &measured {
        if let Some(i) = index(record.answer) {
            counts[i] += 1;
        }
    }
    let answered = counts[0] + counts[1];
    let last = measured
        .iter()
        .map(|r| r.done)
        .max()
        .unwrap_or(to)
        .saturating_sub(from)
        .max(to - from);
    let in_window: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.t >= from && s.t <= to)
        .collect();
    let busy = |i: usize| {
        let values: Vec<f64> = in_window
            .iter()
            .filter_map(|s| s.workers[i].busy())
            .collect();
        (!values.is_empty()).then(|| median(values))
    };
    let weight0 = (policy == Policy::Cswrr).then(|| {
        median(
            in_window
                .iter()
                .filter_map(|s| {
                    let (a, b) = (s.workers[0].weight?, s.workers[1].weight?);
                    (a + b > 0).then(|| a as f64 / (a + b) as f64)
                })
                .collect(),
        )
    });
    let steps = (records
        .iter()
        .filter(|r| r.answer != Answer::NotSent)
        .map(|r| r.sent.as_millis() / STEP.as_millis())
        .max()
        .unwrap_or(0)
        + 1) as usize;
    let mut per_step = vec![[0u64; 2]; steps];
    for record in records {
        if let Some(i) = index(record.answer) {
            per_step[(record.sent.as_millis() / STEP.as_millis()) as usize][i] += 1;
        }
    }
    let with_worker = |r: &&Record| index(r.answer).is_some();
    Run {
        scenario,
        policy,
        round,
        throughput: answered as f64 / last.as_secs_f64(),
        failed: measured.len() - answered as usize,
        p50: percentile_of(&measured, 0.5, with_worker),
        p99: percentile_of(&measured, 0.99, with_worker),
        shares: counts.map(|c| c as f64 / answered.max(1) as f64),
        busy: [busy(0), busy(1)],
        weight0: weight0.filter(|w| !w.is_nan()),
        late: measured
            .iter()
            .filter(|r| r.sent.saturating_sub(r.scheduled) > Duration::from_millis(1))
            .count(),
        others: 0.0,
        steps: per_step,
        samples,
    }
}

/// The `q` quantile of the latencies of `records`, counting those that fail `ok` as slower than any
/// answer (`None` when the quantile falls on one).
fn percentile_of(records: &[Record], q: f64, ok: impl Fn(&&Record) -> bool) -> Option<Duration> {
    let mut latencies: Vec<Option<Duration>> = records
        .iter()
        .map(|r| ok(&r).then(|| r.latency()))
        .collect();
    if latencies.is_empty() {
        return None;
    }
    // `None` sorts first: put failures last.
    latencies.sort_by_key(|l| l.map_or((1, Duration::ZERO), |d| (0, d)));
    let rank = ((q * latencies.len() as f64).ceil() as usize).clamp(1, latencies.len());
    latencies[rank - 1]
}

/// [`percentile_of`] with any worker's answer as success.
fn percentile(records: &[Record], q: f64) -> Option<Duration> {
    percentile_of(records, q, |r| matches!(r.answer, Answer::Worker(_)))
}

fn latency(value: Option<Duration>) -> String {
    value.map_or_else(|| "failed".into(), format_duration)
}

fn describe(run: &Run, options: &Options) -> String {
    format!(
        "{} round {}/{} {:>13}: {:.1} req/s, {} failed, p50 {}, p99 {}, worker 0 {:.1}%, busy {} / {}{}, {} sent late, others {:.2} cores",
        run.scenario.key(),
        run.round + 1,
        options.rounds,
        run.policy.label(),
        run.throughput,
        run.failed,
        latency(run.p50),
        latency(run.p99),
        run.shares[0] * 100.0,
        cores(run.busy[0]),
        cores(run.busy[1]),
        run.weight0
            .map(|w| format!(", weight share {:.1}%", w * 100.0))
            .unwrap_or_default(),
        run.late,
        run.others,
    )
}

fn cores(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.2}"))
}

/// The median over rounds of a latency; a failure counts as slower than any answer.
fn median_latency(values: impl Iterator<Item = Option<Duration>>) -> Option<Duration> {
    let mut values: Vec<Option<Duration>> = values.collect();
    values.sort_by_key(|l| l.map_or((1, Duration::ZERO), |d| (0, d)));
    // The upper middle of an even count, so that a failed round is never averaged away.
    values.get(values.len() / 2).copied().flatten()
}

/// One row per policy: medians over rounds (p99 also its range), failures summed.
fn table(runs: &[&Run]) -> String {
    let mut rows = vec![
        [
            "policy",
            "requests/s",
            "failed",
            "p50",
            "p99",
            "p99 of each round",
            "worker 0 share",
            "busy: worker 0 / 1",
            "worker 0 weight",
        ]
        .map(str::to_owned),
    ];
    for policy in Policy::ALL {
        let runs: Vec<&&Run> = runs.iter().filter(|r| r.policy == policy).collect();
        if runs.is_empty() {
            continue;
        }
        let med = |f: &dyn Fn(&Run) -> Option<f64>| {
            let values: Vec<f64> = runs.iter().filter_map(|r| f(r)).collect();
            (!values.is_empty()).then(|| median(values))
        };
        let mut rounds = runs.clone();
        rounds.sort_by_key(|r| r.round);
        rows.push([
            policy.label().to_owned(),
            format!("{:.1}", med(&|r| Some(r.throughput)).unwrap_or(0.0)),
            runs.iter().map(|r| r.failed).sum::<usize>().to_string(),
            latency(median_latency(runs.iter().map(|r| r.p50))),
            latency(median_latency(runs.iter().map(|r| r.p99))),
            rounds
                .iter()
                .map(|r| latency(r.p99))
                .collect::<Vec<_>>()
                .join(", "),
            format!("{:.1}%", med(&|r| Some(r.shares[0])).unwrap_or(0.0) * 100.0),
            format!(
                "{} / {}",
                cores(med(&|r| r.busy[0])),
                cores(med(&|r| r.busy[1]))
            ),
            med(&|r| r.weight0).map_or_else(|| "-".into(), |w| format!("{:.1}%", w * 100.0)),
        ]);
    }
    markdown(&rows, 1)
}

/// The goals, checked against the medians.
fn goals(scenario: Scenario, runs: &[&Run], rate: f64) -> String {
    let of =
        |policy: Policy| -> Vec<&&Run> { runs.iter().filter(|r| r.policy == policy).collect() };
    let (rr, cswrr) = (of(Policy::RoundRobin), of(Policy::Cswrr));
    if rr.is_empty() || cswrr.is_empty() {
        return String::new();
    }
    let met = |ok: bool| if ok { "met" } else { "not met" };
    let mut text = String::new();
    let (rr_p99, cswrr_p99) = (
        median_latency(rr.iter().map(|r| r.p99)),
        median_latency(cswrr.iter().map(|r| r.p99)),
    );
    match (cswrr_p99, rr_p99) {
        (Some(c), Some(r)) => {
            let ratio = c.as_secs_f64() / r.as_secs_f64();
            let _ = writeln!(
                text,
                "- CSWRR p99 / ROUND_ROBIN p99: {} / {} = {ratio:.3} (goal <= 0.5): {}",
                format_duration(c),
                format_duration(r),
                met(ratio <= 0.5)
            );
        }
        (Some(c), None) => {
            let _ = writeln!(
                text,
                "- CSWRR p99 {} against a ROUND_ROBIN p99 that failed (over {TIMEOUT:?}): met",
                format_duration(c)
            );
        }
        (None, _) => {
            let _ = writeln!(text, "- CSWRR p99 failed: not met");
        }
    }
    let throughput = |runs: &[&&Run]| median(runs.iter().map(|r| r.throughput).collect());
    let (rr_t, cswrr_t) = (throughput(&rr), throughput(&cswrr));
    let ratio = cswrr_t / rr_t;
    let _ = writeln!(
        text,
        "- CSWRR throughput / ROUND_ROBIN: {cswrr_t:.1} / {rr_t:.1} = {ratio:.3} (goal: not lower): {}",
        if ratio >= 1.0 {
            "met"
        } else if ratio >= 0.99 && cswrr_t >= 0.99 * rate {
            "met within 1% (both at the offered rate)"
        } else {
            "not met"
        }
    );
    let share = median(cswrr.iter().map(|r| r.shares[0]).collect());
    let _ = writeln!(
        text,
        "- {} 's share under CSWRR: {:.1}% (goal <= 35%): {}",
        scenario.worker0(),
        share * 100.0,
        met(share <= 0.35)
    );
    text.replace(" 's", "'s")
}

// === the series and the plot ===

fn write_csvs(runs: &[Run], requests: &Path, samples: &Path) -> anyhow::Result<()> {
    let mut r = String::from("scenario,policy,round,t_s,worker0,worker1\n");
    let mut s = String::from(
        "scenario,policy,round,t_s,cpu0,wait0,reported0,weight0,kcpu0,kwait0,cpu1,wait1,reported1,weight1,kcpu1,kwait1\n",
    );
    let opt = |v: Option<f64>| v.map(|v| format!("{v:.4}")).unwrap_or_default();
    for run in runs {
        let key = format!(
            "{},{},{}",
            run.scenario.key(),
            run.policy.service(),
            run.round + 1
        );
        for (i, step) in run.steps.iter().enumerate() {
            let t = (STEP * i as u32).as_secs_f64();
            writeln!(r, "{key},{t:.3},{},{}", step[0], step[1])?;
        }
        for sample in &run.samples {
            write!(s, "{key},{:.3}", sample.t.as_secs_f64())?;
            for w in &sample.workers {
                write!(
                    s,
                    ",{},{},{},{},{},{}",
                    opt(w.cpu),
                    opt(w.wait),
                    opt(w.reported),
                    w.weight.map(|v| v.to_string()).unwrap_or_default(),
                    opt(w.kernel_cpu),
                    opt(w.kernel_wait),
                )?;
            }
            s.push('\n');
        }
    }
    std::fs::write(requests, r).with_context(|| format!("writing {}", requests.display()))?;
    std::fs::write(samples, s).with_context(|| format!("writing {}", samples.display()))?;
    Ok(())
}

/// Draws the first round of each scenario into `out/balance.png` with matplotlib.
fn plot(out: &Path, requests: &Path, samples: &Path, options: &Options) -> anyhow::Result<PathBuf> {
    let venv = out.join("venv");
    let python = venv.join("bin/python");
    let importable = Command::new(&python)
        .args(["-c", "import matplotlib"])
        .output()
        .is_ok_and(|o| o.status.success());
    let python = if importable {
        python
    } else {
        eprintln!("installing {MATPLOTLIB} into {}", venv.display());
        pip_install(&venv, &[MATPLOTLIB])?
    };
    let script = out.join("balance-plot.py");
    std::fs::write(&script, PLOT_SCRIPT)
        .with_context(|| format!("writing {}", script.display()))?;
    let png = out.join("balance.png");
    run_checked(
        Command::new(python)
            .arg(&script)
            .arg(requests)
            .arg(samples)
            .arg(&png)
            .args([options.warmup, options.duration].map(|s| s.to_string())),
    )?;
    Ok(png)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_owned).collect()
    }

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
        assert!(parse_args(&args("--load 1.5")).is_err());
        assert!(parse_args(&args("--cpu-ms 0")).is_err());
        assert!(parse_args(&args("--rounds")).is_err());
        assert!(parse_args(&args("--fast")).is_err());
    }

    fn record(scheduled_ms: u64, latency_ms: u64, answer: Answer) -> Record {
        let scheduled = Duration::from_millis(scheduled_ms);
        Record {
            scheduled,
            sent: scheduled,
            done: scheduled + Duration::from_millis(latency_ms),
            answer,
        }
    }

    #[test]
    fn reads_own_ticks_with_children() {
        let stat = "4242 (a) b) S 1 4242 4242 0 -1 4194560 300 0 0 0 1234 567 8 9 20 0 1 0 99";
        assert_eq!(stat_ticks_with_children(stat), Some(1234 + 567 + 8 + 9));
        assert_eq!(stat_ticks_with_children("4242 (x) S 1"), None);
        assert!(own_ticks(&[std::process::id()]) < u64::MAX);
    }

    #[test]
    fn percentiles_count_failures_as_slowest() {
        let mut records: Vec<Record> = (1..=98)
            .map(|ms| record(0, ms, Answer::Worker(1)))
            .collect();
        records.push(record(0, 1, Answer::Error));
        records.push(record(0, 1, Answer::Status(503)));
        assert_eq!(percentile(&records, 0.5), Some(Duration::from_millis(50)));
        assert_eq!(percentile(&records, 0.98), Some(Duration::from_millis(98)));
        assert_eq!(percentile(&records, 0.99), None);
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn summarizes_only_the_measured_window() {
        let options = parse_args(&args("--warmup 1 --duration 2")).unwrap();
        let worker = |pid| WorkerInfo {
            pid,
            hostname: format!("orca-0-{pid}"),
            addr: "127.0.0.1:1".parse().unwrap(),
        };
        let workers = [worker(10), worker(11)];
        let records = vec![
            // Warm-up: not counted in the figures, but in the steps.
            record(500, 900, Answer::Worker(10)),
            record(1000, 5, Answer::Worker(10)),
            record(1500, 5, Answer::Worker(11)),
            record(2000, 5, Answer::Worker(11)),
            record(2500, 5, Answer::Error),
            // After the window.
            record(3000, 5, Answer::Worker(10)),
        ];
        let samples = vec![Sample {
            t: Duration::from_millis(1500),
            workers: [
                WorkerSample {
                    cpu: Some(0.5),
                    wait: Some(0.25),
                    reported: Some(0.75),
                    weight: Some(100),
                    ..WorkerSample::default()
                },
                WorkerSample {
                    cpu: Some(0.5),
                    wait: None,
                    reported: Some(0.5),
                    weight: Some(300),
                    ..WorkerSample::default()
                },
            ],
        }];
        let run = summarize(
            Scenario::Hog,
            Policy::Cswrr,
            0,
            &options,
            &workers,
            &records,
            samples,
        );
        assert_eq!(run.failed, 1);
        assert_eq!(run.shares, [1.0 / 3.0, 2.0 / 3.0]);
        assert!((run.throughput - 1.5).abs() < 1e-9, "{}", run.throughput);
        assert_eq!(run.p50, Some(Duration::from_millis(5)));
        assert_eq!(run.p99, None);
        assert_eq!(run.busy, [Some(0.75), Some(0.5)]);
        assert_eq!(run.weight0, Some(0.25));
        // Steps of 500 ms by send time: 0.5, 1.0, 1.5, 2.0 and 3.0 s (the error has no worker).
        assert_eq!(
            run.steps,
            vec![[0, 0], [1, 0], [1, 0], [0, 1], [0, 1], [0, 0], [1, 0]]
        );
    }
}
