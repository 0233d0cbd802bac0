//! One host of a fleet on this machine: a `peregrine run` with its own directory (config, control
//! socket, logs), its own loopback address for its gRPC port and workers, `[cluster]` on the
//! benchmark's etcd with `routing = "fleet"`, and optionally an Envoy bootstrapped from it by
//! `peregrine envoy-bootstrap`.
//!
//! Every host of one fleet listens on the same gRPC port, each on its own address
//! (`127.F.0.1`, `127.F.0.2`, ...), as a fleet of machines would; the Envoy's admin is on 127.0.0.1.
//! Dropping a host kills its Envoy, its supervisor and its workers (the harness's guards).

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
};

use anyhow::Context;
use peregrine_e2e::{Envoy, PeregrineToml, ServiceTable, Supervisor, TempDir, free_port};
use xtask::logs::FLEET_DEBUG;

/// The one service every host runs.
pub(super) const SERVICE: &str = "web";
/// Where the supervisors keep their workers in etcd (`[cluster] prefix` is left at `/peregrine`).
pub(super) const WORKER_KEYS: &str = "/peregrine/v1/workers/";

/// The etcd key of worker `pid` in slot `slot` of host `host`.
pub(super) fn worker_key(host: &str, slot: usize, pid: u64) -> String {
    format!("{WORKER_KEYS}{host}/{SERVICE}/{slot}/{pid}")
}

/// The address of host `index` (from 0) of fleet `fleet` (from 1): `127.<fleet>.<index / 250>.<index %
/// 250 + 1>`.
pub(super) fn address(fleet: u8, index: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, fleet, (index / 250) as u8, (index % 250 + 1) as u8)
}

/// Whether `address` (`IP:PORT`, as Envoy lists it) is on `ip`.
pub(super) fn owned_by(ip: Ipv4Addr, address: &str) -> bool {
    address
        .rsplit_once(':')
        .is_some_and(|(host, _)| host.parse::<Ipv4Addr>() == Ok(ip))
}

/// What a host is started with.
#[derive(Clone, Debug)]
pub(super) struct Spec<'a> {
    pub(super) name: String,
    pub(super) ip: Ipv4Addr,
    /// The gRPC port (the same on every host of a fleet).
    pub(super) grpc_port: u16,
    pub(super) workers: u32,
    /// The etcd client endpoints.
    pub(super) etcd: &'a [String],
}

/// The host's `peregrine.toml`.
fn config(spec: &Spec<'_>, dir: &Path) -> String {
    let mut config = PeregrineToml::local(spec.grpc_port).control_in(dir);
    config.supervisor.bind = Some(format!("http://{}:{}", spec.ip, spec.grpc_port));
    // Every kill restarts after the first backoff (100 ms), never a grown one.
    config.supervisor.healthy_after_ms = Some(150);
    crate::config::fleet_host(&mut config, &spec.name, spec.etcd.to_vec());
    let envoy = config.envoy_mut();
    envoy.listen = Some(format!("{}:{}", spec.ip, free_port()));
    envoy.admin = Some(format!("127.0.0.1:{}", free_port()));
    config.service(
        SERVICE,
        ServiceTable::at(format!("http://{}:0", spec.ip)).count(spec.workers),
    );
    config.toml()
}

/// A running host.
#[derive(Debug)]
pub(super) struct FleetHost {
    pub(super) name: String,
    pub(super) ip: Ipv4Addr,
    // Dropped in this order: Envoy, the supervisor with its workers, the directory.
    envoy: Option<Envoy>,
    supervisor: Supervisor,
    dir: TempDir,
}

impl FleetHost {
    /// Writes the config and starts `peregrine run` (with the membership's debug lines in its log).
    pub(super) fn start(peregrine: &Path, spec: &Spec<'_>) -> anyhow::Result<FleetHost> {
        let dir = TempDir::with_prefix(format!("peregrine-fleet-{}-", spec.name))
            .context("a temporary directory")?;
        let supervisor = Supervisor::start_in_with_env(
            peregrine,
            dir.path(),
            &config(spec, dir.path()),
            &[("RUST_LOG", FLEET_DEBUG)],
        )
        .with_context(|| format!("starting host {}", spec.name))?;
        Ok(FleetHost {
            name: spec.name.clone(),
            ip: spec.ip,
            envoy: None,
            supervisor,
            dir,
        })
    }

    /// Starts an Envoy from `peregrine envoy-bootstrap` of this host's config (in `<dir>/envoy`).
    pub(super) fn start_envoy(&mut self, binary: &Path) -> anyhow::Result<()> {
        let dir = self.dir.path().join("envoy");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let bootstrap = self.supervisor.envoy_bootstrap()?;
        self.envoy = Some(
            Envoy::start_in(binary, &dir, &bootstrap)
                .with_context(|| format!("starting the Envoy of host {}", self.name))?,
        );
        Ok(())
    }

    /// The admin address of this host's Envoy.
    pub(super) fn admin(&self) -> anyhow::Result<SocketAddr> {
        Ok(self
            .envoy
            .as_ref()
            .with_context(|| format!("host {} has no Envoy", self.name))?
            .admin_addr())
    }

    /// The supervisor.
    pub(super) fn supervisor(&self) -> &Supervisor {
        &self.supervisor
    }

    /// The logs of every `peregrine run` of this host, oldest first.
    pub(super) fn logs(&self) -> String {
        self.supervisor.all_logs()
    }

    /// The current `peregrine run`'s stderr log, where its tracing lines go.
    pub(super) fn log_path(&mut self) -> PathBuf {
        self.supervisor.process().log_paths().1.to_path_buf()
    }

    /// The live workers of this host.
    pub(super) fn worker_pids(&self) -> Vec<u32> {
        self.supervisor.worker_pids()
    }

    /// Whether an address (`IP:PORT`, as Envoy lists it) is one of this host's workers'.
    pub(super) fn owns(&self, address: &str) -> bool {
        owned_by(self.ip, address)
    }

    /// SIGKILLs the supervisor (its process group), then every worker: the host dies whole, as a
    /// machine that loses power; its keys stay in etcd until its lease expires.
    pub(super) fn kill(&mut self) {
        self.supervisor.kill_with_workers();
    }

    /// Starts `peregrine run` again on the same config (after [`FleetHost::kill`]).
    pub(super) fn start_again(&mut self) -> anyhow::Result<()> {
        self.supervisor
            .start_again()
            .with_context(|| format!("starting host {} again", self.name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_the_config() {
        assert_eq!(address(1, 0), Ipv4Addr::new(127, 1, 0, 1));
        assert_eq!(address(2, 251), Ipv4Addr::new(127, 2, 1, 2));
        let etcd = ["http://127.0.0.1:2379".to_string()];
        let spec = Spec {
            name: "h3".into(),
            ip: address(1, 2),
            grpc_port: 18000,
            workers: 2,
            etcd: &etcd,
        };
        let text = config(&spec, Path::new("/tmp/x"));
        for line in [
            "bind = \"http://127.1.0.3:18000\"",
            "etcd = [\"http://127.0.0.1:2379\"]",
            "host = \"h3\"",
            "routing = \"fleet\"",
            "count = 2",
            "url = \"http://127.1.0.3:0\"",
            "sampler = \"off\"",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }
}
