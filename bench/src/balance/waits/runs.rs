//! One cell's run: its hog, supervisor, Envoys and `SO_REUSEPORT` servers, each set-up's runs under
//! the open-loop generator, and each run's figures.

use super::*;

/// What a cell's runs share.
pub(super) struct CellBench<'a> {
    pub(super) options: &'a Options,
    pub(super) cell: Cell,
    /// Every host's supervisor (one but in two-hosts).
    pub(super) supervisors: Vec<&'a Supervisor>,
    /// Every Envoy of the cell.
    pub(super) envoys: Vec<EnvoyAt>,
    /// The `SO_REUSEPORT` port, when that set-up runs.
    pub(super) reuseport: Option<SocketAddr>,
}

/// One Envoy: its pid, its listener and its admin listener.
#[derive(Clone, Copy, Debug)]
pub(super) struct EnvoyAt {
    pub(super) pid: u32,
    pub(super) listen: SocketAddr,
    pub(super) admin: SocketAddr,
}

/// One cell: its hog and pinning, its supervisor and Envoys, the `SO_REUSEPORT` processes, and every
/// round of `setups`; pushes the runs, and the set-ups skipped with why. The servers are in the
/// virtualenv's `bin`.
pub(super) fn run_cell(
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
        crate::balance::run::pin_to_other_cpu()?;
    } else {
        unpin()?;
    }
    let dir = TempDir::new().context("a temporary directory")?;
    // Where the processes uvicorn forks on one socket take their indices.
    let forks = dir.path().join("forks");
    std::fs::create_dir_all(&forks).with_context(|| format!("creating {}", forks.display()))?;
    // One gRPC port for every host: Envoy opens each endpoint's ORCA stream to its address on it.
    let grpc = free_port();
    // Each Envoy's listener and admin ports.
    let ports: Vec<(u16, u16)> = (0..cell.envoys())
        .map(|_| (free_port(), free_port()))
        .collect();
    let mut setups = setups.to_vec();
    // Several hosts share their membership through an etcd of their own.
    let etcd = if cell.hosts() > 1 {
        Some(peregrine_e2e::Etcd::start().context("etcd for the hosts")?)
    } else {
        None
    };
    let host_dir = |host: u32| {
        if cell.hosts() == 1 {
            dir.path().to_owned()
        } else {
            dir.path().join(cell.host(host).0)
        }
    };
    for host in 0..cell.hosts() {
        std::fs::create_dir_all(host_dir(host)).context("a host's directory")?;
    }
    // Host `host`'s config, with `[envoy]` for its first Envoy.
    let host_config = |host: u32, with: &[SetUp]| -> PeregrineToml {
        let (name, ip) = cell.host(host);
        let envoy = ports[(host as usize).min(ports.len() - 1)];
        let mut config = PeregrineToml::local(grpc)
            .control_in(&host_dir(host))
            .with_envoy(envoy.0, envoy.1);
        if let Some(etcd) = &etcd {
            config.supervisor.bind = Some(format!("http://{ip}:{grpc}"));
            // One machine's loopback: nothing leaves it.
            config.cluster = Some(peregrine_e2e::config::ClusterTable {
                routing: Some("fleet".into()),
                ..peregrine_e2e::config::ClusterTable::insecure([etcd.endpoint()], &name)
            });
            if let Some(envoy) = config.envoy.as_mut() {
                envoy.node = Some(format!("envoy-{name}"));
            }
        }
        for setup in with {
            if let Some(mut service) = setup.service_table(cell, bin, &forks) {
                service.url = Some(format!("http://{ip}:0"));
                if let Some(env) = service.env.as_mut() {
                    env.extend(cell.env(host));
                }
                config.service(setup.service(), service);
            }
        }
        config
    };
    let config = |with: &[SetUp]| host_config(0, with);
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
    let fulls: Vec<PeregrineToml> = (0..cell.hosts())
        .map(|host| host_config(host, &setups))
        .collect();
    for full in &fulls {
        check(peregrine, dir.path(), &full.toml()).context("peregrine check")?;
    }
    let hogs = if cell.hogged() {
        (0..HOG_THREADS)
            .map(|_| crate::balance::spawn_hog(dir.path()))
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
    let supervisors = (0..cell.hosts())
        .map(|host| Supervisor::start_in(peregrine, &host_dir(host), &fulls[host as usize].toml()))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let result = (|| {
        let mut envoys = Vec::new();
        for (k, &(listen, admin)) in ports.iter().enumerate() {
            // In two-hosts, Envoy k is host k's, bootstrapped from its supervisor.
            envoys.push(start_envoy(
                peregrine,
                envoy_binary,
                dir.path(),
                &fulls[k.min(fulls.len() - 1)],
                k,
                (listen, admin),
            )?);
        }
        let bench = CellBench {
            options,
            cell,
            supervisors: supervisors.iter().collect(),
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
        for supervisor in &supervisors {
            eprintln!("{}", supervisor.logs());
        }
        return Err(error);
    }
    drop(supervisors);
    drop(etcd);
    drop(hogs);
    Ok(())
}

/// Envoy `k` of a cell, in a directory of its own under `dir`, bootstrapped from `config` with its
/// own listener, admin port and (beside others) node id.
pub(super) fn start_envoy(
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
    crate::balance::envoy_bootstrapped_from(peregrine, envoy_binary, &dir, &config.toml())
        .with_context(|| format!("Envoy {k}"))
}

/// `peregrine check` on `text`; the error is its first line of complaint.
pub(super) fn check(peregrine: &Path, dir: &Path, text: &str) -> anyhow::Result<()> {
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
pub(super) fn unpin() -> anyhow::Result<()> {
    let mut cpus = rustix::thread::CpuSet::new();
    for cpu in 0..crate::machine::online_cpus().max(2) {
        cpus.set(cpu);
    }
    rustix::thread::sched_setaffinity(None, &cpus).context("unpinning the benchmark")
}

/// The `SO_REUSEPORT` set-up: `cell.workers()` servers of one process each, each binding one port
/// with `SO_REUSEPORT` (process `i` with `APP_WORKER_INDEX=i`, on CPU `i` in a hogged cell), once
/// each has answered.
pub(super) fn reuseport(
    bin: &Path,
    cell: Cell,
    dir: &Path,
) -> anyhow::Result<(SocketAddr, Vec<ChildGuard>)> {
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
            .envs(cell.env(0));
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
pub(super) fn answering_index(addr: SocketAddr, path: &str) -> Option<u32> {
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
    pub(super) fn ready(&self, setups: &[SetUp]) -> anyhow::Result<()> {
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
    pub(super) fn addresses(&self, setup: SetUp) -> Vec<SocketAddr> {
        if setup == SetUp::ReusePort {
            return self.reuseport.into_iter().collect();
        }
        let mut addresses: Vec<SocketAddr> = self
            .supervisors
            .iter()
            .filter_map(|supervisor| supervisor.status_json().ok())
            .flat_map(|status| {
                status["workers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|row| row["service"] == setup.service())
                    .flat_map(|row| row["addresses"].as_array().cloned().unwrap_or_default())
                    .filter_map(|a| a.as_str()?.parse().ok())
                    .collect::<Vec<SocketAddr>>()
            })
            .collect();
        addresses.sort();
        addresses.dedup();
        addresses
    }

    /// [`CellBench::run`], again (up to [`WAITS_NOISY_RETRIES`] times) while other processes used more
    /// than [`NOISY`] cores; keeps the quietest.
    pub(super) fn run_quietest(&self, setup: SetUp, round: usize) -> anyhow::Result<WaitRun> {
        quietest(
            WAITS_NOISY_RETRIES,
            || self.run(setup, round),
            |run| run.others,
            describe,
        )
    }

    /// One run of `setup` in round `round`: warm-up and measured window, then the drain.
    pub(super) fn run(&self, setup: SetUp, round: usize) -> anyhow::Result<WaitRun> {
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
        // Every Envoy's together, and every supervisor's.
        let envoy_ticks = || self.envoys.iter().map(|e| ticks(e.pid)).sum::<u64>();
        let supervisor_ticks = || self.supervisors.iter().map(|s| ticks(s.pid())).sum::<u64>();
        let hz = procfs::clock_ticks_per_second() as f64;
        // What the supervisor (sampling, reporting) and Envoy (its timers, the ORCA streams) take
        // with no requests: subtracted from the run's. A supervisor that has just started (a cell's
        // first run: the eBPF programs loading, the workers registering) is not idle yet: measured
        // again while it takes more than `NOISY` cores, up to `IDLE_TRIES` windows.
        let measure_idle = || {
            let from = (Instant::now(), supervisor_ticks(), envoy_ticks());
            std::thread::sleep(IDLE);
            let secs = from.0.elapsed().as_secs_f64();
            (
                supervisor_ticks().saturating_sub(from.1) as f64 / hz / secs,
                envoy_ticks().saturating_sub(from.2) as f64 / hz / secs,
                secs,
            )
        };
        let mut measured = measure_idle();
        for _ in 1..IDLE_TRIES {
            if measured.0 <= NOISY {
                break;
            }
            measured = measure_idle();
        }
        let (idle, idle_secs) = ((measured.0, measured.1), measured.2);
        let start = Instant::now() + Duration::from_millis(500);
        let before = (
            Busy::now(std::process::id())?,
            supervisor_ticks(),
            envoy_ticks(),
        );
        let records = openloop::run(&plan, start)?;
        let after = (
            Busy::now(std::process::id())?,
            supervisor_ticks(),
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
            run.machinery = Some(Machinery {
                supervisor_us: per_request(after.1.saturating_sub(before.1), idle.0),
                envoy_us: per_request(after.2.saturating_sub(before.2), idle.1),
                supervisor_idle: idle.0,
                envoy_idle: idle.1,
                // Each process summed (the Envoys of four-envoys, the supervisors of two-hosts)
                // is a tick off on its own.
                resolution_us: (1.0 + run_secs / idle_secs) / hz / answered
                    * 1e6
                    * self.supervisors.len().max(self.envoys.len()) as f64,
            });
        }
        Ok(run)
    }

    /// Waits until every listen queue of `setup` is empty (a run that overloaded a worker leaves
    /// connections queued), then for the last request in hand (the longest wait is 500 ms).
    pub(super) fn drain(&self, setup: SetUp) -> anyhow::Result<()> {
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
pub(super) fn listen_backlog(ports: &[u16]) -> u64 {
    let Ok(text) = std::fs::read_to_string("/proc/net/tcp") else {
        return 0;
    };
    backlog_in(&text, ports)
}

/// [`listen_backlog`] of one `/proc/net/tcp` text.
pub(super) fn backlog_in(text: &str, ports: &[u16]) -> u64 {
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
pub(super) fn summarize(
    cell: Cell,
    setup: SetUp,
    round: usize,
    options: &Options,
    records: &[Record],
) -> WaitRun {
    let measured = measured_window(options, records);
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
        machinery: None,
        others: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args;
    use crate::balance::parse_args;

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
