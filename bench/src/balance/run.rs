//! The set-up and the driving: the supervisor and Envoy, their readiness, the hog, and every run of
//! every policy in every scenario and round; then the report and the series.

use std::{
    net::SocketAddr,
    path::Path,
    process::{Command, ExitCode},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, ensure};
use peregrine_e2e::{
    ChildGuard, Envoy, PeregrineToml, ServiceTable, Supervisor, TempDir, free_port, hosts,
    http_get, target_dir,
};
use serde_json::Value;
use xtask::envoy;

use super::{
    Bench, Case, OTHER_CPU, Policy, ReusePort, SHARED_CPU, Scenario, WorkerInfo, parse_args,
    poll::poll_every,
    report::{self, Setting},
    series,
};

use crate::machine::{cpu_line, cpus_allowed, online_cpus};

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let options = parse_args(args)?;
    let cpus = online_cpus();
    ensure!(
        cpus >= 2,
        "the benchmark pins worker 0 to CPU {SHARED_CPU} and worker 1 to CPU {OTHER_CPU}: it needs 2 CPUs, this machine has {cpus}"
    );
    let peregrine =
        super::super::release_peregrine_and(&["-p", "peregrine-bench", "--bin", "hyper-baseline"])?;
    let envoy_binary = envoy::install()?;
    if options.first_weights {
        super::first_weights::run(
            &peregrine,
            &envoy_binary,
            options.rounds,
            &super::super::command_line("balance", args),
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let out = target_dir().join("bench");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    if options.waits || options.timeline {
        // Before any pinning: matplotlib installs on both cores, and the report names the CPUs.
        crate::plot::python(&out)?;
        let cpu_line = cpu_line()?;
        let command = super::super::command_line("balance", args);
        if options.waits {
            // The waits pin per cell (the hogged cells only).
            super::waits::run(&peregrine, &envoy_binary, &options, &cpu_line, &command)?;
        } else {
            pin_to_other_cpu()?;
            super::timeline::run(&peregrine, &envoy_binary, &options, &cpu_line, &command)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    // Before pinning: the report names the CPUs this process may use.
    let cpu_line = cpu_line()?;
    // Build and install first, on both cores; from here on everything this process starts inherits
    // CPU 1, except what pins itself (the workers, the hog).
    pin_to_other_cpu()?;

    let dir = TempDir::new().context("a temporary directory")?;
    let (listen, admin) = (free_port(), free_port());
    let gunicorn = if options.gunicorn {
        Some(xtask::pyapps::install()?.join("gunicorn"))
    } else {
        None
    };
    let config = config(&peregrine, gunicorn.as_deref(), dir.path(), listen, admin);
    let supervisor = Supervisor::start_in(&peregrine, dir.path(), &config)?;
    let listen = SocketAddr::from(([127, 0, 0, 1], listen));
    let result = (|| {
        let mut envoy = Envoy::start_in(&envoy_binary, dir.path(), &supervisor.envoy_bootstrap()?)?;
        let envoy_pid = envoy.process().id();
        let mut bench = Bench {
            options: &options,
            own: vec![std::process::id(), supervisor.pid(), envoy_pid],
            supervisor: &supervisor,
            admin: envoy.admin_addr(),
            listen,
            dir: dir.path(),
            reuseport: None,
        };
        let workers = bench.ready()?;
        bench.own.extend(workers);
        let (baseline, processes) =
            reuseport_baseline(&peregrine.with_file_name("hyper-baseline"), dir.path())?;
        bench.own.extend(baseline.workers.iter().map(|w| w.pid));
        bench.reuseport = Some(baseline);
        let started = Instant::now();
        let mut runs = Vec::new();
        for scenario in Scenario::ALL {
            let hog = (scenario == Scenario::Hog)
                .then(|| super::spawn_hog(dir.path()))
                .transpose()?;
            let hog_pid = hog.as_ref().map(ChildGuard::id);
            for round in 0..options.rounds {
                let policies = Policy::of(scenario);
                for k in 0..policies.len() {
                    let policy = policies[(k + round) % policies.len()];
                    let case = Case {
                        scenario,
                        policy,
                        round,
                        hog: hog_pid,
                    };
                    let run = bench
                        .run_quietest(case)
                        .with_context(|| format!("{} in scenario {scenario:?}", policy.label()))?;
                    eprintln!("{}", report::describe(&run, &options));
                    runs.push(run);
                }
            }
            drop(hog);
        }
        drop(processes);
        let setting = Setting {
            command: super::super::command_line("balance", args),
            elapsed: started.elapsed(),
            cpu_line,
            envoy_version: envoy::short_version(&envoy_binary)?,
            status: supervisor.status_json()?,
        };
        Ok::<_, anyhow::Error>((runs, setting))
    })();
    let (runs, setting) = match result {
        Ok(result) => result,
        Err(error) => {
            eprintln!("{}", supervisor.logs());
            return Err(error);
        }
    };
    drop(supervisor);

    let report_path = report::write(&out, &options, &setting, &runs)?;
    let (requests_csv, samples_csv) = series::write(&out, &runs, &options)?;
    eprintln!(
        "report: {}\nseries: {}, {}",
        report_path.display(),
        requests_csv.display(),
        samples_csv.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Pins this process (and what it starts from now on, except what pins itself) to CPU 1.
pub(super) fn pin_to_other_cpu() -> anyhow::Result<()> {
    let mut cpu = rustix::thread::CpuSet::new();
    cpu.set(OTHER_CPU);
    rustix::thread::sched_setaffinity(None, &cpu).context("pinning the benchmark to CPU 1")
}

/// The `SO_REUSEPORT` baseline: two `hyper-baseline --reuseport` processes on one port, process `i`
/// pinned to CPU `i` like the workers; returns their address and pids once both have answered, and
/// the processes (killed when dropped).
fn reuseport_baseline(binary: &Path, dir: &Path) -> anyhow::Result<(ReusePort, Vec<ChildGuard>)> {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut processes = Vec::new();
    for cpu in [SHARED_CPU, OTHER_CPU] {
        processes.push(ChildGuard::spawn(
            &format!("hyper-reuseport-{cpu}"),
            Command::new("taskset")
                .args(["-c", &cpu.to_string()])
                .arg(binary)
                .arg(addr.to_string())
                .arg("--reuseport"),
            dir,
        )?);
    }
    // `taskset` execs the server: its pid is the child's.
    let pids: Vec<u32> = processes.iter().map(ChildGuard::id).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = std::collections::BTreeSet::new();
    poll(deadline, "both SO_REUSEPORT processes to answer", || {
        // A new connection each time: the kernel's hash sends some to each.
        let (status, body) = http_get(addr, "/").ok()?;
        if status == 200
            && let Some(pid) = peregrine_e2e::worker_pid(&body)
        {
            seen.insert(pid);
        }
        pids.iter().all(|p| seen.contains(p)).then_some(())
    })?;
    for (index, pid) in pids.iter().enumerate() {
        let cpus = cpus_allowed(*pid)?;
        ensure!(
            cpus == index.to_string(),
            "SO_REUSEPORT process {index} (pid {pid}) may run on CPUs {cpus}, expected {index}"
        );
    }
    let worker = |pid: u32, index: usize| WorkerInfo {
        pid,
        hostname: format!("reuseport-{index}-{pid}"),
        addr,
    };
    eprintln!(
        "reuseport: hyper processes {} (CPU 0) and {} (CPU 1) on {addr}, SO_REUSEPORT",
        pids[0], pids[1]
    );
    let workers = [worker(pids[0], 0), worker(pids[1], 1)];
    Ok((ReusePort { addr, workers }, processes))
}

/// The supervisor's config: a service of two workers per policy of [`Policy::ALL`], worker `i` pinned to CPU `i`: the
/// built-in worker, or `gunicorn` on the WSGI test app.
fn config(
    peregrine: &Path,
    gunicorn: Option<&Path>,
    dir: &Path,
    listen: u16,
    admin: u16,
) -> String {
    let worker = match gunicorn {
        // `taskset` execs gunicorn, which keeps the pid; the worker it forks inherits the CPU.
        Some(gunicorn) => {
            ServiceTable::app_server(pinned(peregrine_e2e::gunicorn_command(gunicorn)))
        }
        None => pinned_worker(peregrine),
    };
    let mut config = PeregrineToml::local(free_port())
        .control_in(dir)
        .with_envoy(listen, admin);
    for policy in Policy::ALL {
        config.service(policy.service(), service(policy.service(), policy, &worker));
    }
    config.toml()
}

/// `[service.<name>]` of a run: two workers of `worker` (its command, and the keys of a server on a
/// passed listener) under the route prefix `/<name>`, balanced by `policy`.
pub(super) fn service(name: &str, policy: Policy, worker: &ServiceTable) -> ServiceTable {
    policy.balance(ServiceTable {
        count: Some(2),
        url: Some("http://127.0.0.1:0".into()),
        prefix: Some(format!("/{name}")),
        ..worker.clone()
    })
}

/// The built-in worker, worker `i` pinned to CPU `i`.
pub(super) fn pinned_worker(peregrine: &Path) -> ServiceTable {
    ServiceTable::default().command(pinned([peregrine.display().to_string(), "worker".into()]))
}

/// `command` run by `taskset -c {index}`, which execs it: worker `i` on CPU `i`, with the pid the
/// supervisor started.
fn pinned(command: impl IntoIterator<Item = String>) -> Vec<String> {
    ["taskset", "-c", "{index}"]
        .map(String::from)
        .into_iter()
        .chain(command)
        .collect()
}

impl Bench<'_> {
    /// The two workers of `service`, by index, once both are registered.
    pub(super) fn workers(&self, service: &str) -> anyhow::Result<[WorkerInfo; 2]> {
        let status = self.supervisor.status_json()?;
        let row = |index: u64| -> Option<WorkerInfo> {
            let row = status["workers"]
                .as_array()?
                .iter()
                .find(|row| row["service"] == service && row["index"] == index)?;
            Some(WorkerInfo {
                pid: u32::try_from(row["pid"].as_u64()?).ok()?,
                hostname: row["hostname"].as_str()?.to_owned(),
                addr: row["addresses"]
                    .as_array()?
                    .first()?
                    .as_str()?
                    .parse()
                    .ok()?,
            })
        };
        Ok([
            row(0).with_context(|| format!("no worker 0 of {service} in {status}"))?,
            row(1).with_context(|| format!("no worker 1 of {service} in {status}"))?,
        ])
    }

    /// Waits until every worker is registered and pinned, Envoy routes to every service, and the
    /// ORCA services have weights (in band, the wait sends a request now and then: Envoy learns
    /// those weights from answers); returns every worker's pid.
    fn ready(&self) -> anyhow::Result<Vec<u32>> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut pids = Vec::new();
        for policy in Policy::ALL {
            let service = policy.service();
            let workers = poll(deadline, &format!("the workers of {service}"), || {
                self.workers(service).ok()
            })?;
            for (index, worker) in workers.iter().enumerate() {
                let cpus = cpus_allowed(worker.pid)?;
                ensure!(
                    cpus == index.to_string(),
                    "worker {index} of {service} (pid {}) may run on CPUs {cpus}, expected {index}",
                    worker.pid
                );
            }
            poll(deadline, &format!("Envoy routing /{service}"), || {
                let hosts = hosts(&http_get(self.admin, "/clusters").ok()?.1, service);
                let ok = http_get(self.listen, &format!("/{service}"))
                    .is_ok_and(|(status, _)| status == 200);
                (ok && hosts.len() == 2 && hosts.iter().all(|h| h.healthy)).then_some(())
            })?;
            if policy.weighted() {
                poll(
                    deadline,
                    &format!("ORCA weights for both workers of {service}"),
                    || {
                        if policy.in_band() {
                            let _ = http_get(self.listen, &format!("/{service}"));
                        }
                        let hosts = hosts(&http_get(self.admin, "/clusters").ok()?.1, service);
                        (hosts.len() == 2 && hosts.iter().all(|h| h.weight > 1)).then_some(())
                    },
                )?;
            }
            eprintln!(
                "{service}: workers {} (CPU 0) and {} (CPU 1), {}",
                workers[0].pid,
                workers[1].pid,
                policy.label()
            );
            pids.extend(workers.iter().map(|w| w.pid));
        }
        Ok(pids)
    }

    /// Waits until `service`'s workers served nothing in a sample taken after `since` (a run that
    /// timed out may leave requests queued in a worker), and checks neither was restarted.
    pub(super) fn quiet(
        &self,
        service: &str,
        workers: &[WorkerInfo; 2],
        since: SystemTime,
    ) -> anyhow::Result<()> {
        let since_ms = since.duration_since(UNIX_EPOCH)?.as_millis() as u64;
        poll(
            Instant::now() + Duration::from_secs(60),
            &format!("{service}'s workers to go idle"),
            || {
                let now = self.workers(service).ok()?;
                let status = self.supervisor.status_json().ok()?;
                let rows: Vec<&Value> = status["workers"]
                    .as_array()?
                    .iter()
                    .filter(|row| row["service"] == service)
                    .collect();
                let idle = rows.iter().all(|row| {
                    row["sampled_at_unix_ms"].as_u64() > Some(since_ms)
                        && row["requests_per_second"].as_f64() < Some(1.0)
                });
                (idle && now.iter().zip(workers).all(|(a, b)| a.pid == b.pid)).then_some(())
            },
        )
        .with_context(|| format!("logs in {}", self.dir.display()))
    }
}

/// Polls `f` every 250 ms until it returns `Some` or `deadline` passes. Not the harness's
/// `try_wait_until` (every 20 ms, a timeout per wait): each check here runs `peregrine status` or asks
/// Envoy, and [`Bench::ready`]'s waits share one deadline.
fn poll<T>(deadline: Instant, what: &str, f: impl FnMut() -> Option<T>) -> anyhow::Result<T> {
    poll_every(Duration::from_millis(250), deadline, what, f)
}
