//! The servers under test, each pinned to [`SERVER_CPU`] with its load on [`LOAD_CPU`]: the worker
//! under a `peregrine run` supervisor, and the hyper baseline; and the check that the machine has what
//! loading them takes.

use std::{env, path::Path, process::Command, time::Duration};

use anyhow::{Context, ensure};
use peregrine_e2e::{
    ChildGuard, PeregrineToml, ServiceTable,
    config::{Orca, SupervisorTable},
    free_port, http_get, try_wait_until, worker_pid,
};
use xtask::packages::program_path;

use super::machine::online_cpus;

/// The core both servers are pinned to.
pub(super) const SERVER_CPU: &str = "0";
/// The core of the load generator (and the idle supervisor).
pub(super) const LOAD_CPU: &str = "1";
/// How long a server may take to answer its first request.
const START_DEADLINE: Duration = Duration::from_secs(20);

/// A server under test, running on a fixed port and pinned to [`SERVER_CPU`]; killed on drop.
#[derive(Debug)]
pub(super) struct Running {
    process: ChildGuard,
    /// The pid whose CPU time is measured.
    pub(super) pid: u32,
    pub(super) port: u16,
}

impl Drop for Running {
    /// SIGTERM first: a supervisor stops its workers then (they would outlive a SIGKILL, waiting for
    /// the next supervisor).
    fn drop(&mut self) {
        let _ = self.process.stop(std::time::Duration::from_secs(10));
    }
}

/// Waits until `process` answers `GET /` with `200` on `port`; returns the body.
fn wait_answering(process: &mut ChildGuard, port: u16, what: &str) -> anyhow::Result<String> {
    try_wait_until(START_DEADLINE, what, || {
        process.ensure_running().ok()?;
        let (status, body) = http_get(([127, 0, 0, 1], port), "/").ok()?;
        (status == 200).then_some(body)
    })
    .with_context(|| process.logs())
}

impl Running {
    /// `peregrine run` with one hello worker; the worker's pid is measured.
    pub(super) fn worker(peregrine: &Path, dir: &Path) -> anyhow::Result<Self> {
        Running::worker_with(peregrine, dir, |_| {})
    }

    /// [`Running::worker`] with `supervisor` setting keys of the `[supervisor]` table.
    pub(super) fn worker_with(
        peregrine: &Path,
        dir: &Path,
        supervisor: impl FnOnce(&mut SupervisorTable),
    ) -> anyhow::Result<Self> {
        Running::worker_with_service(peregrine, dir, supervisor, None)
    }

    /// [`Running::worker`] in `dir` (created), its service `orca = "in-band"`: once the sampler
    /// has two readings, a new connection's first response carries the worker's load report, which
    /// this waits for.
    pub(super) fn worker_in_band(peregrine: &Path, dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let running = Running::worker_with_service(peregrine, dir, |_| {}, Some(Orca::InBand))?;
        let mut last = String::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            last = raw_head(running.port).unwrap_or_else(|e| e.to_string());
            if last.contains("\nendpoint-load-metrics-bin: ") {
                return Ok(running);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        anyhow::bail!(
            "no endpoint-load-metrics-bin header within 10 s; the last response: {last:?}"
        )
    }

    /// [`Running::worker_with`], with `orca` as the service's `orca` key.
    fn worker_with_service(
        peregrine: &Path,
        dir: &Path,
        supervisor: impl FnOnce(&mut SupervisorTable),
        orca: Option<Orca>,
    ) -> anyhow::Result<Self> {
        let port = free_port();
        let config = dir.join("peregrine.toml");
        let mut toml = PeregrineToml::local(free_port()).control_in(dir);
        supervisor(&mut toml.supervisor);
        toml.service(
            "hello",
            ServiceTable {
                orca,
                ..pinned_hello(peregrine, format!("http://127.0.0.1:{port}"))?
            },
        );
        std::fs::write(&config, toml.toml())
            .with_context(|| format!("writing {}", config.display()))?;
        let mut command = Command::new("taskset");
        command
            .args(["-c", LOAD_CPU])
            .arg(peregrine)
            .arg("run")
            .arg(&config)
            .env("PEREGRINE_METRICS", "http://127.0.0.1:0");
        if env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "info");
        }
        let mut supervisor = ChildGuard::spawn("peregrine", &mut command, dir)?;
        let body = wait_answering(&mut supervisor, port, "the worker to answer")?;
        let pid = worker_pid(&body).with_context(|| format!("not a hello body: {body:?}"))?;
        Ok(Running {
            process: supervisor,
            pid,
            port,
        })
    }

    /// A server binary that takes `ADDR` (the hyper baseline, a candidate data path), named `name`
    /// in logs; `taskset` execs it, so the child's pid is the server's.
    pub(super) fn binary(name: &str, binary: &Path, dir: &Path) -> anyhow::Result<Self> {
        let port = free_port();
        let mut process = ChildGuard::spawn(
            name,
            Command::new("taskset")
                .args(["-c", SERVER_CPU])
                .arg(binary)
                .arg(format!("127.0.0.1:{port}")),
            dir,
        )?;
        wait_answering(&mut process, port, &format!("{name} to answer"))?;
        Ok(Running {
            pid: process.id(),
            process,
            port,
        })
    }
}

/// A service of one hello worker at `url`, pinned to [`SERVER_CPU`]. `taskset` execs the worker,
/// so the worker keeps the pid the supervisor started and its registration (checked against the
/// peer's pid) still matches.
pub(super) fn pinned_hello(peregrine: &Path, url: String) -> anyhow::Result<ServiceTable> {
    let taskset = program_path("taskset")?.display().to_string();
    let peregrine = peregrine.display().to_string();
    Ok(ServiceTable::at(url).count(1).command([
        taskset,
        "-c".into(),
        SERVER_CPU.into(),
        peregrine,
        "worker".into(),
    ]))
}

/// The head of a `GET /` to `127.0.0.1:port`, on a connection of its own.
fn raw_head(port: u16) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(b"GET / HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n")?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response).into_owned();
    Ok(text.split("\r\n\r\n").next().unwrap_or_default().to_owned())
}

/// Checks for two CPUs, `taskset` and `timeout`, and installs `wrk` and `h2load` with apt-get when they
/// are missing and this runs as root.
pub(super) fn preflight() -> anyhow::Result<()> {
    let cpus = online_cpus();
    ensure!(
        cpus >= 2,
        "the benchmark pins the servers to CPU {SERVER_CPU} and the load to CPU {LOAD_CPU}: it needs 2 CPUs, this machine has {cpus}"
    );
    for (program, package) in [("taskset", "util-linux"), ("timeout", "coreutils")] {
        program_path(program).with_context(|| format!("install the Debian package {package}"))?;
    }
    xtask::packages::ensure(xtask::packages::BENCH)
}
