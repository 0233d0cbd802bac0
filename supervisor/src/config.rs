//! `peregrine.toml`: parsed in one place, every problem reported with its key and line.
//!
//! Parsing has two layers. The raw layer ([`RawConfig`]) mirrors the file with serde (unknown keys are
//! errors) and keeps the spans of the values that later checks may reject. [`Config::parse`] then checks
//! every value, collects *all* problems (not just the first) and returns the typed [`Config`].
//!
//! Environment overrides (for paths and addresses that differ per machine): `PEREGRINE_BIND` replaces
//! `supervisor.bind`, `PEREGRINE_CONTROL` replaces `supervisor.control`. Tests pass a map instead of
//! touching the process environment.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::SocketAddr,
    ops::Range,
    path::{Path, PathBuf},
    time::Duration,
};

use peregrine_contract::url::BindUrl;
use serde::Deserialize;
use toml::Spanned;

/// The default gRPC (xDS) address: loopback only.
pub const DEFAULT_BIND: &str = "http://[::1]:18000";
/// The default registration socket, relative to the config file's directory.
pub const DEFAULT_CONTROL: &str = "peregrine.sock";
/// The default bind url of a service's workers.
pub const DEFAULT_URL: &str = "http://localhost:0";
/// The placeholder replaced by the worker's index in a `unix://` url.
pub const INDEX_PLACEHOLDER: &str = "{index}";

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
}

/// `[orca]`: the ORCA out-of-band load reports and Envoy's client-side weighted round robin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrcaConfig {
    /// Reports are never sent more often than this, whatever interval Envoy asks for. Default: the
    /// sample interval (a faster report would repeat the same sample).
    pub min_report_interval: Duration,
    /// How long a worker must report before Envoy uses its weight (CSWRR `blackout_period`); 2 s.
    pub blackout_period: Duration,
    /// How long Envoy keeps a weight without fresh reports (`weight_expiration_period`); 30 s.
    pub weight_expiration_period: Duration,
    /// How often Envoy recomputes weights (`weight_update_period`); the sample interval, within
    /// [100 ms, 1 s].
    pub weight_update_period: Duration,
}

impl OrcaConfig {
    /// The defaults for a sample interval.
    pub fn defaults_for(sample_interval: Duration) -> OrcaConfig {
        OrcaConfig {
            min_report_interval: sample_interval,
            blackout_period: Duration::from_secs(2),
            weight_expiration_period: Duration::from_secs(30),
            weight_update_period: sample_interval
                .clamp(Duration::from_millis(100), Duration::from_secs(1)),
        }
    }
}

/// `[supervisor]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SupervisorConfig {
    /// Where the gRPC server (xDS) listens.
    pub bind: SocketAddr,
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
}

/// `supervisor.grpc_*`: what the gRPC port (xDS and ORCA) admits. Anyone who can reach the port can
/// open connections; these keep them from starving the supervisor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrpcLimits {
    /// The most connections open at once (`grpc_max_connections`, 8192), further lowered at start to
    /// what the open-file limit leaves after a reserve for workers and the control socket. Each Envoy
    /// holds one connection for xDS and one per ORCA worker.
    pub max_connections: usize,
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

mod balancing;

use self::balancing::RawBalancing;
pub use self::balancing::{Balancing, HashOn, MAX_WEIGHT, RING_POINTS_PER_WORKER};

/// The default of `supervisor.sample_interval_ms`.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// The shortest `supervisor.sample_interval_ms`: below it, sampling costs more than it tells.
pub const MIN_SAMPLE_INTERVAL: Duration = Duration::from_millis(10);

/// Exponential restart backoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartPolicy {
    /// The first delay after an exit.
    pub initial: Duration,
    /// The largest delay.
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
        self.balancing == Balancing::Orca
    }

    /// The bind url of the worker in slot `index`.
    pub fn url_for(&self, index: u32) -> BindUrl {
        self.url
            .replace(INDEX_PLACEHOLDER, &index.to_string())
            .parse()
            .expect("checked by Config::parse")
    }
}

/// One problem in a configuration file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The 1-based line, when known.
    pub line: Option<usize>,
    /// The dotted key, e.g. `service.cluster.count`.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "line {line}: {}: {}", self.key, self.message),
            None => write!(f, "{}: {}", self.key, self.message),
        }
    }
}

/// Why a configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file has problems; each is reported on a line of its own.
    #[error("{}", render(.path, .problems))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found.
        problems: Vec<Problem>,
    },
}

fn render(path: &Path, problems: &[Problem]) -> String {
    let lines: Vec<String> = problems
        .iter()
        .map(|p| format!("{}: {p}", path.display()))
        .collect();
    lines.join("\n")
}

// === raw layer ===

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    supervisor: RawSupervisor,
    #[serde(default)]
    envoy: RawEnvoy,
    #[serde(default)]
    service: BTreeMap<String, RawService>,
    #[serde(default)]
    orca: RawOrca,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOrca {
    min_report_interval_ms: Option<Spanned<i64>>,
    blackout_period_ms: Option<Spanned<i64>>,
    weight_expiration_period_ms: Option<Spanned<i64>>,
    weight_update_period_ms: Option<Spanned<i64>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSupervisor {
    bind: Option<Spanned<String>>,
    control: Option<Spanned<String>>,
    xds_cluster: Option<Spanned<String>>,
    restart_delay_ms: Option<Spanned<u64>>,
    restart_delay_max_ms: Option<Spanned<u64>>,
    healthy_after_ms: Option<u64>,
    sampler: Option<Spanned<String>>,
    sample_interval_ms: Option<Spanned<i64>>,
    drain_timeout_ms: Option<Spanned<i64>>,
    stop_timeout_ms: Option<Spanned<i64>>,
    register_timeout_ms: Option<Spanned<i64>>,
    orphan_timeout_ms: Option<Spanned<i64>>,
    grpc_max_connections: Option<Spanned<i64>>,
    grpc_handshake_timeout_ms: Option<Spanned<i64>>,
    grpc_idle_timeout_ms: Option<Spanned<i64>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEnvoy {
    node: Option<Spanned<String>>,
    listen: Option<Spanned<String>>,
    admin: Option<Spanned<String>>,
    #[serde(default)]
    ads: bool,
    xds: Option<Spanned<String>>,
    timeout_ms: Option<Spanned<i64>>,
    per_try_timeout_ms: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawService {
    count: Option<Spanned<i64>>,
    restart_batch: Option<Spanned<i64>>,
    url: Option<Spanned<String>>,
    command: Option<Spanned<Vec<String>>>,
    env: Option<Spanned<BTreeMap<String, String>>>,
    prefix: Option<Spanned<String>>,
    domains: Option<Spanned<Vec<String>>>,
    orca: Option<Spanned<bool>>,
    lb_policy: Option<Spanned<String>>,
    choice_count: Option<Spanned<i64>>,
    ring_size_min: Option<Spanned<i64>>,
    ring_size_max: Option<Spanned<i64>>,
    table_size: Option<Spanned<i64>>,
    hash_balance_factor: Option<Spanned<i64>>,
    hash_on: Option<Spanned<String>>,
    weight: Option<Spanned<i64>>,
    weights: Option<Spanned<Vec<i64>>>,
}

/// Collects problems with their lines.
struct Checker<'a> {
    source: &'a str,
    /// The config file's directory: relative paths are taken from it.
    base: &'a Path,
    /// `PATH`, to resolve worker programs.
    search_path: Option<&'a str>,
    problems: Vec<Problem>,
}

impl Checker<'_> {
    fn line_of(&self, span: Range<usize>) -> usize {
        let end = span.start.min(self.source.len());
        self.source[..end].bytes().filter(|&b| b == b'\n').count() + 1
    }

    /// Sets `target` to `value` milliseconds if given and at least `min`; else reports `key`.
    fn millis(&mut self, value: Option<Spanned<i64>>, key: &str, min: u64, target: &mut Duration) {
        let Some(value) = value else {
            return;
        };
        match u64::try_from(*value.get_ref()) {
            Ok(ms) if ms >= min => *target = Duration::from_millis(ms),
            _ => self.report(
                Some(value.span()),
                key.to_owned(),
                format!(
                    "must be at least {min} (milliseconds), got {}",
                    value.get_ref()
                ),
            ),
        }
    }

    fn report(&mut self, span: Option<Range<usize>>, key: String, message: impl Into<String>) {
        let line = span.map(|s| self.line_of(s));
        self.problems.push(Problem {
            line,
            key,
            message: message.into(),
        });
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
        let read_error = |source| ConfigError::Read {
            path: path.to_owned(),
            source,
        };
        let source = read_capped(path).map_err(read_error)?;
        let base = canonical_dir(path).map_err(read_error)?;
        let env = std::env::vars().collect();
        let invalid = |problems| ConfigError::Invalid {
            path: path.to_owned(),
            problems,
        };
        let config = Config::parse(&source, &base, &env).map_err(invalid)?;
        let workers: u64 = config.services.values().map(|s| u64::from(s.count)).sum();
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nproc).current;
        match limit {
            // The supervisor itself is one more process of the user.
            Some(limit) if workers + 1 > limit => Err(invalid(vec![Problem {
                line: None,
                key: "service".into(),
                message: format!(
                    "{workers} workers in all, but this user may run only {limit} processes \
                     (RLIMIT_NPROC, `ulimit -u`): lower the counts or raise the limit"
                ),
            }])),
            _ => Ok(config),
        }
    }

    /// Checks a configuration's text; relative paths are taken from `base`. Returns every problem.
    pub fn parse(
        source: &str,
        base: &Path,
        env: &HashMap<String, String>,
    ) -> Result<Config, Vec<Problem>> {
        let mut check = Checker {
            source,
            base,
            search_path: env.get("PATH").map(String::as_str),
            problems: Vec::new(),
        };
        let deserializer = match toml::de::Deserializer::parse(source) {
            Ok(deserializer) => deserializer,
            Err(err) => {
                check.report(err.span(), "(syntax)".into(), err.message().trim());
                return Err(check.problems);
            }
        };
        let raw: RawConfig = match serde_path_to_error::deserialize(deserializer) {
            Ok(raw) => raw,
            Err(err) => {
                let key = dotted_key(err.path());
                let inner = err.into_inner();
                check.report(inner.span(), key, inner.message().trim());
                return Err(check.problems);
            }
        };

        let supervisor = check.supervisor(raw.supervisor, base, env);
        let envoy = check.envoy(raw.envoy);
        if raw.service.is_empty() {
            check.report(
                None,
                "service".into(),
                "no services: add a [service.NAME] table with the workers to run",
            );
        }
        let services: BTreeMap<String, ServiceConfig> = raw
            .service
            .into_iter()
            .map(|(name, service)| (name.clone(), check.service(name, service)))
            .collect();
        let workers: u64 = services.values().map(|s| u64::from(s.count)).sum();
        if workers > MAX_TOTAL_WORKERS {
            check.report(
                None,
                "service".into(),
                format!(
                    "{workers} workers in all; a supervisor runs at most {MAX_TOTAL_WORKERS} \
                     (run more supervisors, each with its own control socket)"
                ),
            );
        }
        let sample_interval = supervisor
            .as_ref()
            .map_or(DEFAULT_SAMPLE_INTERVAL, |s| s.sample_interval);
        let orca = check.orca(raw.orca, sample_interval);

        if check.problems.is_empty() {
            Ok(Config {
                supervisor: supervisor.expect("no problems"),
                envoy: envoy.expect("no problems"),
                services,
                orca,
            })
        } else {
            Err(check.problems)
        }
    }
}

impl Checker<'_> {
    fn orca(&mut self, raw: RawOrca, sample_interval: Duration) -> OrcaConfig {
        let mut orca = OrcaConfig::defaults_for(sample_interval);
        let mut millis = |value, key: &str, min, target: &mut Duration| {
            self.millis(value, &format!("orca.{key}"), min, target)
        };
        millis(
            raw.min_report_interval_ms,
            "min_report_interval_ms",
            10,
            &mut orca.min_report_interval,
        );
        millis(
            raw.blackout_period_ms,
            "blackout_period_ms",
            0,
            &mut orca.blackout_period,
        );
        let expiration_span = raw.weight_expiration_period_ms.as_ref().map(|v| v.span());
        millis(
            raw.weight_expiration_period_ms,
            "weight_expiration_period_ms",
            1000,
            &mut orca.weight_expiration_period,
        );
        millis(
            raw.weight_update_period_ms,
            "weight_update_period_ms",
            100,
            &mut orca.weight_update_period,
        );
        if orca.weight_expiration_period <= orca.blackout_period {
            self.report(
                expiration_span,
                "orca.weight_expiration_period_ms".into(),
                format!(
                    "must be longer than orca.blackout_period_ms ({} ms): a weight would expire \
                     before Envoy starts using it",
                    orca.blackout_period.as_millis()
                ),
            );
        }
        orca
    }

    fn supervisor(
        &mut self,
        raw: RawSupervisor,
        base: &Path,
        env: &HashMap<String, String>,
    ) -> Option<SupervisorConfig> {
        let bind = match env.get("PEREGRINE_BIND") {
            Some(bind) => self.grpc_address(bind, None, "PEREGRINE_BIND (environment)"),
            None => match &raw.bind {
                Some(b) => self.grpc_address(b.get_ref(), Some(b.span()), "supervisor.bind"),
                None => self.grpc_address(DEFAULT_BIND, None, "supervisor.bind"),
            },
        };
        let control = match env.get("PEREGRINE_CONTROL") {
            Some(c) => Some(c.clone()),
            None => raw.control.map(|c| c.into_inner()),
        }
        .unwrap_or_else(|| DEFAULT_CONTROL.into());
        let control = absolute_in(base, Path::new(&control));
        let xds_cluster = match raw.xds_cluster {
            Some(name) if !valid_name(name.get_ref()) => {
                self.report(
                    Some(name.span()),
                    "supervisor.xds_cluster".into(),
                    NAME_RULE,
                );
                String::new()
            }
            Some(name) => name.into_inner(),
            None => "xds_cluster".into(),
        };
        let mut restart = RestartPolicy::default();
        if let Some(ms) = raw.restart_delay_ms {
            if *ms.get_ref() == 0 {
                self.report(
                    Some(ms.span()),
                    "supervisor.restart_delay_ms".into(),
                    "must be at least 1: a zero delay lets a crashing worker restart in a tight loop",
                );
            }
            restart.initial = Duration::from_millis(*ms.get_ref());
        }
        if let Some(ms) = raw.restart_delay_max_ms {
            if Duration::from_millis(*ms.get_ref()) < restart.initial {
                self.report(
                    Some(ms.span()),
                    "supervisor.restart_delay_max_ms".into(),
                    "must not be smaller than restart_delay_ms",
                );
            }
            restart.max = Duration::from_millis(*ms.get_ref());
        }
        if let Some(ms) = raw.healthy_after_ms {
            restart.healthy_after = Duration::from_millis(ms);
        }
        let sampler = match raw.sampler {
            None => SamplerSetting::default(),
            Some(value) => match value.get_ref().as_str() {
                "auto" => SamplerSetting::Auto,
                "ebpf" => SamplerSetting::Ebpf,
                "procfs" => SamplerSetting::Procfs,
                "off" => SamplerSetting::Off,
                other => {
                    self.report(
                        Some(value.span()),
                        "supervisor.sampler".into(),
                        format!(
                            "expected \"auto\", \"ebpf\", \"procfs\" or \"off\", got {other:?}"
                        ),
                    );
                    SamplerSetting::default()
                }
            },
        };
        let sample_interval = match raw.sample_interval_ms {
            None => DEFAULT_SAMPLE_INTERVAL,
            Some(ms) => match u64::try_from(*ms.get_ref()) {
                Ok(ms) if Duration::from_millis(ms) >= MIN_SAMPLE_INTERVAL => {
                    Duration::from_millis(ms)
                }
                _ => {
                    self.report(
                        Some(ms.span()),
                        "supervisor.sample_interval_ms".into(),
                        format!(
                            "must be at least {} (milliseconds), got {}",
                            MIN_SAMPLE_INTERVAL.as_millis(),
                            ms.get_ref()
                        ),
                    );
                    DEFAULT_SAMPLE_INTERVAL
                }
            },
        };
        let mut lifecycle = Lifecycle::default();
        let mut millis = |value, key: &str, min, target: &mut Duration| {
            self.millis(value, &format!("supervisor.{key}"), min, target)
        };
        millis(
            raw.drain_timeout_ms,
            "drain_timeout_ms",
            0,
            &mut lifecycle.drain_timeout,
        );
        millis(
            raw.stop_timeout_ms,
            "stop_timeout_ms",
            1,
            &mut lifecycle.stop_timeout,
        );
        millis(
            raw.register_timeout_ms,
            "register_timeout_ms",
            100,
            &mut lifecycle.register_timeout,
        );
        millis(
            raw.orphan_timeout_ms,
            "orphan_timeout_ms",
            0,
            &mut lifecycle.orphan_timeout,
        );
        let mut grpc = GrpcLimits::default();
        millis(
            raw.grpc_handshake_timeout_ms,
            "grpc_handshake_timeout_ms",
            10,
            &mut grpc.handshake_timeout,
        );
        millis(
            raw.grpc_idle_timeout_ms,
            "grpc_idle_timeout_ms",
            100,
            &mut grpc.idle_timeout,
        );
        if let Some(max) = raw.grpc_max_connections {
            match usize::try_from(*max.get_ref()) {
                Ok(n) if n >= 1 => grpc.max_connections = n,
                _ => self.report(
                    Some(max.span()),
                    "supervisor.grpc_max_connections".into(),
                    format!("must be at least 1, got {}", max.get_ref()),
                ),
            }
        }
        Some(SupervisorConfig {
            bind: bind?,
            control,
            xds_cluster,
            restart,
            sampler,
            sample_interval,
            lifecycle,
            grpc,
        })
    }

    /// Parses `http://IP:PORT`.
    fn grpc_address(
        &mut self,
        url: &str,
        span: Option<Range<usize>>,
        key: &str,
    ) -> Option<SocketAddr> {
        let parsed = url
            .strip_prefix("http://")
            .map(|a| a.trim_end_matches('/'))
            .and_then(|a| a.parse::<SocketAddr>().ok());
        if parsed.is_none() {
            self.report(
                span,
                key.into(),
                format!("expected http://IP:PORT (e.g. {DEFAULT_BIND}), got {url:?}"),
            );
        }
        parsed
    }

    fn socket_address(
        &mut self,
        raw: Option<Spanned<String>>,
        default: &str,
        key: &str,
    ) -> Option<SocketAddr> {
        match raw {
            None => Some(default.parse().expect("valid default")),
            Some(value) => {
                let parsed = value.get_ref().parse().ok();
                if parsed.is_none() {
                    self.report(
                        Some(value.span()),
                        key.into(),
                        format!(
                            "expected IP:PORT (e.g. {default}), got {:?}",
                            value.get_ref()
                        ),
                    );
                }
                parsed
            }
        }
    }

    fn envoy(&mut self, raw: RawEnvoy) -> Option<EnvoyConfig> {
        let node = match raw.node {
            Some(node) if node.get_ref().is_empty() => {
                self.report(Some(node.span()), "envoy.node".into(), "must not be empty");
                String::new()
            }
            Some(node) => node.into_inner(),
            None => "peregrine".into(),
        };
        let listen = self.socket_address(raw.listen, "0.0.0.0:10000", "envoy.listen");
        let admin = self.socket_address(raw.admin, "127.0.0.1:9901", "envoy.admin");
        let xds = match raw.xds {
            None => XdsVariant::default(),
            Some(value) => match value.get_ref().as_str() {
                "sotw" => XdsVariant::StateOfTheWorld,
                "delta" => XdsVariant::Delta,
                other => {
                    self.report(
                        Some(value.span()),
                        "envoy.xds".into(),
                        format!("expected \"sotw\" or \"delta\", got {other:?}"),
                    );
                    XdsVariant::default()
                }
            },
        };
        let mut timeout = Duration::from_secs(15);
        let mut per_try_timeout = Duration::from_secs(15);
        let per_try_span = raw.per_try_timeout_ms.as_ref().map(|v| v.span());
        self.millis(raw.timeout_ms, "envoy.timeout_ms", 1, &mut timeout);
        self.millis(
            raw.per_try_timeout_ms,
            "envoy.per_try_timeout_ms",
            1,
            &mut per_try_timeout,
        );
        if per_try_timeout > timeout {
            self.report(
                per_try_span,
                "envoy.per_try_timeout_ms".into(),
                format!(
                    "must not be longer than envoy.timeout_ms ({} ms), which bounds all tries",
                    timeout.as_millis()
                ),
            );
        }
        Some(EnvoyConfig {
            node,
            listen: listen?,
            admin: admin?,
            ads: raw.ads,
            xds,
            timeout,
            per_try_timeout,
        })
    }

    fn service(&mut self, name: String, raw: RawService) -> ServiceConfig {
        let key = |field: &str| format!("service.{name}.{field}");
        if !valid_name(&name) {
            let at = self.source.find(&format!("\"{name}\"")).map(|at| at..at);
            self.report(at, format!("service.{name}"), NAME_RULE);
        }
        let count = match raw.count {
            None => 1,
            Some(count) => match u32::try_from(*count.get_ref()) {
                Ok(n) if (1..=MAX_WORKERS).contains(&n) => n,
                _ => {
                    self.report(
                        Some(count.span()),
                        key("count"),
                        format!(
                            "must be between 1 and {MAX_WORKERS}, got {}",
                            count.get_ref()
                        ),
                    );
                    1
                }
            },
        };
        let (url, url_span) = match raw.url {
            Some(url) => (url.get_ref().clone(), Some(url.span())),
            None => (DEFAULT_URL.to_string(), None),
        };
        match url.replace(INDEX_PLACEHOLDER, "0").parse::<BindUrl>() {
            Err(err) => self.report(url_span, key("url"), err.to_string()),
            Ok(BindUrl::Tcp { .. }) if url.contains(INDEX_PLACEHOLDER) => self.report(
                url_span,
                key("url"),
                format!("{INDEX_PLACEHOLDER} is only allowed in unix:// urls"),
            ),
            Ok(parsed) => {
                if let Some(port) = parsed.fixed_port().filter(|_| count > 1) {
                    self.report(
                        url_span.clone(),
                        key("url"),
                        format!(
                            "fixed port {port} cannot serve {count} workers: each worker binds its own \
                             listener (no SO_REUSEPORT); use port 0 or count = 1"
                        ),
                    );
                }
                if matches!(parsed, BindUrl::Unix { .. })
                    && count > 1
                    && !url.contains(INDEX_PLACEHOLDER)
                {
                    self.report(
                        url_span,
                        key("url"),
                        format!(
                            "one socket path cannot serve {count} workers: each worker binds its own \
                             listener; put {INDEX_PLACEHOLDER} in the path (e.g. unix:///run/app-{INDEX_PLACEHOLDER}.sock)"
                        ),
                    );
                }
            }
        }
        let env = match raw.env {
            None => BTreeMap::new(),
            Some(env) => {
                let span = env.span();
                let env = env.into_inner();
                for (variable, value) in &env {
                    if variable.is_empty() || variable.contains(['=', '\0']) {
                        self.report(
                            Some(span.clone()),
                            key("env"),
                            format!(
                                "{variable:?} is not a variable name: it must be non-empty, without \
                                 '=' or NUL"
                            ),
                        );
                    } else if value.contains('\0') {
                        self.report(
                            Some(span.clone()),
                            key(&format!("env.{variable}")),
                            "a value cannot hold a NUL byte: the environment is NUL-terminated text",
                        );
                    }
                }
                env
            }
        };
        let command = match raw.command {
            None => WorkerCommand::default(),
            Some(command) if command.get_ref().iter().any(|word| word.contains('\0')) => {
                self.report(
                    Some(command.span()),
                    key("command"),
                    "an argument cannot hold a NUL byte: arguments are NUL-terminated",
                );
                WorkerCommand::default()
            }
            Some(command) => {
                let span = command.span();
                let mut words = command.into_inner().into_iter();
                match words.next().filter(|p| !p.is_empty()) {
                    None => {
                        self.report(
                            Some(span),
                            key("command"),
                            "must name a program, e.g. [\"/usr/bin/app\", \"--flag\"]",
                        );
                        WorkerCommand::default()
                    }
                    Some(program) => {
                        let program = resolve_program(&program, self.base, self.search_path)
                            .unwrap_or_else(|why| {
                                self.report(Some(span), key("command"), why);
                                Program::Peregrine
                            });
                        WorkerCommand {
                            program,
                            args: words.collect(),
                        }
                    }
                }
            }
        };
        let prefix = match raw.prefix {
            Some(prefix) if !prefix.get_ref().starts_with('/') => {
                self.report(Some(prefix.span()), key("prefix"), "must start with /");
                String::new()
            }
            Some(prefix) => prefix.into_inner(),
            None => "/".into(),
        };
        let domains = match raw.domains {
            Some(domains) if domains.get_ref().is_empty() => {
                self.report(
                    Some(domains.span()),
                    key("domains"),
                    "must name at least one domain (\"*\" for any)",
                );
                Vec::new()
            }
            Some(domains) => domains.into_inner(),
            None => vec!["*".into()],
        };
        let unix = url.starts_with("unix:");
        let (balancing, weights) = self.balancing(
            &name,
            RawBalancing {
                orca: raw.orca,
                lb_policy: raw.lb_policy,
                choice_count: raw.choice_count,
                ring_size_min: raw.ring_size_min,
                ring_size_max: raw.ring_size_max,
                table_size: raw.table_size,
                hash_balance_factor: raw.hash_balance_factor,
                hash_on: raw.hash_on,
                weight: raw.weight,
                weights: raw.weights,
            },
            count,
            unix,
        );
        let restart_batch = match raw.restart_batch {
            None => 1,
            Some(batch) => match u32::try_from(*batch.get_ref()) {
                Ok(batch) if batch >= 1 => batch,
                _ => {
                    self.report(
                        Some(batch.span()),
                        key("restart_batch"),
                        format!(
                            "must be at least 1 (workers replaced at once), got {}",
                            batch.get_ref()
                        ),
                    );
                    1
                }
            },
        };
        ServiceConfig {
            name,
            count,
            url,
            command,
            env,
            prefix,
            domains,
            balancing,
            weights,
            restart_batch,
        }
    }
}

/// The largest config file [`Config::load`] reads: far more than any real one needs, and a bound
/// on what a wrong path (`/dev/zero`) can make it read.
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// Reads `path` as UTF-8 text of at most [`MAX_CONFIG_BYTES`].
fn read_capped(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!("longer than {MAX_CONFIG_BYTES} bytes: not a config file"),
        ));
    }
    String::from_utf8(bytes)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// The canonical directory of the file `path` (symlinks resolved); for a file without a canonical
/// path (a pipe, `/dev/fd/N`), the absolute form of its directory.
fn canonical_dir(path: &Path) -> std::io::Result<PathBuf> {
    let file = std::fs::canonicalize(path).or_else(|_| std::path::absolute(path))?;
    Ok(file.parent().unwrap_or(Path::new("/")).to_owned())
}

/// `path` taken from the absolute directory `base`, `.` and `..` resolved, and the symlinks of its
/// directory resolved where that directory exists already: one file has one name.
fn absolute_in(base: &Path, path: &Path) -> PathBuf {
    use std::path::Component;
    let mut lexical = PathBuf::new();
    for part in base.join(path).components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                lexical.pop();
            }
            other => lexical.push(other),
        }
    }
    match (lexical.parent(), lexical.file_name()) {
        (Some(dir), Some(name)) => match std::fs::canonicalize(dir) {
            Ok(dir) => dir.join(name),
            Err(_) => lexical,
        },
        _ => lexical,
    }
}

/// Finds a worker's program: `peregrine` is this binary; a name with a `/` is a path (relative to the
/// config file's directory); any other name is looked up in `PATH`. It must be an executable file.
fn resolve_program(
    program: &str,
    base: &Path,
    search_path: Option<&str>,
) -> Result<Program, String> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |path: &Path| {
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program == "peregrine" {
        return Ok(Program::Peregrine);
    }
    if program.contains('/') {
        let path = base.join(program);
        return if executable(&path) {
            Ok(Program::Path(path))
        } else {
            Err(format!("{} is not an executable file", path.display()))
        };
    }
    search_path
        .unwrap_or_default()
        .split(':')
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(program))
        .find(|path| executable(path))
        .map(Program::Path)
        .ok_or_else(|| format!("program {program:?} not found in PATH"))
}

/// A serde path as the dotted key a user wrote, without serde's private wrapper segments.
fn dotted_key(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut key = String::new();
    for segment in path.iter() {
        let part = match segment {
            Segment::Map { key } if key.starts_with("$__") => continue,
            Segment::Map { key } | Segment::Enum { variant: key } => key.clone(),
            Segment::Seq { index } => index.to_string(),
            Segment::Unknown => continue,
        };
        if !key.is_empty() {
            key.push('.');
        }
        key.push_str(&part);
    }
    if key.is_empty() {
        "(top level)".into()
    } else {
        key
    }
}

/// The most workers a service may ask for.
const MAX_WORKERS: u32 = 4096;

/// The most workers one supervisor runs, all services together.
pub const MAX_TOTAL_WORKERS: u64 = 16384;

const NAME_RULE: &str = "names may use only ASCII letters, digits, '-', '_' and '.'";

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(source: &str) -> Result<Config, Vec<Problem>> {
        Config::parse(source, Path::new("/etc/peregrine"), &HashMap::new())
    }

    fn problems(source: &str) -> Vec<String> {
        parse(source)
            .expect_err("config should be rejected")
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn orca_is_on_for_ip_workers_and_off_for_unix_ones_or_another_lb_policy() {
        let config = parse(
            "[service.a]\n[service.b]\nurl = \"unix:///run/b.sock\"\n\
             [service.c]\nlb_policy = \"least_request\"\n[service.d]\norca = false\n",
        )
        .unwrap();
        let orca = |name: &str| config.services[name].orca();
        assert!(orca("a") && !orca("b") && !orca("c") && !orca("d"));
        assert_eq!(
            config.services["c"].balancing,
            Balancing::LeastRequest { choice_count: 2 }
        );
        assert_eq!(config.services["d"].balancing, Balancing::RoundRobin);
        assert_eq!(
            config.orca,
            OrcaConfig::defaults_for(DEFAULT_SAMPLE_INTERVAL)
        );
    }

    #[test]
    fn hashing_policies_with_their_options_and_weights() {
        let config = parse(
            "[service.ring]\ncount = 3\nlb_policy = \"ring_hash\"\nhash_on = \"header:x-entity-id\"\n\
             ring_size_min = 4096\nhash_balance_factor = 150\nweights = [1, 2, 3]\n\
             [service.mag]\nlb_policy = \"maglev\"\nhash_on = \"cookie:session\"\nweight = 5\n\
             [service.ip]\nlb_policy = \"ring_hash\"\nhash_on = \"source_ip\"\n",
        )
        .unwrap();
        assert_eq!(
            config.services["ring"].balancing,
            Balancing::RingHash {
                hash_on: HashOn::Header("x-entity-id".into()),
                min_ring_size: Some(4096),
                max_ring_size: 8 * 1024 * 1024,
                hash_balance_factor: Some(150),
            }
        );
        assert_eq!(config.services["ring"].weights, [1, 2, 3]);
        assert_eq!(
            config.services["mag"].balancing,
            Balancing::Maglev {
                hash_on: HashOn::Cookie("session".into()),
                table_size: 65537,
                hash_balance_factor: None,
            }
        );
        assert_eq!(config.services["mag"].weights, [5]);
        assert_eq!(
            config.services["ip"].balancing.hash_on(),
            Some(&HashOn::SourceIp)
        );
        assert!(!config.services["ip"].orca());
    }

    #[test]
    fn hashing_mistakes_are_named_with_their_lines() {
        let got = problems(
            "[service.a]\nlb_policy = \"ring_hash\"\n\
             [service.b]\nlb_policy = \"maglev\"\nhash_on = \"query:id\"\ntable_size = 65536\n\
             [service.c]\nlb_policy = \"round_robin\"\nhash_on = \"source_ip\"\nhash_balance_factor = 150\n\
             [service.d]\ncount = 2\nweights = [1]\n[service.e]\nlb_policy = \"ring_hash\"\n\
             hash_on = \"source_ip\"\nhash_balance_factor = 50\nring_size_min = 9000\nring_size_max = 8000\n",
        );
        let expect = [
            "line 2: service.a.hash_on: lb_policy = \"ring_hash\" needs hash_on",
            "line 5: service.b.hash_on: expected \"header:NAME\"",
            "line 6: service.b.table_size: must be a prime",
            "line 10: service.c.hash_balance_factor: applies to lb_policy = \"ring_hash\" or \"maglev\", not round_robin",
            "line 9: service.c.hash_on: applies to lb_policy = \"ring_hash\" or \"maglev\"",
            "line 13: service.d.weights: has 1 entries for 2 workers",
            "line 17: service.e.hash_balance_factor: must be between 100 and 10000, got 50",
            "line 18: service.e.ring_size_min: 9000 is larger than ring_size_max (8000)",
        ];
        assert_eq!(got.len(), expect.len(), "{got:#?}");
        for (got, expect) in got.iter().zip(expect) {
            assert!(
                got.starts_with(expect),
                "{got}\n  should start with\n{expect}"
            );
        }
    }

    #[test]
    fn orca_conflicts_and_bad_values_are_named_with_their_lines() {
        let got = problems(
            "[service.a]\nurl = \"unix:///run/a.sock\"\norca = true\n\
             [service.b]\nlb_policy = \"random\"\norca = true\n\
             [service.c]\nlb_policy = \"fastest\"\n",
        );
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(
            got[0].starts_with("line 3: service.a.orca: ORCA cannot reach unix:// workers"),
            "{got:?}"
        );
        assert!(
            got[1].starts_with("line 6: service.b.orca: orca = true balances on ORCA reports")
                && got[1].contains("lb_policy = \"random\""),
            "{got:?}"
        );
        assert!(
            got[2].starts_with("line 8: service.c.lb_policy: expected \"orca\", \"round_robin\""),
            "{got:?}"
        );
        let got = problems(
            "[orca]\nmin_report_interval_ms = 5\nblackout_period_ms = 40000\n[service.a]\n",
        );
        assert_eq!(
            got,
            [
                "line 2: orca.min_report_interval_ms: must be at least 10 (milliseconds), got 5",
                "orca.weight_expiration_period_ms: must be longer than orca.blackout_period_ms \
                 (40000 ms): a weight would expire before Envoy starts using it",
            ]
        );
    }

    #[test]
    fn parses_the_documented_example() {
        let config = parse(
            r#"
[supervisor]
bind = "http://[::1]:18000"
control = "peregrine.sock"

[service.cluster]
count = 2
url = "http://localhost:0"
command = ["peregrine", "worker"]
"#,
        )
        .unwrap();
        assert_eq!(config.supervisor.bind, "[::1]:18000".parse().unwrap());
        assert_eq!(
            config.supervisor.control,
            Path::new("/etc/peregrine/peregrine.sock")
        );
        let service = &config.services["cluster"];
        assert_eq!(service.count, 2);
        assert_eq!(service.command, WorkerCommand::default());
        assert_eq!(service.url_for(1).to_string(), "http://localhost:0");
    }

    #[test]
    fn defaults_are_loopback_and_built_in() {
        let config = parse("[service.app]\n").unwrap();
        assert!(config.supervisor.bind.ip().is_loopback());
        assert!(config.envoy.admin.ip().is_loopback());
        let app = &config.services["app"];
        assert_eq!((app.count, &app.command), (1, &WorkerCommand::default()));
        assert_eq!(app.prefix, "/");
    }

    #[test]
    fn a_type_error_names_the_key_and_line() {
        let got = problems("[service.cluster]\ncount = \"two\"\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with("line 2: service.cluster.count: "),
            "{got:?}"
        );
        assert!(!got[0].contains('\n'), "one line: {got:?}");
    }

    #[test]
    fn an_unknown_key_is_named() {
        let got = problems("[service.cluster]\ncuont = 2\n");
        assert!(
            got[0].contains("line 2") && got[0].contains("cuont"),
            "{got:?}"
        );
    }

    #[test]
    fn a_syntax_error_has_a_line() {
        let got = problems("[service.cluster]\ncount = = 2\n");
        assert!(got[0].starts_with("line 2: "), "{got:?}");
    }

    #[test]
    fn reports_every_problem_not_just_the_first() {
        let got = problems(
            r#"[supervisor]
bind = "localhost"
[service.web]
count = 3
url = "http://127.0.0.1:8080"
[service."bad name"]
count = 0
"#,
        );
        assert_eq!(got.len(), 4, "{got:#?}");
        assert!(
            got[0].starts_with("line 2: supervisor.bind: expected http://IP:PORT"),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|p| p.starts_with("line 5: service.web.url: fixed port 8080")),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|p| p.contains("service.bad name.count: must be between 1")),
            "{got:?}"
        );
    }

    #[test]
    fn a_shared_unix_path_needs_the_index_placeholder() {
        let got = problems("[service.a]\ncount = 2\nurl = \"unix:///run/a.sock\"\n");
        assert!(got[0].contains("{index}"), "{got:?}");
        let config =
            parse("[service.a]\ncount = 2\nurl = \"unix:///run/a-{index}.sock\"\n").unwrap();
        assert_eq!(
            config.services["a"].url_for(1).to_string(),
            "unix:///run/a-1.sock"
        );
    }

    #[test]
    fn worker_programs_are_resolved_or_reported() {
        let env = HashMap::from([("PATH".to_string(), "/nonexistent:/bin:/usr/bin".to_string())]);
        let parse = |s: &str| Config::parse(s, Path::new("/etc"), &env);
        let config = parse("[service.a]\ncommand = [\"sh\", \"-c\", \"exit 1\"]\n").unwrap();
        let command = &config.services["a"].command;
        assert!(
            matches!(&command.program, Program::Path(p) if p.ends_with("sh")),
            "{command:?}"
        );
        assert_eq!(command.args, ["-c", "exit 1"]);
        let got = parse("[service.a]\ncommand = [\"no-such-program\"]\n").unwrap_err();
        assert_eq!(
            got[0].to_string(),
            "line 2: service.a.command: program \"no-such-program\" not found in PATH"
        );
        let got = parse("[service.a]\ncommand = [\"./app\"]\n").unwrap_err();
        assert!(
            got[0]
                .message
                .contains("/etc/./app is not an executable file"),
            "{got:?}"
        );
        let got = parse("[service.a]\ncommand = []\n").unwrap_err();
        assert!(got[0].message.contains("must name a program"), "{got:?}");
    }

    #[test]
    fn the_sampler_defaults_to_auto_every_second() {
        let config = parse("[service.a]\n").unwrap();
        assert_eq!(config.supervisor.sampler, SamplerSetting::Auto);
        assert_eq!(config.supervisor.sample_interval, Duration::from_secs(1));
        let config =
            parse("[supervisor]\nsampler = \"procfs\"\nsample_interval_ms = 10\n[service.a]\n")
                .unwrap();
        assert_eq!(config.supervisor.sampler, SamplerSetting::Procfs);
        assert_eq!(config.supervisor.sample_interval, Duration::from_millis(10));
    }

    #[test]
    fn lifecycle_timeouts_and_restart_batches() {
        let config = parse("[service.a]\n").unwrap();
        assert_eq!(config.supervisor.lifecycle, Lifecycle::default());
        assert_eq!(config.services["a"].restart_batch, 1);
        let config = parse(
            "[supervisor]\ndrain_timeout_ms = 0\nstop_timeout_ms = 500\nregister_timeout_ms = 2000\n\
             orphan_timeout_ms = 0\n[service.a]\ncount = 8\nrestart_batch = 4\n",
        )
        .unwrap();
        assert_eq!(
            config.supervisor.lifecycle,
            Lifecycle {
                drain_timeout: Duration::ZERO,
                stop_timeout: Duration::from_millis(500),
                register_timeout: Duration::from_secs(2),
                orphan_timeout: Duration::ZERO,
            }
        );
        assert_eq!(config.services["a"].restart_batch, 4);
        let got = problems(
            "[supervisor]\nstop_timeout_ms = 0\nregister_timeout_ms = -1\n[service.a]\nrestart_batch = 0\n",
        );
        assert_eq!(
            got,
            [
                "line 2: supervisor.stop_timeout_ms: must be at least 1 (milliseconds), got 0",
                "line 3: supervisor.register_timeout_ms: must be at least 100 (milliseconds), got -1",
                "line 5: service.a.restart_batch: must be at least 1 (workers replaced at once), got 0",
            ]
        );
    }

    #[test]
    fn envoy_xds_is_sotw_or_delta() {
        let config = parse("[service.a]\n").unwrap();
        assert_eq!(config.envoy.xds, XdsVariant::StateOfTheWorld);
        let config = parse("[envoy]\nads = true\nxds = \"delta\"\n[service.a]\n").unwrap();
        assert_eq!(
            (config.envoy.ads, config.envoy.xds),
            (true, XdsVariant::Delta)
        );
        assert_eq!(
            problems("[envoy]\nxds = \"incremental\"\n[service.a]\n"),
            ["line 2: envoy.xds: expected \"sotw\" or \"delta\", got \"incremental\""]
        );
    }

    #[test]
    fn a_bad_sampler_and_a_short_interval_are_named_with_their_lines() {
        let got =
            problems("[supervisor]\nsampler = \"perf\"\nsample_interval_ms = 9\n[service.a]\n");
        assert_eq!(
            got,
            [
                "line 2: supervisor.sampler: expected \"auto\", \"ebpf\", \"procfs\" or \"off\", got \"perf\"",
                "line 3: supervisor.sample_interval_ms: must be at least 10 (milliseconds), got 9",
            ]
        );
        let got = problems("[supervisor]\nsample_interval_ms = -5\n[service.a]\n");
        assert_eq!(
            got,
            ["line 2: supervisor.sample_interval_ms: must be at least 10 (milliseconds), got -5"]
        );
        let got = problems("[supervisor]\nsampler = 1\n[service.a]\n");
        assert!(
            got[0].starts_with("line 2: supervisor.sampler: invalid type"),
            "{got:?}"
        );
    }

    #[test]
    fn no_services_is_an_error() {
        let got = problems("[supervisor]\n");
        assert!(got[0].contains("no services"), "{got:?}");
    }

    #[test]
    fn environment_overrides_bind_and_control() {
        let env = HashMap::from([
            (
                "PEREGRINE_BIND".to_string(),
                "http://127.0.0.1:1".to_string(),
            ),
            ("PEREGRINE_CONTROL".to_string(), "/run/x.sock".to_string()),
        ]);
        let config = Config::parse("[service.a]\n", Path::new("/"), &env).unwrap();
        assert_eq!(config.supervisor.bind.port(), 1);
        assert_eq!(config.supervisor.control, Path::new("/run/x.sock"));
    }
    #[test]
    fn nul_bytes_and_bad_variable_names_are_refused_with_their_lines() {
        let got = problems(
            "[service.a]\n\nenv = { \"A\" = \"x\\u0000y\" }\n\
             [service.b]\nenv = { \"B=C\" = \"1\" }\n\
             [service.c]\ncommand = [\"peregrine\", \"wor\\u0000ker\"]\n\
             [service.d]\nenv = { \"\" = \"1\" }\n",
        );
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(
            got[0].starts_with("line 3: service.a.env.A: a value cannot hold a NUL"),
            "{got:?}"
        );
        assert!(
            got[1].starts_with("line 5: service.b.env: \"B=C\" is not a variable name"),
            "{got:?}"
        );
        assert!(
            got[2].starts_with("line 7: service.c.command: an argument cannot hold a NUL"),
            "{got:?}"
        );
        assert!(got[3].starts_with("line 9: service.d.env:"), "{got:?}");
    }

    #[test]
    fn the_total_of_workers_is_bounded() {
        let many: String = (0..5)
            .map(|i| format!("[service.s{i}]\ncount = 4096\n"))
            .collect();
        let got = problems(&many);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].contains("20480 workers in all"), "{got:?}");
        let enough: String = (0..4)
            .map(|i| format!("[service.s{i}]\ncount = 4096\n"))
            .collect();
        assert!(parse(&enough).is_ok());
    }

    #[test]
    fn errors_deep_inside_tables_have_lines() {
        for source in [
            "[service.web]\n\n[service.web.env.a.b.c]\nd = 1\n",
            "[service.web]\n\nenv = { a = { b = { c = 1 } } }\n",
            &format!(
                "[service.web]\n\nx = {}1{}\n",
                "{a=".repeat(200),
                "}".repeat(200)
            ),
        ] {
            let got = problems(source);
            assert!(got[0].starts_with("line 3: "), "{source:?}: {got:?}");
        }
    }

    #[test]
    fn a_config_file_is_read_only_up_to_its_cap() {
        let err = Config::load(Path::new("/dev/zero")).expect_err("not a config");
        let text = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(text.contains("longer than 1048576 bytes"), "{text}");
    }

    #[test]
    fn relative_paths_become_one_canonical_path() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
        std::fs::write(
            real.join("p.toml"),
            "[supervisor]\ncontrol = \"./sub/../p.sock\"\n[service.a]\n",
        )
        .unwrap();
        let canonical = std::fs::canonicalize(&real).unwrap().join("p.sock");
        for path in [real.join("p.toml"), dir.path().join("link/p.toml")] {
            let config = Config::load(&path).unwrap();
            assert_eq!(config.supervisor.control, canonical, "{}", path.display());
        }
        assert_eq!(
            absolute_in(Path::new("/nonexistent/dir"), Path::new("../x/./y.sock")),
            Path::new("/nonexistent/x/y.sock")
        );
    }

    #[test]
    fn route_and_try_timeouts() {
        let config =
            parse("[envoy]\ntimeout_ms = 20000\nper_try_timeout_ms = 500\n[service.a]\n").unwrap();
        assert_eq!(config.envoy.timeout, Duration::from_secs(20));
        assert_eq!(config.envoy.per_try_timeout, Duration::from_millis(500));
        let defaults = parse("[service.a]\n").unwrap();
        assert_eq!(defaults.envoy.timeout, Duration::from_secs(15));
        assert_eq!(defaults.envoy.per_try_timeout, Duration::from_secs(15));
        let got =
            problems("[envoy]\ntimeout_ms = 1000\n\nper_try_timeout_ms = 2000\n[service.a]\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with("line 4: envoy.per_try_timeout_ms: must not be longer"),
            "{got:?}"
        );
    }

    #[test]
    fn grpc_limits() {
        let config = parse(
            "[supervisor]\ngrpc_max_connections = 100\ngrpc_handshake_timeout_ms = 500\n\
             grpc_idle_timeout_ms = 2000\n[service.a]\n",
        )
        .unwrap();
        assert_eq!(
            config.supervisor.grpc,
            GrpcLimits {
                max_connections: 100,
                handshake_timeout: Duration::from_millis(500),
                idle_timeout: Duration::from_secs(2),
            }
        );
        let got = problems("[supervisor]\ngrpc_max_connections = 0\n[service.a]\n");
        assert!(
            got[0].starts_with("line 2: supervisor.grpc_max_connections"),
            "{got:?}"
        );
    }
}
