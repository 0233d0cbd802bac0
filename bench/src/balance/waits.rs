//! `cargo xtask bench balance --waits`: gunicorn *sync* workers (one request at a time) whose
//! requests wait, as on a database, behind the real Envoy, per balancing set-up.
//!
//! **The app.** `tests/apps/wsgi_app.py` under gunicorn 27 (`target/pyapps/venv`): `/slow?ms=N`
//! sleeps N ms and uses no CPU to speak of. Every answer names the process that served it
//! (`X-Worker-Index`), so each worker's share is counted even where one gunicorn forks several.
//!
//! **Set-ups** ([`SetUp`]; `--setup KEY`, all by default), each taken in turn in every round, in an
//! order rotated per round:
//! - `shared-socket`: what gunicorn does by itself. One Peregrine worker (`count = 1`) whose gunicorn
//!   runs `--workers 4` on the one passed socket: one accept queue, each connection taken by whichever
//!   process is free. The forks learn their index from `tests/apps/gunicorn_forks.py` (`-c`).
//! - `orca`: the former default with `pass_socket` (`count = 4`, gunicorn `--workers 1`, a listener
//!   per worker, `orca = true`: client-side weighted round robin on the supervisor's ORCA reports).
//! - `lr2`, `lr4`: `lb_policy = "least_request"` with `choice_count` 2, and with `choice_count` the
//!   number of workers (join the shortest queue of Envoy's own count).
//! - `rr`: `lb_policy = "round_robin"`.
//! - `reuseport`: the workers' gunicorns started by the benchmark itself, outside Peregrine, each
//!   `--workers 1 --reuse-port --bind 127.0.0.1:P` on one port, loaded *directly* by the generator
//!   (no Envoy): the kernel hashes each connection (gunicorn's sync worker closes every one) to one of
//!   them.
//! - `shared`: Peregrine's default for gunicorn's sync worker (`count = 4`, gunicorn `--workers 1`,
//!   no balancing key: `concurrency` read off the command as 1): one listener the supervisor binds
//!   and all `count` workers share, published to Envoy as one endpoint. When `peregrine check` does
//!   not take a set-up's config (an older supervisor, say), the set-up is skipped with the reason,
//!   and the report says so.
//!
//! **Cells** ([`Cell`]; `--cell KEY`, all by default), each with a supervisor and an Envoy
//! (`--concurrency 1`, HTTP/1.1 to the workers) of its own, started when the cell starts:
//! - `io`: 4 workers, nothing pinned. Each request waits 5 ms (90%) or 100 ms (10%): 14.5 ms on
//!   average, so 4 workers serve about 250/s with gunicorn's own cost; `--rate` 150/s is 60% of that.
//! - `slow-worker`: the same, but worker 0's waits are 5x longer (`APP_WAIT_FACTOR=5`,
//!   `APP_SLOW_INDEX=0`; in `shared-socket` the fork of index 0, by `gunicorn_forks.py`).
//! - `cpu-hog`: 2 workers, worker `i` pinned to CPU `i` (`taskset`; in `shared-socket` the fork of
//!   index `i`, by `APP_PIN_FORKS=0,1`), requests of `?cpu=4` (4 ms of CPU) at `--hog-rate` 100/s, and
//!   a 3-process CPU hog (`sh -c 'while :; do :; done'` x3) pinned to CPU 0. The benchmark pins itself
//!   (and so the supervisor, Envoy and the generator) to CPU 1 in this cell, as the other balance
//!   scenarios do.
//!
//! **Load.** The open-loop generator ([`openloop`](super::openloop)) with Poisson arrivals (seeded:
//! round `r` uses `--seed` + `r`, the same for every set-up of the round) and, in the waiting cells,
//! each request's wait drawn from the mix (seeded likewise), so every set-up of a round gets the very
//! same requests at the very same times. Latency from each request's scheduled time; 256 connections,
//! each request to whichever is free; an answer may take 10 s. A run is a `--warmup` (5 s) and a
//! measured `--duration` (20 s); only requests scheduled in the window count, failures as slower than
//! every answer.
//!
//! **Figures** per cell and set-up: p50 and p99 (median over rounds, and the p99's min-max), failed
//! requests (summed), each worker's share of the answers (median), and the CPU the supervisor and
//! Envoy took per answered request (`/proc/PID/stat` before and after the run, 10 ms ticks), less
//! what each took idle over the 2 s before the run (the supervisor samples and reports, Envoy keeps
//! its ORCA streams and timers), which the report gives beside it. Between
//! runs the benchmark waits until every listen queue of the set-up is empty (`/proc/net/tcp`), so a
//! backlog a run left does not delay the next. Report: `target/bench/balance-waits.md`; p99 per cell
//! and set-up: `target/bench/balance-waits.csv` and `.png`.
//!
//! **Noise.** As the other balance runs: the CPU that processes outside this benchmark's tree took
//! during each run; a run over 0.1 core is run again (once: on a shared machine more would
//! triple the runs) and the quieter kept.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, ensure};
use peregrine_contract::procfs;
use peregrine_e2e::{
    ChildGuard, Envoy, PeregrineToml, ServiceTable, Supervisor, TempDir, config::Orca, free_port,
    gunicorn_command, hosts, http_get, target_dir, test_app,
};
use xtask::envoy;

use super::{
    NOISY, Options, TIMEOUT,
    measure::percentile,
    openloop::{self, Answer, Mix, Plan, Record},
    poll::poll_every,
};
use crate::{
    machine::{Busy, machine_lines},
    table::{format_duration, markdown, median},
};

/// Requests per second of the waiting cells by default: 60% of what 4 workers serve.
pub(super) const RATE: f64 = 150.0;
/// Requests per second of the CPU-hog cell by default.
pub(super) const HOG_RATE: f64 = 100.0;
/// The measured window by default, in seconds.
pub(super) const DURATION: u64 = 20;
/// The waits, in ms, and their shares.
const MIX: [(u64, f64); 2] = [(5, 0.9), (100, 0.1)];
/// XORed into a round's seed for the waits' draws (the arrivals take the seed itself).
const MIX_SEED: u64 = 0x5EED_0F7A_46E7;
/// How much longer the slow worker waits.
const SLOW_FACTOR: u32 = 5;
/// CPU per request in the CPU-hog cell.
const CPU_MS: u64 = 4;
/// Processes of the hog on CPU 0.
const HOG_THREADS: usize = 3;
/// Connections of the generator.
const CONNECTIONS: usize = 256;
/// How long the supervisor's and Envoy's idle CPU is measured before each run.
const IDLE: Duration = Duration::from_secs(2);
/// How many times a noisy run is repeated here (the quietest kept): once, as in the timeline; a
/// shared machine would otherwise triple the runs.
const WAITS_NOISY_RETRIES: usize = 1;
/// The plotting script.
const PLOT_SCRIPT: &str = include_str!("waits_plot.py");

/// What the workers do, and what slows one of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cell {
    Io,
    SlowWorker,
    CpuHog,
}

impl Cell {
    const ALL: [Cell; 3] = [Cell::Io, Cell::SlowWorker, Cell::CpuHog];

    fn key(self) -> &'static str {
        match self {
            Cell::Io => "io",
            Cell::SlowWorker => "slow-worker",
            Cell::CpuHog => "cpu-hog",
        }
    }

    fn title(self, options: &Options) -> String {
        match self {
            Cell::Io => format!(
                "io: 4 workers, waits of 5 ms (90%) or 100 ms (10%), {} req/s",
                options.waits_rate
            ),
            Cell::SlowWorker => format!(
                "slow-worker: the same, worker 0's waits {SLOW_FACTOR}x longer, {} req/s",
                options.waits_rate
            ),
            Cell::CpuHog => format!(
                "cpu-hog: 2 pinned workers, {CPU_MS} ms of CPU per request, a {HOG_THREADS}-process hog on CPU 0, {} req/s",
                options.hog_rate
            ),
        }
    }

    fn workers(self) -> u32 {
        match self {
            Cell::Io | Cell::SlowWorker => 4,
            Cell::CpuHog => 2,
        }
    }

    fn rate(self, options: &Options) -> f64 {
        match self {
            Cell::Io | Cell::SlowWorker => options.waits_rate,
            Cell::CpuHog => options.hog_rate,
        }
    }

    fn pinned(self) -> bool {
        self == Cell::CpuHog
    }

    /// The app's environment in this cell.
    fn env(self) -> Vec<(String, String)> {
        match self {
            Cell::SlowWorker => vec![
                ("APP_WAIT_FACTOR".into(), SLOW_FACTOR.to_string()),
                ("APP_SLOW_INDEX".into(), "0".into()),
            ],
            Cell::Io | Cell::CpuHog => Vec::new(),
        }
    }

    /// The request targets under `prefix` (a route, or empty) with their weights.
    fn targets(self, prefix: &str) -> Vec<(String, f64)> {
        match self {
            Cell::Io | Cell::SlowWorker => MIX
                .iter()
                .map(|(ms, weight)| (format!("{prefix}/slow?ms={ms}"), *weight))
                .collect(),
            Cell::CpuHog => vec![(format!("{prefix}/?cpu={CPU_MS}"), 1.0)],
        }
    }
}

/// A way to spread the requests over the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SetUp {
    SharedSocket,
    Orca,
    Lr2,
    LrAll,
    RoundRobin,
    ReusePort,
    Shared,
}

impl SetUp {
    const ALL: [SetUp; 7] = [
        SetUp::SharedSocket,
        SetUp::Orca,
        SetUp::Lr2,
        SetUp::LrAll,
        SetUp::RoundRobin,
        SetUp::ReusePort,
        SetUp::Shared,
    ];

    fn key(self) -> &'static str {
        match self {
            SetUp::SharedSocket => "shared-socket",
            SetUp::Orca => "orca",
            SetUp::Lr2 => "lr2",
            SetUp::LrAll => "lr4",
            SetUp::RoundRobin => "rr",
            SetUp::ReusePort => "reuseport",
            SetUp::Shared => "shared",
        }
    }

    fn label(self, workers: u32) -> String {
        match self {
            SetUp::SharedSocket => {
                format!("gunicorn's shared socket (count 1, --workers {workers})")
            }
            SetUp::Orca => "ORCA weighted round robin, a listener each (the former default)".into(),
            SetUp::Lr2 => "least request, 2 choices".into(),
            SetUp::LrAll => format!("least request, choice_count = workers ({workers})"),
            SetUp::RoundRobin => "round robin".into(),
            SetUp::ReusePort => "SO_REUSEPORT, no Envoy".into(),
            SetUp::Shared => "Peregrine's default: one shared listener".into(),
        }
    }

    /// The service (Envoy cluster and route prefix `/<name>`); names that are no prefix of one
    /// another.
    fn service(self) -> &'static str {
        match self {
            SetUp::SharedSocket => "socket",
            SetUp::Orca => "orca",
            SetUp::Lr2 => "lr2",
            SetUp::LrAll => "lrall",
            SetUp::RoundRobin => "rr",
            SetUp::ReusePort => "reuseport",
            SetUp::Shared => "shared",
        }
    }

    /// The Peregrine service of this set-up in `cell` (none for the `SO_REUSEPORT` one).
    fn service_table(self, cell: Cell, gunicorn: &Path) -> Option<ServiceTable> {
        let workers = cell.workers();
        let mut env: std::collections::BTreeMap<String, String> = cell.env().into_iter().collect();
        env.insert("PYTHONUNBUFFERED".into(), "1".into());
        let (count, command) = match self {
            SetUp::ReusePort => return None,
            SetUp::SharedSocket => {
                if cell.pinned() {
                    env.insert("APP_PIN_FORKS".into(), "0,1".into());
                }
                (1, gunicorn_args(gunicorn, workers, true))
            }
            _ => {
                let command = gunicorn_args(gunicorn, 1, false);
                let command = if cell.pinned() {
                    ["taskset", "-c", "{index}"]
                        .map(String::from)
                        .into_iter()
                        .chain(command)
                        .collect()
                } else {
                    command
                };
                (workers, command)
            }
        };
        let service = ServiceTable {
            count: Some(count),
            url: Some("http://127.0.0.1:0".into()),
            prefix: Some(format!("/{}", self.service())),
            env: Some(env),
            ..ServiceTable::app_server(command)
        };
        Some(match self {
            SetUp::RoundRobin => ServiceTable {
                lb_policy: Some("round_robin".into()),
                ..service
            },
            SetUp::Lr2 | SetUp::LrAll => ServiceTable {
                lb_policy: Some("least_request".into()),
                choice_count: Some(if self == SetUp::Lr2 { 2 } else { workers }),
                ..service
            },
            SetUp::Orca => service.orca(Orca::On),
            _ => service,
        })
    }

    /// How many hosts Envoy holds once the set-up is ready (`None`: any, at least one).
    fn hosts(self, cell: Cell) -> Option<usize> {
        match self {
            SetUp::SharedSocket => Some(1),
            SetUp::Shared | SetUp::ReusePort => None,
            _ => Some(cell.workers() as usize),
        }
    }
}

/// gunicorn on the WSGI test app with `workers` processes, and with `gunicorn_forks.py` (each fork's
/// index, and its CPU) when `forks`.
fn gunicorn_args(gunicorn: &Path, workers: u32, forks: bool) -> Vec<String> {
    let mut command = gunicorn_command(gunicorn);
    let at = command
        .iter()
        .position(|a| a == "--workers")
        .expect("gunicorn_command sets --workers")
        + 1;
    command[at] = workers.to_string();
    if forks {
        command.splice(
            1..1,
            [
                "-c".to_owned(),
                test_app("gunicorn_forks.py").display().to_string(),
            ],
        );
    }
    command
}

/// Checks `--cell` and `--setup` name cells and set-ups of this benchmark.
pub(super) fn check_keys(options: &Options) -> anyhow::Result<()> {
    for key in &options.cells {
        ensure!(
            Cell::ALL.iter().any(|c| c.key() == key),
            "no cell {key:?}: {}",
            Cell::ALL.map(Cell::key).join(", ")
        );
    }
    for key in &options.setups {
        ensure!(
            SetUp::ALL.iter().any(|s| s.key() == key),
            "no set-up {key:?}: {}",
            SetUp::ALL.map(SetUp::key).join(", ")
        );
    }
    Ok(())
}

fn chosen(key: &str, list: &[String]) -> bool {
    list.is_empty() || list.iter().any(|k| k == key)
}

/// One run's figures.
#[derive(Clone, Debug)]
struct WaitRun {
    cell: Cell,
    setup: SetUp,
    round: usize,
    seed: u64,
    /// Requests scheduled in the measured window.
    requests: usize,
    failed: usize,
    p50: Option<Duration>,
    p99: Option<Duration>,
    /// The p99 of the short (5 ms) requests alone, in the waiting cells: how long a short request
    /// waits behind long ones.
    p99_short: Option<Duration>,
    /// Each worker's share of the window's answers, by the index in their answers.
    shares: Vec<f64>,
    /// Answers without an index (there should be none).
    unindexed: usize,
    /// CPU per answered request of the whole run beyond what the process takes idle, in µs (`None`
    /// where the process is not part of the set-up).
    supervisor_us: Option<f64>,
    envoy_us: Option<f64>,
    /// What the supervisor and Envoy took idle just before the run, in cores.
    supervisor_idle: Option<f64>,
    envoy_idle: Option<f64>,
    /// Other processes' CPU during the run, in cores.
    others: f64,
}

/// What a cell's runs share.
struct CellBench<'a> {
    options: &'a Options,
    cell: Cell,
    supervisor: &'a Supervisor,
    supervisor_pid: u32,
    envoy_pid: u32,
    listen: SocketAddr,
    /// The `SO_REUSEPORT` port, when that set-up runs.
    reuseport: Option<SocketAddr>,
}

/// Runs every chosen cell and set-up `options.rounds` times; writes the report, the CSV and the plot.
pub(super) fn run(
    peregrine: &Path,
    envoy_binary: &Path,
    options: &Options,
    cpu_line: &str,
    command: &str,
) -> anyhow::Result<()> {
    let gunicorn = xtask::pyapps::install()?.join("gunicorn");
    let out = target_dir().join("bench");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let started = Instant::now();
    let mut runs = Vec::new();
    let mut skipped = Vec::new();
    for cell in Cell::ALL
        .into_iter()
        .filter(|c| chosen(c.key(), &options.cells))
    {
        let setups: Vec<SetUp> = SetUp::ALL
            .into_iter()
            .filter(|s| chosen(s.key(), &options.setups))
            .collect();
        run_cell(
            peregrine,
            envoy_binary,
            &gunicorn,
            options,
            cell,
            &setups,
            (&mut runs, &mut skipped),
        )
        .with_context(|| format!("cell {}", cell.key()))?;
    }
    let setting = Setting {
        command: command.to_owned(),
        cpu_line: cpu_line.to_owned(),
        envoy_version: envoy::short_version(envoy_binary)?,
        elapsed: started.elapsed(),
        skipped,
    };
    let report = write_report(&out, options, &setting, &runs)?;
    let csv = write_csv(&out, &runs)?;
    let png = out.join("balance-waits.png");
    crate::plot::run(
        &out,
        "balance-waits-plot.py",
        PLOT_SCRIPT,
        [csv.as_os_str(), png.as_os_str()],
    )?;
    eprintln!(
        "report: {}\np99: {}, {}",
        report.display(),
        csv.display(),
        png.display()
    );
    Ok(())
}

/// One cell: its hog and pinning, its supervisor and Envoy, the `SO_REUSEPORT` processes, and every
/// round of `setups`; pushes the runs, and the set-ups skipped with why.
fn run_cell(
    peregrine: &Path,
    envoy_binary: &Path,
    gunicorn: &Path,
    options: &Options,
    cell: Cell,
    setups: &[SetUp],
    (runs, skipped): (&mut Vec<WaitRun>, &mut Vec<String>),
) -> anyhow::Result<()> {
    eprintln!("== {}", cell.title(options));
    if cell.pinned() {
        super::run::pin_to_other_cpu()?;
    } else {
        unpin()?;
    }
    let dir = TempDir::new().context("a temporary directory")?;
    let (listen, admin) = (free_port(), free_port());
    let mut setups = setups.to_vec();
    // The config, each set-up's service checked alone first, so that one `peregrine check` does
    // not take (an older supervisor's, say) is skipped alone.
    let config = |with: &[SetUp]| -> String {
        let mut config = PeregrineToml::local(free_port())
            .control_in(dir.path())
            .with_envoy(listen, admin);
        for setup in with {
            if let Some(service) = setup.service_table(cell, gunicorn) {
                config.service(setup.service(), service);
            }
        }
        config.toml()
    };
    for setup in setups.clone() {
        if setup == SetUp::ReusePort {
            continue;
        }
        if let Err(refusal) = check(peregrine, dir.path(), &config(&[setup])) {
            let why = format!(
                "{} skipped in {}: `peregrine check` refuses its config ({refusal})",
                setup.key(),
                cell.key(),
            );
            eprintln!("{why}");
            skipped.push(why);
            setups.retain(|s| *s != setup);
        }
    }
    let text = config(&setups);
    check(peregrine, dir.path(), &text).context("peregrine check")?;
    let hogs = if cell == Cell::CpuHog {
        (0..HOG_THREADS)
            .map(|_| super::spawn_hog(dir.path()))
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        Vec::new()
    };
    let (reuseport, _processes) = if setups.contains(&SetUp::ReusePort) {
        let (addr, processes) = reuseport(gunicorn, cell, dir.path())?;
        (Some(addr), processes)
    } else {
        (None, Vec::new())
    };
    let supervisor = Supervisor::start_in(peregrine, dir.path(), &text)?;
    let result = (|| {
        let mut envoy = Envoy::start_in(envoy_binary, dir.path(), &supervisor.envoy_bootstrap()?)?;
        let bench = CellBench {
            options,
            cell,
            supervisor: &supervisor,
            supervisor_pid: supervisor.pid(),
            envoy_pid: envoy.process().id(),
            listen: SocketAddr::from(([127, 0, 0, 1], listen)),
            reuseport,
        };
        bench.ready(&setups, envoy.admin_addr())?;
        for round in 0..options.rounds {
            for k in 0..setups.len() {
                let setup = setups[(k + round) % setups.len()];
                let run = bench
                    .run_quietest(setup, round)
                    .with_context(|| setup.label(cell.workers()))?;
                eprintln!("{}", describe(&run));
                runs.push(run);
            }
        }
        Ok::<_, anyhow::Error>(())
    })();
    if let Err(error) = result {
        eprintln!("{}", supervisor.logs());
        return Err(error);
    }
    drop(supervisor);
    drop(hogs);
    Ok(())
}

/// `peregrine check` on `text`; the error is its first line of complaint.
fn check(peregrine: &Path, dir: &Path, text: &str) -> anyhow::Result<()> {
    let path = dir.join("check.toml");
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    let output = Command::new(peregrine)
        .arg("check")
        .arg(&path)
        .output()
        .context("running peregrine check")?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let first = stderr
        .lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .unwrap_or("no message");
    anyhow::bail!("{first}")
}

/// Lets this thread (and what it starts from now on) run on every CPU again.
fn unpin() -> anyhow::Result<()> {
    let mut cpus = rustix::thread::CpuSet::new();
    for cpu in 0..crate::machine::online_cpus().max(2) {
        cpus.set(cpu);
    }
    rustix::thread::sched_setaffinity(None, &cpus).context("unpinning the benchmark")
}

/// The `SO_REUSEPORT` set-up: `cell.workers()` gunicorns `--workers 1 --reuse-port` on one port
/// (process `i` with `APP_WORKER_INDEX=i`, on CPU `i` in the pinned cell), once each has answered.
fn reuseport(
    gunicorn: &Path,
    cell: Cell,
    dir: &Path,
) -> anyhow::Result<(SocketAddr, Vec<ChildGuard>)> {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut processes = Vec::new();
    for index in 0..cell.workers() {
        let mut args = gunicorn_args(gunicorn, 1, false);
        args.splice(
            1..1,
            ["--reuse-port".to_owned(), "--bind".into(), addr.to_string()],
        );
        let mut command = if cell.pinned() {
            let mut command = Command::new("taskset");
            command.args(["-c", &index.to_string()]).args(&args);
            command
        } else {
            let mut command = Command::new(&args[0]);
            command.args(&args[1..]);
            command
        };
        command
            .env("APP_WORKER_INDEX", index.to_string())
            .env("PYTHONUNBUFFERED", "1")
            .envs(cell.env());
        processes.push(ChildGuard::spawn(
            &format!("reuseport-{index}"),
            &mut command,
            dir,
        )?);
    }
    let mut seen = std::collections::BTreeSet::new();
    poll_every(
        Duration::from_millis(100),
        Instant::now() + Duration::from_secs(30),
        "every SO_REUSEPORT gunicorn to answer",
        || {
            // A new connection each time: the kernel's hash sends some to each.
            for _ in 0..8 {
                if let Some(index) = answering_index(addr, "/") {
                    seen.insert(index);
                }
            }
            (seen.len() == cell.workers() as usize).then_some(())
        },
    )?;
    eprintln!(
        "reuseport: {} gunicorns on {addr}, SO_REUSEPORT, loaded directly",
        cell.workers()
    );
    Ok((addr, processes))
}

/// The `x-worker-index` of one answer to `GET path` at `addr` (a new connection).
fn answering_index(addr: SocketAddr, path: &str) -> Option<u32> {
    let plan = Plan {
        addrs: vec![addr],
        path: path.to_owned(),
        rate: 1000.0,
        duration: Duration::from_millis(1),
        connections: 1,
        timeout: Duration::from_secs(2),
        per_connection: false,
        burst: None,
        poisson: None,
        mix: None,
    };
    let records = openloop::run(&plan, Instant::now()).ok()?;
    records.first()?.worker_index
}

impl CellBench<'_> {
    /// Waits until Envoy holds every service's hosts, healthy, and routes to each.
    fn ready(&self, setups: &[SetUp], admin: SocketAddr) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(90);
        for setup in setups {
            if *setup == SetUp::ReusePort {
                continue;
            }
            let service = setup.service();
            poll_every(
                Duration::from_millis(250),
                deadline,
                &format!("Envoy routing /{service}"),
                || {
                    let hosts = hosts(&http_get(admin, "/clusters").ok()?.1, service);
                    let expected = setup
                        .hosts(self.cell)
                        .map_or(!hosts.is_empty(), |n| hosts.len() == n);
                    let ok = http_get(self.listen, &format!("/{service}/"))
                        .is_ok_and(|(status, _)| status == 200);
                    (ok && expected && hosts.iter().all(|h| h.healthy)).then_some(())
                },
            )?;
            eprintln!(
                "{service}: {} ({} hosts in Envoy)",
                setup.label(self.cell.workers()),
                hosts(&http_get(admin, "/clusters")?.1, service).len()
            );
        }
        Ok(())
    }

    /// The listen addresses of `setup`'s workers (the shared port for `SO_REUSEPORT`).
    fn addresses(&self, setup: SetUp) -> Vec<SocketAddr> {
        if setup == SetUp::ReusePort {
            return self.reuseport.into_iter().collect();
        }
        let Ok(status) = self.supervisor.status_json() else {
            return Vec::new();
        };
        let mut addresses: Vec<SocketAddr> = status["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|row| row["service"] == setup.service())
            .flat_map(|row| row["addresses"].as_array().cloned().unwrap_or_default())
            .filter_map(|a| a.as_str()?.parse().ok())
            .collect();
        addresses.sort();
        addresses.dedup();
        addresses
    }

    /// [`CellBench::run`], again (up to [`WAITS_NOISY_RETRIES`] times) while other processes used more
    /// than [`NOISY`] cores; keeps the quietest.
    fn run_quietest(&self, setup: SetUp, round: usize) -> anyhow::Result<WaitRun> {
        let mut best = self.run(setup, round)?;
        for _ in 0..WAITS_NOISY_RETRIES {
            if best.others <= NOISY {
                break;
            }
            eprintln!(
                "  other processes used {:.2} cores: running again ({})",
                best.others,
                describe(&best)
            );
            let again = self.run(setup, round)?;
            if again.others < best.others {
                best = again;
            }
        }
        Ok(best)
    }

    /// One run of `setup` in round `round`: warm-up and measured window, then the drain.
    fn run(&self, setup: SetUp, round: usize) -> anyhow::Result<WaitRun> {
        let options = self.options;
        let seed = options.seed + round as u64;
        let (addr, prefix) = match setup {
            SetUp::ReusePort => (
                self.reuseport
                    .context("the SO_REUSEPORT gunicorns are not running")?,
                String::new(),
            ),
            _ => (self.listen, format!("/{}", setup.service())),
        };
        let plan = Plan {
            addrs: vec![addr],
            path: String::new(),
            rate: self.cell.rate(options),
            duration: Duration::from_secs(options.warmup + options.duration),
            connections: CONNECTIONS,
            timeout: TIMEOUT,
            per_connection: false,
            burst: None,
            poisson: Some(seed),
            mix: Some(Mix {
                seed: seed ^ MIX_SEED,
                targets: self.cell.targets(&prefix),
            }),
        };
        let through_envoy = setup != SetUp::ReusePort;
        let ticks = |pid: u32| procfs::stat(pid).map_or(0, |s| s.cpu_ticks());
        let hz = procfs::clock_ticks_per_second() as f64;
        // What the supervisor (sampling, reporting) and Envoy (its timers, the ORCA streams) take
        // with no requests: subtracted from the run's.
        let idle_from = (
            Instant::now(),
            ticks(self.supervisor_pid),
            ticks(self.envoy_pid),
        );
        std::thread::sleep(IDLE);
        let idle_secs = idle_from.0.elapsed().as_secs_f64();
        let idle = (
            ticks(self.supervisor_pid).saturating_sub(idle_from.1) as f64 / hz / idle_secs,
            ticks(self.envoy_pid).saturating_sub(idle_from.2) as f64 / hz / idle_secs,
        );
        let start = Instant::now() + Duration::from_millis(500);
        let before = (
            Busy::now(std::process::id())?,
            ticks(self.supervisor_pid),
            ticks(self.envoy_pid),
        );
        let records = openloop::run(&plan, start)?;
        let after = (
            Busy::now(std::process::id())?,
            ticks(self.supervisor_pid),
            ticks(self.envoy_pid),
        );
        let others = after.0.since(before.0).1;
        let run_secs = start.elapsed().as_secs_f64() + 0.5;
        self.drain(setup)?;
        let mut run = summarize(self.cell, setup, round, options, &records);
        run.seed = seed;
        run.others = others;
        let answered = records
            .iter()
            .filter(|r| matches!(r.answer, Answer::Worker(_)))
            .count()
            .max(1) as f64;
        let per_request =
            |ticks: u64, idle: f64| (ticks as f64 / hz - idle * run_secs) / answered * 1e6;
        if through_envoy {
            run.supervisor_us = Some(per_request(after.1.saturating_sub(before.1), idle.0));
            run.envoy_us = Some(per_request(after.2.saturating_sub(before.2), idle.1));
            run.supervisor_idle = Some(idle.0);
            run.envoy_idle = Some(idle.1);
        }
        Ok(run)
    }

    /// Waits until every listen queue of `setup` is empty (a run that overloaded a worker leaves
    /// connections queued), then for the last request in hand (the longest wait is 500 ms).
    fn drain(&self, setup: SetUp) -> anyhow::Result<()> {
        let ports: Vec<u16> = self.addresses(setup).iter().map(SocketAddr::port).collect();
        poll_every(
            Duration::from_millis(100),
            Instant::now() + Duration::from_secs(120),
            &format!("the listen queues of {} to empty", setup.key()),
            || (listen_backlog(&ports) == 0).then_some(()),
        )?;
        std::thread::sleep(Duration::from_millis(600));
        Ok(())
    }
}

/// Connections waiting in the accept queues of the listeners on `ports` (`/proc/net/tcp`: a
/// listener's `rx_queue` is its accept queue).
fn listen_backlog(ports: &[u16]) -> u64 {
    let Ok(text) = std::fs::read_to_string("/proc/net/tcp") else {
        return 0;
    };
    backlog_in(&text, ports)
}

/// [`listen_backlog`] of one `/proc/net/tcp` text.
fn backlog_in(text: &str, ports: &[u16]) -> u64 {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, state, queues) = (fields.get(1)?, fields.get(3)?, fields.get(4)?);
            if *state != "0A" {
                return None;
            }
            let port = u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?;
            if !ports.contains(&port) {
                return None;
            }
            u64::from_str_radix(queues.split(':').nth(1)?, 16).ok()
        })
        .sum()
}

/// The figures of one run from its records.
fn summarize(
    cell: Cell,
    setup: SetUp,
    round: usize,
    options: &Options,
    records: &[Record],
) -> WaitRun {
    let from = Duration::from_secs(options.warmup);
    let to = from + Duration::from_secs(options.duration);
    let measured: Vec<Record> = records
        .iter()
        .filter(|r| r.scheduled >= from && r.scheduled < to)
        .copied()
        .collect();
    let workers = cell.workers() as usize;
    let mut counts = vec![0u64; workers];
    let mut unindexed = 0;
    let mut answered = 0usize;
    for record in &measured {
        if !matches!(record.answer, Answer::Worker(_)) {
            continue;
        }
        answered += 1;
        match record.worker_index.map(|i| i as usize) {
            Some(i) if i < workers => counts[i] += 1,
            _ => unindexed += 1,
        }
    }
    let total = counts.iter().sum::<u64>().max(1) as f64;
    WaitRun {
        cell,
        setup,
        round,
        seed: 0,
        requests: measured.len(),
        failed: measured.len() - answered,
        p50: percentile(&measured, 0.5),
        p99: percentile(&measured, 0.99),
        p99_short: (cell != Cell::CpuHog)
            .then(|| {
                let short: Vec<Record> =
                    measured.iter().filter(|r| r.target == 0).copied().collect();
                percentile(&short, 0.99)
            })
            .flatten(),
        shares: counts.iter().map(|c| *c as f64 / total).collect(),
        unindexed,
        supervisor_us: None,
        envoy_us: None,
        supervisor_idle: None,
        envoy_idle: None,
        others: 0.0,
    }
}

/// One line per run, as it ends.
fn describe(run: &WaitRun) -> String {
    let duration = |d: Option<Duration>| d.map_or("failed".into(), format_duration);
    format!(
        "{} {} round {}: p50 {}, p99 {}, failed {}/{}, shares {}, supervisor {}, Envoy {}, others {:.2} cores",
        run.cell.key(),
        run.setup.key(),
        run.round + 1,
        duration(run.p50),
        duration(run.p99),
        run.failed,
        run.requests,
        shares(&run.shares),
        run.supervisor_us.map_or("-".into(), |us| format!(
            "{us:.0} µs/req (idle {:.3} cores)",
            run.supervisor_idle.unwrap_or(0.0)
        )),
        run.envoy_us.map_or("-".into(), |us| format!(
            "{us:.0} µs/req (idle {:.3} cores)",
            run.envoy_idle.unwrap_or(0.0)
        )),
        run.others
    )
}

/// Shares in percent, `25/25/25/25%`.
fn shares(shares: &[f64]) -> String {
    let parts: Vec<String> = shares.iter().map(|s| format!("{:.0}", s * 100.0)).collect();
    format!("{}%", parts.join("/"))
}

// === the report ===

/// What the report says about the runs as a whole.
struct Setting {
    command: String,
    cpu_line: String,
    envoy_version: String,
    elapsed: Duration,
    /// The set-ups skipped, and why.
    skipped: Vec<String>,
}

/// `median (min-max)` of durations in ms.
fn ms_median_range(values: &[Option<Duration>]) -> String {
    if values.iter().any(Option::is_none) {
        let failed = values.iter().filter(|v| v.is_none()).count();
        let ok: Vec<f64> = values.iter().flatten().map(Duration::as_secs_f64).collect();
        if ok.is_empty() {
            return "failed".into();
        }
        return format!(
            "{} in {} rounds, {failed} on a failure",
            format_duration(Duration::from_secs_f64(median(ok))),
            values.len() - failed
        );
    }
    let secs: Vec<f64> = values.iter().flatten().map(Duration::as_secs_f64).collect();
    let (low, high) = secs
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    format!(
        "{} ({}-{})",
        format_duration(Duration::from_secs_f64(median(secs.clone()))),
        format_duration(Duration::from_secs_f64(low)),
        format_duration(Duration::from_secs_f64(high))
    )
}

/// The median of a figure over runs, `-` when no run has it.
fn median_of(values: impl Iterator<Item = Option<f64>>, format: impl Fn(f64) -> String) -> String {
    let values: Vec<f64> = values.flatten().collect();
    if values.is_empty() {
        "-".into()
    } else {
        format(median(values))
    }
}

/// `µs per request (idle cores)`, medians over runs.
fn cpu(
    per_request: impl Iterator<Item = Option<f64>>,
    idle: impl Iterator<Item = Option<f64>>,
) -> String {
    let per_request = median_of(per_request, |us| format!("{us:.0}"));
    if per_request == "-" {
        return per_request;
    }
    format!("{per_request} ({})", median_of(idle, |c| format!("{c:.3}")))
}

/// The report's tables: one per cell, one row per set-up.
fn tables(options: &Options, runs: &[WaitRun]) -> String {
    let mut out = String::new();
    for cell in Cell::ALL {
        let of_cell: Vec<&WaitRun> = runs.iter().filter(|r| r.cell == cell).collect();
        if of_cell.is_empty() {
            continue;
        }
        writeln!(out, "**{}**\n", cell.title(options)).expect("a String");
        let mut rows = vec![
            [
                "set-up",
                "p50",
                "p99 median (min-max)",
                "p99 of 5 ms requests, median (min-max)",
                "failed",
                "share per worker",
                "supervisor µs/req (idle)",
                "Envoy µs/req (idle)",
                "others (max)",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for setup in SetUp::ALL {
            let of: Vec<&WaitRun> = of_cell
                .iter()
                .copied()
                .filter(|r| r.setup == setup)
                .collect();
            if of.is_empty() {
                continue;
            }
            let p50s: Vec<f64> = of
                .iter()
                .filter_map(|r| r.p50)
                .map(|d| d.as_secs_f64())
                .collect();
            let workers = cell.workers() as usize;
            let share: Vec<f64> = (0..workers)
                .map(|i| median(of.iter().map(|r| r.shares[i]).collect()))
                .collect();
            let others = of.iter().map(|r| r.others).fold(0.0, f64::max);
            let unindexed: usize = of.iter().map(|r| r.unindexed).sum();
            rows.push(vec![
                setup.label(cell.workers()),
                if p50s.is_empty() {
                    "failed".into()
                } else {
                    format_duration(Duration::from_secs_f64(median(p50s)))
                },
                ms_median_range(&of.iter().map(|r| r.p99).collect::<Vec<_>>()),
                if cell == Cell::CpuHog {
                    "-".into()
                } else {
                    ms_median_range(&of.iter().map(|r| r.p99_short).collect::<Vec<_>>())
                },
                format!(
                    "{} of {}",
                    of.iter().map(|r| r.failed).sum::<usize>(),
                    of.iter().map(|r| r.requests).sum::<usize>()
                ),
                if unindexed > 0 {
                    format!("{} ({unindexed} unindexed)", shares(&share))
                } else {
                    shares(&share)
                },
                cpu(
                    of.iter().map(|r| r.supervisor_us),
                    of.iter().map(|r| r.supervisor_idle),
                ),
                cpu(
                    of.iter().map(|r| r.envoy_us),
                    of.iter().map(|r| r.envoy_idle),
                ),
                format!("{others:.2}"),
            ]);
        }
        out.push_str(&markdown(&rows, 1));
        out.push('\n');
    }
    out
}

fn write_report(
    out: &Path,
    options: &Options,
    setting: &Setting,
    runs: &[WaitRun],
) -> anyhow::Result<PathBuf> {
    let mut report = String::new();
    writeln!(
        report,
        "# Balance: gunicorn sync workers whose requests wait\n"
    )?;
    writeln!(report, "Command: `{}`", setting.command)?;
    machine_lines(&mut report, &setting.cpu_line)?;
    writeln!(
        report,
        "Envoy: {} (`--concurrency 1`)",
        setting.envoy_version
    )?;
    let seeds: Vec<String> = (0..options.rounds)
        .map(|r| (options.seed + r as u64).to_string())
        .collect();
    writeln!(
        report,
        "Load: Poisson arrivals, open loop, latency from the scheduled time; {} rounds (seeds {}), {} s warm-up + {} s measured per run; {} in all",
        options.rounds,
        seeds.join(", "),
        options.warmup,
        options.duration,
        format_duration(setting.elapsed)
    )?;
    let others: Vec<f64> = runs.iter().map(|r| r.others).collect();
    if !others.is_empty() {
        writeln!(
            report,
            "Other processes' CPU during the kept runs: median {:.2} cores, max {:.2}",
            median(others.clone()),
            others.iter().copied().fold(0.0, f64::max)
        )?;
    }
    for why in &setting.skipped {
        writeln!(report, "Skipped: {why}")?;
    }
    writeln!(report)?;
    report.push_str(&tables(options, runs));
    writeln!(
        report,
        "p50 and p99: the median over rounds (p99 also its min-max; a p99 that falls on a failed request counts as none); p99 of 5 ms requests: of the requests that drew the short wait alone; failed: summed over rounds, of the requests scheduled in the measured windows; share: each worker's share of the answers (worker 0 first; the slowed or hogged one), median over rounds; supervisor and Envoy: their CPU per answered request over the whole run (`/proc/PID/stat`, 10 ms ticks), less what they took idle in the 2 s before it (in brackets, in cores), median over rounds (`-`: not in the path); others: the most CPU other processes took during a kept run, in cores."
    )?;
    let path = out.join("balance-waits.md");
    std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    print!("{report}");
    Ok(path)
}

/// `cell,setup,label,round,p50_ms,p99_ms,failed` per run (an empty p99 where it fell on a failure).
fn write_csv(out: &Path, runs: &[WaitRun]) -> anyhow::Result<PathBuf> {
    let mut csv = String::from("cell,setup,label,round,p50_ms,p99_ms,failed\n");
    let ms =
        |d: Option<Duration>| d.map_or(String::new(), |d| format!("{:.3}", d.as_secs_f64() * 1e3));
    for run in runs {
        writeln!(
            csv,
            "{},{},{},{},{},{},{}",
            run.cell.key(),
            run.setup.key(),
            run.setup.label(run.cell.workers()).replace(',', ";"),
            run.round + 1,
            ms(run.p50),
            ms(run.p99),
            run.failed
        )?;
    }
    let path = out.join("balance-waits.csv");
    std::fs::write(&path, csv).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::parse_args;

    fn args(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn parses_the_waits_options() {
        let defaults = parse_args(&args("--waits")).unwrap();
        assert!(defaults.waits);
        assert_eq!(defaults.duration, DURATION);
        assert_eq!((defaults.waits_rate, defaults.hog_rate), (RATE, HOG_RATE));
        assert_eq!((defaults.rounds, defaults.seed), (3, 1));
        let chosen = parse_args(&args(
            "--waits --rounds 2 --duration 5 --rate 120 --hog-rate 80 --seed 9 --cell io --cell cpu-hog --setup shared-socket --setup lr4",
        ))
        .unwrap();
        assert_eq!((chosen.rounds, chosen.duration, chosen.seed), (2, 5, 9));
        assert_eq!((chosen.waits_rate, chosen.hog_rate), (120.0, 80.0));
        assert_eq!(chosen.cells, ["io", "cpu-hog"]);
        assert_eq!(chosen.setups, ["shared-socket", "lr4"]);
        assert_eq!(
            parse_args(&[]).unwrap().duration,
            10,
            "the other runs keep theirs"
        );
        assert!(parse_args(&args("--waits --cell disk")).is_err());
        assert!(parse_args(&args("--waits --setup orca-ib")).is_err());
        assert!(
            parse_args(&args("--cell io")).is_err(),
            "--cell without --waits"
        );
        assert!(parse_args(&args("--waits --timeline")).is_err());
        assert!(parse_args(&args("--waits --rate 0")).is_err());
        assert!(parse_args(&args("--waits --rate")).is_err());
    }

    #[test]
    fn the_cells_mix_and_set_ups() {
        let io = Cell::Io.targets("/orca");
        assert_eq!(io[0], ("/orca/slow?ms=5".to_owned(), 0.9));
        assert_eq!(io[1], ("/orca/slow?ms=100".to_owned(), 0.1));
        // 14.5 ms of waiting on average.
        let mean: f64 = MIX.iter().map(|(ms, w)| *ms as f64 * w).sum();
        assert!((mean - 14.5).abs() < 1e-9);
        assert_eq!(Cell::CpuHog.targets(""), [("/?cpu=4".to_owned(), 1.0)]);
        assert!(
            Cell::SlowWorker
                .env()
                .contains(&("APP_SLOW_INDEX".into(), "0".into()))
        );
        // No route prefix is a prefix of another.
        for a in SetUp::ALL {
            for b in SetUp::ALL {
                assert!(
                    a == b || !b.service().starts_with(a.service()),
                    "{a:?} {b:?}"
                );
            }
        }
        let gunicorn = Path::new("/venv/bin/gunicorn");
        let socket = SetUp::SharedSocket
            .service_table(Cell::Io, gunicorn)
            .unwrap();
        assert_eq!(socket.count, Some(1));
        let command = socket.command.unwrap();
        let workers = command.iter().position(|a| a == "--workers").unwrap();
        assert_eq!(command[workers + 1], "4");
        assert!(command.iter().any(|a| a.ends_with("gunicorn_forks.py")));
        let lr = SetUp::LrAll.service_table(Cell::CpuHog, gunicorn).unwrap();
        assert_eq!(
            (lr.count, lr.choice_count, lr.lb_policy.as_deref()),
            (Some(2), Some(2), Some("least_request"))
        );
        assert_eq!(lr.command.unwrap()[..3], ["taskset", "-c", "{index}"]);
        let orca = SetUp::Orca.service_table(Cell::Io, gunicorn).unwrap();
        assert_eq!(
            (orca.count, orca.lb_policy, orca.orca),
            (Some(4), None, Some(Orca::On))
        );
        // Peregrine's default: no balancing key, so gunicorn's sync worker shares a listener.
        let shared = SetUp::Shared.service_table(Cell::Io, gunicorn).unwrap();
        assert_eq!(
            (shared.count, shared.orca, shared.lb_policy, shared.listener),
            (Some(4), None, None, None)
        );
        assert!(SetUp::ReusePort.service_table(Cell::Io, gunicorn).is_none());
    }

    #[test]
    fn reads_listen_queues() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:1F90 00000000:0000 0A 00000000:00000003 00:00000000 00000000  1000        0 1\n   1: 0100007F:1F91 00000000:0000 0A 00000000:00000002 00:00000000 00000000  1000        0 2\n   2: 0100007F:1F90 0100007F:C350 01 00000000:00000009 00:00000000 00000000  1000        0 3\n";
        assert_eq!(backlog_in(text, &[0x1F90]), 3, "listeners only");
        assert_eq!(backlog_in(text, &[0x1F90, 0x1F91]), 5);
        assert_eq!(backlog_in(text, &[80]), 0);
    }

    #[test]
    fn summarizes_by_the_answers_index() {
        let options = parse_args(&args("--waits --warmup 1 --duration 2")).unwrap();
        let record = |ms: u64, latency: u64, answer, index| Record {
            scheduled: Duration::from_millis(ms),
            sent: Duration::from_millis(ms),
            done: Duration::from_millis(ms + latency),
            answer,
            target: 0,
            worker_index: index,
        };
        let records = vec![
            record(500, 900, Answer::Worker(1), Some(0)),
            record(1000, 5, Answer::Worker(1), Some(0)),
            record(1100, 7, Answer::Worker(1), Some(1)),
            record(1200, 9, Answer::Worker(1), Some(1)),
            record(1300, 9, Answer::Worker(1), Some(3)),
            record(1400, 9, Answer::Error, None),
            record(3000, 5, Answer::Worker(1), Some(2)),
        ];
        let run = summarize(Cell::Io, SetUp::Orca, 0, &options, &records);
        assert_eq!((run.requests, run.failed, run.unindexed), (5, 1, 0));
        assert_eq!(run.shares, [0.25, 0.5, 0.0, 0.25]);
        assert_eq!(run.p50, Some(Duration::from_millis(9)));
        assert_eq!(run.p99, None);
        assert_eq!(run.p99_short, None, "the error drew the short wait too");
    }
}
