//! The supervisor under test: `peregrine run` (release) with `W` built-in workers of one `orca = true`
//! service, pinned with its workers to one CPU; its CPU time and resident memory.

use std::{path::Path, time::Duration};

use anyhow::{Context, ensure};
use peregrine_contract::procfs;
use peregrine_e2e::{
    PeregrineToml, ServiceTable, Supervisor, TempDir, config::Orca, free_port, try_wait_until,
};

/// How long `W` workers may take to be registered and sampled.
const START_DEADLINE: Duration = Duration::from_secs(60);

/// A running supervisor and its workers' hostnames; stopped (workers too) on drop.
#[derive(Debug)]
pub(super) struct Host {
    supervisor: Supervisor,
    pub(super) pid: u32,
    pub(super) grpc_port: u16,
    /// The EDS hostname of every worker: what Envoy sends as an ORCA stream's `:authority`.
    pub(super) hostnames: Vec<String>,
    _dir: TempDir,
}

impl Host {
    /// Starts `peregrine` with `workers` hello workers (`orca = true`), everything pinned to `cpu`,
    /// admitting at least `connections` gRPC connections in all; waits until every worker is ready.
    pub(super) fn start(
        peregrine: &Path,
        workers: usize,
        cpu: usize,
        connections: usize,
    ) -> anyhow::Result<Host> {
        let dir = TempDir::new().context("a temporary directory")?;
        let grpc_port = free_port();
        let config = config(peregrine, grpc_port, workers, connections);
        let cpu = cpu.to_string();
        let wrapper = ["taskset", "-c", &cpu];
        let supervisor = Supervisor::start_wrapped_at(&wrapper, peregrine, dir.path(), &config)?;
        let pid = supervisor.pid();
        let hostnames = try_wait_until(START_DEADLINE, "every worker ready", || {
            let status = supervisor.status_json().ok()?;
            let rows = status["workers"].as_array()?;
            let ready: Vec<String> = rows
                .iter()
                .filter(|w| w["state"].as_str() == Some("ready"))
                .filter_map(|w| w["hostname"].as_str().map(str::to_owned))
                .collect();
            (ready.len() == workers).then_some(ready)
        })
        .with_context(|| supervisor.logs())?;
        Ok(Host {
            supervisor,
            pid,
            grpc_port,
            hostnames,
            _dir: dir,
        })
    }

    /// The supervisor's CPU time so far (user + system, all threads, not its workers'), in clock
    /// ticks.
    pub(super) fn cpu_ticks(&self) -> anyhow::Result<u64> {
        Ok(procfs::stat(self.pid)?.cpu_ticks())
    }

    /// The supervisor's resident memory (`VmRSS`), in bytes.
    pub(super) fn rss(&self) -> anyhow::Result<u64> {
        vm_rss(self.pid)
    }

    /// The ORCA streams the supervisor holds and the reports it has sent on them, all workers
    /// together (`peregrine status --json`).
    pub(super) fn orca_totals(&self) -> anyhow::Result<(u64, u64)> {
        let status = self.supervisor.status_json()?;
        let workers = status["workers"]
            .as_array()
            .with_context(|| format!("no workers in {status}"))?;
        let sum = |key: &str| workers.iter().filter_map(|w| w[key].as_u64()).sum::<u64>();
        Ok((sum("orca_streams"), sum("orca_reports")))
    }

    /// The sampler the supervisor runs, and its interval (`peregrine status --json`).
    pub(super) fn sampler(&self) -> anyhow::Result<String> {
        let status = self.supervisor.status_json()?;
        Ok(format!(
            "{}, every {} ms",
            status["sampler"].as_str().unwrap_or("none"),
            status["sample_interval_ms"]
        ))
    }

    /// The supervisor's logs, for an error.
    pub(super) fn logs(&self) -> String {
        self.supervisor.logs()
    }
}

/// `VmRSS` of process `pid`, in bytes.
pub(super) fn vm_rss(pid: u32) -> anyhow::Result<u64> {
    let status = peregrine_contract::procfs::status(pid)?;
    Ok(status.rss_kib * 1024)
}

/// The supervisor's config: `workers` built-in workers on fresh loopback ports, ORCA on (the
/// default for an IP url, written out), the default 200 ms sample interval and report floor. The
/// gRPC port keeps its per-address cap (1,024; each simulated Envoy dials from an address of its
/// own), and its global cap (8,192) is raised only when `connections` would not fit under it.
fn config(peregrine: &Path, grpc_port: u16, workers: usize, connections: usize) -> String {
    // Room for the client's streams and a few more (status, an Envoy's xDS).
    let wanted = connections + 64;
    let mut config = PeregrineToml::local(grpc_port);
    config.supervisor.grpc_max_connections = (wanted > 8192).then_some(wanted as u64);
    config.service(
        "hello",
        ServiceTable::at("http://127.0.0.1:0")
            .count(workers as u32)
            .orca(Orca::On)
            .command([peregrine.display().to_string(), "worker".into()]),
    );
    config.toml()
}

/// Checks that the supervisor's open-file limit leaves room for `connections`.
pub(super) fn check_open_files(pid: u32, connections: usize) -> anyhow::Result<()> {
    let path = format!("/proc/{pid}/limits");
    let limits = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let soft: Option<u64> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok());
    if let Some(soft) = soft {
        ensure!(
            soft as usize > connections + 256,
            "the supervisor may open {soft} files, too few for {connections} connections: raise `ulimit -n`"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_raises_the_global_cap_only_past_it() {
        let small = config(Path::new("/p"), 1, 64, 6400);
        assert!(!small.contains("grpc_max_connections"), "{small}");
        assert!(small.contains("count = 64"), "{small}");
        let large = config(Path::new("/p"), 1, 64, 12800);
        assert!(large.contains("grpc_max_connections = 12864"), "{large}");
    }

    #[test]
    fn reads_this_process_rss() {
        assert!(vm_rss(std::process::id()).unwrap() > 0);
    }
}
