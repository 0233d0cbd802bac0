//! `peregrine.toml` for tests and benchmarks, from typed tables instead of hand-written text.
//!
//! Each table is a struct whose fields are the table's keys, every one an `Option` that is left out
//! of the file when `None` (the supervisor's default then applies). TOML quoting, table order and
//! dotted sub-tables are the serializer's, so a path or a name with a quote in it cannot break the
//! file. The keys are those of `docs/configuration.md`, table for table: a unit test holds that.
//!
//! Tests of the config *parser* (a bad value and its line, an unknown key) keep writing text: the
//! text is what they test.
//!
//! ```
//! use peregrine_e2e::config::{PeregrineToml, Sampler, ServiceTable};
//!
//! let mut config = PeregrineToml::local(18000).with_envoy(10000, 9901);
//! config.supervisor.sampler = Some(Sampler::Off);
//! config.service("web", ServiceTable::at("http://127.0.0.1:0").count(2));
//! let text = config.toml();
//! assert!(text.contains("[service.web]\ncount = 2\n"), "{text}");
//! ```

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::{Serialize, Serializer};

/// A whole `peregrine.toml`; [`PeregrineToml::toml`] writes it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PeregrineToml {
    pub supervisor: SupervisorTable,
    pub envoy: Option<EnvoyTable>,
    pub orca: Option<OrcaTable>,
    pub cluster: Option<ClusterTable>,
    /// `[service.NAME]`, by name.
    #[serde(rename = "service")]
    pub services: BTreeMap<String, ServiceTable>,
}

/// `[supervisor]`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SupervisorTable {
    pub bind: Option<String>,
    pub metrics: Option<String>,
    /// May hold `{dir}`, which [`Supervisor::start`](crate::Supervisor::start) fills in.
    pub control: Option<String>,
    pub xds_cluster: Option<String>,
    pub restart_delay_ms: Option<u64>,
    pub restart_delay_max_ms: Option<u64>,
    pub healthy_after_ms: Option<u64>,
    pub sampler: Option<Sampler>,
    pub sample_interval_ms: Option<u64>,
    pub drain_timeout_ms: Option<u64>,
    pub stop_timeout_ms: Option<u64>,
    pub register_timeout_ms: Option<u64>,
    pub orphan_timeout_ms: Option<u64>,
    pub grpc_max_connections: Option<u64>,
    pub grpc_max_connections_per_peer: Option<u64>,
    pub grpc_handshake_timeout_ms: Option<u64>,
    pub grpc_idle_timeout_ms: Option<u64>,
    pub tls: Option<ServerTls>,
}

/// `supervisor.sampler`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Sampler {
    Auto,
    Ebpf,
    Procfs,
    Off,
}

impl Sampler {
    /// As the config, the log and `peregrine status` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Sampler::Auto => "auto",
            Sampler::Ebpf => "ebpf",
            Sampler::Procfs => "procfs",
            Sampler::Off => "off",
        }
    }
}

/// `[supervisor.tls]`: the gRPC port's TLS.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ServerTls {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub client_ca: Option<PathBuf>,
}

/// `[envoy]`: what `peregrine envoy-bootstrap` writes.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EnvoyTable {
    pub node: Option<String>,
    pub listen: Option<String>,
    pub admin: Option<String>,
    pub ads: Option<bool>,
    /// `"sotw"` or `"delta"`.
    pub xds: Option<String>,
    pub timeout_ms: Option<u64>,
    pub per_try_timeout_ms: Option<u64>,
    pub xds_servers: Option<Vec<String>>,
    pub tls: Option<EnvoyTls>,
}

/// `[envoy.tls]`: Envoy's side of the gRPC port's TLS.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EnvoyTls {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: Option<PathBuf>,
    pub server_name: Option<String>,
}

/// `[orca]`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OrcaTable {
    pub min_report_interval_ms: Option<u64>,
    pub blackout_period_ms: Option<u64>,
    pub weight_expiration_period_ms: Option<u64>,
    pub weight_update_period_ms: Option<u64>,
}

/// `[cluster]`: a fleet on etcd.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClusterTable {
    pub etcd: Option<Vec<String>>,
    pub allow_insecure: Option<bool>,
    pub host: Option<String>,
    pub region: Option<String>,
    pub zone: Option<String>,
    pub lease_ttl_ms: Option<u64>,
    pub prefix: Option<String>,
    /// `"local-first"` or `"fleet"`.
    pub routing: Option<String>,
    pub allowed_networks: Option<Vec<String>>,
    pub tls: Option<ClusterTls>,
}

/// `[cluster.tls]`: the etcd client's TLS.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClusterTls {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// `[service.NAME]`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ServiceTable {
    pub count: Option<u32>,
    pub restart_batch: Option<u32>,
    pub url: Option<String>,
    /// May hold `{index}` and the other placeholders of the docs.
    pub command: Option<Vec<String>>,
    pub pass_socket: Option<bool>,
    pub ready_path: Option<String>,
    pub stop_signal: Option<String>,
    /// How many requests one worker serves at once.
    pub concurrency: Option<u32>,
    /// `"shared"` or `"per-worker"`.
    pub listener: Option<String>,
    pub user: Option<AccountId>,
    pub group: Option<AccountId>,
    pub env: Option<BTreeMap<String, String>>,
    pub prefix: Option<String>,
    pub domains: Option<Vec<String>>,
    pub orca: Option<Orca>,
    /// `"orca"`, `"round_robin"`, `"least_request"`, `"random"`, `"ring_hash"` or `"maglev"`.
    pub lb_policy: Option<String>,
    pub choice_count: Option<u32>,
    pub ring_size_min: Option<u64>,
    pub ring_size_max: Option<u64>,
    pub table_size: Option<u64>,
    pub hash_balance_factor: Option<u32>,
    pub hash_on: Option<String>,
    pub weight: Option<u32>,
    pub weights: Option<Vec<u32>>,
}

/// `service.NAME.orca`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Orca {
    /// `true`: out of band, on the gRPC port.
    On,
    /// `false`.
    Off,
    /// `"in-band"`: in a response trailer the worker writes.
    InBand,
}

impl Serialize for Orca {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Orca::On => serializer.serialize_bool(true),
            Orca::Off => serializer.serialize_bool(false),
            Orca::InBand => serializer.serialize_str("in-band"),
        }
    }
}

/// `service.NAME.user` or `group`: a name or a numeric id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum AccountId {
    Name(String),
    Id(u32),
}

// === impl PeregrineToml ===

impl PeregrineToml {
    /// `[supervisor]` with the gRPC port on `127.0.0.1:<grpc_port>` and the control socket in the
    /// supervisor's directory (`{dir}`, see [`Supervisor::start`](crate::Supervisor::start)); no
    /// other table.
    pub fn local(grpc_port: u16) -> Self {
        Self {
            supervisor: SupervisorTable {
                bind: Some(format!("http://127.0.0.1:{grpc_port}")),
                control: Some("{dir}/peregrine.sock".into()),
                ..SupervisorTable::default()
            },
            ..Self::default()
        }
    }

    /// [`PeregrineToml::local`] with `[envoy]` on the given loopback ports and one service named
    /// `cluster` of `workers` hello workers on `http://localhost:0`: the set-up of most tests.
    pub fn one_service(grpc_port: u16, listen_port: u16, admin_port: u16, workers: u32) -> Self {
        let mut config = Self::local(grpc_port).with_envoy(listen_port, admin_port);
        config.service(
            crate::CLUSTER,
            ServiceTable::at("http://localhost:0").count(workers),
        );
        config
    }

    /// With `[envoy]`: Envoy's listener and admin on the given loopback ports.
    #[must_use]
    pub fn with_envoy(mut self, listen_port: u16, admin_port: u16) -> Self {
        self.envoy = Some(EnvoyTable {
            listen: Some(format!("127.0.0.1:{listen_port}")),
            admin: Some(format!("127.0.0.1:{admin_port}")),
            ..EnvoyTable::default()
        });
        self
    }

    /// Adds (or replaces) `[service.<name>]`.
    pub fn service(&mut self, name: &str, service: ServiceTable) -> &mut Self {
        self.services.insert(name.to_owned(), service);
        self
    }

    /// `[service.<name>]`.
    ///
    /// # Panics
    ///
    /// When there is no such service.
    #[track_caller]
    pub fn service_mut(&mut self, name: &str) -> &mut ServiceTable {
        self.services
            .get_mut(name)
            .unwrap_or_else(|| panic!("no [service.{name}] in the config"))
    }

    /// `[orca]`, made empty first if there is none.
    pub fn orca_mut(&mut self) -> &mut OrcaTable {
        self.orca.get_or_insert_with(OrcaTable::default)
    }

    /// `[cluster]`, made empty first if there is none.
    pub fn cluster_mut(&mut self) -> &mut ClusterTable {
        self.cluster.get_or_insert_with(ClusterTable::default)
    }

    /// `[envoy]`, made empty first if there is none.
    pub fn envoy_mut(&mut self) -> &mut EnvoyTable {
        self.envoy.get_or_insert_with(EnvoyTable::default)
    }

    /// The file's text.
    ///
    /// # Panics
    ///
    /// Never for these types (every value has a TOML form).
    pub fn toml(&self) -> String {
        toml::to_string(self).expect("every table of the config has a TOML form")
    }

    /// With the control socket at `dir/peregrine.sock` instead of `{dir}/peregrine.sock`, named
    /// in the config itself (the [`Supervisor`](crate::Supervisor) starts fill in `{dir}` with
    /// their directory; a config a caller runs itself needs the path).
    #[must_use]
    pub fn control_in(mut self, dir: &Path) -> Self {
        self.supervisor.control = Some(dir.join("peregrine.sock").display().to_string());
        self
    }

    /// The file's text with every `{dir}` made `dir`, as
    /// [`Supervisor::start`](crate::Supervisor::start) writes it: for a config written by the test
    /// itself, or written again over a running supervisor's before a reload.
    pub fn toml_in(&self, dir: &Path) -> String {
        self.toml().replace("{dir}", &dir.display().to_string())
    }
}

// === impl ClusterTable ===

impl ClusterTable {
    /// `[cluster]` of host `host` on the etcd at `etcd` (client endpoints) in cleartext, with
    /// `allow_insecure = true`: a fleet on one machine's loopback, where nothing leaves it.
    pub fn insecure<S: Into<String>>(
        etcd: impl IntoIterator<Item = S>,
        host: impl Into<String>,
    ) -> Self {
        Self {
            etcd: Some(etcd.into_iter().map(Into::into).collect()),
            host: Some(host.into()),
            allow_insecure: Some(true),
            ..Self::default()
        }
    }
}

// === impl ServiceTable ===

impl ServiceTable {
    /// A service whose workers listen at `url`.
    pub fn at(url: impl Into<String>) -> Self {
        Self {
            url: Some(url.into()),
            ..Self::default()
        }
    }

    #[must_use]
    pub fn count(mut self, count: u32) -> Self {
        self.count = Some(count);
        self
    }

    /// The workers run `command` (a program and its arguments).
    #[must_use]
    pub fn command<S: Into<String>>(mut self, command: impl IntoIterator<Item = S>) -> Self {
        self.command = Some(command.into_iter().map(Into::into).collect());
        self
    }

    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }

    #[must_use]
    pub fn orca(mut self, orca: Orca) -> Self {
        self.orca = Some(orca);
        self
    }

    /// A third-party server as the workers (e.g. [`gunicorn_command`](crate::gunicorn_command)):
    /// `command` on a listener the supervisor binds and passes (`pass_socket = true`), ready once
    /// `/healthz` answers, as every application of `tests/apps` does. No url: add one with
    /// `ServiceTable { url, ..ServiceTable::app_server(command) }`.
    pub fn app_server<S: Into<String>>(command: impl IntoIterator<Item = S>) -> Self {
        Self {
            pass_socket: Some(true),
            ready_path: Some("/healthz".into()),
            ..Self::default()
        }
        .command(command)
    }

    /// Each worker its own listener (`listener = "per-worker"`), whatever the server's concurrency.
    #[must_use]
    pub fn per_worker(mut self) -> Self {
        self.listener = Some("per-worker".into());
        self
    }

    /// One listener all the workers share (`listener = "shared"`).
    #[must_use]
    pub fn shared(mut self) -> Self {
        self.listener = Some("shared".into());
        self
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// Every table with every key set: the keys the builder can write.
    fn every_key() -> PeregrineToml {
        let path = || Some(PathBuf::from("/p"));
        let text = || Some("x".to_owned());
        let texts = || Some(vec!["x".to_owned()]);
        let service = ServiceTable {
            count: Some(1),
            restart_batch: Some(1),
            url: text(),
            command: texts(),
            pass_socket: Some(true),
            ready_path: text(),
            stop_signal: text(),
            concurrency: Some(1),
            listener: text(),
            user: Some(AccountId::Name("nobody".into())),
            group: Some(AccountId::Id(65534)),
            env: Some(BTreeMap::from([("A".into(), "b".into())])),
            prefix: text(),
            domains: texts(),
            orca: Some(Orca::InBand),
            lb_policy: text(),
            choice_count: Some(2),
            ring_size_min: Some(1),
            ring_size_max: Some(1),
            table_size: Some(2),
            hash_balance_factor: Some(100),
            hash_on: text(),
            weight: Some(1),
            weights: Some(vec![1]),
        };
        PeregrineToml {
            supervisor: SupervisorTable {
                bind: text(),
                metrics: text(),
                control: text(),
                xds_cluster: text(),
                restart_delay_ms: Some(1),
                restart_delay_max_ms: Some(1),
                healthy_after_ms: Some(1),
                sampler: Some(Sampler::Auto),
                sample_interval_ms: Some(1),
                drain_timeout_ms: Some(1),
                stop_timeout_ms: Some(1),
                register_timeout_ms: Some(1),
                orphan_timeout_ms: Some(1),
                grpc_max_connections: Some(1),
                grpc_max_connections_per_peer: Some(1),
                grpc_handshake_timeout_ms: Some(1),
                grpc_idle_timeout_ms: Some(1),
                tls: Some(ServerTls {
                    cert: path(),
                    key: path(),
                    client_ca: path(),
                }),
            },
            envoy: Some(EnvoyTable {
                node: text(),
                listen: text(),
                admin: text(),
                ads: Some(true),
                xds: text(),
                timeout_ms: Some(1),
                per_try_timeout_ms: Some(1),
                xds_servers: texts(),
                tls: Some(EnvoyTls {
                    cert: path(),
                    key: path(),
                    ca: path(),
                    server_name: text(),
                }),
            }),
            orca: Some(OrcaTable {
                min_report_interval_ms: Some(1),
                blackout_period_ms: Some(1),
                weight_expiration_period_ms: Some(1),
                weight_update_period_ms: Some(1),
            }),
            cluster: Some(ClusterTable {
                etcd: texts(),
                allow_insecure: Some(true),
                host: text(),
                region: text(),
                zone: text(),
                lease_ttl_ms: Some(1),
                prefix: text(),
                routing: text(),
                allowed_networks: texts(),
                tls: Some(ClusterTls {
                    ca: path(),
                    cert: path(),
                    key: path(),
                }),
            }),
            services: BTreeMap::from([("NAME".to_owned(), service)]),
        }
    }

    /// `table.key` for every key of `table`, sub-tables by their dotted names.
    fn keys_of(prefix: &str, table: &toml::Table, into: &mut BTreeSet<String>) {
        for (key, value) in table {
            match value {
                toml::Value::Table(sub) if key != "env" => {
                    let name = if prefix.is_empty() {
                        key.clone()
                    } else {
                        format!("{prefix}.{key}")
                    };
                    keys_of(&name, sub, into);
                }
                _ => {
                    into.insert(format!("{prefix}.{key}"));
                }
            }
        }
    }

    /// `table.key` for every key row of the reference (`| `key` |` under a ``## `[table]` `` title).
    fn documented_keys() -> BTreeSet<String> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md");
        let page = std::fs::read_to_string(path).expect("the configuration reference");
        let mut keys = BTreeSet::new();
        let mut table = None;
        for line in page.lines() {
            if let Some(title) = line.strip_prefix("## ") {
                table = title
                    .strip_prefix("`[")
                    .and_then(|rest| rest.split_once("]`"))
                    .map(|(name, _)| name.to_owned());
            } else if let (Some(table), Some(row)) = (&table, line.strip_prefix("| `"))
                && let Some((key, _)) = row.split_once("` |")
            {
                keys.insert(format!("{table}.{key}"));
            }
        }
        keys
    }

    #[test]
    fn the_builder_writes_every_documented_key_and_no_other() {
        let written: toml::Table = toml::from_str(&every_key().toml()).expect("valid TOML");
        let mut keys = BTreeSet::new();
        keys_of("", &written, &mut keys);
        let documented = documented_keys();
        assert!(
            documented.len() > 60,
            "the reference's rows: {documented:?}"
        );
        assert_eq!(
            keys.difference(&documented).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "written but not documented"
        );
        assert_eq!(
            documented.difference(&keys).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "documented but the builder cannot write it"
        );
    }

    #[test]
    fn left_out_keys_are_not_written_and_text_is_quoted() {
        let mut config = PeregrineToml::local(18000);
        config.supervisor.control = Some("/a \"quoted\" dir/peregrine.sock".into());
        config.service(
            "web",
            ServiceTable::at("http://127.0.0.1:0")
                .count(2)
                .orca(Orca::Off),
        );
        let text = config.toml();
        let parsed: toml::Table = toml::from_str(&text).expect("valid TOML");
        assert_eq!(
            parsed["supervisor"]["control"].as_str(),
            Some("/a \"quoted\" dir/peregrine.sock")
        );
        assert_eq!(parsed["service"]["web"]["orca"].as_bool(), Some(false));
        assert_eq!(parsed["service"]["web"]["count"].as_integer(), Some(2));
        for absent in [
            "[envoy]",
            "[orca]",
            "[cluster]",
            "metrics",
            "sampler",
            "command",
        ] {
            assert!(!text.contains(absent), "{absent} in {text}");
        }
    }

    #[test]
    fn the_helpers_set_their_keys() {
        let mut config = PeregrineToml::local(18000).control_in(Path::new("/tmp/x"));
        config.service("app", ServiceTable::app_server(["gunicorn", "app:app"]));
        let parsed: toml::Table = toml::from_str(&config.toml()).expect("valid TOML");
        assert_eq!(
            parsed["supervisor"]["control"].as_str(),
            Some("/tmp/x/peregrine.sock")
        );
        let app = &parsed["service"]["app"];
        assert_eq!(app["pass_socket"].as_bool(), Some(true));
        assert_eq!(app["ready_path"].as_str(), Some("/healthz"));
        assert_eq!(app["command"].as_array().map(Vec::len), Some(2));
        assert!(app.get("url").is_none(), "{app}");
    }
}
