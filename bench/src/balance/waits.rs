//! `cargo xtask bench balance --waits`: servers whose requests wait, as on a database (gunicorn *sync*
//! workers, one request at a time; uvicorn, many at once), or burn CPU beside a hog, behind the real
//! Envoy (one, or four), per balancing set-up.
//!
//! **The apps** (`target/pyapps/venv`). Every answer names the process that served it
//! (`X-Worker-Index`), so each worker's share is counted even where one server forks several on one
//! socket.
//! - gunicorn 27 on `tests/apps/wsgi_app.py`: `/slow?ms=N` sleeps N ms and uses no CPU to speak of,
//!   holding its process; gunicorn's sync worker closes every connection.
//! - uvicorn on `tests/apps/asgi_app.py`: `/slow?ms=N` awaits N ms and blocks nothing; `?cpu=MS`
//!   blocks the event loop. uvicorn keeps connections alive. It takes a passed descriptor as a Unix
//!   socket (`socket.fromfd(fd, AF_UNIX, ...)`, `--fd`), so asyncio leaves Nagle's algorithm on the
//!   connections it accepts there, and an answer on a kept-alive connection after the first waits
//!   about 40 ms for the client's delayed ACK, unless the listener itself has `TCP_NODELAY` (accepted
//!   connections inherit it). The set-ups under Peregrine measure the listener the supervisor
//!   passes, as it is; the `reuseport` set-up's listener has `TCP_NODELAY`, as a uvicorn that binds
//!   its own port has on every connection.
//!
//! **Set-ups** ([`SetUp`]; `--setup KEY`, all by default), each taken in turn in every round, in an
//! order rotated per round:
//! - `shared-socket`: what the server does by itself. One Peregrine worker (`count = 1`) whose server
//!   runs `--workers 4` (2 in the hogged cells) on the one passed socket: one accept queue, each
//!   connection taken by whichever process is free (for uvicorn, each of Envoy's kept-alive
//!   connections, for as long as it lasts). gunicorn's forks learn their index from
//!   `tests/apps/gunicorn_forks.py` (`-c`); uvicorn's take one each as they load the app
//!   (`APP_INDEX_DIR`, lock files in the cell's directory; `tests/apps/app_knobs.py`).
//! - `orca`: a listener per worker balanced on ORCA, the default before shared listeners (`count =
//!   4`, `--workers 1`, `orca = true`: client-side weighted round robin on the supervisor's ORCA
//!   reports, which for gunicorn's sync worker carry its requests in flight).
//! - `lr2`, `lr4`: `lb_policy = "least_request"` with `choice_count` 2, and with `choice_count` the
//!   number of workers (join the shortest queue of Envoy's own count).
//! - `rr`: `lb_policy = "round_robin"`.
//! - `reuseport`: the workers' servers started by the benchmark itself, outside Peregrine, each of
//!   one process on one port with `SO_REUSEPORT`, loaded *directly* by the generator (no Envoy):
//!   gunicorn `--workers 1 --reuse-port --bind 127.0.0.1:P`; uvicorn, which has no `--reuse-port`,
//!   through `tests/apps/reuseport.py`, which binds the port and passes it as `--fd 3`. The kernel
//!   hashes each new connection to one of them: for gunicorn every request (it closes every
//!   connection), for uvicorn each of the generator's connections for the whole run.
//! - `shared`: Peregrine's default, no balancing key. For gunicorn's sync worker (`concurrency` read
//!   off the command as 1): one listener the supervisor binds and all `count` workers share, published
//!   to Envoy as one endpoint. For uvicorn (`concurrency` many): a listener per worker, balanced on
//!   ORCA, as `peregrine check` prints it ("a listener per worker, orca over the workers").
//!
//! When `peregrine check` does not take a set-up's config (an older supervisor, say), the set-up is
//! skipped with the reason, and the report says so; so is a set-up a cell leaves out
//! ([`Cell::leaves_out`]): `reuseport` in four-envoys (no Envoy is in its path: its figure is io's),
//! `orca` in the async cells (it is the default there, the `shared` row), `lr2` in async-hog (with 2
//! workers it is `lr4`).
//!
//! **Cells** ([`Cell`]; `--cell KEY`, all by default), each with a supervisor and Envoys
//! (`--concurrency 1`, HTTP/1.1 to the workers) of its own, started when the cell starts:
//! - `io`: 4 gunicorn workers, nothing pinned. Each request waits 5 ms (90%) or 100 ms (10%): 14.5 ms
//!   on average, so 4 workers serve about 250/s with gunicorn's own cost; `--rate` 150/s is 60% of
//!   that.
//! - `slow-worker`: the same, but worker 0's waits are 5x longer (`APP_WAIT_FACTOR=5`,
//!   `APP_SLOW_INDEX=0`; in `shared-socket` the fork of index 0, by `gunicorn_forks.py`).
//! - `cpu-hog`: 2 gunicorn workers, worker `i` pinned to CPU `i` (`taskset`; in `shared-socket` the
//!   fork of index `i`, by `APP_PIN_FORKS=0,1`), requests of `?cpu=4` (4 ms of CPU) at `--hog-rate`
//!   100/s, and a 3-process CPU hog (`sh -c 'while :; do :; done'` x3) pinned to CPU 0. The benchmark
//!   pins itself (and so the supervisor, Envoy and the generator) to CPU 1 in the hogged cells, as the
//!   other balance scenarios do.
//! - `four-envoys`: io's workers, waits and rate behind **four** Envoys, each `--concurrency 1` with
//!   a bootstrap of its own (`peregrine envoy-bootstrap` on the cell's config with its own listener,
//!   admin port and node id; `--base-id` random per Envoy) on the one supervisor's xDS. The generator
//!   sends request `i` to Envoy `i mod 4`, each Envoy with a quarter of the connections. Each Envoy's
//!   least request counts only the quarter of the requests in flight that it sent, while a shared
//!   accept queue holds them all.
//! - `async-io`: io's waits and rate with 4 uvicorn workers, whose waits block nothing.
//! - `async-hog`: cpu-hog with 2 uvicorn workers (pinned as there; in `shared-socket` uvicorn's forks
//!   pin themselves, `APP_PIN_FORKS=0,1`).
//!
//! **Load.** The open-loop generator ([`openloop`](super::openloop)) with Poisson arrivals (seeded:
//! round `r` uses `--seed` + `r`, the same for every set-up of the round) and, in the waiting cells,
//! each request's wait drawn from the mix (seeded likewise), so every set-up of a round gets the very
//! same requests at the very same times. Latency from each request's scheduled time;
//! `--connections` (256) kept-alive connections, each request to whichever is free (of its Envoy's
//! quarter, in four-envoys); an answer may take 10 s. A run is a `--warmup` (5 s) and a measured
//! `--duration` (20 s); only requests scheduled in the window count, failures as slower than every
//! answer.
//!
//! **What makes a `SO_REUSEPORT` split vary.** The kernel picks a process by a hash of each
//! connection's addresses and ports (with a secret drawn at boot), so the split is set by the
//! client's source ports, and the kernel gives every run's connections new ephemeral ports: each
//! run is a new draw, whatever the seed (the seed sets the requests, not the split). With uvicorn a
//! connection stays with its process for the run, so the split of the requests is near that of the
//! generator's connections (its one queue hands a request to a free connection, which leans a little
//! away from a slow process's busy ones); how far the split strays from even shrinks with the
//! number of connections (256 over 2 processes: about 3 points either way; `--connections 64`
//! strays twice as far). With gunicorn each request is a new connection, and the split is even
//! over a run. The report lists the `reuseport` set-up's split and p99 per round: its luckiest and
//! unluckiest draws.
//!
//! **Figures** per cell and set-up: p50 and p99 (median over rounds, and the p99's min-max), the p99
//! of the 5 ms requests (waiting cells), failed requests (summed), each worker's share of the answers
//! (median), and the CPU the supervisor and Envoy (four-envoys: the four together) took per answered
//! request (`/proc/PID/stat` before and after the run, 10 ms ticks), less what each took idle over
//! the 2 s before the run (the supervisor samples and reports, Envoy keeps its ORCA streams and
//! timers), which the report gives beside it. The goals, where a run has both sides: on async-io
//! the default's p99 within 1.1x of `lr4`'s; under async-hog within 1.5x of `reuseport`'s luckiest
//! round and at most 0.5x its unluckiest. Between runs the benchmark waits until every listen
//! queue of the set-up is empty (`/proc/net/tcp`), so a backlog a run left does not delay the next.
//! Report: `target/bench/balance-waits.md`; p99 and shares per run: `target/bench/balance-waits.csv`,
//! and the p99s plotted per cell and set-up in `.png`.
//!
//! **Ctrl-C** fails the next wait between runs (at most one run later): the guards then stop every
//! process the cell started; a second one ends the benchmark at once.
//!
//! **Noise.** As the other balance runs: the CPU that processes outside this benchmark's tree took
//! during each run; a run over 0.1 core is run again (once: on a shared machine more would
//! triple the runs) and the quieter kept.
//!
//! **How long.** A run takes its warm-up and window plus about 3 s (the idle measure, the drain),
//! 28 s at the defaults, twice that when it is run again for noise; a cell's start (supervisor,
//! Envoys, readiness) a few seconds. At the defaults, 3 rounds of every set-up a cell runs: io,
//! slow-worker and cpu-hog 7 set-ups each (about 10 min a cell), four-envoys and async-io 6 (about
//! 8.5 min), async-hog 5 (about 7 min); every cell, about 55 min on a quiet machine, up to twice
//! that on a busy one. `--duration 15` takes a sixth off.

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
/// Requests per second of the hogged cells by default.
pub(super) const HOG_RATE: f64 = 100.0;
/// The measured window by default, in seconds.
pub(super) const DURATION: u64 = 20;
/// The waits, in ms, and their shares.
const MIX: [(u64, f64); 2] = [(5, 0.9), (100, 0.1)];
/// XORed into a round's seed for the waits' draws (the arrivals take the seed itself).
const MIX_SEED: u64 = 0x5EED_0F7A_46E7;
/// How much longer the slow worker waits.
const SLOW_FACTOR: u32 = 5;
/// CPU per request in the hogged cells.
const CPU_MS: u64 = 4;
/// Processes of the hog on CPU 0.
const HOG_THREADS: usize = 3;
/// The Envoys of the four-envoys cell.
const ENVOYS: usize = 4;
/// How long the supervisor's and Envoy's idle CPU is measured before each run.
const IDLE: Duration = Duration::from_secs(2);
/// How many times a noisy run is repeated here (the quietest kept): once, as in the timeline; a
/// shared machine would otherwise triple the runs.
const WAITS_NOISY_RETRIES: usize = 1;
/// The plotting script.
const PLOT_SCRIPT: &str = include_str!("waits_plot.py");

/// What the workers do, what slows one of them, and what stands in front of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cell {
    Io,
    SlowWorker,
    CpuHog,
    FourEnvoys,
    AsyncIo,
    AsyncHog,
}

impl Cell {
    const ALL: [Cell; 6] = [
        Cell::Io,
        Cell::SlowWorker,
        Cell::CpuHog,
        Cell::FourEnvoys,
        Cell::AsyncIo,
        Cell::AsyncHog,
    ];

    fn key(self) -> &'static str {
        match self {
            Cell::Io => "io",
            Cell::SlowWorker => "slow-worker",
            Cell::CpuHog => "cpu-hog",
            Cell::FourEnvoys => "four-envoys",
            Cell::AsyncIo => "async-io",
            Cell::AsyncHog => "async-hog",
        }
    }

    fn title(self, options: &Options) -> String {
        let rate = self.rate(options);
        match self {
            Cell::Io => format!("io: 4 workers, waits of 5 ms (90%) or 100 ms (10%), {rate} req/s"),
            Cell::SlowWorker => format!(
                "slow-worker: the same, worker 0's waits {SLOW_FACTOR}x longer, {rate} req/s"
            ),
            Cell::CpuHog => format!(
                "cpu-hog: 2 pinned workers, {CPU_MS} ms of CPU per request, a {HOG_THREADS}-process hog on CPU 0, {rate} req/s"
            ),
            Cell::FourEnvoys => format!(
                "four-envoys: io behind {ENVOYS} Envoys, request i to Envoy i mod {ENVOYS}, {rate} req/s"
            ),
            Cell::AsyncIo => format!(
                "async-io: 4 uvicorn workers, waits of 5 ms (90%) or 100 ms (10%) that block nothing, {rate} req/s"
            ),
            Cell::AsyncHog => format!(
                "async-hog: 2 pinned uvicorn workers, {CPU_MS} ms of CPU per request, a {HOG_THREADS}-process hog on CPU 0, {rate} req/s"
            ),
        }
    }

    fn workers(self) -> u32 {
        match self {
            Cell::Io | Cell::SlowWorker | Cell::FourEnvoys | Cell::AsyncIo => 4,
            Cell::CpuHog | Cell::AsyncHog => 2,
        }
    }

    /// Whether the requests wait (the mix of 5 ms and 100 ms), rather than burn CPU beside a hog.
    fn waits(self) -> bool {
        !self.hogged()
    }

    /// Whether CPU 0 has the hog, and each worker a CPU of its own.
    fn hogged(self) -> bool {
        matches!(self, Cell::CpuHog | Cell::AsyncHog)
    }

    fn rate(self, options: &Options) -> f64 {
        if self.waits() {
            options.waits_rate
        } else {
            options.hog_rate
        }
    }

    fn app(self) -> App {
        match self {
            Cell::AsyncIo | Cell::AsyncHog => App::Uvicorn,
            _ => App::Gunicorn,
        }
    }

    /// The Envoys in front of the supervisor's workers.
    fn envoys(self) -> usize {
        if self == Cell::FourEnvoys { ENVOYS } else { 1 }
    }

    /// Why `setup` is left out of this cell, if it is.
    fn leaves_out(self, setup: SetUp) -> Option<&'static str> {
        match (self, setup) {
            (Cell::FourEnvoys, SetUp::ReusePort) => {
                Some("no Envoy is in its path, so the io cell's row is its figure")
            }
            (Cell::AsyncIo | Cell::AsyncHog, SetUp::Orca) => Some(
                "ORCA on a listener each is what Peregrine gives uvicorn by default: the `shared` row",
            ),
            (Cell::AsyncHog, SetUp::Lr2) => Some("with 2 workers it is lr4's config"),
            _ => None,
        }
    }

    /// The app's environment in this cell.
    fn env(self) -> Vec<(String, String)> {
        match self {
            Cell::SlowWorker => vec![
                ("APP_WAIT_FACTOR".into(), SLOW_FACTOR.to_string()),
                ("APP_SLOW_INDEX".into(), "0".into()),
            ],
            _ => Vec::new(),
        }
    }

    /// The request targets under `prefix` (a route, or empty) with their weights.
    fn targets(self, prefix: &str) -> Vec<(String, f64)> {
        if self.waits() {
            MIX.iter()
                .map(|(ms, weight)| (format!("{prefix}/slow?ms={ms}"), *weight))
                .collect()
        } else {
            vec![(format!("{prefix}/?cpu={CPU_MS}"), 1.0)]
        }
    }
}

/// The server the workers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum App {
    /// gunicorn's sync worker on `tests/apps/wsgi_app.py`: one request at a time.
    Gunicorn,
    /// uvicorn on `tests/apps/asgi_app.py`: many at once, on one event loop.
    Uvicorn,
}

/// Where a server takes its listener from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Listener {
    /// The one the supervisor passes.
    Passed,
    /// One it binds with `SO_REUSEPORT` on this address, beside its siblings.
    ReusePort(SocketAddr),
}

impl App {
    fn name(self) -> &'static str {
        match self {
            App::Gunicorn => "gunicorn",
            App::Uvicorn => "uvicorn",
        }
    }

    /// The server on the test app (in the virtualenv's `bin`) with `processes` processes on one
    /// `listener`: forked by the server itself when more than one, each told its index (gunicorn by
    /// `gunicorn_forks.py`, uvicorn by [`App::forks_env`]).
    fn command(self, bin: &Path, processes: u32, listener: Listener) -> Vec<String> {
        match self {
            App::Gunicorn => {
                let mut command = gunicorn_command(&bin.join("gunicorn"));
                let at = command
                    .iter()
                    .position(|a| a == "--workers")
                    .expect("gunicorn_command sets --workers")
                    + 1;
                command[at] = processes.to_string();
                if processes > 1 {
                    command.splice(
                        1..1,
                        [
                            "-c".to_owned(),
                            test_app("gunicorn_forks.py").display().to_string(),
                        ],
                    );
                }
                if let Listener::ReusePort(addr) = listener {
                    command.splice(
                        1..1,
                        ["--reuse-port".to_owned(), "--bind".into(), addr.to_string()],
                    );
                }
                command
            }
            App::Uvicorn => {
                let uvicorn = bin.join("uvicorn").display().to_string();
                // uvicorn has no --reuse-port: `reuseport.py` binds the port and passes it as fd 3.
                let mut command = match listener {
                    Listener::Passed => vec![uvicorn, "--fd".into(), "{fd}".into()],
                    Listener::ReusePort(addr) => vec![
                        bin.join("python").display().to_string(),
                        test_app("reuseport.py").display().to_string(),
                        addr.to_string(),
                        uvicorn,
                        "--fd".into(),
                        "3".into(),
                    ],
                };
                if processes > 1 {
                    command.extend(["--workers".into(), processes.to_string()]);
                }
                // gunicorn logs no access either.
                command.extend([
                    "--no-access-log".into(),
                    "--app-dir".into(),
                    test_app("").display().to_string(),
                    "asgi_app:app".into(),
                ]);
                command
            }
        }
    }

    /// The environment that numbers the processes one server forks on its socket (`forks`: a
    /// directory of their index locks, for uvicorn) and, in a hogged cell, pins process `i` to CPU
    /// `i`.
    fn forks_env(self, cell: Cell, forks: &Path) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if self == App::Uvicorn {
            env.push(("APP_INDEX_DIR".into(), forks.display().to_string()));
        }
        if cell.hogged() {
            env.push(("APP_PIN_FORKS".into(), "0,1".into()));
        }
        env
    }
}

/// `command` run on `cpu` (`taskset -c`).
fn taskset(cpu: &str, command: Vec<String>) -> Vec<String> {
    ["taskset", "-c", cpu]
        .map(String::from)
        .into_iter()
        .chain(command)
        .collect()
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

    fn label(self, cell: Cell) -> String {
        let workers = cell.workers();
        match self {
            SetUp::SharedSocket => format!(
                "{}'s shared socket (count 1, --workers {workers})",
                cell.app().name()
            ),
            SetUp::Orca => "ORCA weighted round robin, a listener each".into(),
            SetUp::Lr2 => "least request, 2 choices".into(),
            SetUp::LrAll => format!("least request, choice_count = workers ({workers})"),
            SetUp::RoundRobin => "round robin".into(),
            SetUp::ReusePort => "SO_REUSEPORT, no Envoy".into(),
            SetUp::Shared => match cell.app() {
                App::Gunicorn => "Peregrine's default: one shared listener".into(),
                App::Uvicorn => "Peregrine's default: a listener each, ORCA".into(),
            },
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

    /// The Peregrine service of this set-up in `cell` (none for the `SO_REUSEPORT` one): the
    /// servers from the virtualenv's `bin`, uvicorn's forks numbered in `forks`.
    fn service_table(self, cell: Cell, bin: &Path, forks: &Path) -> Option<ServiceTable> {
        let workers = cell.workers();
        let app = cell.app();
        let mut env: std::collections::BTreeMap<String, String> = cell.env().into_iter().collect();
        env.insert("PYTHONUNBUFFERED".into(), "1".into());
        let (count, command) = match self {
            SetUp::ReusePort => return None,
            SetUp::SharedSocket => {
                env.extend(app.forks_env(cell, forks));
                (1, app.command(bin, workers, Listener::Passed))
            }
            _ => {
                let command = app.command(bin, 1, Listener::Passed);
                let command = if cell.hogged() {
                    taskset("{index}", command)
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

    /// How many hosts each Envoy holds once the set-up is ready (`None`: any, at least one).
    fn hosts(self, cell: Cell) -> Option<usize> {
        match (self, cell.app()) {
            (SetUp::SharedSocket, _) => Some(1),
            (SetUp::ReusePort, _) | (SetUp::Shared, App::Gunicorn) => None,
            _ => Some(cell.workers() as usize),
        }
    }
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
    ensure!(
        !chosen(Cell::FourEnvoys.key(), &options.cells) || options.connections >= ENVOYS,
        "four-envoys needs --connections {ENVOYS} at least: one to each Envoy"
    );
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
    /// How far off either per-request figure can be, in µs: a clock tick each way at both ends of
    /// the run and of the idle measure, the latter scaled to the run.
    cpu_resolution_us: Option<f64>,
    /// Other processes' CPU during the run, in cores.
    others: f64,
}

/// What a cell's runs share.
struct CellBench<'a> {
    options: &'a Options,
    cell: Cell,
    supervisor: &'a Supervisor,
    supervisor_pid: u32,
    /// Every Envoy of the cell.
    envoys: Vec<EnvoyAt>,
    /// The `SO_REUSEPORT` port, when that set-up runs.
    reuseport: Option<SocketAddr>,
}

/// One Envoy: its pid, its listener and its admin listener.
#[derive(Clone, Copy, Debug)]
struct EnvoyAt {
    pid: u32,
    listen: SocketAddr,
    admin: SocketAddr,
}

/// Runs every chosen cell and set-up `options.rounds` times; writes the report, the CSV and the plot.
pub(super) fn run(
    peregrine: &Path,
    envoy_binary: &Path,
    options: &Options,
    cpu_line: &str,
    command: &str,
) -> anyhow::Result<()> {
    // Ctrl-C fails the next wait, and the guards stop every process of the cell.
    xtask::interrupt::install()?;
    // gunicorn, uvicorn and their Python.
    let bin = xtask::pyapps::install()?;
    let out = target_dir().join("bench");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let started = Instant::now();
    let mut runs = Vec::new();
    let mut skipped = Vec::new();
    for cell in Cell::ALL
        .into_iter()
        .filter(|c| chosen(c.key(), &options.cells))
    {
        let mut setups = Vec::new();
        for setup in SetUp::ALL
            .into_iter()
            .filter(|s| chosen(s.key(), &options.setups))
        {
            match cell.leaves_out(setup) {
                Some(why) => skipped.push(format!("{} in {}: {why}", setup.key(), cell.key())),
                None => setups.push(setup),
            }
        }
        if setups.is_empty() {
            continue;
        }
        run_cell(
            peregrine,
            envoy_binary,
            &bin,
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

/// One cell: its hog and pinning, its supervisor and Envoys, the `SO_REUSEPORT` processes, and every
/// round of `setups`; pushes the runs, and the set-ups skipped with why. The servers are in the
/// virtualenv's `bin`.
fn run_cell(
    peregrine: &Path,
    envoy_binary: &Path,
    bin: &Path,
    options: &Options,
    cell: Cell,
    setups: &[SetUp],
    (runs, skipped): (&mut Vec<WaitRun>, &mut Vec<String>),
) -> anyhow::Result<()> {
    eprintln!("== {}", cell.title(options));
    if cell.hogged() {
        super::run::pin_to_other_cpu()?;
    } else {
        unpin()?;
    }
    let dir = TempDir::new().context("a temporary directory")?;
    // Where the processes uvicorn forks on one socket take their indices.
    let forks = dir.path().join("forks");
    std::fs::create_dir_all(&forks).with_context(|| format!("creating {}", forks.display()))?;
    let grpc = free_port();
    // Each Envoy's listener and admin ports.
    let ports: Vec<(u16, u16)> = (0..cell.envoys())
        .map(|_| (free_port(), free_port()))
        .collect();
    let mut setups = setups.to_vec();
    // The config, with `[envoy]` for the first Envoy.
    let config = |with: &[SetUp]| -> PeregrineToml {
        let mut config = PeregrineToml::local(grpc)
            .control_in(dir.path())
            .with_envoy(ports[0].0, ports[0].1);
        for setup in with {
            if let Some(service) = setup.service_table(cell, bin, &forks) {
                config.service(setup.service(), service);
            }
        }
        config
    };
    // Each set-up's service checked alone first, so that one `peregrine check` does not take (an
    // older supervisor's, say) is skipped alone.
    for setup in setups.clone() {
        if setup == SetUp::ReusePort {
            continue;
        }
        if let Err(refusal) = check(peregrine, dir.path(), &config(&[setup]).toml()) {
            let why = format!(
                "{} in {}: `peregrine check` refuses its config ({refusal})",
                setup.key(),
                cell.key(),
            );
            eprintln!("skipped: {why}");
            skipped.push(why);
            setups.retain(|s| *s != setup);
        }
    }
    let full = config(&setups);
    let text = full.toml();
    check(peregrine, dir.path(), &text).context("peregrine check")?;
    let hogs = if cell.hogged() {
        (0..HOG_THREADS)
            .map(|_| super::spawn_hog(dir.path()))
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        Vec::new()
    };
    let (reuseport, _processes) = if setups.contains(&SetUp::ReusePort) {
        let (addr, processes) = reuseport(bin, cell, dir.path())?;
        (Some(addr), processes)
    } else {
        (None, Vec::new())
    };
    let supervisor = Supervisor::start_in(peregrine, dir.path(), &text)?;
    let result = (|| {
        let mut envoys = Vec::new();
        for (k, &(listen, admin)) in ports.iter().enumerate() {
            envoys.push(start_envoy(
                peregrine,
                envoy_binary,
                dir.path(),
                &full,
                k,
                (listen, admin),
            )?);
        }
        let bench = CellBench {
            options,
            cell,
            supervisor: &supervisor,
            supervisor_pid: supervisor.pid(),
            envoys: envoys
                .iter_mut()
                .zip(&ports)
                .map(|(envoy, &(listen, _))| EnvoyAt {
                    pid: envoy.process().id(),
                    listen: SocketAddr::from(([127, 0, 0, 1], listen)),
                    admin: envoy.admin_addr(),
                })
                .collect(),
            reuseport,
        };
        bench.ready(&setups)?;
        for round in 0..options.rounds {
            for k in 0..setups.len() {
                let setup = setups[(k + round) % setups.len()];
                let run = bench
                    .run_quietest(setup, round)
                    .with_context(|| setup.label(cell))?;
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

/// Envoy `k` of a cell, in a directory of its own under `dir`, bootstrapped from `config` with its
/// own listener, admin port and (beside others) node id.
fn start_envoy(
    peregrine: &Path,
    envoy_binary: &Path,
    dir: &Path,
    config: &PeregrineToml,
    k: usize,
    (listen, admin): (u16, u16),
) -> anyhow::Result<Envoy> {
    let mut config = config.clone().with_envoy(listen, admin);
    if k > 0
        && let Some(envoy) = config.envoy.as_mut()
    {
        envoy.node = Some(format!("peregrine-envoy-{k}"));
    }
    let dir = dir.join(format!("envoy-{k}"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    super::envoy_bootstrapped_from(peregrine, envoy_binary, &dir, &config.toml())
        .with_context(|| format!("Envoy {k}"))
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

/// The `SO_REUSEPORT` set-up: `cell.workers()` servers of one process each, each binding one port
/// with `SO_REUSEPORT` (process `i` with `APP_WORKER_INDEX=i`, on CPU `i` in a hogged cell), once
/// each has answered.
fn reuseport(bin: &Path, cell: Cell, dir: &Path) -> anyhow::Result<(SocketAddr, Vec<ChildGuard>)> {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let app = cell.app();
    let mut processes = Vec::new();
    for index in 0..cell.workers() {
        let args = app.command(bin, 1, Listener::ReusePort(addr));
        let args = if cell.hogged() {
            taskset(&index.to_string(), args)
        } else {
            args
        };
        let mut command = Command::new(&args[0]);
        command
            .args(&args[1..])
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
        &format!("every SO_REUSEPORT {} to answer", app.name()),
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
        "reuseport: {} {}s on {addr}, SO_REUSEPORT, loaded directly",
        cell.workers(),
        app.name()
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
    /// Waits until every Envoy holds every service's hosts, healthy, and routes to each.
    fn ready(&self, setups: &[SetUp]) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(90);
        for setup in setups {
            if *setup == SetUp::ReusePort {
                continue;
            }
            let service = setup.service();
            for (k, envoy) in self.envoys.iter().enumerate() {
                poll_every(
                    Duration::from_millis(250),
                    deadline,
                    &format!("Envoy {k} routing /{service}"),
                    || {
                        let hosts = hosts(&http_get(envoy.admin, "/clusters").ok()?.1, service);
                        let expected = setup
                            .hosts(self.cell)
                            .map_or(!hosts.is_empty(), |n| hosts.len() == n);
                        let ok = http_get(envoy.listen, &format!("/{service}/"))
                            .is_ok_and(|(status, _)| status == 200);
                        (ok && expected && hosts.iter().all(|h| h.healthy)).then_some(())
                    },
                )?;
            }
            eprintln!(
                "{service}: {} ({} hosts in Envoy, {} Envoys)",
                setup.label(self.cell),
                hosts(&http_get(self.envoys[0].admin, "/clusters")?.1, service).len(),
                self.envoys.len()
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
        let (addrs, prefix) = match setup {
            SetUp::ReusePort => (
                vec![
                    self.reuseport
                        .context("the SO_REUSEPORT servers are not running")?,
                ],
                String::new(),
            ),
            _ => (
                self.envoys.iter().map(|e| e.listen).collect(),
                format!("/{}", setup.service()),
            ),
        };
        let plan = Plan {
            addrs,
            path: String::new(),
            rate: self.cell.rate(options),
            duration: Duration::from_secs(options.warmup + options.duration),
            connections: options.connections,
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
        // Every Envoy's together.
        let envoy_ticks = || self.envoys.iter().map(|e| ticks(e.pid)).sum::<u64>();
        let hz = procfs::clock_ticks_per_second() as f64;
        // What the supervisor (sampling, reporting) and Envoy (its timers, the ORCA streams) take
        // with no requests: subtracted from the run's.
        let idle_from = (Instant::now(), ticks(self.supervisor_pid), envoy_ticks());
        std::thread::sleep(IDLE);
        let idle_secs = idle_from.0.elapsed().as_secs_f64();
        let idle = (
            ticks(self.supervisor_pid).saturating_sub(idle_from.1) as f64 / hz / idle_secs,
            envoy_ticks().saturating_sub(idle_from.2) as f64 / hz / idle_secs,
        );
        let start = Instant::now() + Duration::from_millis(500);
        let before = (
            Busy::now(std::process::id())?,
            ticks(self.supervisor_pid),
            envoy_ticks(),
        );
        let records = openloop::run(&plan, start)?;
        let after = (
            Busy::now(std::process::id())?,
            ticks(self.supervisor_pid),
            envoy_ticks(),
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
            run.cpu_resolution_us = Some((1.0 + run_secs / idle_secs) / hz / answered * 1e6);
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
        p99_short: cell
            .waits()
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
        cpu_resolution_us: None,
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
            "{} µs/req (idle {:.3} cores)",
            per_request_us(us, run.cpu_resolution_us),
            run.supervisor_idle.unwrap_or(0.0)
        )),
        run.envoy_us.map_or("-".into(), |us| format!(
            "{} µs/req (idle {:.3} cores)",
            per_request_us(us, run.cpu_resolution_us),
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

/// CPU per request in µs, or `< R` where it is within `resolution` µs of nothing (a process that
/// takes no more under load than idle, as far as 10 ms ticks tell).
fn per_request_us(us: f64, resolution: Option<f64>) -> String {
    match resolution {
        Some(r) if us.abs() < r => format!("< {r:.0}"),
        _ => format!("{us:.0}"),
    }
}

/// `µs per request (idle cores)`, medians over runs.
fn cpu(
    per_request: impl Iterator<Item = Option<f64>>,
    idle: impl Iterator<Item = Option<f64>>,
    resolution: impl Iterator<Item = Option<f64>>,
) -> String {
    let resolution: Vec<f64> = resolution.flatten().collect();
    let resolution = (!resolution.is_empty()).then(|| median(resolution));
    let per_request = median_of(per_request, |us| per_request_us(us, resolution));
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
                setup.label(cell),
                if p50s.is_empty() {
                    "failed".into()
                } else {
                    format_duration(Duration::from_secs_f64(median(p50s)))
                },
                ms_median_range(&of.iter().map(|r| r.p99).collect::<Vec<_>>()),
                if cell.waits() {
                    ms_median_range(&of.iter().map(|r| r.p99_short).collect::<Vec<_>>())
                } else {
                    "-".into()
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
                    of.iter().map(|r| r.cpu_resolution_us),
                ),
                cpu(
                    of.iter().map(|r| r.envoy_us),
                    of.iter().map(|r| r.envoy_idle),
                    of.iter().map(|r| r.cpu_resolution_us),
                ),
                format!("{others:.2}"),
            ]);
        }
        out.push_str(&markdown(&rows, 1));
        out.push('\n');
    }
    out
}

/// Per round, the `SO_REUSEPORT` set-up's split and p99 in every cell it ran in. Each run opens its
/// connections afresh, from new ephemeral ports, and the kernel hashes each to one process: each
/// round is one draw of that split, the luckiest and the unluckiest among them.
fn reuseport_rounds(runs: &[WaitRun]) -> String {
    let mut out = String::new();
    for cell in Cell::ALL {
        let mut of: Vec<&WaitRun> = runs
            .iter()
            .filter(|r| r.cell == cell && r.setup == SetUp::ReusePort)
            .collect();
        if of.is_empty() {
            continue;
        }
        of.sort_by_key(|r| r.round);
        writeln!(
            out,
            "**{}: SO_REUSEPORT per round** (each run's connections split by the kernel's hash)\n",
            cell.key()
        )
        .expect("a String");
        let mut rows = vec![
            ["round (seed)", "share per worker", "p50", "p99", "failed"]
                .map(String::from)
                .to_vec(),
        ];
        let duration = |d: Option<Duration>| d.map_or("failed".into(), format_duration);
        for run in of {
            rows.push(vec![
                format!("{} ({})", run.round + 1, run.seed),
                shares(&run.shares),
                duration(run.p50),
                duration(run.p99),
                format!("{} of {}", run.failed, run.requests),
            ]);
        }
        out.push_str(&markdown(&rows, 1));
        out.push('\n');
    }
    out
}

/// The median of the runs' p99s, a failed one counting as slower than any (`None` when the median
/// falls on a failure, or there is no run).
fn median_p99<'a>(runs: impl Iterator<Item = &'a WaitRun>) -> Option<Duration> {
    let p99s: Vec<f64> = runs
        .map(|r| r.p99.map_or(f64::INFINITY, |d| d.as_secs_f64()))
        .collect();
    if p99s.is_empty() {
        return None;
    }
    let median = median(p99s);
    median.is_finite().then(|| Duration::from_secs_f64(median))
}

/// `a / b` as a ratio against `goal` (at most): `0.93x (goal: at most 1.1x): met`.
fn against(a: Option<Duration>, b: Option<Duration>, goal: f64) -> String {
    match (a, b) {
        (Some(a), Some(b)) => {
            let ratio = a.as_secs_f64() / b.as_secs_f64();
            let verdict = if ratio <= goal { "met" } else { "not met" };
            format!("{ratio:.2}x (goal: at most {goal}x): {verdict}")
        }
        (Some(_), None) => format!("the other failed (goal: at most {goal}x): met"),
        (None, _) => format!("failed (goal: at most {goal}x): not met"),
    }
}

/// The goals of the async cells, for those whose runs have both sides: on async-io the default's
/// p99 within 1.1x of least request over every worker; under async-hog within 1.5x of
/// `SO_REUSEPORT`'s luckiest round and at most 0.5x its unluckiest.
fn goals(runs: &[WaitRun]) -> Vec<String> {
    let of = |cell: Cell, setup: SetUp| -> Vec<&WaitRun> {
        runs.iter()
            .filter(|r| r.cell == cell && r.setup == setup)
            .collect()
    };
    let duration = |d: Option<Duration>| d.map_or("failed".into(), format_duration);
    let mut goals = Vec::new();
    let (default, lr) = (
        of(Cell::AsyncIo, SetUp::Shared),
        of(Cell::AsyncIo, SetUp::LrAll),
    );
    if !default.is_empty() && !lr.is_empty() {
        let (a, b) = (median_p99(default.into_iter()), median_p99(lr.into_iter()));
        goals.push(format!(
            "async-io: Peregrine's default, p99 {}, against least request over every worker, {}: {}",
            duration(a),
            duration(b),
            against(a, b, 1.1)
        ));
    }
    let (default, mut reuseport) = (
        of(Cell::AsyncHog, SetUp::Shared),
        of(Cell::AsyncHog, SetUp::ReusePort),
    );
    if !default.is_empty() && !reuseport.is_empty() {
        let a = median_p99(default.into_iter());
        // From the luckiest round to the unluckiest; a failed p99 is the unluckiest.
        reuseport.sort_by(|x, y| {
            let key = |r: &WaitRun| r.p99.map_or(f64::INFINITY, |d| d.as_secs_f64());
            key(x).total_cmp(&key(y))
        });
        let round = |r: &WaitRun| {
            format!(
                "round {}, shares {}, p99 {}",
                r.round + 1,
                shares(&r.shares),
                duration(r.p99)
            )
        };
        let (luckiest, unluckiest) = (reuseport[0], reuseport[reuseport.len() - 1]);
        goals.push(format!(
            "async-hog: Peregrine's default, p99 {}, against SO_REUSEPORT's luckiest round ({}): {}; against its unluckiest ({}): {}",
            duration(a),
            round(luckiest),
            against(a, luckiest.p99, 1.5),
            round(unluckiest),
            against(a, unluckiest.p99, 0.5)
        ));
    }
    goals
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
        "# Balance: servers whose requests wait, or burn CPU beside a hog, per set-up\n"
    )?;
    writeln!(report, "Command: `{}`", setting.command)?;
    machine_lines(&mut report, &setting.cpu_line)?;
    writeln!(
        report,
        "Envoy: {} (`--concurrency 1`; {ENVOYS} of them in four-envoys)",
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
    writeln!(
        report,
        "Generator: {} connections (in four-envoys, a quarter to each Envoy)",
        options.connections
    )?;
    for why in &setting.skipped {
        writeln!(report, "Skipped: {why}")?;
    }
    writeln!(report)?;
    let goals = goals(runs);
    if !goals.is_empty() {
        writeln!(report, "Goals:")?;
        for goal in goals {
            writeln!(report, "- {goal}")?;
        }
        writeln!(report)?;
    }
    report.push_str(&tables(options, runs));
    report.push_str(&reuseport_rounds(runs));
    writeln!(
        report,
        "p50 and p99: the median over rounds (p99 also its min-max; a p99 that falls on a failed request counts as none); p99 of 5 ms requests: of the requests that drew the short wait alone; failed: summed over rounds, of the requests scheduled in the measured windows; share: each worker's share of the answers (worker 0 first; the slowed or hogged one), median over rounds; supervisor and Envoy (in four-envoys, the four Envoys together): their CPU per answered request over the whole run (`/proc/PID/stat`, 10 ms ticks), less what they took idle in the 2 s before it (in brackets, in cores), median over rounds (`-`: not in the path; `< R`: within the R µs that 10 ms ticks can tell from idle); others: the most CPU other processes took during a kept run, in cores."
    )?;
    let path = out.join("balance-waits.md");
    std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    print!("{report}");
    Ok(path)
}

/// `cell,setup,label,round,p50_ms,p99_ms,failed,shares` per run (an empty p99 where it fell on a
/// failure; shares in percent, worker 0 first, `/` between them).
fn write_csv(out: &Path, runs: &[WaitRun]) -> anyhow::Result<PathBuf> {
    let mut csv = String::from("cell,setup,label,round,p50_ms,p99_ms,failed,shares\n");
    let ms =
        |d: Option<Duration>| d.map_or(String::new(), |d| format!("{:.3}", d.as_secs_f64() * 1e3));
    for run in runs {
        writeln!(
            csv,
            "{},{},{},{},{},{},{},{}",
            run.cell.key(),
            run.setup.key(),
            run.setup.label(run.cell).replace(',', ";"),
            run.round + 1,
            ms(run.p50),
            ms(run.p99),
            run.failed,
            shares(&run.shares).trim_end_matches('%')
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
    fn a_cost_within_what_ticks_can_tell_is_shown_as_its_bound() {
        // Ticks of 10 ms over a 20 s run and a 2 s idle measure, 2,268 answers: about 50 µs.
        assert_eq!(per_request_us(-35.0, Some(50.0)), "< 50");
        assert_eq!(per_request_us(49.0, Some(50.0)), "< 50");
        assert_eq!(per_request_us(647.2, Some(50.0)), "647");
        assert_eq!(per_request_us(-35.0, None), "-35");
        assert_eq!(
            cpu(
                [Some(-2.0), Some(8.0)].into_iter(),
                [Some(0.02)].into_iter(),
                [Some(50.0)].into_iter()
            ),
            "< 50 (0.020)"
        );
        assert_eq!(
            cpu([None].into_iter(), [None].into_iter(), [None].into_iter()),
            "-"
        );
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
        let new = parse_args(&args(
            "--waits --cell four-envoys --cell async-io --cell async-hog --setup reuseport --connections 64",
        ))
        .unwrap();
        assert_eq!(new.cells, ["four-envoys", "async-io", "async-hog"]);
        assert_eq!((defaults.connections, new.connections), (256, 64));
        assert_eq!(chosen.setups, ["shared-socket", "lr4"]);
        assert_eq!(
            parse_args(&[]).unwrap().duration,
            10,
            "the other runs keep theirs"
        );
        assert!(parse_args(&args("--waits --cell disk")).is_err());
        assert!(parse_args(&args("--waits --connections 2")).is_err());
        assert!(parse_args(&args("--waits --cell io --connections 2")).is_ok());
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
        let (bin, forks) = (Path::new("/venv/bin"), Path::new("/tmp/forks"));
        let socket = SetUp::SharedSocket
            .service_table(Cell::Io, bin, forks)
            .unwrap();
        assert_eq!(socket.count, Some(1));
        let command = socket.command.unwrap();
        assert_eq!(command[0], "/venv/bin/gunicorn");
        let workers = command.iter().position(|a| a == "--workers").unwrap();
        assert_eq!(command[workers + 1], "4");
        assert!(command.iter().any(|a| a.ends_with("gunicorn_forks.py")));
        let lr = SetUp::LrAll
            .service_table(Cell::CpuHog, bin, forks)
            .unwrap();
        assert_eq!(
            (lr.count, lr.choice_count, lr.lb_policy.as_deref()),
            (Some(2), Some(2), Some("least_request"))
        );
        assert_eq!(lr.command.unwrap()[..3], ["taskset", "-c", "{index}"]);
        let orca = SetUp::Orca.service_table(Cell::Io, bin, forks).unwrap();
        assert_eq!(
            (orca.count, orca.lb_policy, orca.orca),
            (Some(4), None, Some(Orca::On))
        );
        // Peregrine's default: no balancing key, so gunicorn's sync worker shares a listener.
        let shared = SetUp::Shared.service_table(Cell::Io, bin, forks).unwrap();
        assert_eq!(
            (shared.count, shared.orca, shared.lb_policy, shared.listener),
            (Some(4), None, None, None)
        );
        assert!(
            SetUp::ReusePort
                .service_table(Cell::Io, bin, forks)
                .is_none()
        );
    }

    #[test]
    fn four_envoys_and_the_async_cells() {
        let (bin, forks) = (Path::new("/venv/bin"), Path::new("/tmp/forks"));
        assert_eq!((Cell::FourEnvoys.envoys(), Cell::Io.envoys()), (4, 1));
        assert_eq!(Cell::FourEnvoys.targets("/x"), Cell::Io.targets("/x"));
        assert_eq!(
            Cell::FourEnvoys.app(),
            App::Gunicorn,
            "io's app behind more Envoys"
        );
        assert!(Cell::FourEnvoys.leaves_out(SetUp::ReusePort).is_some());
        assert!(Cell::AsyncIo.leaves_out(SetUp::Orca).is_some());
        assert!(Cell::AsyncHog.leaves_out(SetUp::Lr2).is_some());
        assert!(Cell::AsyncIo.leaves_out(SetUp::Lr2).is_none());
        assert!(Cell::Io.leaves_out(SetUp::ReusePort).is_none());
        assert!(Cell::AsyncIo.waits() && !Cell::AsyncHog.waits() && Cell::AsyncHog.hogged());
        assert_eq!(Cell::AsyncHog.targets(""), [("/?cpu=4".to_owned(), 1.0)]);
        // uvicorn on the passed socket, one process per worker, pinned in the hogged cell.
        let default = SetUp::Shared
            .service_table(Cell::AsyncHog, bin, forks)
            .unwrap();
        assert_eq!(
            (default.count, default.orca, default.lb_policy),
            (Some(2), None, None)
        );
        assert_eq!(
            default.command.unwrap(),
            [
                "taskset",
                "-c",
                "{index}",
                "/venv/bin/uvicorn",
                "--fd",
                "{fd}",
                "--no-access-log",
                "--app-dir",
                &test_app("").display().to_string(),
                "asgi_app:app"
            ]
        );
        assert_eq!(SetUp::Shared.hosts(Cell::AsyncIo), Some(4));
        assert_eq!(SetUp::Shared.hosts(Cell::Io), None);
        // uvicorn's own workers on one socket: numbered through their locks, pinned in async-hog.
        let socket = SetUp::SharedSocket
            .service_table(Cell::AsyncHog, bin, forks)
            .unwrap();
        let command = socket.command.unwrap();
        let workers = command.iter().position(|a| a == "--workers").unwrap();
        assert_eq!(
            (socket.count, command[workers + 1].as_str()),
            (Some(1), "2")
        );
        let env = socket.env.unwrap();
        assert_eq!(env["APP_INDEX_DIR"], "/tmp/forks");
        assert_eq!(env["APP_PIN_FORKS"], "0,1");
        // SO_REUSEPORT: reuseport.py binds the port for uvicorn; gunicorn binds it itself.
        let addr: SocketAddr = "127.0.0.1:8000".parse().unwrap();
        let uvicorn = App::Uvicorn.command(bin, 1, Listener::ReusePort(addr));
        assert_eq!(uvicorn[0], "/venv/bin/python");
        assert!(uvicorn[1].ends_with("reuseport.py"));
        assert_eq!(
            uvicorn[2..6],
            ["127.0.0.1:8000", "/venv/bin/uvicorn", "--fd", "3"]
        );
        let gunicorn = App::Gunicorn.command(bin, 1, Listener::ReusePort(addr));
        assert_eq!(gunicorn[1..4], ["--reuse-port", "--bind", "127.0.0.1:8000"]);
        assert!(!gunicorn.iter().any(|a| a.ends_with("gunicorn_forks.py")));
        assert_eq!(
            SetUp::Shared.label(Cell::AsyncIo),
            "Peregrine's default: a listener each, ORCA"
        );
        assert!(
            SetUp::SharedSocket
                .label(Cell::AsyncIo)
                .starts_with("uvicorn's")
        );
    }

    #[test]
    fn the_goals_of_the_async_cells() {
        let run = |cell, setup, round, p99_ms: Option<u64>, share0: f64| WaitRun {
            cell,
            setup,
            round,
            seed: 1 + round as u64,
            requests: 100,
            failed: usize::from(p99_ms.is_none()),
            p50: Some(Duration::from_millis(5)),
            p99: p99_ms.map(Duration::from_millis),
            p99_short: None,
            shares: vec![share0, 1.0 - share0],
            unindexed: 0,
            supervisor_us: None,
            envoy_us: None,
            supervisor_idle: None,
            envoy_idle: None,
            cpu_resolution_us: None,
            others: 0.0,
        };
        let runs = vec![
            run(Cell::AsyncIo, SetUp::Shared, 0, Some(105), 0.5),
            run(Cell::AsyncIo, SetUp::LrAll, 0, Some(100), 0.5),
            run(Cell::AsyncHog, SetUp::Shared, 0, Some(30), 0.3),
            run(Cell::AsyncHog, SetUp::ReusePort, 0, Some(25), 0.45),
            run(Cell::AsyncHog, SetUp::ReusePort, 1, None, 0.55),
            run(Cell::AsyncHog, SetUp::ReusePort, 2, Some(900), 0.5),
        ];
        let goals = goals(&runs);
        assert_eq!(goals.len(), 2, "{goals:?}");
        assert!(
            goals[0].contains("1.05x (goal: at most 1.1x): met"),
            "{}",
            goals[0]
        );
        assert!(
            goals[1].contains("luckiest round (round 1, shares 45/55%, p99 25.0 ms): 1.20x"),
            "{}",
            goals[1]
        );
        assert!(
            goals[1].contains("unluckiest (round 2, shares 55/45%, p99 failed): the other failed"),
            "{}",
            goals[1]
        );
        assert_eq!(
            median_p99(runs[3..].iter()),
            Some(Duration::from_millis(900))
        );
        let rounds = reuseport_rounds(&runs);
        assert!(
            rounds.contains("async-hog: SO_REUSEPORT per round"),
            "{rounds}"
        );
        assert!(super::goals(&runs[..1]).is_empty(), "one side only");
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
