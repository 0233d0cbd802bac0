//! One cell of the matrix: one supervisor binary, one kind of stream, `N` clients, `M` endpoints in
//! `S` services. Its own `peregrine run` and its own prefix in the shared etcd, so each cell starts
//! from a fresh process (its memory figures are its own).
//!
//! 1. The supervisor starts with no other host (RSS *empty*); the fleet's records are written; a
//!    change is put last and one client waits for it, so every record before it is in the
//!    supervisor's view (watch events arrive in order); that client leaves (RSS *loaded*).
//! 2. `N` clients connect at once (the *initial sync*: until each has every cluster's endpoints).
//!    After a second: RSS *with streams*, and the supervisor's idle CPU rate.
//! 3. **Single changes**: one worker's record put, until every client ACKed the endpoints holding
//!    it; the supervisor's CPU beyond its idle rate, the bytes and endpoints responses received.
//! 4. **Burst**: 100 workers put, one every 10 ms, until every client holds all of them; the
//!    endpoints responses each client received meanwhile.
//! 5. **Reconnect storm**: every client drops its connection and connects again at once, as a fresh
//!    Envoy (no `initial_resource_versions`): until every one is served again; RSS polled every
//!    10 ms for the peak.

use std::{
    net::{SocketAddr, TcpStream},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use peregrine_contract::procfs;
use peregrine_e2e::{PeregrineToml, ServiceTable, Supervisor, TempDir, free_port};
use tokio::{runtime::Runtime, sync::watch};

use super::{
    client::{self, ClientStats, Control, Kind, Shared},
    records::Fleet,
};
use crate::machine::Busy;

/// Workers changed in a burst, and over how long.
const BURST: usize = 100;
const BURST_OVER: Duration = Duration::from_secs(1);
/// How long a change, the initial sync or a storm may take before the cell gives up on it.
const CHANGE_WITHIN: Duration = Duration::from_secs(30);
const SYNC_WITHIN: Duration = Duration::from_secs(120);
/// After a change is everywhere, before its bytes are counted and the next starts.
const SETTLE: Duration = Duration::from_millis(200);

/// What a cell is.
#[derive(Clone, Debug)]
pub(super) struct Spec<'a> {
    pub(super) label: &'a str,
    pub(super) binary: &'a Path,
    pub(super) kind: Kind,
    pub(super) clients: usize,
    pub(super) endpoints: usize,
    pub(super) services: usize,
    pub(super) changes: usize,
    pub(super) burst: bool,
    pub(super) storm: bool,
    /// The cell's number: its etcd prefix.
    pub(super) id: usize,
}

/// One change, everywhere.
#[derive(Clone, Debug, Default)]
pub(super) struct Change {
    /// From the (last) put's return to each client's ACK, in ms; empty if it timed out.
    pub(super) per_client_ms: Vec<f64>,
    /// How many clients had it within [`CHANGE_WITHIN`].
    pub(super) done: usize,
    /// From the first put's return (a burst's), to the last ACK, in ms.
    pub(super) from_first_ms: f64,
    /// The supervisor's on-CPU time beyond its idle rate, in ms.
    pub(super) cpu_ms: f64,
    /// The supervisor's utime + stime over the same window, in ms (10 ms ticks).
    pub(super) cpu_ticks_ms: f64,
    /// Bytes received by every client.
    pub(super) bytes: u64,
    /// Endpoints responses each client received.
    pub(super) pushes: Vec<u64>,
    /// Endpoints states each client received (responses at a new version).
    pub(super) states: Vec<u64>,
    /// This process's (the clients') CPU, in ms.
    pub(super) client_cpu_ms: f64,
}

/// What a cell measured.
#[derive(Clone, Debug, Default)]
pub(super) struct Cell {
    pub(super) label: String,
    pub(super) kind: &'static str,
    pub(super) clients: usize,
    pub(super) endpoints: usize,
    pub(super) services: usize,
    pub(super) rss_empty_kib: u64,
    pub(super) rss_loaded_kib: u64,
    pub(super) rss_streams_kib: u64,
    pub(super) write_s: f64,
    pub(super) initial_sync_s: f64,
    /// Bytes of the initial sync, every client.
    pub(super) initial_bytes: u64,
    pub(super) idle_cpu_ms_per_s: f64,
    pub(super) changes: Vec<Change>,
    pub(super) burst: Option<Change>,
    /// The storm: until every client was served again, in s (`None`: not within the deadline).
    pub(super) storm_s: Option<f64>,
    pub(super) storm_peak_kib: u64,
    pub(super) storm_hwm_kib: u64,
    pub(super) errors: u64,
    pub(super) last_error: Option<String>,
    /// Cores busy on the machine, and with other work than the benchmark's, over the cell.
    pub(super) machine_cores: f64,
    pub(super) other_cores: f64,
    pub(super) load1: f64,
}

/// The supervisor's config: no workers of its own beyond one, `[cluster]` on `etcd` at `prefix`.
fn config(dir: &Path, grpc: u16, etcd: SocketAddr, prefix: &str) -> String {
    let mut config = PeregrineToml::local(grpc).control_in(dir);
    // Every client is on 127.0.0.1, and a storm opens N connections while N close.
    config.supervisor.grpc_max_connections_per_peer = Some(8192);
    crate::config::fleet_host(&mut config, "bench", vec![format!("http://{etcd}")]);
    config.cluster.get_or_insert_default().prefix = Some(prefix.to_owned());
    config.service("local", ServiceTable::at("http://127.0.0.1:0").count(1));
    config.toml()
}

/// The supervisor's memory now.
fn memory(pid: u32) -> anyhow::Result<procfs::Status> {
    procfs::status(pid).with_context(|| format!("reading /proc/{pid}/status"))
}

/// The supervisor's on-CPU time, in ns (every thread's schedstat).
fn on_cpu_ns(pid: u32) -> anyhow::Result<u64> {
    Ok(procfs::process_schedstat(pid)
        .with_context(|| format!("reading the schedstat of {pid}"))?
        .on_cpu_ns)
}

/// A process's utime + stime, in ms.
fn ticks_ms(pid: u32) -> anyhow::Result<f64> {
    let ticks = procfs::stat(pid)
        .with_context(|| format!("reading /proc/{pid}/stat"))?
        .cpu_ticks();
    Ok(ticks as f64 * 1000.0 / procfs::clock_ticks_per_second() as f64)
}

/// Runs one cell; `etcd` is the shared member's client address.
pub(super) fn run(rt: &Runtime, etcd: SocketAddr, spec: &Spec<'_>) -> anyhow::Result<Cell> {
    let busy = Busy::now_for_this_tree()?;
    let dir = TempDir::with_prefix("peregrine-xds-scale-").context("a temporary directory")?;
    let grpc = free_port();
    let prefix = format!("/xds-bench/c{}", spec.id);
    let mut supervisor = Supervisor::start_in_with_env(
        spec.binary,
        dir.path(),
        &config(dir.path(), grpc, etcd, &prefix),
        &[("RUST_LOG", "warn")],
    )
    .with_context(|| format!("starting {}", spec.binary.display()))?;
    let pid = supervisor.pid();
    let addr = SocketAddr::from(([127, 0, 0, 1], grpc));
    peregrine_e2e::try_wait_until(
        Duration::from_secs(30),
        "the supervisor's gRPC port",
        || TcpStream::connect(addr).ok().map(|_| ()),
    )?;
    std::thread::sleep(Duration::from_millis(500));
    let mut cell = Cell {
        label: spec.label.to_owned(),
        kind: spec.kind.name(),
        clients: spec.clients,
        endpoints: spec.endpoints,
        services: spec.services,
        rss_empty_kib: memory(pid)?.rss_kib,
        ..Cell::default()
    };
    let started = Instant::now();
    let mut fleet = Fleet::write(etcd, &prefix, spec.endpoints, spec.services)?;
    cell.write_s = started.elapsed().as_secs_f64();
    let url = format!("http://{addr}");
    let result = measure(rt, &url, pid, spec, &mut fleet, &mut cell);
    if let Err(error) = fleet.remove() {
        eprintln!("xds-scale: removing the cell's records: {error:#}");
    }
    if let Err(error) = &result {
        eprintln!(
            "xds-scale: cell failed: {error:#}\nsupervisor log:\n{}",
            tail(&supervisor.logs(), 40)
        );
    }
    // What the supervisor warned about beyond its start (a lost etcd session, a record skipped).
    let warnings: Vec<String> = supervisor
        .logs()
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .skip(3)
        .map(str::to_owned)
        .collect();
    if !warnings.is_empty() {
        eprintln!(
            "xds-scale: the supervisor warned {} times; the last:\n{}",
            warnings.len(),
            tail(&warnings.join("\n"), 10)
        );
    }
    let _ = supervisor.stop();
    result?;
    let (machine, others) = Busy::now_for_this_tree()?.since(busy);
    cell.machine_cores = machine;
    cell.other_cores = others;
    cell.load1 = crate::machine::load_average()?[0];
    Ok(cell)
}

/// Each client's count now, less its count `before`.
fn since(before: &[u64], now: Vec<u64>) -> Vec<u64> {
    now.iter()
        .zip(before)
        .map(|(now, before)| now - before)
        .collect()
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A set of running clients.
struct Clients {
    shared: Arc<Shared>,
    control: watch::Sender<Control>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Clients {
    fn start(rt: &Runtime, n: usize, kind: Kind, url: &str) -> Clients {
        let shared = Arc::new(Shared {
            epoch: Instant::now(),
            target: Default::default(),
            clients: (0..n).map(|_| Default::default()).collect(),
            last_error: Default::default(),
        });
        let (control, rx) = watch::channel(Control::default());
        let tasks = {
            let _guard = rt.enter();
            client::start(n, kind, url, &shared, &rx)
        };
        Clients {
            shared,
            control,
            tasks,
        }
    }

    /// Waits until every client is served in `session`; returns when the last was.
    fn wait_served(&self, session: u64, within: Duration) -> anyhow::Result<Instant> {
        let deadline = Instant::now() + within;
        loop {
            let served = self
                .shared
                .clients
                .iter()
                .filter(|c| c.served_session.load(Ordering::Acquire) == session + 1)
                .count();
            if served == self.shared.clients.len() {
                let last = self
                    .shared
                    .clients
                    .iter()
                    .map(|c| c.served_at.load(Ordering::Relaxed))
                    .max()
                    .unwrap_or(0);
                return Ok(self.shared.at(last));
            }
            xtask::interrupt::check()?;
            if Instant::now() > deadline {
                bail!(
                    "{served} of {} clients served within {within:?} (last error: {:?})",
                    self.shared.clients.len(),
                    self.shared.last_error.lock().expect("error lock")
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits until every client completed `generation` (or the deadline); returns each one's ACK
    /// time, for those that did.
    fn wait_done(&self, generation: u64, within: Duration) -> Vec<Instant> {
        let deadline = Instant::now() + within;
        loop {
            let done: Vec<Instant> = self
                .shared
                .clients
                .iter()
                .filter(|c| c.done_generation.load(Ordering::Acquire) == generation)
                .map(|c| self.shared.at(c.done_at.load(Ordering::Relaxed)))
                .collect();
            if done.len() == self.shared.clients.len() || Instant::now() > deadline {
                return done;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Each client's `counter`.
    fn per_client(&self, counter: impl Fn(&ClientStats) -> &AtomicU64) -> Vec<u64> {
        self.shared
            .clients
            .iter()
            .map(|c| counter(c).load(Ordering::Relaxed))
            .collect()
    }

    fn bytes(&self) -> u64 {
        self.shared.sum(|c| &c.bytes)
    }

    fn reconnect(&self) -> u64 {
        let mut session = 0;
        self.control.send_modify(|c| {
            c.session += 1;
            session = c.session;
        });
        session
    }

    fn stop(self, rt: &Runtime) {
        self.control.send_modify(|c| c.stop = true);
        rt.block_on(async {
            for task in self.tasks {
                let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
            }
        });
    }
}

/// Steps 1 to 5 of the module docs, once the supervisor runs and the records are written.
fn measure(
    rt: &Runtime,
    url: &str,
    pid: u32,
    spec: &Spec<'_>,
    fleet: &mut Fleet,
    cell: &mut Cell,
) -> anyhow::Result<()> {
    let mut generation = 0;
    // 1. Everything written is in the view once a change put after it is.
    {
        let probe = Clients::start(rt, 1, Kind::Sotw, url);
        probe.wait_served(0, SYNC_WITHIN)?;
        generation += 1;
        let change = one_change(&probe, fleet, &[0], generation, pid, 0.0)?;
        anyhow::ensure!(change.done == 1, "the probe never saw the last record");
        probe.stop(rt);
    }
    std::thread::sleep(Duration::from_millis(300));
    cell.rss_loaded_kib = memory(pid)?.rss_kib;
    // 2. The initial sync.
    let clients = Clients::start(rt, spec.clients, spec.kind, url);
    let started = Instant::now();
    let result = (|| {
        let last = clients.wait_served(0, SYNC_WITHIN)?;
        cell.initial_sync_s = last.duration_since(started).as_secs_f64();
        cell.initial_bytes = clients.bytes();
        std::thread::sleep(Duration::from_secs(1));
        cell.rss_streams_kib = memory(pid)?.rss_kib;
        let idle_from = (Instant::now(), on_cpu_ns(pid)?);
        std::thread::sleep(Duration::from_secs(1));
        let idle_ms_per_s =
            (on_cpu_ns(pid)? - idle_from.1) as f64 / 1e6 / idle_from.0.elapsed().as_secs_f64();
        cell.idle_cpu_ms_per_s = idle_ms_per_s;
        // 3. Single changes, each on another worker of another service.
        for i in 0..spec.changes {
            generation += 1;
            let w = (i * 7919 + 1) % fleet.len();
            let change = one_change(&clients, fleet, &[w], generation, pid, idle_ms_per_s)?;
            cell.changes.push(change);
            std::thread::sleep(SETTLE);
        }
        // 4. A burst.
        if spec.burst {
            generation += 1;
            let n = BURST.min(fleet.len());
            let workers: Vec<usize> = (0..n).map(|i| (i * 7907 + 3) % fleet.len()).collect();
            let mut workers = workers;
            workers.sort_unstable();
            workers.dedup();
            cell.burst = Some(one_change(
                &clients,
                fleet,
                &workers,
                generation,
                pid,
                idle_ms_per_s,
            )?);
        }
        // 5. A reconnect storm.
        if spec.storm {
            let steady = memory(pid)?;
            let polling = Arc::new(AtomicBool::new(true));
            let peak = Arc::new(AtomicU64::new(steady.rss_kib));
            let poller = {
                let (polling, peak) = (polling.clone(), peak.clone());
                std::thread::spawn(move || {
                    while polling.load(Ordering::Relaxed) {
                        if let Ok(status) = procfs::status(pid) {
                            peak.fetch_max(status.rss_kib, Ordering::Relaxed);
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                })
            };
            let started = Instant::now();
            let session = clients.reconnect();
            let served = clients.wait_served(session, SYNC_WITHIN);
            polling.store(false, Ordering::Relaxed);
            let _ = poller.join();
            cell.storm_s = served
                .ok()
                .map(|last| last.duration_since(started).as_secs_f64());
            cell.storm_peak_kib = peak.load(Ordering::Relaxed);
            cell.storm_hwm_kib = memory(pid)?.hwm_kib;
        }
        anyhow::Ok(())
    })();
    cell.errors = clients.shared.sum(|c| &c.errors);
    cell.last_error = clients
        .shared
        .last_error
        .lock()
        .expect("error lock")
        .clone();
    clients.stop(rt);
    result
}

/// Puts `workers` (over [`BURST_OVER`] when more than one) as change `generation` (their markers' number) and waits until every
/// client ACKed endpoints holding them all.
fn one_change(
    clients: &Clients,
    fleet: &mut Fleet,
    workers: &[usize],
    generation: u64,
    pid: u32,
    idle_ms_per_s: f64,
) -> anyhow::Result<Change> {
    let expected: Vec<_> = workers
        .iter()
        .map(|&w| {
            let (cluster, marker) = fleet.marker_of(w, generation);
            super::records::Written {
                cluster,
                marker,
                at: Instant::now(),
            }
        })
        .collect();
    // The clients' own count of targets, not the markers' (which count over the cell's clients).
    let target = clients.shared.set_target(Fleet::markers(&expected));
    let pushes_before = clients.per_client(|c| &c.eds_responses);
    let states_before = clients.per_client(|c| &c.eds_states);
    let bytes_before = clients.bytes();
    let (cpu_before, ticks_before) = (on_cpu_ns(pid)?, ticks_ms(pid)?);
    let me = std::process::id();
    let client_before = ticks_ms(me)?;
    let window = Instant::now();
    let gap = BURST_OVER / workers.len() as u32;
    let mut written = Vec::with_capacity(workers.len());
    for (i, &w) in workers.iter().enumerate() {
        if i > 0 {
            let due = window + gap * i as u32;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        written.push(fleet.change(w, generation)?);
    }
    let first = written.first().expect("a change").at;
    let last = written.last().expect("a change").at;
    let done = clients.wait_done(target, CHANGE_WITHIN);
    let cpu_after = on_cpu_ns(pid)?;
    let ticks_after = ticks_ms(pid)?;
    let elapsed = window.elapsed().as_secs_f64();
    let client_after = ticks_ms(me)?;
    std::thread::sleep(SETTLE);
    let all = done.len() == clients.shared.clients.len();
    let latest = done.iter().max().copied().unwrap_or(last);
    Ok(Change {
        per_client_ms: if all {
            done.iter()
                .map(|at| at.saturating_duration_since(last).as_secs_f64() * 1e3)
                .collect()
        } else {
            Vec::new()
        },
        done: done.len(),
        from_first_ms: latest.saturating_duration_since(first).as_secs_f64() * 1e3,
        cpu_ms: ((cpu_after - cpu_before) as f64 / 1e6 - idle_ms_per_s * elapsed).max(0.0),
        cpu_ticks_ms: ticks_after - ticks_before,
        bytes: clients.bytes() - bytes_before,
        pushes: since(&pushes_before, clients.per_client(|c| &c.eds_responses)),
        states: since(&states_before, clients.per_client(|c| &c.eds_states)),
        client_cpu_ms: client_after - client_before,
    })
}
