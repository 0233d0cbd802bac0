//! The cells (what the workers do, and what stands in front of them), the apps and the set-ups of
//! `cargo xtask bench balance --waits`: each one's config and targets.

use super::*;

/// What the workers do, what slows one of them, and what stands in front of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cell {
    Io,
    SlowWorker,
    CpuHog,
    FourEnvoys,
    AsyncIo,
    AsyncHog,
    TwoHosts,
}

impl Cell {
    pub(super) const ALL: [Cell; 7] = [
        Cell::Io,
        Cell::SlowWorker,
        Cell::CpuHog,
        Cell::FourEnvoys,
        Cell::AsyncIo,
        Cell::AsyncHog,
        Cell::TwoHosts,
    ];

    pub(super) fn key(self) -> &'static str {
        match self {
            Cell::Io => "io",
            Cell::SlowWorker => "slow-worker",
            Cell::CpuHog => "cpu-hog",
            Cell::FourEnvoys => "four-envoys",
            Cell::AsyncIo => "async-io",
            Cell::AsyncHog => "async-hog",
            Cell::TwoHosts => "two-hosts",
        }
    }

    pub(super) fn title(self, options: &Options) -> String {
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
            Cell::TwoHosts => format!(
                "two-hosts: 2 hosts of 2 workers, host b's waits {HOST_SLOW_FACTOR}x longer, an Envoy per host, request i to Envoy i mod 2, {rate} req/s"
            ),
        }
    }

    /// Every host's workers together.
    pub(super) fn workers(self) -> u32 {
        match self {
            Cell::Io | Cell::SlowWorker | Cell::FourEnvoys | Cell::AsyncIo | Cell::TwoHosts => 4,
            Cell::CpuHog | Cell::AsyncHog => 2,
        }
    }

    /// The hosts (supervisors, each on a loopback address of its own, sharing membership through
    /// etcd).
    pub(super) fn hosts(self) -> u32 {
        if self == Cell::TwoHosts { 2 } else { 1 }
    }

    /// Each host's workers.
    pub(super) fn workers_per_host(self) -> u32 {
        self.workers() / self.hosts()
    }

    /// Whether the requests wait (the mix of 5 ms and 100 ms), rather than burn CPU beside a hog.
    pub(super) fn waits(self) -> bool {
        !self.hogged()
    }

    /// Whether CPU 0 has the hog, and each worker a CPU of its own.
    pub(super) fn hogged(self) -> bool {
        matches!(self, Cell::CpuHog | Cell::AsyncHog)
    }

    pub(super) fn rate(self, options: &Options) -> f64 {
        if self.waits() {
            options.waits_rate
        } else {
            options.hog_rate
        }
    }

    pub(super) fn app(self) -> App {
        match self {
            Cell::AsyncIo | Cell::AsyncHog => App::Uvicorn,
            _ => App::Gunicorn,
        }
    }

    /// The Envoys in front of the supervisors' workers: in two-hosts, one per host.
    pub(super) fn envoys(self) -> usize {
        match self {
            Cell::FourEnvoys => ENVOYS,
            Cell::TwoHosts => 2,
            _ => 1,
        }
    }

    /// Why `setup` is left out of this cell, if it is.
    pub(super) fn leaves_out(self, setup: SetUp) -> Option<&'static str> {
        match (self, setup) {
            (Cell::FourEnvoys, SetUp::ReusePort) => {
                Some("no Envoy is in its path, so the io cell's row is its figure")
            }
            (Cell::AsyncIo | Cell::AsyncHog, SetUp::Orca) => Some(
                "ORCA on a listener each is what Peregrine gives uvicorn by default: the `shared` row",
            ),
            (Cell::AsyncHog, SetUp::Lr2) => Some("with 2 workers it is lr4's config"),
            (Cell::TwoHosts, SetUp::SharedSocket | SetUp::ReusePort) => {
                Some("no socket spans two hosts: each host's own shared one is the `shared` row")
            }
            (Cell::TwoHosts, SetUp::Lr2) => {
                Some("lr4 is the better of the two in every other cell")
            }
            (Cell::TwoHosts, _) => None,
            (_, SetUp::SharedOrca) => Some("one host is one endpoint: nothing to weigh it against"),
            _ => None,
        }
    }

    /// The app's environment in this cell, on its host `host` (0 where it has one).
    pub(super) fn env(self, host: u32) -> Vec<(String, String)> {
        match self {
            Cell::SlowWorker => vec![
                ("APP_WAIT_FACTOR".into(), SLOW_FACTOR.to_string()),
                ("APP_SLOW_INDEX".into(), "0".into()),
            ],
            // Host b's workers all wait longer (its backend is slower); each host's workers name
            // indices of their own.
            Cell::TwoHosts => {
                let mut env = vec![(
                    "APP_INDEX_BASE".into(),
                    (host * self.workers_per_host()).to_string(),
                )];
                if host == 1 {
                    env.push(("APP_WAIT_FACTOR".into(), HOST_SLOW_FACTOR.to_string()));
                }
                env
            }
            _ => Vec::new(),
        }
    }

    /// Host `host`'s name and address: this machine's loopback with one host, else `a` on
    /// 127.0.0.2, `b` on 127.0.0.3 and so on.
    pub(super) fn host(self, host: u32) -> (String, std::net::Ipv4Addr) {
        let name = char::from(b'a' + host as u8).to_string();
        if self.hosts() == 1 {
            (name, std::net::Ipv4Addr::LOCALHOST)
        } else {
            (name, std::net::Ipv4Addr::new(127, 0, 0, 2 + host as u8))
        }
    }

    /// The request targets under `prefix` (a route, or empty) with their weights.
    pub(super) fn targets(self, prefix: &str) -> Vec<(String, f64)> {
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
pub(super) enum App {
    /// gunicorn's sync worker on `tests/apps/wsgi_app.py`: one request at a time.
    Gunicorn,
    /// uvicorn on `tests/apps/asgi_app.py`: many at once, on one event loop.
    Uvicorn,
}

/// Where a server takes its listener from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Listener {
    /// The one the supervisor passes.
    Passed,
    /// One it binds with `SO_REUSEPORT` on this address, beside its siblings.
    ReusePort(SocketAddr),
}

impl App {
    pub(super) fn name(self) -> &'static str {
        match self {
            App::Gunicorn => "gunicorn",
            App::Uvicorn => "uvicorn",
        }
    }

    /// The server on the test app (in the virtualenv's `bin`) with `processes` processes on one
    /// `listener`: forked by the server itself when more than one, each told its index (gunicorn by
    /// `gunicorn_forks.py`, uvicorn by [`App::forks_env`]).
    pub(super) fn command(self, bin: &Path, processes: u32, listener: Listener) -> Vec<String> {
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
    pub(super) fn forks_env(self, cell: Cell, forks: &Path) -> Vec<(String, String)> {
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
pub(super) fn taskset(cpu: &str, command: Vec<String>) -> Vec<String> {
    ["taskset", "-c", cpu]
        .map(String::from)
        .into_iter()
        .chain(command)
        .collect()
}

/// A way to spread the requests over the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SetUp {
    SharedSocket,
    Orca,
    Lr2,
    LrAll,
    RoundRobin,
    ReusePort,
    Shared,
    SharedOrca,
}

impl SetUp {
    pub(super) const ALL: [SetUp; 8] = [
        SetUp::SharedSocket,
        SetUp::Orca,
        SetUp::Lr2,
        SetUp::LrAll,
        SetUp::RoundRobin,
        SetUp::ReusePort,
        SetUp::Shared,
        SetUp::SharedOrca,
    ];

    pub(super) fn key(self) -> &'static str {
        match self {
            SetUp::SharedSocket => "shared-socket",
            SetUp::Orca => "orca",
            SetUp::Lr2 => "lr2",
            SetUp::LrAll => "lr4",
            SetUp::RoundRobin => "rr",
            SetUp::ReusePort => "reuseport",
            SetUp::Shared => "shared",
            SetUp::SharedOrca => "shared-orca",
        }
    }

    pub(super) fn label(self, cell: Cell) -> String {
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
            SetUp::SharedOrca => "one shared listener per host, ORCA between hosts".into(),
        }
    }

    /// The service (Envoy cluster and route prefix `/<name>`); names that are no prefix of one
    /// another.
    pub(super) fn service(self) -> &'static str {
        match self {
            SetUp::SharedSocket => "socket",
            SetUp::Orca => "orca",
            SetUp::Lr2 => "lr2",
            SetUp::LrAll => "lrall",
            SetUp::RoundRobin => "rr",
            SetUp::ReusePort => "reuseport",
            SetUp::Shared => "shared",
            SetUp::SharedOrca => "weighed",
        }
    }

    /// The Peregrine service of this set-up in `cell` (none for the `SO_REUSEPORT` one): the
    /// servers from the virtualenv's `bin`, uvicorn's forks numbered in `forks`.
    pub(super) fn service_table(
        self,
        cell: Cell,
        bin: &Path,
        forks: &Path,
    ) -> Option<ServiceTable> {
        let workers = cell.workers_per_host();
        let app = cell.app();
        let mut env: std::collections::BTreeMap<String, String> = cell.env(0).into_iter().collect();
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
                choice_count: Some(if self == SetUp::Lr2 {
                    2
                } else {
                    cell.workers()
                }),
                ..service
            },
            SetUp::Orca => service.orca(Orca::On),
            SetUp::SharedOrca => ServiceTable {
                listener: Some("shared".into()),
                ..service.orca(Orca::On)
            },
            _ => service,
        })
    }

    /// How many hosts each Envoy holds once the set-up is ready (`None`: any, at least one).
    pub(super) fn hosts(self, cell: Cell) -> Option<usize> {
        match (self, cell.app()) {
            (SetUp::SharedSocket, _) => Some(1),
            (SetUp::Shared | SetUp::SharedOrca, App::Gunicorn) if cell.hosts() > 1 => {
                Some(cell.hosts() as usize)
            }
            (SetUp::ReusePort, _) | (SetUp::Shared | SetUp::SharedOrca, App::Gunicorn) => None,
            _ => Some(cell.workers() as usize),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                .env(0)
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
    fn two_hosts_of_two_workers_one_slower() {
        let (bin, forks) = (Path::new("/venv/bin"), Path::new("/tmp/forks"));
        let cell = Cell::TwoHosts;
        assert_eq!(
            (cell.hosts(), cell.workers_per_host(), cell.envoys()),
            (2, 2, 2)
        );
        assert_eq!(
            cell.host(1),
            ("b".into(), std::net::Ipv4Addr::new(127, 0, 0, 3))
        );
        assert_eq!(
            Cell::Io.host(0),
            ("a".into(), std::net::Ipv4Addr::LOCALHOST)
        );
        // Host b's workers wait longer, and the hosts' workers name indices of their own.
        let b = cell.env(1);
        assert!(b.contains(&("APP_WAIT_FACTOR".into(), HOST_SLOW_FACTOR.to_string())));
        assert!(b.contains(&("APP_INDEX_BASE".into(), "2".into())));
        assert_eq!(cell.env(0), [("APP_INDEX_BASE".into(), "0".into())]);
        for setup in [SetUp::SharedSocket, SetUp::ReusePort, SetUp::Lr2] {
            assert!(cell.leaves_out(setup).is_some(), "{setup:?}");
        }
        for setup in [SetUp::Shared, SetUp::SharedOrca, SetUp::Orca, SetUp::LrAll] {
            assert!(cell.leaves_out(setup).is_none(), "{setup:?}");
        }
        assert!(Cell::Io.leaves_out(SetUp::SharedOrca).is_some());
        // A shared listener per host, weighed on ORCA between hosts: one endpoint a host.
        let weighed = SetUp::SharedOrca.service_table(cell, bin, forks).unwrap();
        assert_eq!(
            (weighed.count, weighed.orca, weighed.listener.as_deref()),
            (Some(2), Some(Orca::On), Some("shared"))
        );
        assert_eq!(SetUp::SharedOrca.hosts(cell), Some(2));
        assert_eq!(SetUp::Shared.hosts(cell), Some(2));
        // A listener each: every host's workers in every Envoy, least request over all four.
        let lr = SetUp::LrAll.service_table(cell, bin, forks).unwrap();
        assert_eq!((lr.count, lr.choice_count), (Some(2), Some(4)));
        assert_eq!(SetUp::LrAll.hosts(cell), Some(4));
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
}
