//! The supervisor config of one host of a fleet on a [`Network`](crate::Network): its gRPC port and
//! workers on the host's own address, its Envoy's listener and admin on the host's loopback, and
//! `[cluster]` on the fleet's etcd. Shared by the multi-host tests (`tests/fleet_hosts.rs`) and
//! `cargo xtask demo fleet`.

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use crate::{
    PeregrineToml, ServiceTable,
    config::{ClusterTable, EnvoyTable, Sampler},
};

/// What one host's `peregrine.toml` says; [`FleetHostConfig::toml`] writes it.
#[derive(Clone, Debug)]
pub struct FleetHostConfig<'a> {
    /// The host's name in the fleet (and Envoy's node is `envoy-<name>`).
    pub name: &'a str,
    /// The host's address (a [`NetHost::address`](crate::NetHost::address)): the gRPC port's and
    /// the workers'.
    pub address: Ipv4Addr,
    /// The gRPC (xDS and ORCA) port: the same on every host, since Envoy dials every worker's IP on
    /// one ORCA port.
    pub grpc_port: u16,
    /// The one service, and its workers.
    pub service: &'a str,
    pub workers: u32,
    /// The xDS servers of the bootstrap (`http://IP:PORT` each): this host's supervisor, or every
    /// host's.
    pub xds_servers: Vec<String>,
    /// The etcd client endpoints.
    pub etcd: Vec<String>,
    /// `local-first` or `fleet`.
    pub routing: &'a str,
    pub lease_ttl: Duration,
    /// The host's locality (empty: left out, the default).
    pub region: &'a str,
    pub zone: &'a str,
    /// Envoy's listener and admin, on the host's loopback (every host has its own).
    pub envoy_listen: SocketAddr,
    pub envoy_admin: SocketAddr,
    /// Each try of a request through Envoy: a try sent to a worker that is cut off gets no answer,
    /// and is retried on another worker after this long.
    pub per_try_timeout: Duration,
    /// `supervisor.sampler`.
    pub sampler: Sampler,
    /// TLS everywhere the control plane leaves the host, from a directory `peregrine tls init`
    /// wrote: the gRPC port (mutual), Envoy's side of it, and etcd (client certificates; the
    /// endpoints are `https://`). `None`: cleartext, with `allow_insecure = true`.
    pub tls: Option<&'a std::path::Path>,
}

impl FleetHostConfig<'_> {
    /// The config. Its control socket is `{dir}/peregrine.sock`: the supervisor's directory,
    /// which [`Supervisor::start_wrapped_in`](crate::Supervisor::start_wrapped_in) and
    /// [`Supervisor::start_wrapped_at`](crate::Supervisor::start_wrapped_at) fill in.
    pub fn config(&self) -> PeregrineToml {
        let mut config = PeregrineToml::local(self.grpc_port);
        config.supervisor.bind = Some(format!("http://{}:{}", self.address, self.grpc_port));
        config.supervisor.sampler = Some(self.sampler);
        config.envoy = Some(EnvoyTable {
            node: Some(format!("envoy-{}", self.name)),
            listen: Some(self.envoy_listen.to_string()),
            admin: Some(self.envoy_admin.to_string()),
            xds_servers: Some(self.xds_servers.clone()),
            per_try_timeout_ms: Some(millis(self.per_try_timeout)),
            ..EnvoyTable::default()
        });
        let given = |value: &str| (!value.is_empty()).then(|| value.to_owned());
        config.cluster = Some(ClusterTable {
            etcd: Some(self.etcd.clone()),
            host: Some(self.name.to_owned()),
            region: given(self.region),
            zone: given(self.zone),
            lease_ttl_ms: Some(millis(self.lease_ttl)),
            routing: Some(self.routing.to_owned()),
            allow_insecure: self.tls.is_none().then_some(true),
            tls: self
                .tls
                .map(|dir| crate::EtcdTls::in_dir(dir).cluster_tls()),
            ..ClusterTable::default()
        });
        if let Some(dir) = self.tls {
            crate::pki::secure_control_plane(&mut config, dir);
        }
        config.service(
            self.service,
            ServiceTable::at(format!("http://{}:0", self.address)).count(self.workers),
        );
        config
    }

    /// [`FleetHostConfig::config`]'s text.
    pub fn toml(&self) -> String {
        self.config().toml()
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).expect("a duration of tests fits in u64 milliseconds")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_every_part() {
        let config = FleetHostConfig {
            name: "a",
            address: Ipv4Addr::new(10, 77, 3, 11),
            grpc_port: 18000,
            service: "web",
            workers: 2,
            xds_servers: vec!["http://10.77.3.11:18000".into()],
            etcd: vec![
                "http://10.77.3.14:2379".into(),
                "http://10.77.3.14:2380".into(),
            ],
            routing: "local-first",
            lease_ttl: Duration::from_secs(3),
            region: "",
            zone: "z1",
            envoy_listen: "127.0.0.1:10000".parse().unwrap(),
            envoy_admin: "127.0.0.1:9901".parse().unwrap(),
            per_try_timeout: Duration::from_secs(1),
            sampler: Sampler::Off,
            tls: None,
        };
        let text = config.toml();
        assert!(text.contains("allow_insecure = true\n"), "{text}");
        let secure = FleetHostConfig {
            tls: Some(std::path::Path::new("/certs")),
            ..config.clone()
        }
        .toml();
        for line in [
            "[cluster.tls]\nca = \"/certs/etcd-ca.pem\"\n",
            "[supervisor.tls]\ncert = \"/certs/server.pem\"\n",
            "client_ca = \"/certs/ca.pem\"\n",
            "[envoy.tls]\ncert = \"/certs/envoy.pem\"\n",
        ] {
            assert!(secure.contains(line), "{line} in {secure}");
        }
        assert!(!secure.contains("allow_insecure"));
        for line in [
            "bind = \"http://10.77.3.11:18000\"\n",
            "control = \"{dir}/peregrine.sock\"\n",
            "node = \"envoy-a\"\n",
            "xds_servers = [\"http://10.77.3.11:18000\"]\n",
            "per_try_timeout_ms = 1000\n",
            "etcd = [\"http://10.77.3.14:2379\", \"http://10.77.3.14:2380\"]\n",
            "host = \"a\"\nzone = \"z1\"\nlease_ttl_ms = 3000\n",
            "routing = \"local-first\"\n",
            "[service.web]\ncount = 2\nurl = \"http://10.77.3.11:0\"\n",
        ] {
            assert!(text.contains(line), "{line:?} in {text}");
        }
        assert!(!text.contains("region"), "{text}");
    }
}
