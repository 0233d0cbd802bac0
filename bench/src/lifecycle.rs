//! `cargo xtask bench lifecycle`: a rolling restart of 8 workers and a supervisor adopting its workers
//! after a SIGKILL, with the release `peregrine`, the real Envoy and continuous load through it.
//!
//! **Set-up.** One supervisor with a service `cluster` of 8 hello workers (`count = 8`), one Envoy
//! bootstrapped from it, and a load of 2 HTTP/1.1 keep-alive and 2 HTTP/2 (h2c) clients sending `GET /`
//! through Envoy one after another for as long as the stack runs ([`Load`]); every answer is checked.
//!
//! **Rolling restart.** For each `--batches` size (`restart_batch`, 1 and 4 by default) a fresh stack,
//! then `--rounds` times (3): `peregrine restart CONFIG`, timed from its start until it returns (it
//! answers once every worker is replaced: each new worker registered, its predecessor drained, ACKed
//! by Envoy, stopped). Then Envoy must list 8 healthy hosts, none of the old ones, and the old workers
//! must have exited. The requests served and failed count from before the command until it returned.
//!
//! **Adoption.** A fresh stack; `--rounds` times: SIGKILL the supervisor (its workers keep serving),
//! start it again on the same config in the same directory, and measure from the new process's start:
//! (a) until it logs `Adopted workers registered again` (the line's timestamp), and that line's own
//! `took=` (from when it began waiting for the adopted workers, after reading the config, binding,
//! setting up the sampler and finding them), (b) until `peregrine status --json` lists the same 8
//! pids, (c) until Envoy's CDS and EDS streams are connected again (`control_plane.connected_state` 1
//! for both, after a disconnect or a new xDS connection). (b) and (c) are polled together, about every
//! 20 ms plus a `peregrine status` and three admin requests.
//!
//! Any failed request fails the benchmark (after the report), with the failures and the supervisor's
//! logs on stderr. Every wait has a deadline.

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, ExitCode, Output, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, bail, ensure};
use peregrine_e2e::{
    Envoy, Load, LoadReport, PeregrineToml, Supervisor, TempDir, free_port, gone, try_wait_until,
};
use rustix::process::{Pid, Signal, kill_process};
use xtask::envoy;

use super::{
    Flags,
    machine::{cpu_line, machine_lines},
    parse,
    table::{format_duration, markdown, median},
};

const USAGE: &str = "cargo xtask bench lifecycle [--rounds N] [--batches N,N...]";

/// Workers of the service.
const WORKERS: u32 = 8;
/// The service (and Envoy cluster) name of [`PeregrineToml::one_service`].
const SERVICE: &str = peregrine_e2e::CLUSTER;
/// Load clients through Envoy, by protocol.
const HTTP1_CLIENTS: usize = 2;
const HTTP2_CLIENTS: usize = 2;
/// How long any one step may take: a stack coming up, a restart, an adoption, the load answering.
const STEP: Duration = Duration::from_secs(120);
/// How long the load runs at most, per round (it is stopped long before).
const LOAD_PER_ROUND: Duration = Duration::from_secs(180);
/// The supervisor's log line once every adopted worker has registered with it.
const ADOPTED: &str = "Adopted workers registered again";
/// The supervisor's log line when adopted workers did not register in time.
const NOT_ADOPTED: &str = "Adopted workers did not register again in time";
/// Supervisor log lines shown when a request failed or a step went wrong.
const LOG_LINES: usize = 80;

#[derive(Debug)]
struct Options {
    rounds: usize,
    batches: Vec<u32>,
}

fn parse_args(args: &[String]) -> anyhow::Result<Options> {
    let mut options = Options {
        rounds: 3,
        batches: vec![1, 4],
    };
    let mut args = Flags::new(args, USAGE);
    while let Some(flag) = args.next() {
        let value = args.value(flag)?;
        match flag {
            "--rounds" => {
                options.rounds = value.parse().context("--rounds N: a whole number")?;
                ensure!(options.rounds > 0, "--rounds N: at least 1");
            }
            "--batches" => {
                options.batches = value
                    .split(',')
                    .map(|b| match b.trim().parse::<u32>() {
                        Ok(b) if (1..=WORKERS).contains(&b) => Ok(b),
                        _ => bail!("--batches: {b:?} is not a batch size from 1 to {WORKERS}"),
                    })
                    .collect::<anyhow::Result<_>>()?;
            }
            _ => return Err(args.unknown(flag)),
        }
    }
    Ok(options)
}

/// One timed rolling restart.
#[derive(Debug)]
struct Restart {
    took: Duration,
    served: u64,
    failed: usize,
}

/// One adoption, each time from the new supervisor's start.
#[derive(Debug)]
struct Adoption {
    /// Until the supervisor logged that every adopted worker registered (the line's timestamp).
    registered: Duration,
    /// The supervisor's own measure of that wait (`took=` of the line), which starts after it read its
    /// config, bound its sockets, set up the sampler and found the workers.
    waited: Duration,
    /// Until `peregrine status --json` lists the same pids.
    status: Duration,
    /// Until Envoy's CDS and EDS streams are connected again.
    envoy: Duration,
    served: u64,
    failed: usize,
}

/// Requests failed over a whole stack, with what went wrong, for the error at the end.
#[derive(Debug, Default)]
struct Failures {
    count: usize,
    detail: String,
    /// Requests Envoy retried (its route retries resets and refused streams): a drain that let a
    /// request reach a stopping worker would show here even when the client saw no failure.
    envoy_retries: u64,
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let options = parse_args(args)?;
    let peregrine = super::release_peregrine()?;
    let envoy_binary = envoy::install()?;
    let started = Instant::now();
    let mut failures = Failures::default();

    let mut restarts = Vec::new();
    for &batch in &options.batches {
        let rounds = restart_rounds(&peregrine, &envoy_binary, batch, &options, &mut failures)
            .with_context(|| format!("rolling restarts with restart_batch = {batch}"))?;
        restarts.push((batch, rounds));
    }
    let adoptions =
        adoption_rounds(&peregrine, &envoy_binary, &options, &mut failures).context("adoptions")?;

    let mut report = String::new();
    writeln!(
        report,
        "Command: `{}` ({} rounds, {:.0?} in all)",
        super::command_line("lifecycle", args),
        options.rounds,
        started.elapsed()
    )?;
    machine_lines(&mut report, &cpu_line()?)?;
    writeln!(report, "Envoy: {}", envoy::short_version(&envoy_binary)?)?;
    writeln!(
        report,
        "Load: {HTTP1_CLIENTS} HTTP/1.1 keep-alive + {HTTP2_CLIENTS} HTTP/2 clients through Envoy, one request after another each; {WORKERS} hello workers"
    )?;
    writeln!(report)?;
    report.push_str(&restart_table(&restarts));
    writeln!(report)?;
    report.push_str(&adoption_table(&adoptions));
    let served: u64 = adoptions.iter().map(|a| a.served).sum();
    let failed: usize = adoptions.iter().map(|a| a.failed).sum();
    writeln!(
        report,
        "\nRequests during the adoptions: {served} served, {failed} failed; over every stack's whole run: {} failed, {} retried by Envoy",
        failures.count, failures.envoy_retries
    )?;
    println!("{report}");

    if failures.count > 0 {
        bail!(
            "{} requests failed (must be none):\n{}",
            failures.count,
            failures.detail
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn restart_table(restarts: &[(u32, Vec<Restart>)]) -> String {
    let mut rows = vec![[
        "step".to_string(),
        "batch".into(),
        "rounds".into(),
        "median time".into(),
        "each round".into(),
        "served during (each round)".into(),
        "failed".into(),
    ]];
    for (batch, rounds) in restarts {
        rows.push([
            format!("rolling restart of {WORKERS}"),
            batch.to_string(),
            rounds.len().to_string(),
            median_of(rounds.iter().map(|r| r.took)),
            each(rounds.iter().map(|r| r.took)),
            rounds
                .iter()
                .map(|r| r.served.to_string())
                .collect::<Vec<_>>()
                .join(" / "),
            rounds.iter().map(|r| r.failed).sum::<usize>().to_string(),
        ]);
    }
    markdown(&rows, 1)
}

fn adoption_table(adoptions: &[Adoption]) -> String {
    let mut rows = vec![[
        "adoption, from the new supervisor's start".to_string(),
        "median".into(),
        "each round".into(),
    ]];
    let mut row = |label: &str, get: fn(&Adoption) -> Duration| {
        rows.push([
            label.to_string(),
            median_of(adoptions.iter().map(get)),
            each(adoptions.iter().map(get)),
        ]);
    };
    row(
        "(a) every adopted worker registered again (log line's time)",
        |a| a.registered,
    );
    row(
        "(a') of which the supervisor waited for them (`took=`)",
        |a| a.waited,
    );
    row("(b) `peregrine status --json` lists the same pids", |a| {
        a.status
    });
    row("(c) Envoy's CDS and EDS streams connected again", |a| {
        a.envoy
    });
    markdown(&rows, 1)
}

fn median_of(durations: impl Iterator<Item = Duration>) -> String {
    format_duration(Duration::from_secs_f64(median(
        durations.map(|d| d.as_secs_f64()).collect(),
    )))
}

fn each(durations: impl Iterator<Item = Duration>) -> String {
    durations
        .map(format_duration)
        .collect::<Vec<_>>()
        .join(" / ")
}

/// `--rounds` rolling restarts of one stack with `restart_batch = batch`.
fn restart_rounds(
    peregrine: &Path,
    envoy: &Path,
    batch: u32,
    options: &Options,
    failures: &mut Failures,
) -> anyhow::Result<Vec<Restart>> {
    let stack = Stack::start(peregrine, envoy, batch, options.rounds)?;
    stack
        .guard(|| {
            let mut workers = stack.wait_for_workers(&BTreeSet::new())?;
            let mut rounds = Vec::new();
            for round in 0..options.rounds {
                let before = stack.load.snapshot();
                let (took, out) = stack.control("restart")?;
                let after = stack.load.snapshot();
                ensure!(
                    out.starts_with(&format!("{WORKERS} replaced, 0 added, 0 removed, 0 failed")),
                    "peregrine restart answered {out:?}"
                );
                let fresh = stack.wait_for_workers(&workers)?;
                try_wait_until(STEP, "the replaced workers to exit", || {
                    workers.iter().all(|pid| gone(*pid)).then_some(())
                })?;
                let restart = Restart {
                    took,
                    served: after.served() - before.served(),
                    failed: after.failures.len() - before.failures.len(),
                };
                eprintln!("restart_batch = {batch}, round {round}: {restart:?}");
                rounds.push(restart);
                workers = fresh;
            }
            Ok(rounds)
        })
        .and_then(|rounds| {
            stack.finish(failures)?;
            Ok(rounds)
        })
}

/// `--rounds` times: SIGKILL the supervisor and start it again, on one stack.
fn adoption_rounds(
    peregrine: &Path,
    envoy: &Path,
    options: &Options,
    failures: &mut Failures,
) -> anyhow::Result<Vec<Adoption>> {
    let mut stack = Stack::start(peregrine, envoy, 1, options.rounds)?;
    let workers = stack.guard(|| stack.wait_for_workers(&BTreeSet::new()))?;
    let mut rounds = Vec::new();
    for round in 0..options.rounds {
        let adoption = stack
            .adopt(&workers)
            .with_context(|| format!("round {round}"));
        let adoption = stack.guard(|| adoption)?;
        eprintln!("adoption, round {round}: {adoption:?}");
        rounds.push(adoption);
    }
    stack.guard(|| {
        ensure!(
            stack.envoy.host_pids(SERVICE)?.0 == workers,
            "Envoy routes to other workers than the adopted ones"
        );
        Ok(())
    })?;
    stack.finish(failures)?;
    Ok(rounds)
}

/// A supervisor running [`WORKERS`] hello workers, an Envoy bootstrapped from it and a load through it.
struct Stack {
    // Dropped in this order: the load, Envoy, the supervisor with its workers, the directory.
    load: Load,
    envoy: Envoy,
    supervisor: Supervisor,
    _dir: TempDir,
    /// The binary the supervisor runs, for `peregrine restart`.
    peregrine: PathBuf,
}

impl Stack {
    fn start(peregrine: &Path, envoy: &Path, batch: u32, rounds: usize) -> anyhow::Result<Stack> {
        let dir = TempDir::new().context("a temporary directory")?;
        let (grpc, listen, admin) = (free_port(), free_port(), free_port());
        let mut config =
            PeregrineToml::one_service(grpc, listen, admin, WORKERS).control_in(dir.path());
        let service = config.services.get_mut(SERVICE).expect("the one service");
        service.restart_batch = Some(batch);
        let supervisor = Supervisor::start_in(peregrine, dir.path(), &config.toml())?;
        let envoy = Envoy::start_in(envoy, dir.path(), &supervisor.envoy_bootstrap()?)?;
        // The load starts once Envoy routes to every worker: before, its listener may not be up yet.
        wait_for_workers(&envoy, &BTreeSet::new())
            .inspect_err(|_| eprintln!("{}", log_tail(&supervisor)))?;
        let listen = SocketAddr::from(([127, 0, 0, 1], listen));
        let limit = LOAD_PER_ROUND * (rounds as u32 + 1);
        let stack = Stack {
            load: Load::start(listen, HTTP1_CLIENTS, HTTP2_CLIENTS, limit),
            envoy,
            supervisor,
            _dir: dir,
            peregrine: peregrine.to_path_buf(),
        };
        stack.guard(|| {
            try_wait_until(STEP, "the load to be served", || {
                let seen = stack.load.snapshot();
                (seen.ok.len() == 2 && seen.ok.values().all(|n| *n >= 20)).then_some(())
            })
        })?;
        Ok(stack)
    }

    /// Runs `f`; if it fails, prints the tail of the supervisor's logs first.
    fn guard<T>(&self, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        f().inspect_err(|_| eprintln!("{}", log_tail(&self.supervisor)))
    }

    /// Waits until Envoy lists [`WORKERS`] healthy hosts, none of them in `not`.
    fn wait_for_workers(&self, not: &BTreeSet<u32>) -> anyhow::Result<BTreeSet<u32>> {
        wait_for_workers(&self.envoy, not)
    }

    /// Runs `peregrine COMMAND CONFIG` (killed after [`STEP`]); returns how long it took and its stdout.
    fn control(&self, command: &str) -> anyhow::Result<(Duration, String)> {
        let begun = Instant::now();
        let child = Command::new(&self.peregrine)
            .arg(command)
            .arg(self.supervisor.config_path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running peregrine {command}"))?;
        let pid = child.id();
        let (done, answer) = mpsc::channel();
        thread::spawn(move || {
            let output = child.wait_with_output();
            let _ = done.send((begun.elapsed(), output));
        });
        let (took, output): (Duration, std::io::Result<Output>) = match answer.recv_timeout(STEP) {
            Ok(answer) => answer,
            Err(_) => {
                if let Some(pid) = Pid::from_raw(pid as i32) {
                    let _ = kill_process(pid, Signal::KILL);
                }
                bail!("peregrine {command} did not return within {STEP:?}");
            }
        };
        let output = output.with_context(|| format!("waiting for peregrine {command}"))?;
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        ensure!(
            output.status.success(),
            "peregrine {command} failed ({}): {stdout}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        Ok((took, stdout))
    }

    /// SIGKILLs the supervisor, starts it again and measures until it and Envoy hold `workers` again.
    fn adopt(&mut self, workers: &BTreeSet<u32>) -> anyhow::Result<Adoption> {
        let before = self.load.snapshot();
        let connections = |envoy: &Envoy| envoy.stat("cluster.xds_cluster.upstream_cx_total");
        let connections_before = connections(&self.envoy);
        self.supervisor.kill_and_start_again()?;
        // The new process was spawned at the end of `kill_and_start_again`.
        let start = Instant::now();
        let start_of_day = seconds_of_day(SystemTime::now());

        // (c) is polled beside (b): Envoy may reconnect before `status` lists every worker.
        let mut envoy_took = None;
        let mut disconnected = false;
        let mut poll_envoy = |envoy: &Envoy| {
            if envoy_took.is_some() {
                return envoy_took;
            }
            let state = |scope: &str| envoy.stat(&format!("{scope}.control_plane.connected_state"));
            let (cds, eds) = (state("cluster_manager.cds"), state("cluster.cluster"));
            if cds == Some(0) || eds == Some(0) {
                disconnected = true;
            }
            let reconnected = disconnected || connections(envoy) > connections_before;
            if reconnected && cds == Some(1) && eds == Some(1) {
                envoy_took = Some(start.elapsed());
            }
            envoy_took
        };
        let status = try_wait_until(STEP, "`peregrine status` to list the same workers", || {
            poll_envoy(&self.envoy);
            let pids = self.supervisor.status_pids().ok()?;
            (pids == *workers).then(|| start.elapsed())
        })?;
        let envoy = try_wait_until(STEP, "Envoy's CDS and EDS streams to reconnect", || {
            poll_envoy(&self.envoy)
        })?;
        let (logged_at, waited) =
            try_wait_until(STEP, "the supervisor to log the adoption", || {
                adopted_line(&self.supervisor.logs()).transpose()
            })??;
        let registered = Duration::from_secs_f64((logged_at - start_of_day).rem_euclid(DAY));
        let after = self.load.snapshot();
        Ok(Adoption {
            registered,
            waited,
            status,
            envoy,
            served: after.served() - before.served(),
            failed: after.failures.len() - before.failures.len(),
        })
    }

    /// Lets the load serve a little more, stops it and adds its failures to `failures`.
    fn finish(self, failures: &mut Failures) -> anyhow::Result<()> {
        let before = self.load.snapshot().served();
        self.guard(|| {
            try_wait_until(STEP, "the load to go on being served", || {
                (self.load.snapshot().served() >= before + 100).then_some(())
            })
        })?;
        let Stack {
            load,
            envoy,
            supervisor,
            ..
        } = self;
        let report: LoadReport = load.stop();
        failures.envoy_retries += envoy
            .stat(&format!("cluster.{SERVICE}.upstream_rq_retry"))
            .unwrap_or(0);
        eprintln!(
            "{} requests in {:.1?}, {} failed; by protocol {:?}",
            report.served(),
            report.elapsed,
            report.failures.len(),
            report.ok
        );
        if !report.failures.is_empty() {
            failures.count += report.failures.len();
            let shown = &report.failures[..report.failures.len().min(10)];
            writeln!(
                failures.detail,
                "{} of {} requests failed, the first: {shown:?}\n{}",
                report.failures.len(),
                report.served() + report.failures.len() as u64,
                log_tail(&supervisor)
            )?;
        }
        drop(envoy);
        drop(supervisor);
        Ok(())
    }
}

/// Waits until Envoy lists exactly [`WORKERS`] hosts of [`SERVICE`], all healthy and none of them in
/// `not`; returns their pids.
fn wait_for_workers(envoy: &Envoy, not: &BTreeSet<u32>) -> anyhow::Result<BTreeSet<u32>> {
    try_wait_until(
        STEP,
        &format!("{WORKERS} healthy hosts in Envoy, none of {not:?}"),
        || {
            let (healthy, all) = envoy.host_pids(SERVICE).ok()?;
            (healthy.len() == WORKERS as usize
                && all.len() == WORKERS as usize
                && healthy.is_disjoint(not))
            .then_some(healthy)
        },
    )
}

/// The last [`LOG_LINES`] lines of every process `supervisor` started.
fn log_tail(supervisor: &Supervisor) -> String {
    let logs = supervisor.all_logs();
    let lines: Vec<&str> = logs.lines().collect();
    format!(
        "supervisor logs (last {} lines):\n{}",
        LOG_LINES.min(lines.len()),
        lines[lines.len().saturating_sub(LOG_LINES)..].join("\n")
    )
}

/// Seconds in a day, for times of day.
const DAY: f64 = 86_400.0;

/// The time of day in UTC, in seconds.
fn seconds_of_day(time: SystemTime) -> f64 {
    time.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
        .rem_euclid(DAY)
}

/// The supervisor's [`ADOPTED`] line: its time of day in UTC (in seconds, from tracing's
/// `2026-12-01T10:00:00.120000Z` timestamp) and its `took=`. `None` while it has not logged it, an
/// error if it logged that the workers did not register in time.
fn adopted_line(logs: &str) -> anyhow::Result<Option<(f64, Duration)>> {
    if let Some(line) = logs.lines().find(|line| line.contains(NOT_ADOPTED)) {
        bail!("the supervisor logged: {line}");
    }
    let Some(line) = logs.lines().find(|line| line.contains(ADOPTED)) else {
        return Ok(None);
    };
    let time = line
        .split_whitespace()
        .next()
        .and_then(|stamp| stamp.split_once('T'))
        .and_then(|(_, time)| time.strip_suffix('Z'))
        .and_then(|time| {
            let mut parts = time.split(':').map(str::parse::<f64>);
            let (Some(Ok(h)), Some(Ok(m)), Some(Ok(s)), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                return None;
            };
            Some(h * 3600.0 + m * 60.0 + s)
        })
        .with_context(|| format!("no UTC timestamp at the start of {line:?}"))?;
    let took = line
        .split_whitespace()
        .find_map(|word| word.strip_prefix("took="))
        .with_context(|| format!("no took= in {line:?}"))?;
    let took = parse::duration(took).with_context(|| format!("in {line:?}"))?;
    Ok(Some((time, took)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_adoption_line() {
        let logs = "2026-12-01T10:00:00.000001Z  INFO peregrine_supervisor::run: Supervisor starting\n\
                    2026-12-01T10:00:01.250000Z  INFO peregrine_supervisor::adopt: Adopted workers registered again workers=8 took=123.4567ms\n";
        assert_eq!(
            adopted_line(logs).unwrap(),
            Some((36_001.25, Duration::from_secs_f64(0.1234567)))
        );
        let (_, took) = adopted_line(
            "2026-12-01T00:00:00Z INFO Adopted workers registered again workers=1 took=12.5µs",
        )
        .unwrap()
        .unwrap();
        assert_eq!(took, Duration::from_secs_f64(12.5e-6));
        assert_eq!(adopted_line("INFO Supervisor running").unwrap(), None);
        assert!(
            adopted_line("WARN Adopted workers did not register again in time; serving xDS")
                .is_err()
        );
        assert!(adopted_line("INFO Adopted workers registered again took=1ms").is_err());
    }

    #[test]
    fn parses_rounds_and_batches() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let options = parse_args(&[]).unwrap();
        assert_eq!((options.rounds, options.batches), (3, vec![1, 4]));
        let options = parse_args(&args(&["--batches", "1,2,8", "--rounds", "5"])).unwrap();
        assert_eq!((options.rounds, options.batches), (5, vec![1, 2, 8]));
        assert!(parse_args(&args(&["--batches", "0"])).is_err());
        assert!(parse_args(&args(&["--rounds"])).is_err());
    }
}
