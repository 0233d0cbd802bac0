//! `cargo xtask bench orca-cost`: what ORCA out-of-band load reports cost the supervisor, per stream.
//!
//! With `routing = "fleet"` every Envoy opens one ORCA stream to every worker of the fleet, each
//! served by that worker's supervisor: 100 hosts of 64 workers make 6,400 streams on every
//! supervisor, 32,000 reports a second at the 200 ms default. This measures that cost on the real
//! thing: one release `peregrine run` with `W` built-in workers of one `orca = true` service (the
//! supervisor and its workers pinned to CPU 0), and a client of ours ([`client`], pinned to CPU 1)
//! playing `K` Envoys, each holding a stream per worker: `P = K x W` streams, each on its own HTTP/2
//! connection with `:authority` = the worker's EDS hostname and a 200 ms report interval, as Envoy
//! opens them. Each simulated Envoy dials from a loopback address of its own (127.0.1.1,
//! 127.0.1.2, ...), as the hosts of a fleet do: the supervisor's per-address cap
//! (`grpc_max_connections_per_peer`, 1,024) is left as it is, and its global cap (8,192) is raised
//! in the config only for a point that would not fit under it.
//!
//! `W` is 32 by default, not the 64: each built-in worker's io_uring ring is charged to the
//! user's locked memory, and 64 of them are past the 8 MiB `RLIMIT_MEMLOCK` of a shell (the packaged
//! unit sets `LimitMEMLOCK=infinity`; where raising the limit is not permitted, `--workers 64` fails
//! with "cannot start the io_uring runtime"). What a stream costs does not depend on which worker it
//! reports: 6,400 streams are 200 Envoys x 32 workers here, 100 x 64 in the issue.
//!
//! Each point runs on a fresh supervisor: once its workers are ready, a window with no stream
//! (the baseline: the sampler, the registry), then the `P` streams are opened, and once every one
//! has had its first report and a few seconds passed, a window with them. The supervisor's CPU is
//! `utime + stime` from `/proc/PID/stat` (all threads, not its workers') over each 2 s slice of the
//! window, as a share of one core; its memory is `VmRSS`. What the streams cost is the difference
//! between the two windows of the same supervisor, divided by `P`. The client counts the reports it
//! receives. Every window also records how busy the machine was and how much of it other work took
//! (the machine is shared).
//!
//! The report goes to stdout and `target/bench/orca-cost.md`, the points to
//! `target/bench/orca-cost.csv` and, with matplotlib, their plot to `target/bench/orca-cost.svg`.

mod client;
mod host;

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::ExitCode,
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use anyhow::{Context, ensure};
use peregrine_contract::procfs;
use peregrine_e2e::target_dir;

use self::{client::Client, host::Host};
use super::{
    Flags,
    machine::{Busy, cpu_line, load_average, machine_lines, online_cpus},
    plot,
    table::{markdown, median},
};

const USAGE: &str = "cargo xtask bench orca-cost [--workers W] [--streams P,P,...] [--window SECS] [--rounds N] [--quick]";

/// The CPU of the supervisor and its workers.
const SUPERVISOR_CPU: usize = 0;
/// The CPU of the client.
const CLIENT_CPU: usize = 1;
/// The report interval each stream asks for: Envoy's default `oob_reporting_period`, and the
/// supervisor's default floor.
const INTERVAL: Duration = Duration::from_millis(200);
/// One measured slice of a window.
const SLICE: Duration = Duration::from_secs(2);
/// After the streams are served, before their window: the connections' setup is over.
const SETTLE: Duration = Duration::from_secs(3);
/// How long opening every stream of a point may take.
/// Past it, the point is measured with the streams served so far (the report says how many): the
/// client, one thread, falls behind before the supervisor does.
const OPEN_DEADLINE: Duration = Duration::from_secs(60);

/// Options of `cargo xtask bench orca-cost`.
#[derive(Debug, PartialEq, Eq)]
struct Options {
    workers: usize,
    /// The stream counts measured, in order.
    streams: Vec<usize>,
    /// Each window's length (the baseline's is half of it).
    window: Duration,
    rounds: usize,
}

fn parse_args(args: &[String]) -> anyhow::Result<Options> {
    let mut options = Options {
        workers: 32,
        streams: vec![0, 64, 640, 1600, 3200, 6400],
        window: Duration::from_secs(10),
        rounds: 1,
    };
    let mut args = Flags::new(args, USAGE);
    while let Some(flag) = args.next() {
        match flag {
            "--workers" => {
                options.workers = args.value(flag)?.parse().context("--workers W")?;
            }
            "--streams" => {
                options.streams = args
                    .value(flag)?
                    .split(',')
                    .map(|p| p.trim().parse())
                    .collect::<Result<_, _>>()
                    .context("--streams P,P,...: whole numbers")?;
            }
            "--window" => {
                let secs: u64 = args.value(flag)?.parse().context("--window SECS")?;
                options.window = Duration::from_secs(secs);
            }
            "--rounds" => options.rounds = args.value(flag)?.parse().context("--rounds N")?,
            "--quick" => {
                options.workers = 16;
                options.streams = vec![0, 160, 1600];
                options.window = Duration::from_secs(4);
            }
            other => return Err(args.unknown(other)),
        }
    }
    ensure!(options.workers >= 1, "--workers must be at least 1");
    ensure!(!options.streams.is_empty(), "--streams needs a count");
    ensure!(
        options.window >= SLICE,
        "--window must be at least {} s",
        SLICE.as_secs()
    );
    ensure!(options.rounds >= 1, "--rounds must be at least 1");
    Ok(options)
}

/// What a window measured.
#[derive(Clone, Debug, Default)]
struct Window {
    /// The supervisor's CPU, in cores, for each slice.
    cpu: Vec<f64>,
    /// Reports the client received per second, for each slice.
    reports_per_sec: Vec<f64>,
    /// Reports the supervisor sent per second over the window (its own count).
    sent_per_sec: f64,
    /// The ORCA streams the supervisor held at the window's end.
    open_streams: u64,
    /// The supervisor's `VmRSS` at the window's end, in bytes.
    rss: u64,
    /// The client's CPU (this process), in cores over the window.
    client_cpu: f64,
    /// Cores busy on the machine over the window, all work together.
    machine: f64,
    /// Cores busy with work other than the benchmark's.
    others: f64,
    /// The 1-minute load average at the window's end.
    load1: f64,
}

impl Window {
    fn cpu_median(&self) -> f64 {
        median(self.cpu.clone())
    }

    fn reports_median(&self) -> f64 {
        median(self.reports_per_sec.clone())
    }
}

/// One point: `streams` streams on a fresh supervisor.
#[derive(Clone, Debug)]
struct Point {
    streams: usize,
    envoys: usize,
    /// From the first connection to every stream's first report.
    opened_in: Duration,
    idle: Window,
    loaded: Window,
    /// The supervisor's sampler and its interval.
    sampler: String,
}

impl Point {
    /// The supervisor CPU the streams added, in cores.
    fn added_cpu(&self) -> f64 {
        self.loaded.cpu_median() - self.idle.cpu_median()
    }

    /// The resident memory the streams added, in bytes (negative when within noise).
    fn added_rss(&self) -> f64 {
        self.loaded.rss as f64 - self.idle.rss as f64
    }
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let options = parse_args(args)?;
    ensure!(
        online_cpus() >= 2,
        "the benchmark pins the supervisor to CPU {SUPERVISOR_CPU} and its client to CPU {CLIENT_CPU}: it needs 2 CPUs"
    );
    let peregrine = super::release_peregrine()?;
    let started = Instant::now();
    let mut points = Vec::new();
    for round in 0..options.rounds {
        for &streams in &options.streams {
            let point = measure_point(&peregrine, &options, streams)
                .with_context(|| format!("{streams} streams"))?;
            eprintln!(
                "round {}/{}: {streams} streams: supervisor {:.1}% -> {:.1}% of a core, {:.0} reports/s sent, {:.0} received, RSS {:.1} -> {:.1} MiB, others {:.2} cores",
                round + 1,
                options.rounds,
                point.idle.cpu_median() * 100.0,
                point.loaded.cpu_median() * 100.0,
                point.loaded.sent_per_sec,
                point.loaded.reports_median(),
                mib(point.idle.rss as f64),
                mib(point.loaded.rss as f64),
                point.loaded.others,
            );
            points.push(point);
        }
    }
    let elapsed = started.elapsed();

    let out = target_dir().join("bench");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut report = String::new();
    writeln!(
        report,
        "Command: `{}` ({elapsed:.0?} in all)",
        super::command_line("orca-cost", args)
    )?;
    machine_lines(&mut report, &cpu_line()?)?;
    writeln!(report)?;
    report.push_str(&table(&options, &points)?);
    let csv = write_csv(&out, &points)?;
    let svg = out.join("orca-cost.svg");
    match plot::run(
        &out,
        "orca-cost-plot.py",
        PLOT_SCRIPT,
        [csv.as_os_str(), svg.as_os_str()],
    ) {
        Ok(()) => writeln!(report, "\nPlot: `{}`", svg.display())?,
        Err(error) => eprintln!("no plot: {error:#}"),
    }
    let md = out.join("orca-cost.md");
    std::fs::write(&md, &report).with_context(|| format!("writing {}", md.display()))?;
    println!("{report}");
    Ok(ExitCode::SUCCESS)
}

/// Starts a supervisor, measures its idle window, opens `streams` streams and measures again.
fn measure_point(peregrine: &Path, options: &Options, streams: usize) -> anyhow::Result<Point> {
    let host = Host::start(peregrine, options.workers, SUPERVISOR_CPU, streams)?;
    host::check_open_files(host.pid, streams)?;
    let sampler = host.sampler()?;
    // Half the loaded window: the baseline is steady, and only its median is used.
    let idle = measure_window(&host, None, (options.window / 2).max(SLICE))?;

    let plan = client::plan(&host.hostnames, streams);
    let envoys = streams.div_ceil(options.workers);
    let opening = Instant::now();
    let client = Client::start(host.grpc_port, plan, INTERVAL, CLIENT_CPU)?;
    loop {
        let served = client.counters.served.load(Ordering::Relaxed) as usize;
        let failed = client.counters.failed.load(Ordering::Relaxed);
        ensure!(
            failed == 0,
            "{failed} of {streams} streams failed (their errors above); supervisor's log:\n{}",
            tail(&host.logs(), 40)
        );
        if served == streams {
            break;
        }
        if opening.elapsed() >= OPEN_DEADLINE {
            eprintln!(
                "only {served} of {streams} streams had a report after {OPEN_DEADLINE:?}: measuring them"
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let opened_in = opening.elapsed();
    std::thread::sleep(SETTLE);
    let loaded = measure_window(&host, Some(&client), options.window)?;
    let failed = client.counters.failed.load(Ordering::Relaxed);
    ensure!(failed == 0, "{failed} streams ended during the window");
    if loaded.open_streams != streams as u64 {
        eprintln!(
            "the supervisor holds {} ORCA streams of {streams}",
            loaded.open_streams
        );
    }
    client.stop()?;
    drop(host);
    Ok(Point {
        streams,
        envoys,
        opened_in,
        idle,
        loaded,
        sampler,
    })
}

/// Measures `host` (and `client`'s reports, if any) over `length`, slice by slice.
fn measure_window(
    host: &Host,
    client: Option<&Client>,
    length: Duration,
) -> anyhow::Result<Window> {
    let hz = procfs::clock_ticks_per_second() as f64;
    let reports = || client.map_or(0, |c| c.counters.reports.load(Ordering::Relaxed));
    let me = std::process::id();
    let own = || procfs::stat(me).map(|s| s.cpu_ticks());
    let busy_before = Busy::now(me)?;
    let (_, sent_before) = host.orca_totals()?;
    let (own_before, window_start) = (own()?, Instant::now());
    let mut window = Window::default();
    let slices = (length.as_secs_f64() / SLICE.as_secs_f64())
        .round()
        .max(1.0) as usize;
    for _ in 0..slices {
        let (ticks, count, at) = (host.cpu_ticks()?, reports(), Instant::now());
        std::thread::sleep(SLICE);
        let secs = at.elapsed().as_secs_f64();
        window
            .cpu
            .push((host.cpu_ticks()? - ticks) as f64 / hz / secs);
        window
            .reports_per_sec
            .push((reports() - count) as f64 / secs);
    }
    let window_secs = window_start.elapsed().as_secs_f64();
    window.client_cpu = (own()? - own_before) as f64 / hz / window_secs;
    window.rss = host.rss()?;
    let (open, sent_after) = host.orca_totals()?;
    (window.open_streams, window.sent_per_sec) =
        (open, (sent_after - sent_before) as f64 / window_secs);
    (window.machine, window.others) = Busy::now(me)?.since(busy_before);
    window.load1 = load_average()?[0];
    Ok(window)
}

/// The report's table: a row per point (medians over the rounds), then what one stream costs.
fn table(options: &Options, points: &[Point]) -> anyhow::Result<String> {
    let mut text = String::new();
    let sampler = points.first().map_or("-", |p| p.sampler.as_str());
    writeln!(
        text,
        "One `peregrine run` (release) with {} built-in workers (idle) of one `orca = true` service, sampler {sampler}, it and its workers on CPU {SUPERVISOR_CPU}; the client on CPU {CLIENT_CPU}, each simulated Envoy from a loopback address of its own, one HTTP/2 connection per stream, {} ms report interval. Idle window {} s, window with the streams {} s, in {} s slices; {} round(s). CPU is the supervisor's `utime + stime` as a share of one core, median of the slices (range over slices and rounds); RSS at each window's end; reports sent are the supervisor's own count (`status --json`), received the client's; CPU per report is the added CPU over the reports sent. The last column is the machine during the window: cores busy, of which other work than the benchmark's, and the 1-minute load average.\n",
        options.workers,
        INTERVAL.as_millis(),
        (options.window / 2).max(SLICE).as_secs(),
        options.window.as_secs(),
        SLICE.as_secs(),
        options.rounds,
    )?;
    let mut rows = vec![
        [
            "streams (Envoys x workers)",
            "reports/s sent / received (expected)",
            "supervisor CPU idle -> with streams",
            "added CPU per 1,000 streams",
            "CPU per report",
            "RSS idle -> with streams",
            "added RSS per stream",
            "opened in",
            "client CPU",
            "machine busy (others), load1",
        ]
        .map(str::to_owned),
    ];
    for &streams in &options.streams {
        let same: Vec<&Point> = points.iter().filter(|p| p.streams == streams).collect();
        let Some(first) = same.first() else { continue };
        let med = |f: &dyn Fn(&Point) -> f64| median(same.iter().map(|p| f(p)).collect());
        let range = |f: &dyn Fn(&Window) -> &Vec<f64>, loaded: bool| {
            let all: Vec<f64> = same
                .iter()
                .flat_map(|p| f(if loaded { &p.loaded } else { &p.idle }).iter().copied())
                .collect();
            let (lo, hi) = all
                .iter()
                .fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
            (median(all), lo, hi)
        };
        let (idle, idle_lo, idle_hi) = range(&|w| &w.cpu, false);
        let (loaded, lo, hi) = range(&|w| &w.cpu, true);
        let (received, ..) = range(&|w| &w.reports_per_sec, true);
        let reports = med(&|p| p.loaded.sent_per_sec);
        let added_cpu = med(&|p| p.added_cpu());
        let added_rss = med(&|p| p.added_rss());
        let per_report = if reports > 0.0 {
            super::table::format_duration(Duration::from_secs_f64((added_cpu / reports).max(0.0)))
        } else {
            "-".to_owned()
        };
        // Per stream the supervisor held (all of them, unless the client fell behind opening them).
        let held = med(&|p| p.loaded.open_streams as f64);
        let per_stream = |value: f64, format: &dyn Fn(f64) -> String| {
            if held == 0.0 {
                "-".to_owned()
            } else {
                format(value / held)
            }
        };
        rows.push([
            format!(
                "{streams} ({} x {})",
                first.envoys,
                streams.min(options.workers)
            ),
            format!(
                "{reports:.0} / {received:.0} ({:.0})",
                streams as f64 / INTERVAL.as_secs_f64()
            ),
            format!(
                "{:.1}% ({:.1}-{:.1}) -> {:.1}% ({:.1}-{:.1})",
                idle * 100.0,
                idle_lo * 100.0,
                idle_hi * 100.0,
                loaded * 100.0,
                lo * 100.0,
                hi * 100.0
            ),
            per_stream(added_cpu * 1000.0, &|v| {
                format!("{:.2}% of a core", v * 100.0)
            }),
            per_report,
            format!(
                "{:.1} -> {:.1} MiB",
                mib(med(&|p| p.idle.rss as f64)),
                mib(med(&|p| p.loaded.rss as f64))
            ),
            per_stream(added_rss, &|v| format!("{:.1} KiB", v / 1024.0)),
            if held as usize == streams {
                format!("{:.1} s", med(&|p| p.opened_in.as_secs_f64()))
            } else {
                format!(
                    "{held:.0} held after {:.0} s",
                    med(&|p| p.opened_in.as_secs_f64())
                )
            },
            format!("{:.0}%", med(&|p| p.loaded.client_cpu) * 100.0),
            format!(
                "{:.2} ({:.2}), {:.1}",
                med(&|p| p.loaded.machine),
                med(&|p| p.loaded.others),
                med(&|p| p.loaded.load1)
            ),
        ]);
    }
    text.push_str(&markdown(&rows, 1));
    Ok(text)
}

/// Writes every point (every round) to `out/orca-cost.csv`.
fn write_csv(out: &Path, points: &[Point]) -> anyhow::Result<PathBuf> {
    let path = out.join("orca-cost.csv");
    let mut text = String::from(
        "streams,envoys,idle_cpu_cores,loaded_cpu_cores,loaded_cpu_min,loaded_cpu_max,sent_per_sec,received_per_sec,idle_rss_bytes,loaded_rss_bytes,others_cores\n",
    );
    for p in points {
        let (lo, hi) = p
            .loaded
            .cpu
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
        writeln!(
            text,
            "{},{},{:.4},{:.4},{lo:.4},{hi:.4},{:.1},{:.1},{},{},{:.3}",
            p.streams,
            p.envoys,
            p.idle.cpu_median(),
            p.loaded.cpu_median(),
            p.loaded.sent_per_sec,
            p.loaded.reports_median(),
            p.idle.rss,
            p.loaded.rss,
            p.loaded.others,
        )?;
    }
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The plot: supervisor CPU and RSS against the number of streams.
const PLOT_SCRIPT: &str = include_str!("orca_cost/plot.py");

fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args;

    #[test]
    fn parses_the_options() {
        let options =
            parse_args(&args("--workers 8 --streams 0,80 --window 4 --rounds 2")).unwrap();
        assert_eq!(
            options,
            Options {
                workers: 8,
                streams: vec![0, 80],
                window: Duration::from_secs(4),
                rounds: 2,
            }
        );
        assert_eq!(parse_args(&[]).unwrap().streams.last(), Some(&6400));
        assert!(parse_args(&args("--window 1")).is_err());
        assert!(parse_args(&args("--streams 1,x")).is_err());
        assert!(parse_args(&args("--bogus")).is_err());
    }
}
