//! `peregrine.toml`: parsed in one place, every problem reported with its key and line.
//!
//! Parsing has two layers. The raw layer (`raw`) mirrors the file with serde (unknown keys are
//! errors) and keeps the spans of the values that later checks may reject. [`Config::parse`] then checks
//! every value (`check`), collects *all* problems (not just the first) and returns the typed
//! [`Config`].
//!
//! This file holds the typed configuration the rest of the supervisor reads and the entry points
//! [`Config::load`] and [`Config::parse`]; `error` holds what a rejected file says, `files` the
//! paths a file names, `limits` the bounds it is held to, `balancing` a service's balancing
//! policy from its type to its checks, and [`account`] the user a service's workers run as. Invariant: the rest of the supervisor sees only checked,
//! typed values; the raw layer and the checker are private to this module.
//!
//! Environment overrides (for paths and addresses that differ per machine): `PEREGRINE_BIND` replaces
//! `supervisor.bind`, `PEREGRINE_METRICS` `supervisor.metrics`, `PEREGRINE_CONTROL`
//! `supervisor.control` and `PEREGRINE_ETCD` `cluster.etcd`. Tests pass a map instead of touching the
//! process environment. Every key, its default and its range are in `docs/configuration.md`, which
//! the tests in `reference` hold to this parser.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use ipnet::IpNet;
use peregrine_contract::url::BindUrl;

pub mod account;
mod check;
pub mod concurrency;
mod control_path;
mod error;
mod files;
mod limits;
mod raw;
#[cfg(test)]
mod reference;
mod unit;
mod warning;
mod wording;

use self::raw::RawConfig;
pub use self::{
    account::{Account, Identity, can_read_other_users_files, can_switch_users, worker_socket},
    check::{
        balancing::{
            Balancing, DEFAULT_CHOICE_COUNT, HashOn, MAX_WEIGHT, OrcaReports,
            RING_POINTS_PER_WORKER, balancer_problem,
        },
        cluster::{ENV_ETCD, MAX_FLEET_SERVICE_NAME, fleet_name, fleet_service_name},
        tls::DEFAULT_SERVER_NAME,
    },
    control_path::control_socket,
    error::{ConfigError, Problem},
    limits::{
        MAX_CONFIG_BYTES, MAX_REPORT_INTERVAL, MAX_SOCKET_PATH, MAX_TOTAL_WORKERS,
        MIN_SAMPLE_INTERVAL,
    },
    unit::{SandboxError, UnitSandbox},
    warning::Warning,
};

/// The default gRPC (xDS) address: loopback only.
pub const DEFAULT_BIND: &str = "http://[::1]:18000";
/// The default of `supervisor.metrics`: Prometheus metrics on loopback, at 9464 (the port
/// OpenTelemetry's Prometheus exporter uses).
pub const DEFAULT_METRICS: &str = "http://127.0.0.1:9464";
/// The default registration socket, relative to the config file's directory.
pub const DEFAULT_CONTROL: &str = "peregrine.sock";
/// The default bind url of a service's workers.
pub const DEFAULT_URL: &str = "http://localhost:0";
/// The default bind url of a `pass_socket` service's workers: one loopback address.
pub const DEFAULT_PASSED_URL: &str = "http://127.0.0.1:0";
/// The placeholder replaced by the worker's index in a `unix://` url and in `command`.
pub const INDEX_PLACEHOLDER: &str = "{index}";
/// In the `command` of a `pass_socket` service: the passed listener's descriptor number (3).
pub const FD_PLACEHOLDER: &str = "{fd}";
/// In the `command` of a `pass_socket` service: the passed TCP listener's port.
pub const PORT_PLACEHOLDER: &str = "{port}";
/// In the `command` of a `pass_socket` service: the passed listener's address (`IP:PORT`, or the
/// socket's path).
pub const ADDRESS_PLACEHOLDER: &str = "{address}";
/// The descriptor a passed listener has in the worker: the first after stdin, stdout and stderr, as
/// systemd's socket activation has it (`SD_LISTEN_FDS_START`).
pub const PASSED_FD: i32 = 3;
/// The default `ready_path`.
pub const DEFAULT_READY_PATH: &str = "/";
/// The default of `supervisor.sample_interval_ms`. Until a worker's first weight reaches Envoy (one
/// to two intervals after its first requests) Envoy round-robins, and a slowed worker builds a
/// backlog: measured by `cargo xtask bench balance --timeline` (BENCHMARKS.md), the first 10 s of a
/// cold start with a hog on worker 0's core had a p99 of 217 ms at 1 s and 14-78 ms at 200 ms. An
/// eBPF pass over 512 workers takes 0.28 ms, five times a second.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_millis(200);

/// A checked configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// `[supervisor]`.
    pub supervisor: SupervisorConfig,
    /// `[envoy]`: used only to write an Envoy bootstrap.
    pub envoy: EnvoyConfig,
    /// `[service.NAME]`, by name. Never empty.
    pub services: BTreeMap<String, ServiceConfig>,
    /// `[orca]`: how workers report their load to Envoy.
    pub orca: OrcaConfig,
    /// `[cluster]`: this host's place in a fleet; `None` runs a single host.
    pub cluster: Option<ClusterConfig>,
    /// Every file the config names for the supervisor or Envoy to read (TLS certificates, keys and
    /// CAs), with the key and line that name it, for `peregrine check` to read each.
    pub files: Vec<NamedFile>,
}

/// A file a config names, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedFile {
    /// The dotted key, e.g. `supervisor.tls.cert`.
    pub key: String,
    /// The line of its value.
    pub line: Line,
    /// The path, absolute.
    pub path: PathBuf,
}

/// A 1-based line of the config file, for messages. Where a value was written is not what the config
/// means: any two lines are equal, so a config edited only above a key compares equal to the old.
#[derive(Clone, Copy, Debug, Eq)]
pub struct Line(pub usize);

impl PartialEq for Line {
    fn eq(&self, _: &Line) -> bool {
        true
    }
}

impl NamedFile {
    /// A problem with the file, at its key and line.
    pub fn problem(&self, message: impl Into<String>) -> Problem {
        Problem {
            line: Some(self.line.0),
            key: self.key.clone(),
            message: message.into(),
        }
    }
}

/// `[cluster]`: a fleet of hosts sharing membership through etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    /// The etcd endpoints (`etcd`; `PEREGRINE_ETCD`, comma-separated, overrides it).
    pub etcd: Vec<String>,
    /// This host's name in the fleet (`host`; the machine's hostname by default).
    pub host: String,
    /// The locality of this host's workers.
    pub locality: Locality,
    /// How long a host whose supervisor stops renewing its lease stays in the fleet (`lease_ttl_ms`,
    /// 3 s; etcd counts whole seconds, so it is rounded up to one).
    pub lease_ttl: Duration,
    /// The key prefix of the fleet in etcd (`prefix`, `/peregrine`): one fleet per prefix.
    pub prefix: String,
    /// How Envoy is told to route across hosts.
    pub routing: Routing,
    /// `[cluster.tls]`: the etcd client's TLS; `None` only with `allow_insecure = true`.
    pub tls: Option<EtcdTlsConfig>,
    /// The networks other hosts' workers may be at (`allowed_networks`); empty: any unicast
    /// address but link-local ones.
    pub allowed_networks: Vec<IpNet>,
}

/// A certificate chain and its private key: PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertFiles {
    /// The certificate chain, leaf first (`cert`).
    pub cert: PathBuf,
    /// Its private key, PKCS#8, PKCS#1 or SEC1 (`key`).
    pub key: PathBuf,
}

/// `[supervisor.tls]`: the gRPC port (xDS and ORCA) over TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTlsConfig {
    /// This supervisor's certificate and key (`cert`, `key`).
    pub identity: CertFiles,
    /// When set, a client must present a certificate this CA signed (`client_ca`): mutual TLS.
    pub client_ca: Option<PathBuf>,
}

/// `[envoy.tls]`: Envoy's side of the gRPC port's TLS, written into its bootstrap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvoyTlsConfig {
    /// Envoy's client certificate and key (`cert`, `key`); required when the supervisor asks for one
    /// (`supervisor.tls.client_ca`).
    pub identity: Option<CertFiles>,
    /// The CA that signs supervisors' certificates (`ca`).
    pub ca: PathBuf,
    /// The SNI Envoy sends and the name it requires in the supervisor's certificate (`server_name`,
    /// `"peregrine"`).
    pub server_name: String,
}

/// `[cluster.tls]`: the etcd client over TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdTlsConfig {
    /// The CA that signs etcd's server certificates (`ca`).
    pub ca: PathBuf,
    /// The client certificate and key etcd checks with `--client-cert-auth` (`cert`, `key`).
    pub identity: Option<CertFiles>,
}

/// Where a host's workers are: Envoy's locality (region, zone; the host is the sub-zone).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Locality {
    /// `region`, `""` by default.
    pub region: String,
    /// `zone`, `""` by default.
    pub zone: String,
}

/// `cluster.routing`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Routing {
    /// Near workers first: the requesting Envoy's own host, then its zone, its region, the rest
    /// (`"local-first"`, the default).
    #[default]
    LocalFirst,
    /// Every host's workers in one priority, balanced on their load (`"fleet"`).
    Fleet,
}

impl Routing {
    /// Every setting, for the check of `cluster.routing`.
    const ALL: [Routing; 2] = [Routing::LocalFirst, Routing::Fleet];

    /// The value as written in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            Routing::LocalFirst => "local-first",
            Routing::Fleet => "fleet",
        }
    }
}

/// `[orca]`: the ORCA out-of-band load reports and Envoy's client-side weighted round robin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrcaConfig {
    /// Reports are never sent more often than this, whatever interval Envoy asks for. Default: the
    /// sample interval (a faster report would repeat the same sample).
    pub min_report_interval: Duration,
    /// How long a worker must report before Envoy uses its weight (CSWRR `blackout_period`); 0 by
    /// default: Envoy's blackout is for servers whose first self-reported figures are noise, and the
    /// first report here is already the kernel's own account of a whole sample interval. Measured
    /// with Envoy 1.40 (idle workers, 1 s samples): the first weights apply 2.0 s after the hosts
    /// with 0, 4.0 s with 2 s (the blackout adds its whole length); 0.2 s with 0 and 200 ms samples.
    pub blackout_period: Duration,
    /// How long Envoy keeps a weight without fresh reports (`weight_expiration_period`); 30 s.
    pub weight_expiration_period: Duration,
    /// How often Envoy recomputes weights (`weight_update_period`); half the sample interval,
    /// within [100 ms, 1 s]: a report waits at most that long to count.
    pub weight_update_period: Duration,
}

impl OrcaConfig {
    /// The defaults for a sample interval.
    pub fn defaults_for(sample_interval: Duration) -> OrcaConfig {
        OrcaConfig {
            min_report_interval: sample_interval,
            blackout_period: Duration::ZERO,
            weight_expiration_period: Duration::from_secs(30),
            weight_update_period: (sample_interval / 2)
                .clamp(Duration::from_millis(100), Duration::from_secs(1)),
        }
    }
}

/// `[supervisor]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SupervisorConfig {
    /// Where the gRPC server (xDS) listens.
    pub bind: SocketAddr,
    /// Where Prometheus metrics are served (`GET /metrics`); `None`: not at all (`metrics = ""`).
    pub metrics: Option<SocketAddr>,
    /// The registration socket's path (absolute).
    pub control: PathBuf,
    /// The name Envoy's bootstrap gives the cluster that reaches this supervisor.
    pub xds_cluster: String,
    /// How exited workers are restarted.
    pub restart: RestartPolicy,
    /// Which scheduler source the load sampler uses.
    pub sampler: SamplerSetting,
    /// How often the load sampler samples every worker.
    pub sample_interval: Duration,
    /// How workers are drained, stopped and left behind.
    pub lifecycle: Lifecycle,
    /// What the gRPC port admits.
    pub grpc: GrpcLimits,
    /// `[supervisor.tls]`: TLS on the gRPC port; `None`: cleartext.
    pub tls: Option<ServerTlsConfig>,
}

/// `supervisor.grpc_*`: what the gRPC port (xDS and ORCA) admits. Anyone who can reach the port can
/// open connections; these keep them from starving the supervisor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrpcLimits {
    /// The most connections open at once (`grpc_max_connections`, 8192), further lowered at start to
    /// what the open-file limit leaves after a reserve for workers and the control socket. Each Envoy
    /// holds one connection for xDS and one per ORCA worker.
    pub max_connections: usize,
    /// The most connections open at once from one address (`grpc_max_connections_per_peer`, 1024),
    /// no more than the cap in effect. A connection over it takes the slot of that address's oldest
    /// connection that has not proved itself a client, else it is refused.
    pub max_connections_per_peer: usize,
    /// How long a new connection has to send the HTTP/2 preface (`grpc_handshake_timeout_ms`, 10 s).
    pub handshake_timeout: Duration,
    /// How long a connection may stay open without a stream (`grpc_idle_timeout_ms`, 60 s). Envoy's
    /// connections always carry a stream; an idle one is dropped (Envoy reconnects when it needs to).
    pub idle_timeout: Duration,
}

impl Default for GrpcLimits {
    fn default() -> Self {
        GrpcLimits {
            max_connections: 8192,
            max_connections_per_peer: 1024,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// `supervisor.*_timeout_ms`: how long each step of stopping a worker may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifecycle {
    /// How long to wait for every connected Envoy to ACK a worker's DRAINING state before stopping it
    /// anyway (`drain_timeout_ms`, 10 s).
    pub drain_timeout: Duration,
    /// How long a worker has to finish its requests and exit after SIGTERM before SIGKILL
    /// (`stop_timeout_ms`, 10 s).
    pub stop_timeout: Duration,
    /// How long a new worker has to register when it replaces another before the replacement is given
    /// up (`register_timeout_ms`, 30 s).
    pub register_timeout: Duration,
    /// How long workers keep serving without a supervisor before they exit (`orphan_timeout_ms`, 60 s;
    /// 0 = for ever).
    pub orphan_timeout: Duration,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle {
            drain_timeout: Duration::from_secs(10),
            stop_timeout: Duration::from_secs(10),
            register_timeout: Duration::from_secs(30),
            orphan_timeout: Duration::from_secs(60),
        }
    }
}

/// `supervisor.sampler`: where the load sampler reads the workers' scheduler time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SamplerSetting {
    /// The best source this machine offers (`"auto"`, the default).
    #[default]
    Auto,
    /// The eBPF sampler, or fail to start (`"ebpf"`).
    Ebpf,
    /// `/proc/<pid>/task/*/schedstat` (`"procfs"`).
    Procfs,
    /// No load sampling (`"off"`): workers still count requests, but no loads are published.
    Off,
}

impl SamplerSetting {
    /// Every setting, for the check of `supervisor.sampler`.
    const ALL: [SamplerSetting; 4] = [
        SamplerSetting::Auto,
        SamplerSetting::Ebpf,
        SamplerSetting::Procfs,
        SamplerSetting::Off,
    ];

    /// The value as written in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            SamplerSetting::Auto => "auto",
            SamplerSetting::Ebpf => "ebpf",
            SamplerSetting::Procfs => "procfs",
            SamplerSetting::Off => "off",
        }
    }
}

impl fmt::Display for SamplerSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Exponential restart backoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartPolicy {
    /// The first delay after an exit.
    pub initial: Duration,
    /// The largest delay (`restart_delay_max_ms`; 10 s, or `initial` when that is longer).
    pub max: Duration,
    /// A worker that ran this long resets its delay to `initial`.
    pub healthy_after: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(10),
            healthy_after: Duration::from_secs(10),
        }
    }
}

/// `[envoy]`: what `peregrine envoy-bootstrap` writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvoyConfig {
    /// Envoy's node id (and node cluster).
    pub node: String,
    /// The address of Envoy's HTTP listener.
    pub listen: SocketAddr,
    /// The address of Envoy's admin interface.
    pub admin: SocketAddr,
    /// Whether Envoy fetches clusters and endpoints over one ADS stream instead of dedicated CDS and
    /// EDS streams.
    pub ads: bool,
    /// Which variant of the xDS protocol Envoy speaks on those streams.
    pub xds: XdsVariant,
    /// A request's timeout in the routes, all tries together (`timeout_ms`, 15 s: Envoy's default).
    pub timeout: Duration,
    /// The timeout of each try (`per_try_timeout_ms`, 15 s); a try that times out is retried on
    /// another worker. Lower it to what the slowest request of the services takes, so that a stalled
    /// worker's requests move on sooner.
    pub per_try_timeout: Duration,
    /// The xDS servers the bootstrap dials (`xds_servers`: a fleet's supervisors, any of which can
    /// serve Envoy); empty: `supervisor.bind`.
    pub xds_servers: Vec<SocketAddr>,
    /// `[envoy.tls]`: how Envoy dials the gRPC port over TLS; set exactly when `[supervisor.tls]` is.
    pub tls: Option<EnvoyTlsConfig>,
}

/// `envoy.xds`: the variant of the xDS protocol Envoy speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XdsVariant {
    /// State of the world (`"sotw"`, the default): every response carries the full set.
    #[default]
    StateOfTheWorld,
    /// Incremental (`"delta"`): responses carry what changed and what was removed.
    Delta,
}

/// `[service.NAME]`: one Envoy cluster and its workers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceConfig {
    /// The service (and Envoy cluster) name.
    pub name: String,
    /// How many workers to run.
    pub count: u32,
    /// Where each worker binds; a `unix://` url may hold [`INDEX_PLACEHOLDER`].
    pub url: String,
    /// The worker command, its program resolved; by default the built-in hello worker.
    pub command: WorkerCommand,
    /// Extra environment for the workers.
    pub env: BTreeMap<String, String>,
    /// The route prefix in the generated Envoy bootstrap.
    pub prefix: String,
    /// The route's domains in the generated Envoy bootstrap.
    pub domains: Vec<String>,
    /// How Envoy balances the service's requests over its workers: on their ORCA load reports by
    /// default for IP urls (unix:// workers cannot be reached by ORCA streams), round robin otherwise.
    pub balancing: Balancing,
    /// Each worker's load-balancing weight, by index (1 by default).
    pub weights: Vec<u32>,
    /// How many workers a rolling restart replaces at once (`restart_batch`, 1).
    pub restart_batch: u32,
    /// Whether the supervisor binds each worker's listener and passes it as descriptor
    /// [`PASSED_FD`] (systemd's socket activation), and registers the worker on its behalf once
    /// `GET ready_path` answers: for servers that do not speak Peregrine's registration.
    pub pass_socket: bool,
    /// With `pass_socket`: what a worker must answer (any status below 500) before it is published.
    pub ready_path: String,
    /// What asks a worker to finish its requests and exit (SIGTERM by default).
    pub stop_signal: StopSignal,
    /// The account its workers run as (`user`, `group`); `None`: the supervisor's own. A service
    /// with one registers on its own socket, [`worker_socket`].
    pub account: Option<Account>,
    /// How many requests one worker serves at once (`concurrency`), written or read off the command.
    pub concurrency: concurrency::Concurrency,
    /// Whether the workers share one listener the supervisor binds (`listener = "shared"`) or each
    /// has its own.
    pub listener: concurrency::ListenerMode,
}

/// A signal that stops a worker gracefully, by name (`stop_signal`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopSignal {
    /// Its name without `SIG` (`TERM`).
    pub name: &'static str,
    /// The signal.
    pub signal: rustix::process::Signal,
}

impl Default for StopSignal {
    fn default() -> Self {
        StopSignal {
            name: "TERM",
            signal: rustix::process::Signal::TERM,
        }
    }
}

impl StopSignal {
    /// The signals a server may take as its request to stop, by name without `SIG`.
    pub const NAMES: [(&'static str, rustix::process::Signal); 7] = [
        ("TERM", rustix::process::Signal::TERM),
        ("INT", rustix::process::Signal::INT),
        ("QUIT", rustix::process::Signal::QUIT),
        ("HUP", rustix::process::Signal::HUP),
        ("USR1", rustix::process::Signal::USR1),
        ("USR2", rustix::process::Signal::USR2),
        ("WINCH", rustix::process::Signal::WINCH),
    ];

    /// The signal named `name`, with or without `SIG` (`SIGTERM`, `TERM`), in any case.
    pub fn parse(name: &str) -> Option<StopSignal> {
        let upper = name.to_ascii_uppercase();
        let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == bare)
            .map(|&(name, signal)| StopSignal { name, signal })
    }
}

impl std::fmt::Display for StopSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SIG{}", self.name)
    }
}

/// The program a worker runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Program {
    /// This very `peregrine` binary (a command whose program is `peregrine`, and the default).
    Peregrine,
    /// An executable file, resolved through `PATH` or against the config file's directory.
    Path(PathBuf),
}

/// A worker's command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerCommand {
    /// The program.
    pub program: Program,
    /// Its arguments.
    pub args: Vec<String>,
}

impl Default for WorkerCommand {
    /// `peregrine worker`: the built-in hello worker.
    fn default() -> Self {
        WorkerCommand {
            program: Program::Peregrine,
            args: vec!["worker".into()],
        }
    }
}

impl ServiceConfig {
    /// Whether Envoy balances the service on its workers' ORCA load reports.
    pub fn orca(&self) -> bool {
        matches!(self.balancing, Balancing::Orca(_))
    }

    /// Whether those reports travel in band, in the workers' responses (`orca = "in-band"`).
    pub fn orca_in_band(&self) -> bool {
        self.balancing == Balancing::Orca(OrcaReports::InBand)
    }

    /// How its workers listen and are balanced, in words, for `peregrine check` and `status`:
    /// `concurrency 1 (gunicorn's sync worker), one shared listener, least_request between hosts`.
    pub fn balanced_on(&self) -> String {
        let (listener, among) = match self.listener {
            concurrency::ListenerMode::Shared => ("one shared listener", "between hosts"),
            concurrency::ListenerMode::PerWorker => ("a listener per worker", "over the workers"),
        };
        format!(
            "concurrency {}, {listener}, {} {among}",
            self.concurrency.describe(),
            self.balancing.name()
        )
    }

    /// The bind url of the worker in slot `index`.
    pub fn url_for(&self, index: u32) -> BindUrl {
        self.url
            .replace(INDEX_PLACEHOLDER, &index.to_string())
            .parse()
            .expect("checked by Config::parse")
    }
}

impl Config {
    /// Reads and checks a configuration file, with overrides from the process environment.
    ///
    /// Relative paths in it are taken from the directory of the file's canonical path (so two
    /// supervisors started in different directories with the same relative config path never share a
    /// socket). The file may be at most [`MAX_CONFIG_BYTES`] long; the total of workers is also held
    /// to this user's process limit (`RLIMIT_NPROC`).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_as(path, Identity::of_this_process())
    }

    /// [`Config::load`], its users held to what a supervisor that is `identity` may switch to
    /// ([`Identity::root`] for a command that only reads the config, such as `envoy-bootstrap` run
    /// by a user who could not start the supervisor).
    pub fn load_as(path: &Path, identity: Identity) -> Result<Config, ConfigError> {
        let read_error = |source| ConfigError::Read {
            path: path.to_owned(),
            source,
        };
        let source = files::read_capped(path).map_err(read_error)?;
        let base = files::canonical_dir(path).map_err(read_error)?;
        let env = std::env::vars().collect();
        let invalid = |problems| ConfigError::Invalid {
            path: path.to_owned(),
            problems,
        };
        let config = Config::parse_as(&source, &base, &env, identity).map_err(invalid)?;
        let workers = workers_in_all(&config.services);
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nproc).current;
        match limit {
            // The supervisor itself is one more process of the user.
            Some(limit) if workers + 1 > limit => Err(invalid(vec![check::total_problem(
                &source,
                &config.services,
                format!(
                    "{workers} workers in all, this service's the most, but this user may run \
                     only {limit} processes (RLIMIT_NPROC, `ulimit -u`): lower the counts or raise \
                     the limit"
                ),
            )])),
            _ => Ok(config),
        }
    }

    /// Checks a configuration's text; relative paths are taken from `base`. Returns every problem.
    /// A service's `user` and `group` are looked up in this machine's user and group databases, and
    /// held to what this process may switch to ([`Identity::of_this_process`]).
    pub fn parse(
        source: &str,
        base: &Path,
        env: &HashMap<String, String>,
    ) -> Result<Config, Vec<Problem>> {
        Config::parse_as(source, base, env, Identity::of_this_process())
    }

    /// [`Config::parse`] for a supervisor that is `identity`.
    fn parse_as(
        source: &str,
        base: &Path,
        env: &HashMap<String, String>,
        identity: Identity,
    ) -> Result<Config, Vec<Problem>> {
        let raw = RawConfig::from_toml(source).map_err(|problem| vec![problem])?;
        check::config(raw, source, base, env, identity)
    }
}

/// How many workers `services` run, all together.
fn workers_in_all(services: &BTreeMap<String, ServiceConfig>) -> u64 {
    services.values().map(|s| u64::from(s.count)).sum()
}

#[cfg(test)]
mod testing {
    //! What the tests of every part of the configuration share.

    use std::{collections::HashMap, path::Path};

    use super::{Config, Identity, Problem, check, raw::RawConfig};

    /// Parses `source` as if read from `/etc/peregrine`, without environment.
    pub(super) fn parse(source: &str) -> Result<Config, Vec<Problem>> {
        Config::parse(source, Path::new("/etc/peregrine"), &HashMap::new())
    }

    /// [`parse`], in a supervisor that is `identity`.
    pub(super) fn parse_as(source: &str, identity: Identity) -> Result<Config, Vec<Problem>> {
        let raw = RawConfig::from_toml(source).map_err(|problem| vec![problem])?;
        check::config(
            raw,
            source,
            Path::new("/etc/peregrine"),
            &HashMap::new(),
            identity,
        )
    }

    /// The problems of a rejected `source`, as printed.
    pub(super) fn problems(source: &str) -> Vec<String> {
        parse(source)
            .expect_err("config should be rejected")
            .iter()
            .map(ToString::to_string)
            .collect()
    }
}
