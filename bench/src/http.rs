//! `cargo xtask bench http`: the worker's HTTP server against a hyper baseline, side by side.
//!
//! Both servers run at the same time on the same core (CPU 0, through `taskset -c 0`), each one thread:
//! the real `peregrine run` (release) with one hello worker on a fixed loopback port, and
//! `bench/src/bin/hyper-baseline.rs` (hyper 1.x on a tokio current-thread runtime, the same response
//! bytes). The supervisor is pinned to CPU 1 with the load generator: it is idle during the runs, and
//! this keeps it off the servers' core. Only one server is loaded at a time; the idle one waits in
//! `epoll_wait`/`io_uring_enter` and costs nothing.
//!
//! Each round runs every load against each server, alternating which server goes first, and the table
//! shows the median over the rounds. The server's CPU time per request is the process's `utime + stime`
//! (from `/proc/PID/stat`, all threads) over the run divided by the requests completed: unlike requests
//! per second, it does not depend on whether the load generator, which has one core to itself, is the
//! bottleneck.
//!
//! The machine may be shared: every run also measures how much of the servers' core other processes
//! took (`/proc/stat` for CPU 0 minus the server's own time), runs again (twice at most) when that is
//! over 10%, keeps the quietest run, and the report says how noisy the runs were.

use std::{
    fmt::Write as _,
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use anyhow::{Context, bail, ensure};
use peregrine_contract::procfs;
use peregrine_e2e::{TempDir, http_get};

use super::{
    Flags, behind_envoy, idle, kernel_ops,
    machine::{cpu_line, cpus_allowed, machine_lines},
    parse,
    server::{LOAD_CPU, Running, SERVER_CPU, preflight},
    table::{format_duration, markdown, median, median_and_range},
};

/// Extra time a load generator gets beyond `--duration` before `timeout` kills it.
const LOAD_GRACE: Duration = Duration::from_secs(10);

/// The share of the servers' core used by other processes above which a run is called noisy.
const NOISY: f64 = 0.1;
/// How many times a noisy run is repeated (the quietest is kept).
const NOISY_RETRIES: usize = 2;

const USAGE: &str = "cargo xtask bench http [--duration SECS] [--rounds N] [--ops] [--idle N] [--behind-envoy] [--orca-in-band]";

/// A server under test, in table order: the worker, then hyper.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    Worker,
    /// The worker again, its service `orca = "in-band"`: each connection carries each of its load reports once
    /// (`--orca-in-band`).
    WorkerInBand,
    Hyper,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Server::Worker => "worker",
            Server::WorkerInBand => "worker+orca",
            Server::Hyper => "hyper",
        }
    }
}

/// The loads, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Load {
    /// `wrk -t1 -c50 --latency`: HTTP/1.1 keep-alive, one request in flight per connection.
    Wrk,
    /// `h2load --h1 -c10 -m16`: HTTP/1.1, 16 requests pipelined per connection.
    Pipelined,
    /// `h2load -c10 -m10`: HTTP/2 with prior knowledge (h2c), 10 streams per connection.
    H2c,
}

impl Load {
    const ALL: [Load; 3] = [Load::Wrk, Load::Pipelined, Load::H2c];

    fn name(self) -> &'static str {
        match self {
            Load::Wrk => "HTTP/1.1 keep-alive: `wrk -t1 -c50`",
            Load::Pipelined => "HTTP/1.1 pipelined: `h2load --h1 -c10 -m16`",
            Load::H2c => "h2c: `h2load -c10 -m10`",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Load::Wrk => "wrk c50",
            Load::Pipelined => "h1 pipelined",
            Load::H2c => "h2c",
        }
    }

    /// The load generator's command line (without the pinning and time bound).
    fn command(self, port: u16, duration: u64) -> Vec<String> {
        let url = format!("http://127.0.0.1:{port}/");
        let duration = duration.to_string();
        let args: &[&str] = match self {
            Load::Wrk => &["wrk", "-t1", "-c50", "-d", &duration, "--latency", &url],
            Load::Pipelined => &["h2load", "--h1", "-c10", "-m16", "-D", &duration, &url],
            Load::H2c => &["h2load", "-c10", "-m10", "-D", &duration, &url],
        };
        args.iter().map(|arg| arg.to_string()).collect()
    }

    /// The latency figures this load's tool reports, by label.
    fn latency_labels(self) -> &'static [&'static str] {
        match self {
            Load::Wrk => &["latency p50", "latency p99"],
            Load::Pipelined | Load::H2c => &["latency mean"],
        }
    }
}

/// One run of one load against one server.
#[derive(Clone, Debug)]
pub(super) struct Sample {
    /// Requests completed.
    pub(super) requests: u64,
    pub(super) requests_per_sec: f64,
    /// In the order of [`Load::latency_labels`].
    latencies: Vec<Duration>,
    /// Server CPU time (user + system) per completed request.
    pub(super) cpu_per_request: Duration,
    /// The server's CPU time over the run's wall time: 1.0 is its core saturated.
    pub(super) server_busy: f64,
    /// The busy fraction of the load generator's core over the run (all processes on it).
    load_core_busy: f64,
    /// The busy fraction of the servers' core that the server did not use: other processes, noise.
    pub(super) others_on_server_core: f64,
}

/// What a run of a load found.
#[derive(Debug)]
pub(super) enum Outcome {
    Measured(Sample),
    /// The server answered no request over h2c: it does not speak HTTP/2.
    NoH2,
}

/// Options of `cargo xtask bench http`.
#[derive(Debug, PartialEq, Eq)]
struct Options {
    duration: u64,
    rounds: usize,
    /// Also count each server's system calls and io_uring submissions per request, in runs of
    /// their own.
    ops: bool,
    /// Instead of the loads: the memory of this many idle connections, per server.
    idle: Option<usize>,
    /// Instead of the loads: each server behind an Envoy of its own, over HTTP/2.
    behind_envoy: bool,
    /// Also measure the worker with its in-band ORCA load reports (each once per connection).
    orca_in_band: bool,
}

fn parse_args(args: &[String]) -> anyhow::Result<Options> {
    let mut options = Options {
        duration: 5,
        rounds: 3,
        ops: false,
        idle: None,
        behind_envoy: false,
        orca_in_band: false,
    };
    let mut args = Flags::new(args, USAGE);
    while let Some(flag) = args.next() {
        match flag {
            "--duration" => {
                options.duration = args
                    .value(flag)?
                    .parse()
                    .context("--duration SECS: a whole number of seconds")?;
            }
            "--rounds" => {
                options.rounds = args
                    .value(flag)?
                    .parse()
                    .context("--rounds N: a whole number")?;
            }
            "--ops" => options.ops = true,
            "--behind-envoy" => options.behind_envoy = true,
            "--orca-in-band" => options.orca_in_band = true,
            "--idle" => {
                let n: usize = args
                    .value(flag)?
                    .parse()
                    .context("--idle N: a whole number of connections")?;
                ensure!(n >= 1, "--idle must be at least 1 connection");
                options.idle = Some(n);
            }
            other => return Err(args.unknown(other)),
        }
    }
    ensure!(
        options.duration >= 1,
        "--duration must be at least 1 second"
    );
    ensure!(options.rounds >= 1, "--rounds must be at least 1");
    Ok(options)
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let options = parse_args(args)?;
    preflight()?;
    let peregrine =
        super::release_peregrine_and(&["-p", "peregrine-bench", "--bin", "hyper-baseline"])?;
    let dir = TempDir::new().context("a temporary directory")?;
    let servers: Vec<Server> = [Server::Worker]
        .into_iter()
        .chain(options.orca_in_band.then_some(Server::WorkerInBand))
        .chain([Server::Hyper])
        .collect();
    let start = |server: Server| match server {
        Server::Worker => Running::worker(&peregrine, dir.path()),
        Server::WorkerInBand => Running::worker_in_band(&peregrine, &dir.path().join("in-band")),
        Server::Hyper => Running::binary(
            "hyper-baseline",
            &peregrine.with_file_name("hyper-baseline"),
            dir.path(),
        ),
    };
    if let Some(n) = options.idle {
        let report = idle_report(&servers, start, n, options.rounds)?;
        println!("Command: `{}`\n{report}", super::command_line("http", args));
        return Ok(ExitCode::SUCCESS);
    }
    let running = servers
        .iter()
        .map(|&server| Ok((server, start(server)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let targets: Vec<(Server, u32, u16)> = running
        .iter()
        .map(|(server, r)| (*server, r.pid, r.port))
        .collect();
    for &(server, pid, port) in &targets {
        let (status, body) = http_get(([127, 0, 0, 1], port), "/")?;
        let affinity = cpus_allowed(pid)?;
        ensure!(
            affinity == SERVER_CPU,
            "{} (pid {pid}) may run on CPUs {affinity}, expected {SERVER_CPU}",
            server.name()
        );
        eprintln!(
            "{}: pid {pid}, 127.0.0.1:{port}, CPU {affinity}, answers {status} {body:?}",
            server.name()
        );
    }

    if options.behind_envoy {
        // The worker again on a Unix socket, after the worker on TCP.
        let unix = behind_envoy::UnixWorker::start(&peregrine)?;
        let mut behind: Vec<behind_envoy::Target> = targets
            .iter()
            .map(|&(server, pid, port)| behind_envoy::Target {
                name: server.name().to_owned(),
                pid,
                upstream: behind_envoy::Upstream::Tcp(port),
            })
            .collect();
        behind.insert(
            1,
            behind_envoy::Target {
                name: "worker (unix)".to_owned(),
                pid: unix.pid,
                upstream: behind_envoy::Upstream::Unix(unix.path.clone()),
            },
        );
        let report = behind_envoy::report(
            &behind,
            Server::Hyper.name(),
            options.duration,
            options.rounds,
        )?;
        drop((running, unix));
        println!("Command: `{}`\n{report}", super::command_line("http", args));
        return Ok(ExitCode::SUCCESS);
    }

    // results[load][server]: one outcome per round.
    let mut results: Vec<Vec<Vec<Outcome>>> = Load::ALL
        .iter()
        .map(|_| servers.iter().map(|_| Vec::new()).collect())
        .collect();
    let started = Instant::now();
    for round in 0..options.rounds {
        for (l, load) in Load::ALL.into_iter().enumerate() {
            // Each round starts from another server, so none is always first (or last).
            let mut order = targets.clone();
            order.rotate_left(round % targets.len());
            for (server, pid, port) in order {
                let s = servers.iter().position(|&x| x == server).expect("a server");
                let runs = &mut results[l][s];
                if matches!(runs.first(), Some(Outcome::NoH2)) {
                    continue;
                }
                let outcome = run_quietest(load, pid, port, options.duration)
                    .with_context(|| format!("{} against {}", load.short(), server.name()))?;
                eprintln!(
                    "round {}/{} {:>12} {:>6}: {}",
                    round + 1,
                    options.rounds,
                    load.short(),
                    server.name(),
                    describe(load, &outcome)
                );
                if matches!(outcome, Outcome::NoH2) && server == Server::Hyper {
                    bail!("the hyper baseline answered no h2c request");
                }
                runs.push(outcome);
            }
        }
    }
    // ops[load][server]: (system calls, io_uring submissions) per request, from one counted run.
    let mut ops: Vec<Vec<Option<(f64, f64)>>> = Vec::new();
    if options.ops {
        for load in Load::ALL {
            let mut row = Vec::new();
            for &(server, pid, port) in &targets {
                let counting = kernel_ops::Counting::start(pid)?;
                let outcome = run_load(load, pid, port, options.duration);
                let counted = counting.stop()?;
                let per_request = match outcome? {
                    Outcome::Measured(sample) => {
                        let n = sample.requests as f64;
                        Some((counted.syscalls as f64 / n, counted.submissions as f64 / n))
                    }
                    Outcome::NoH2 => None,
                };
                eprintln!(
                    "counted {:>12} {:>6}: {per_request:.2?} (system calls, io_uring submissions) per request",
                    load.short(),
                    server.name()
                );
                row.push(per_request);
            }
            ops.push(row);
        }
    }
    let elapsed = started.elapsed();
    drop(running);

    let mut report = String::new();
    let command = super::command_line("http", args);
    writeln!(
        report,
        "Command: `{command}` ({} rounds of {} s per load and server, {elapsed:.0?} in all)",
        options.rounds, options.duration
    )?;
    machine_lines(&mut report, &cpu_line()?)?;
    writeln!(
        report,
        "Tools: {}, {}",
        tool_version("wrk", "-v"),
        tool_version("h2load", "--version")
    )?;
    let others: Vec<f64> = results
        .iter()
        .flatten()
        .flatten()
        .filter_map(|outcome| match outcome {
            Outcome::Measured(sample) => Some(sample.others_on_server_core),
            Outcome::NoH2 => None,
        })
        .collect();
    if !others.is_empty() {
        let noisy = others.iter().filter(|&&o| o > NOISY).count();
        writeln!(
            report,
            "Other load on CPU {SERVER_CPU}: median {:.0}%, max {:.0}% of its time; {noisy} of {} runs above {:.0}%",
            median(others.clone()) * 100.0,
            others.iter().copied().fold(0.0, f64::max) * 100.0,
            others.len(),
            NOISY * 100.0,
        )?;
    }
    writeln!(report)?;
    report.push_str(&table(&servers, &results));
    if options.ops {
        writeln!(
            report,
            "\nKernel entries per request (one run of each load and server under `perf stat`, apart from the runs above):\n"
        )?;
        report.push_str(&ops_table(&servers, &ops));
    }
    println!("{report}");
    Ok(ExitCode::SUCCESS)
}

/// Runs `load` like [`run_load`], again (up to [`NOISY_RETRIES`] times) while other processes used the
/// servers' core, and keeps the quietest run.
pub(super) fn run_quietest(
    load: Load,
    pid: u32,
    port: u16,
    duration: u64,
) -> anyhow::Result<Outcome> {
    let mut best = run_load(load, pid, port, duration)?;
    for _ in 0..NOISY_RETRIES {
        let Outcome::Measured(sample) = &best else {
            break;
        };
        if sample.others_on_server_core <= NOISY {
            break;
        }
        eprintln!(
            "other processes used {:.0}% of CPU {SERVER_CPU}: running again",
            sample.others_on_server_core * 100.0
        );
        let again = run_load(load, pid, port, duration)?;
        if let Outcome::Measured(next) = &again
            && next.others_on_server_core < sample.others_on_server_core
        {
            best = again;
        }
    }
    Ok(best)
}

/// Runs `load` against the server `pid` on `port` for `duration` seconds, pinned to [`LOAD_CPU`].
fn run_load(load: Load, pid: u32, port: u16, duration: u64) -> anyhow::Result<Outcome> {
    let args = load.command(port, duration);
    let limit = Duration::from_secs(duration) + LOAD_GRACE;
    let before = procfs::stat(pid)?.cpu_ticks();
    let cores_before = procfs::cpu_stat()?;
    let wall = Instant::now();
    let output = Command::new("timeout")
        .args(["--kill-after=2", &limit.as_secs().to_string()])
        .args(["taskset", "-c", LOAD_CPU])
        .args(&args)
        .output()
        .with_context(|| format!("running {}", args.join(" ")))?;
    let after = procfs::stat(pid)?.cpu_ticks();
    let cores_after = procfs::cpu_stat()?;
    let wall = wall.elapsed();
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "`{}` failed ({}):\n{stdout}{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let (requests, requests_per_sec, latencies) = match load {
        Load::Wrk => {
            let report = parse::wrk(&stdout)?;
            if report.errors > 0 {
                eprintln!("warning: wrk reports {} errors:\n{stdout}", report.errors);
            }
            (
                report.requests,
                report.requests_per_sec,
                vec![report.p50, report.p99],
            )
        }
        Load::Pipelined | Load::H2c => {
            let report = parse::h2load(&stdout)?;
            if report.succeeded == 0 {
                return Ok(Outcome::NoH2);
            }
            if report.failed > 0 || report.succeeded < report.done {
                eprintln!(
                    "warning: h2load reports {} failed and {} non-2xx/3xx:\n{stdout}",
                    report.failed,
                    report.done - report.succeeded
                );
            }
            (
                report.done,
                report.requests_per_sec,
                vec![report.mean_latency],
            )
        }
    };
    ensure!(requests > 0, "no request completed:\n{stdout}");
    let cpu =
        Duration::from_secs_f64((after - before) as f64 / procfs::clock_ticks_per_second() as f64);
    let busy = |cpu: &str| -> anyhow::Result<f64> {
        let find = |cores: &procfs::CpuStat| {
            cores
                .cpus
                .iter()
                .find(|(n, _)| n.to_string() == cpu)
                .map(|(_, ticks)| *ticks)
                .with_context(|| format!("no cpu{cpu} line in /proc/stat"))
        };
        Ok(find(&cores_after)?.busy_since(find(&cores_before)?))
    };
    let server_busy = cpu.as_secs_f64() / wall.as_secs_f64();
    let others = busy(SERVER_CPU)? - server_busy;
    Ok(Outcome::Measured(Sample {
        requests,
        requests_per_sec,
        latencies,
        cpu_per_request: cpu.div_f64(requests as f64),
        server_busy,
        load_core_busy: busy(LOAD_CPU)?,
        others_on_server_core: others.max(0.0),
    }))
}

fn describe(load: Load, outcome: &Outcome) -> String {
    match outcome {
        Outcome::NoH2 => "no request answered: no h2 support".into(),
        Outcome::Measured(sample) => {
            let mut text = format!("{:.0} req/s", sample.requests_per_sec);
            for (label, latency) in load.latency_labels().iter().zip(&sample.latencies) {
                write!(text, ", {label} {}", format_duration(*latency)).expect("a String");
            }
            write!(
                text,
                ", {} CPU/req",
                format_duration(sample.cpu_per_request)
            )
            .expect("a String");
            write!(
                text,
                ", server {:.0}% busy, load core {:.0}% busy, others {:.0}% of CPU {SERVER_CPU}",
                sample.server_busy * 100.0,
                sample.load_core_busy * 100.0,
                sample.others_on_server_core * 100.0
            )
            .expect("a String");
            text
        }
    }
}

// === the table ===

/// The markdown table of medians: one row per load and metric, a column per server (the worker and
/// hyper first), then each other server's ratio to hyper.
fn table(servers: &[Server], results: &[Vec<Vec<Outcome>>]) -> String {
    let hyper = servers
        .iter()
        .position(|&s| s == Server::Hyper)
        .expect("hyper is always measured");
    let others: Vec<usize> = (0..servers.len()).filter(|&s| s != hyper).collect();
    let mut header = vec!["load".to_owned(), "metric".to_owned()];
    header.extend(servers.iter().map(|s| s.name().to_owned()));
    header.extend(
        others
            .iter()
            .map(|&s| format!("{}/hyper", servers[s].name())),
    );
    let mut rows = vec![header];
    for (load, runs) in Load::ALL.into_iter().zip(results) {
        let samples: Vec<Option<Vec<&Sample>>> = runs
            .iter()
            .map(|runs| {
                let samples: Vec<&Sample> = runs
                    .iter()
                    .filter_map(|outcome| match outcome {
                        Outcome::Measured(sample) => Some(sample),
                        Outcome::NoH2 => None,
                    })
                    .collect();
                (!samples.is_empty()).then_some(samples)
            })
            .collect();
        type Metric = (String, Box<dyn Fn(&Sample) -> f64>, fn(f64) -> String);
        let mut metrics: Vec<Metric> = vec![(
            "requests/s".into(),
            Box::new(|s: &Sample| s.requests_per_sec),
            |v| format!("{v:.0}"),
        )];
        for (i, label) in load.latency_labels().iter().enumerate() {
            metrics.push((
                (*label).into(),
                Box::new(move |s: &Sample| s.latencies[i].as_secs_f64()),
                |v| format_duration(Duration::from_secs_f64(v)),
            ));
        }
        metrics.push((
            "server CPU/request".into(),
            Box::new(|s: &Sample| s.cpu_per_request.as_secs_f64()),
            |v| format_duration(Duration::from_secs_f64(v)),
        ));
        metrics.push((
            "server core busy".into(),
            Box::new(|s: &Sample| s.server_busy),
            |v| format!("{:.0}%", v * 100.0),
        ));
        metrics.push((
            "load core busy".into(),
            Box::new(|s: &Sample| s.load_core_busy),
            |v| format!("{:.0}%", v * 100.0),
        ));
        for (m, (label, get, format)) in metrics.iter().enumerate() {
            let medians: Vec<Option<f64>> = samples
                .iter()
                .map(|samples| {
                    samples
                        .as_ref()
                        .map(|s| median(s.iter().map(|s| get(s)).collect()))
                })
                .collect();
            let cell = |server: usize| match medians[server] {
                Some(value) => format(value),
                None if load == Load::H2c => "n/a (no h2 yet)".into(),
                None => "n/a".into(),
            };
            let ratio = |server: usize| match (medians[server], medians[hyper]) {
                (Some(value), Some(hyper)) if hyper > 0.0 => format!("{:.2}", value / hyper),
                _ => "n/a".into(),
            };
            let load_cell = if m == 0 {
                load.name().to_owned()
            } else {
                String::new()
            };
            let mut row = vec![load_cell, label.clone()];
            row.extend((0..servers.len()).map(cell));
            row.extend(others.iter().map(|&s| ratio(s)));
            rows.push(row);
        }
    }
    markdown(&rows, 2)
}

/// The idle-connection memory of every server: per kind, each server's growth per connection (median
/// and range over `rounds`) and its ratio to hyper's median. Every measurement starts a fresh server
/// (`start`): memory freed by earlier connections stays with a process's allocator and would hide the
/// next connections' cost.
fn idle_report(
    servers: &[Server],
    start: impl Fn(Server) -> anyhow::Result<Running>,
    n: usize,
    rounds: usize,
) -> anyhow::Result<String> {
    let hyper = servers
        .iter()
        .position(|&s| s == Server::Hyper)
        .expect("hyper is always measured");
    let mut report = String::new();
    machine_lines(&mut report, &cpu_line()?)?;
    writeln!(
        report,
        "Resident memory growth per idle connection, {n} connections, median (range) of {rounds} rounds:\n"
    )?;
    let mut header = vec!["idle connection".to_owned()];
    header.extend(servers.iter().map(|s| s.name().to_owned()));
    header.extend(
        servers
            .iter()
            .filter(|&&s| s != Server::Hyper)
            .map(|s| format!("{}/hyper", s.name())),
    );
    let mut rows = vec![header];
    for kind in idle::Idle::ALL {
        let mut medians = Vec::new();
        let mut cells = vec![kind.name().to_owned()];
        for &server in servers {
            let mut growth = Vec::new();
            for round in 0..rounds {
                let running = start(server)?;
                let bytes = idle::growth_per_connection(kind, running.pid, running.port, n)
                    .with_context(|| format!("{} idle connections to {}", n, server.name()))?;
                eprintln!(
                    "round {}/{rounds} {:?} {:>12}: {bytes:.0} bytes per idle connection",
                    round + 1,
                    kind,
                    server.name()
                );
                growth.push(bytes);
            }
            medians.push(median(growth.clone()));
            cells.push(median_and_range(growth, kib));
        }
        for (s, median) in medians.iter().enumerate() {
            if s != hyper {
                cells.push(format!("{:.2}", median / medians[hyper]));
            }
        }
        rows.push(cells);
    }
    report.push_str(&markdown(&rows, 1));
    Ok(report)
}

/// Bytes as KiB with one decimal.
fn kib(bytes: f64) -> String {
    format!("{:.1} KiB", bytes / 1024.0)
}

/// The table of system calls and io_uring submissions per request: a row per load, a column pair per
/// server.
fn ops_table(servers: &[Server], ops: &[Vec<Option<(f64, f64)>>]) -> String {
    let mut header = vec!["load".to_owned()];
    for server in servers {
        header.push(format!("{} syscalls", server.name()));
        header.push(format!("{} SQEs", server.name()));
    }
    let mut rows = vec![header];
    for (load, row) in Load::ALL.into_iter().zip(ops) {
        let mut cells = vec![load.name().to_owned()];
        for counted in row {
            match counted {
                Some((syscalls, submissions)) => {
                    cells.push(format!("{syscalls:.3}"));
                    cells.push(format!("{submissions:.3}"));
                }
                None => cells.extend(["n/a".to_owned(), "n/a".to_owned()]),
            }
        }
        rows.push(cells);
    }
    markdown(&rows, 1)
}

/// The first line a tool prints about its version (`wrk -v` prints it and then its usage).
fn tool_version(program: &str, flag: &str) -> String {
    Command::new(program)
        .arg(flag)
        .output()
        .ok()
        .and_then(|output| {
            let text = [output.stdout, output.stderr].concat();
            let text = String::from_utf8_lossy(&text);
            let line = text.lines().next()?.trim().to_owned();
            (!line.is_empty()).then_some(line)
        })
        .unwrap_or_else(|| format!("{program} (version unknown)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args;

    #[test]
    fn parses_the_options() {
        assert_eq!(
            parse_args(&[]).unwrap(),
            Options {
                duration: 5,
                rounds: 3,
                ops: false,
                idle: None,
                behind_envoy: false,
                orca_in_band: false,
            }
        );
        assert_eq!(
            parse_args(&args("--rounds 1 --duration 2 --ops --orca-in-band")).unwrap(),
            Options {
                duration: 2,
                rounds: 1,
                ops: true,
                idle: None,
                behind_envoy: false,
                orca_in_band: true,
            }
        );
        assert!(parse_args(&args("--with spike-uring")).is_err());
        assert!(parse_args(&args("--duration")).is_err());
        assert!(parse_args(&args("--duration 0")).is_err());
        assert!(parse_args(&args("--rounds x")).is_err());
        assert!(parse_args(&args("--perf")).is_err());
    }

    #[test]
    fn builds_the_table_with_medians_and_no_h2() {
        let sample = |rps: f64, cpu_us: u64, latencies: usize| {
            Outcome::Measured(Sample {
                requests: 1,
                requests_per_sec: rps,
                latencies: vec![Duration::from_micros(100); latencies],
                cpu_per_request: Duration::from_micros(cpu_us),
                server_busy: 1.0,
                load_core_busy: 0.5,
                others_on_server_core: 0.0,
            })
        };
        let results = vec![
            vec![
                vec![
                    sample(100.0, 2, 2),
                    sample(300.0, 4, 2),
                    sample(200.0, 3, 2),
                ],
                vec![sample(100.0, 6, 2)],
            ],
            vec![vec![sample(50.0, 1, 1)], vec![sample(100.0, 2, 1)]],
            vec![vec![Outcome::NoH2], vec![sample(10.0, 5, 1)]],
        ];
        let table = table(&[Server::Worker, Server::Hyper], &results);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[1].contains("---: |"), "{table}");
        // The cells of every line, trimmed.
        let cells: Vec<Vec<&str>> = lines
            .iter()
            .map(|line| {
                line.split('|')
                    .map(str::trim)
                    .filter(|c| !c.is_empty())
                    .collect()
            })
            .collect();
        assert_eq!(
            cells[0],
            ["load", "metric", "worker", "hyper", "worker/hyper"]
        );
        // wrk: the median of 100, 300 and 200 req/s against 100; 3 µs against 6 µs of CPU per request.
        assert_eq!(
            cells[2][1..],
            ["requests/s", "200", "100", "2.00"],
            "{table}"
        );
        assert_eq!(
            cells[5],
            ["server CPU/request", "3.00 µs", "6.00 µs", "0.50"],
            "{table}"
        );
        // h2c: the worker's cells say why they are empty, the ratio is n/a.
        assert_eq!(
            cells[13][1..],
            ["requests/s", "n/a (no h2 yet)", "10", "n/a"],
            "{table}"
        );
        assert_eq!(lines.len(), 2 + 6 + 5 + 5, "{table}");
    }

    #[test]
    fn every_other_server_gets_a_column_and_a_ratio_to_hyper() {
        let sample = |cpu_us: u64, latencies: usize| {
            Outcome::Measured(Sample {
                requests: 1,
                requests_per_sec: 1.0,
                latencies: vec![Duration::from_micros(100); latencies],
                cpu_per_request: Duration::from_micros(cpu_us),
                server_busy: 1.0,
                load_core_busy: 0.5,
                others_on_server_core: 0.0,
            })
        };
        let servers = [Server::Worker, Server::WorkerInBand, Server::Hyper];
        let results: Vec<Vec<Vec<Outcome>>> = [2, 1, 1]
            .iter()
            .map(|&latencies| {
                vec![
                    vec![sample(6, latencies)],
                    vec![sample(3, latencies)],
                    vec![sample(4, latencies)],
                ]
            })
            .collect();
        let table = table(&servers, &results);
        let header: Vec<&str> = table
            .lines()
            .next()
            .unwrap()
            .split('|')
            .map(str::trim)
            .collect();
        assert_eq!(
            header[1..header.len() - 1],
            [
                "load",
                "metric",
                "worker",
                "worker+orca",
                "hyper",
                "worker/hyper",
                "worker+orca/hyper"
            ]
        );
        let cpu = table.lines().nth(5).unwrap();
        assert!(
            cpu.contains(" 1.50 |") && cpu.contains(" 0.75 |"),
            "{table}"
        );
    }
}
