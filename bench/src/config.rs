//! `peregrine.toml` shapes that more than one benchmark builds (see [`peregrine_e2e::config`]).

use peregrine_e2e::{
    PeregrineToml,
    config::{ClusterTable, Sampler},
};

/// Makes `config` the config of host `name` of a benchmark's fleet, everything on this machine: no
/// sampler, Envoy's node `envoy-<name>`, and `[cluster]` on `etcd` in cleartext (one machine's
/// loopback: nothing leaves it), in zone `z-<name>`, with every endpoint of the fleet served to
/// every Envoy (`routing = "fleet"`).
pub(crate) fn fleet_host(config: &mut PeregrineToml, name: &str, etcd: Vec<String>) {
    config.supervisor.sampler = Some(Sampler::Off);
    config.envoy_mut().node = Some(format!("envoy-{name}"));
    config.cluster = Some(ClusterTable {
        zone: Some(format!("z-{name}")),
        routing: Some("fleet".into()),
        ..ClusterTable::insecure(etcd, name)
    });
}
