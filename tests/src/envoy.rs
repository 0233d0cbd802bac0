//! A real Envoy for tests, its admin API and the parser of admin `/clusters`.

use std::{
    collections::{BTreeSet, hash_map::RandomState},
    hash::{BuildHasher, Hasher},
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, bail};
use tempfile::TempDir;

use crate::{ChildGuard, http::http_get, paths::envoy_path, wait::try_wait_until};

/// How long [`Envoy::start`] waits for the admin listener.
const ADMIN_DEADLINE: Duration = Duration::from_secs(30);

/// A running Envoy (`--concurrency 1 --disable-hot-restart` with a random `--base-id`), killed on drop.
///
/// Envoy writes its admin address to a file (`--admin-address-path`), so the bootstrap may use port 0
/// for admin; a listener port should come from [`free_port`](crate::free_port).
#[derive(Debug)]
pub struct Envoy {
    // Declared before `_temp` so the process dies before its directory is removed.
    process: ChildGuard,
    dir: PathBuf,
    admin: SocketAddr,
    _temp: Option<TempDir>,
}

// === impl Envoy ===

impl Envoy {
    /// Starts Envoy with `bootstrap_yaml` in a fresh temporary directory and waits for its admin listener.
    ///
    /// # Panics
    ///
    /// When there is no Envoy binary (call [`envoy_or_skip`](crate::envoy_or_skip) first) or it does
    /// not start.
    #[track_caller]
    pub fn start(bootstrap_yaml: &str) -> Self {
        Self::start_wrapped(&[], bootstrap_yaml)
    }

    /// Like [`Envoy::start`], but started through `wrapper` (a program and its arguments that exec
    /// the rest, e.g. a [`NetHost::wrapper`](crate::NetHost::wrapper) to run Envoy on that host), so
    /// Envoy keeps the pid. Its admin address (in the bootstrap) is then the host's: talk to it from
    /// inside the host ([`NetHost::run`](crate::NetHost::run)) when it is a loopback address.
    ///
    /// # Panics
    ///
    /// As [`Envoy::start`].
    #[track_caller]
    pub fn start_wrapped(wrapper: &[&str], bootstrap_yaml: &str) -> Self {
        let binary = envoy_path().expect("no Envoy binary: set ENVOY or run `cargo xtask envoy`");
        let temp = tempfile::Builder::new()
            .prefix("peregrine-envoy-")
            .tempdir()
            .expect("a temp dir");
        let mut envoy = Self::spawn(wrapper, &binary, temp.path(), bootstrap_yaml)
            .unwrap_or_else(|error| panic!("starting Envoy: {error:?}"));
        envoy._temp = Some(temp);
        envoy
    }

    /// Starts `binary` with `bootstrap_yaml` written to `dir/envoy.yaml`, logging into `dir`, and waits
    /// for its admin listener. `ENVOY_LOG_LEVEL` overrides the log level (default `warning`).
    pub fn start_in(binary: &Path, dir: &Path, bootstrap_yaml: &str) -> anyhow::Result<Self> {
        Self::spawn(&[], binary, dir, bootstrap_yaml)
    }

    /// [`Envoy::start_in`] through `wrapper` (none when empty), e.g. a
    /// [`NetHost::wrapper`](crate::NetHost::wrapper): Envoy runs on that host, and its admin
    /// address is the host's.
    pub fn start_wrapped_in(
        wrapper: &[&str],
        binary: &Path,
        dir: &Path,
        bootstrap_yaml: &str,
    ) -> anyhow::Result<Self> {
        Self::spawn(wrapper, binary, dir, bootstrap_yaml)
    }

    /// [`Envoy::start_in`] through `wrapper` (none when empty).
    fn spawn(
        wrapper: &[&str],
        binary: &Path,
        dir: &Path,
        bootstrap_yaml: &str,
    ) -> anyhow::Result<Self> {
        let config = dir.join("envoy.yaml");
        std::fs::write(&config, bootstrap_yaml)
            .with_context(|| format!("writing {}", config.display()))?;
        let admin_path = dir.join("envoy-admin-address");
        let _ = std::fs::remove_file(&admin_path);
        let level = std::env::var("ENVOY_LOG_LEVEL").unwrap_or_else(|_| "warning".to_owned());
        let mut command = crate::process::wrapped(wrapper, binary);
        let mut process = ChildGuard::spawn(
            "envoy",
            command
                .arg("-c")
                .arg(&config)
                .arg("--admin-address-path")
                .arg(&admin_path)
                .args(["--base-id", &random_base_id().to_string()])
                .args(["--disable-hot-restart", "--concurrency", "1", "-l", &level]),
            dir,
        )?;
        let admin = try_wait_until(ADMIN_DEADLINE, "Envoy's admin address", || {
            if process.try_wait().is_some() {
                return Some(None);
            }
            let text = std::fs::read_to_string(&admin_path).ok()?;
            text.trim().parse::<SocketAddr>().ok().map(Some)
        })?;
        let Some(admin) = admin else {
            bail!("{}", process.ensure_running().unwrap_err());
        };
        Ok(Self {
            process,
            dir: dir.to_path_buf(),
            admin,
            _temp: None,
        })
    }

    /// The admin listener's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }

    /// The directory holding `envoy.yaml` and the logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The process, for its pid, logs or exit status.
    pub fn process(&mut self) -> &mut ChildGuard {
        &mut self.process
    }

    /// `GET path` on the admin listener; an error unless the status is 200.
    pub fn admin_get(&self, path: &str) -> anyhow::Result<String> {
        let (status, body) = http_get(self.admin, path)?;
        if status != 200 {
            bail!("admin {path} answered {status}: {body}");
        }
        Ok(body)
    }

    /// Admin `/clusters` (text); parse it with [`hosts`].
    ///
    /// # Panics
    ///
    /// When the admin API does not answer.
    #[track_caller]
    pub fn clusters(&self) -> String {
        self.admin_get("/clusters")
            .unwrap_or_else(|error| panic!("{error:?}"))
    }

    /// Admin `/stats` (text, `name: value` lines); see [`Envoy::stat`].
    ///
    /// # Panics
    ///
    /// When the admin API does not answer.
    #[track_caller]
    pub fn stats(&self) -> String {
        self.admin_get("/stats")
            .unwrap_or_else(|error| panic!("{error:?}"))
    }

    /// One counter or gauge from `/stats`, if Envoy has it.
    pub fn stat(&self, name: &str) -> Option<u64> {
        let text = self
            .admin_get(&format!("/stats?filter=^{}$", name.replace('.', "\\.")))
            .ok()?;
        stat_value(&text, name)
    }

    /// The pids of the hosts of `cluster` that Envoy routes to (healthy), and of all it lists, read from
    /// the EDS hostnames (`<service>-<index>-<pid>`).
    pub fn host_pids(&self, cluster: &str) -> anyhow::Result<(BTreeSet<u32>, BTreeSet<u32>)> {
        let hosts = hosts(&self.admin_get("/clusters")?, cluster);
        let healthy = hosts
            .iter()
            .filter(|h| h.healthy)
            .filter_map(|h| hostname_pid(&h.hostname))
            .collect();
        let all = hosts
            .iter()
            .filter_map(|h| hostname_pid(&h.hostname))
            .collect();
        Ok((healthy, all))
    }

    /// Logs of the Envoy process.
    pub fn logs(&self) -> String {
        self.process.logs()
    }
}

fn random_base_id() -> u32 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    // Small enough for Envoy's shared-memory names, never 0 (the default a stray Envoy would use).
    (hasher.finish() % 1_000_000) as u32 + 1
}

fn stat_value(stats: &str, name: &str) -> Option<u64> {
    stats.lines().find_map(|line| {
        line.strip_prefix(name)?
            .strip_prefix(": ")?
            .trim()
            .parse()
            .ok()
    })
}

/// The worker pid in an EDS hostname: its last part (`<service>-<index>-<pid>`, in a fleet
/// `<host>-<service>-<index>-<pid>`).
pub fn hostname_pid(hostname: &str) -> Option<u32> {
    hostname.rsplit('-').next()?.parse().ok()
}

/// One host of one cluster in admin `/clusters`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Host {
    /// `ip:port` (`[v6]:port` for IPv6) or a pipe path.
    pub address: String,
    /// The EDS hostname (empty when none).
    pub hostname: String,
    /// `health_flags` as printed, e.g. `healthy` or `/failed_eds_health`.
    pub health_flags: String,
    /// `health_flags` is `healthy`.
    pub healthy: bool,
    /// `weight`.
    pub weight: u64,
    /// `rq_success`: requests that got a response.
    pub rq_success: u64,
    /// `rq_error`.
    pub rq_error: u64,
    /// `rq_total`.
    pub rq_total: u64,
    /// `priority`: 0 is sent requests first.
    pub priority: u32,
    /// `sub_zone` of the host's locality (in a fleet: the host it runs on).
    pub sub_zone: String,
}

/// The hosts of `cluster` in admin `/clusters` text, in the order Envoy lists them.
///
/// Host lines look like `cluster::127.0.0.1:41234::hostname::cluster-0-1234` or
/// `cluster::[::1]:41234::rq_success::7`; cluster-level lines such as
/// `cluster::default_priority::max_connections::1024` are skipped because their second field is not an
/// address.
pub fn hosts(clusters_text: &str, cluster: &str) -> Vec<Host> {
    let prefix = format!("{cluster}::");
    let mut hosts: Vec<Host> = Vec::new();
    for line in clusters_text.lines() {
        let Some(rest) = line.strip_prefix(&prefix) else {
            continue;
        };
        // The address may contain `::` (IPv6), the key and value never do.
        let mut fields = rest.rsplitn(3, "::");
        let (Some(value), Some(key), Some(address)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if !is_address(address) {
            continue;
        }
        let index = match hosts.iter().position(|host| host.address == address) {
            Some(index) => index,
            None => {
                hosts.push(Host {
                    address: address.to_owned(),
                    ..Host::default()
                });
                hosts.len() - 1
            }
        };
        let host = &mut hosts[index];
        let number = || value.parse().unwrap_or(0);
        match key {
            "hostname" => host.hostname = value.to_owned(),
            "health_flags" => {
                host.health_flags = value.to_owned();
                host.healthy = value == "healthy";
            }
            "weight" => host.weight = number(),
            "rq_success" => host.rq_success = number(),
            "rq_error" => host.rq_error = number(),
            "rq_total" => host.rq_total = number(),
            "priority" => host.priority = value.parse().unwrap_or(0),
            "sub_zone" => host.sub_zone = value.to_owned(),
            _ => {}
        }
    }
    hosts
}

fn is_address(field: &str) -> bool {
    field.parse::<SocketAddr>().is_ok() || field.starts_with('/') || field.starts_with('@')
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTERS: &str = "\
cluster::observability_name::cluster
cluster::default_priority::max_connections::1024
cluster::high_priority::max_requests::1024
cluster::added_via_api::true
cluster::outlier::success_rate_average::-1
cluster::127.0.0.1:41234::cx_active::0
cluster::127.0.0.1:41234::rq_error::1
cluster::127.0.0.1:41234::rq_success::7
cluster::127.0.0.1:41234::rq_total::8
cluster::127.0.0.1:41234::hostname::cluster-0-1234
cluster::127.0.0.1:41234::health_flags::healthy
cluster::127.0.0.1:41234::weight::1
cluster::127.0.0.1:41234::priority::1
cluster::127.0.0.1:41234::sub_zone::host-b
cluster::[::1]:41235::rq_success::3
cluster::[::1]:41235::hostname::cluster-1-1235
cluster::[::1]:41235::health_flags::/failed_eds_health
cluster::[::1]:41235::weight::5
cluster_two::127.0.0.1:1::hostname::other
";

    #[test]
    fn parses_hosts_of_one_cluster() {
        let hosts = hosts(CLUSTERS, "cluster");
        assert_eq!(
            hosts,
            vec![
                Host {
                    address: "127.0.0.1:41234".into(),
                    hostname: "cluster-0-1234".into(),
                    health_flags: "healthy".into(),
                    healthy: true,
                    weight: 1,
                    rq_success: 7,
                    rq_error: 1,
                    rq_total: 8,
                    priority: 1,
                    sub_zone: "host-b".into(),
                },
                Host {
                    address: "[::1]:41235".into(),
                    hostname: "cluster-1-1235".into(),
                    health_flags: "/failed_eds_health".into(),
                    healthy: false,
                    weight: 5,
                    rq_success: 3,
                    ..Host::default()
                },
            ]
        );
    }

    #[test]
    fn other_and_missing_clusters() {
        assert_eq!(super::hosts(CLUSTERS, "cluster_two")[0].hostname, "other");
        assert!(super::hosts(CLUSTERS, "clus").is_empty());
        assert!(super::hosts("", "cluster").is_empty());
    }

    #[test]
    fn reads_stat_values() {
        let stats = "cluster.a.upstream_rq: 4\ncluster.a.upstream_rq_200: 3\n";
        assert_eq!(stat_value(stats, "cluster.a.upstream_rq"), Some(4));
        assert_eq!(stat_value(stats, "cluster.a.upstream_rq_200"), Some(3));
        assert_eq!(stat_value(stats, "cluster.a"), None);
    }

    #[test]
    fn base_ids_are_positive() {
        assert!((1..=1_000_000).contains(&random_base_id()));
    }
}
