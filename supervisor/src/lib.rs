//! The Peregrine supervisor.
//!
//! It reads `peregrine.toml` ([`config`]), starts and restarts worker processes ([`manager`]), accepts
//! their registrations over a Unix socket ([`registration`]), keeps the one source of truth about them
//! ([`registry`]) and serves it to Envoy over gRPC as CDS/EDS/ADS ([`xds`]). [`sampler`] measures each
//! worker's CPU, run-queue wait and requests into the registry, and [`status`] shows it all to
//! `peregrine status` over the same Unix socket. [`bootstrap`] writes an Envoy bootstrap that points at
//! it.

pub mod adopt;
pub mod balancer;
pub mod bootstrap;
pub mod children;
pub mod config;
pub mod descriptors;
pub mod fleet;
pub mod grpc_port;
pub mod instance;
pub mod manager;
pub mod metrics;
pub mod orca;
pub mod printable;
pub mod registration;
pub mod registry;
pub mod run;
pub mod sampler;
pub mod service_manager;
pub mod status;
pub mod throttle;
pub mod timings;
pub mod tls;
pub mod trim;
pub mod upgrade;
pub mod xds;

/// The Envoy bootstrap for a configuration: what `peregrine envoy-bootstrap` prints.
pub fn envoy_bootstrap_for(config: &config::Config) -> String {
    bootstrap::envoy_bootstrap(&bootstrap::BootstrapInput {
        node_id: config.envoy.node.clone(),
        node_cluster: config.envoy.node.clone(),
        xds_address: config.supervisor.bind,
        xds_servers: config.envoy.xds_servers.clone(),
        xds_cluster_name: config.supervisor.xds_cluster.clone(),
        listener_address: config.envoy.listen,
        admin_address: config.envoy.admin,
        ads: config.envoy.ads,
        xds: config.envoy.xds,
        timeout: config.envoy.timeout,
        per_try_timeout: config.envoy.per_try_timeout,
        locality: config
            .cluster
            .as_ref()
            .map(|cluster| bootstrap::NodeLocality {
                region: cluster.locality.region.clone(),
                zone: cluster.locality.zone.clone(),
                sub_zone: cluster.host.clone(),
            }),
        tls: config
            .envoy
            .tls
            .as_ref()
            .map(|tls| bootstrap::BootstrapTls {
                identity: tls.identity.clone(),
                ca: tls.ca.clone(),
                server_name: tls.server_name.clone(),
            }),
        services: config
            .services
            .values()
            .map(|s| bootstrap::BootstrapService {
                name: s.name.clone(),
                prefix: s.prefix.clone(),
                domains: s.domains.clone(),
                hash_on: s.balancing.hash_on().cloned(),
            })
            .collect(),
    })
}
