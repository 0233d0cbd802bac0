//! `cargo xtask bench sampler`: what sampling costs the workers, and what one sample pass costs.
//!
//! **Under load.** One hello worker pinned to CPU 0 (as in `bench http`), loaded with h2c
//! (`h2load -c10 -m10`, which saturates the worker's core, so its requests/s is the worker's
//! throughput) from CPU 1, with the supervisor's sampler off, eBPF and procfs, at 1 s and 100 ms. Each
//! mode runs its own supervisor, one at a time (two eBPF samplers would both run on every scheduler
//! event); every round runs every mode, in a rotated order, and the table shows medians. For eBPF the
//! kernel's own statistics (`BPF_ENABLE_STATS`, on for the whole benchmark) give the programs' exact run
//! time, which the noisy throughput figures cannot resolve below a few percent.
//!
//! **One pass.** `cargo bench -p peregrine-supervisor --bench sampler_pass`: the cost of reading 8, 64
//! and 512 tracked processes with each backend.

use std::{
    fmt::Write as _,
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::{Context, bail, ensure};
use peregrine_e2e::{
    TempDir,
    config::{Sampler, SupervisorTable},
};
use xtask::{cargo, run_checked};

use super::{
    Flags,
    http::{Load, Outcome, run_quietest},
    machine::{cpu_line, machine_lines},
    server::{Running, preflight},
    table::{format_duration, markdown, median},
};

const USAGE: &str = "cargo xtask bench sampler [--duration SECS] [--rounds N]";

/// The program names of the eBPF sampler (`ebpf/src/bpf/sampler.bpf.c`): the scheduler's, the process
/// trees' and the send counter's. Each runs for every such event on the machine, tracked or not, so
/// all of them are the sampler's cost.
const PROGRAMS: [&str; 7] = [
    "on_runtime",
    "on_wakeup",
    "on_wakeup_new",
    "on_switch",
    "on_fork",
    "on_exit",
    "on_send",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Off,
    Ebpf(u64),
    Procfs(u64),
}

impl Mode {
    const ALL: [Mode; 5] = [
        Mode::Off,
        Mode::Ebpf(1000),
        Mode::Ebpf(100),
        Mode::Procfs(1000),
        Mode::Procfs(100),
    ];

    fn name(self) -> String {
        match self {
            Mode::Off => "off".into(),
            Mode::Ebpf(ms) => format!("eBPF, {}", interval(ms)),
            Mode::Procfs(ms) => format!("procfs, {}", interval(ms)),
        }
    }

    /// Sets the mode's keys of `[supervisor]`.
    fn configure(self, supervisor: &mut SupervisorTable) {
        let (sampler, interval) = match self {
            Mode::Off => (Sampler::Off, None),
            Mode::Ebpf(ms) => (Sampler::Ebpf, Some(ms)),
            Mode::Procfs(ms) => (Sampler::Procfs, Some(ms)),
        };
        supervisor.sampler = Some(sampler);
        supervisor.sample_interval_ms = interval;
    }
}

fn interval(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{ms} ms")
    }
}

/// One loaded run of one mode.
#[derive(Clone, Copy, Debug)]
struct Run {
    requests_per_sec: f64,
    cpu_per_request: Duration,
    /// The eBPF programs' run time over the run, per request served.
    bpf_per_request: Option<Duration>,
    /// The eBPF programs' run time as a share of the worker's CPU time.
    bpf_share: Option<f64>,
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let (duration, rounds) = parse_args(args)?;
    ensure!(
        rustix::process::geteuid().is_root(),
        "the sampler benchmark loads eBPF programs: run it as root"
    );
    preflight()?;
    let peregrine = super::release_peregrine()?;
    // The kernel counts each program's run time while this descriptor is open.
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("enabling BPF run-time statistics")?;

    let mut runs: Vec<Vec<Run>> = Mode::ALL.iter().map(|_| Vec::new()).collect();
    let started = Instant::now();
    for round in 0..rounds {
        for k in 0..Mode::ALL.len() {
            let m = (k + round) % Mode::ALL.len();
            let mode = Mode::ALL[m];
            let dir = TempDir::new().context("a temporary directory")?;
            let worker = Running::worker_with(&peregrine, dir.path(), |s| mode.configure(s))
                .with_context(|| format!("starting the supervisor with sampler {}", mode.name()))?;
            // A first sample is a baseline: let the sampler take it before the load starts.
            std::thread::sleep(Duration::from_millis(300));
            let bpf_before = bpf_run_time()?;
            let outcome = run_quietest(Load::H2c, worker.pid, worker.port, duration)?;
            let bpf = bpf_run_time()?.saturating_sub(bpf_before);
            drop(worker);
            let Outcome::Measured(sample) = outcome else {
                bail!("the worker answered no h2c request");
            };
            let requests = sample.requests_per_sec * duration as f64;
            let ebpf = matches!(mode, Mode::Ebpf(_));
            let run = Run {
                requests_per_sec: sample.requests_per_sec,
                cpu_per_request: sample.cpu_per_request,
                bpf_per_request: ebpf.then(|| bpf.div_f64(requests.max(1.0))),
                bpf_share: ebpf.then(|| {
                    bpf.as_secs_f64() / (sample.cpu_per_request.as_secs_f64() * requests).max(1e-9)
                }),
            };
            eprintln!(
                "round {}/{rounds} {:>16}: {:.0} req/s, {} CPU/request{}",
                round + 1,
                mode.name(),
                run.requests_per_sec,
                format_duration(run.cpu_per_request),
                run.bpf_per_request
                    .map(|d| format!(", eBPF {} per request", format_duration(d)))
                    .unwrap_or_default()
            );
            runs[m].push(run);
        }
    }

    let mut report = String::new();
    let command = super::command_line("sampler", args);
    writeln!(
        report,
        "Command: `{command}` ({rounds} rounds of {duration} s per mode, {:.0?} in all)",
        started.elapsed()
    )?;
    machine_lines(&mut report, &cpu_line()?)?;
    writeln!(report)?;
    report.push_str(&table(&runs));
    println!("{report}");

    eprintln!("one sample pass, 8 / 64 / 512 tracked processes:");
    run_checked(cargo().args([
        "bench",
        "-p",
        "peregrine-supervisor",
        "--bench",
        "sampler_pass",
    ]))?;
    Ok(ExitCode::SUCCESS)
}

fn table(runs: &[Vec<Run>]) -> String {
    let off_rps = median(runs[0].iter().map(|r| r.requests_per_sec).collect());
    let off_cpu = median(
        runs[0]
            .iter()
            .map(|r| r.cpu_per_request.as_secs_f64())
            .collect(),
    );
    let mut rows = vec![[
        "sampler".to_string(),
        "requests/s".into(),
        "vs off".into(),
        "worker CPU/request".into(),
        "eBPF programs per request (share of worker CPU)".into(),
    ]];
    for (mode, runs) in Mode::ALL.iter().zip(runs) {
        let rps = median(runs.iter().map(|r| r.requests_per_sec).collect());
        let cpu = median(
            runs.iter()
                .map(|r| r.cpu_per_request.as_secs_f64())
                .collect(),
        );
        let bpf = runs
            .iter()
            .map(|r| r.bpf_per_request.map(|d| d.as_secs_f64()))
            .collect::<Option<Vec<_>>>()
            .map(|v| {
                let share = median(runs.iter().filter_map(|r| r.bpf_share).collect());
                format!(
                    "{} ({:.2}%)",
                    format_duration(Duration::from_secs_f64(median(v))),
                    share * 100.0
                )
            })
            .unwrap_or_else(|| "-".into());
        rows.push([
            mode.name(),
            format!("{rps:.0}"),
            format!("{:.3}", rps / off_rps),
            format!(
                "{} ({:.3})",
                format_duration(Duration::from_secs_f64(cpu)),
                cpu / off_cpu
            ),
            bpf,
        ]);
    }
    markdown(&rows, 2)
}

/// The total run time of the sampler's programs loaded now (zero when none is).
fn bpf_run_time() -> anyhow::Result<Duration> {
    let mut total = Duration::ZERO;
    for info in aya::programs::loaded_programs() {
        let info = info.context("listing loaded BPF programs")?;
        if info
            .name_as_str()
            .is_some_and(|name| PROGRAMS.contains(&name))
        {
            total += info.run_time();
        }
    }
    Ok(total)
}

fn parse_args(args: &[String]) -> anyhow::Result<(u64, usize)> {
    let (mut duration, mut rounds) = (5u64, 3usize);
    let mut args = Flags::new(args, USAGE);
    while let Some(flag) = args.next() {
        match flag {
            "--duration" => duration = args.value(flag)?.parse().context("--duration SECS")?,
            "--rounds" => rounds = args.value(flag)?.parse().context("--rounds N")?,
            other => return Err(args.unknown(other)),
        }
    }
    ensure!(
        duration >= 1 && rounds >= 1,
        "--duration and --rounds must be at least 1"
    );
    Ok((duration, rounds))
}
