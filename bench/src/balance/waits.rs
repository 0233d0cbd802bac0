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
//! - `shared-orca`: one shared listener per host (`listener = "shared"`) weighed between hosts on
//!   ORCA (`orca = true`): each host's supervisor reports its listener's load. Only in two-hosts
//!   (one host is one endpoint, with nothing to weigh it against).
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
//! - `two-hosts`: io's 4 gunicorn workers on two hosts of 2 (`a` on 127.0.0.2, `b` on 127.0.0.3),
//!   each a supervisor in a fleet (`routing = "fleet"`, an etcd of the cell's own, one gRPC port),
//!   every worker of host b waiting 2x longer (its backend is slower: `APP_WAIT_FACTOR`), an Envoy
//!   per host bootstrapped from its own supervisor, and request `i` to Envoy `i mod 2`. No socket
//!   spans two hosts, so `shared-socket` and `reuseport` are left out; each Envoy's least request
//!   counts only the requests it sent itself. The workers of host `h` number themselves from
//!   `2h` (`APP_INDEX_BASE`).
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
//! 8.5 min), async-hog and two-hosts 5 (about 7 min); every cell, about 62 min on a quiet
//! machine, up to twice that on a busy one. `--duration 15` takes a sixth off.

mod cell;
mod report;
mod runs;

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
    measure::{measured_window, percentile, quietest},
    openloop::{self, Answer, Mix, Plan, Record},
    poll::poll_every,
};
use crate::{
    machine::{Busy, machine_lines},
    table::{format_duration, markdown, median},
};
use cell::{Cell, Listener, SetUp, taskset};
use report::{Setting, describe, write_csv, write_report};
use runs::run_cell;

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
/// How much longer every worker of the slower host of two-hosts waits.
const HOST_SLOW_FACTOR: u32 = 2;
/// CPU per request in the hogged cells.
const CPU_MS: u64 = 4;
/// Processes of the hog on CPU 0.
const HOG_THREADS: usize = 3;
/// The Envoys of the four-envoys cell.
const ENVOYS: usize = 4;
/// How long the supervisor's and Envoy's idle CPU is measured before each run.
const IDLE: Duration = Duration::from_secs(2);
/// How many idle windows a run takes at most, while the supervisor is still busy starting.
const IDLE_TRIES: usize = 5;
/// How many times a noisy run is repeated here (the quietest kept): once, as in the timeline; a
/// shared machine would otherwise triple the runs.
const WAITS_NOISY_RETRIES: usize = 1;
/// The plotting script.
const PLOT_SCRIPT: &str = include_str!("waits_plot.py");

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
    /// What the supervisor and Envoy took (`None` where the set-up has no Envoy in its path).
    machinery: Option<Machinery>,
    /// Other processes' CPU during the run, in cores.
    others: f64,
}

/// What the supervisor and Envoy (every Envoy of the cell together) took during a run.
#[derive(Clone, Copy, Debug)]
struct Machinery {
    /// CPU per answered request of the whole run beyond what the process takes idle, in µs.
    supervisor_us: f64,
    envoy_us: f64,
    /// What each took idle just before the run, in cores.
    supervisor_idle: f64,
    envoy_idle: f64,
    /// How far off either per-request figure can be, in µs: a clock tick each way at both ends of
    /// the run and of the idle measure, the latter scaled to the run.
    resolution_us: f64,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args;
    use crate::balance::parse_args;

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
}
