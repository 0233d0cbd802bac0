//! Envoy started with the bootstrap our users copy from the Falcon guide (dedicated CDS and EDS on
//! `xds_cluster` at `[::1]`, no Peregrine-specific settings) against a supervisor bound to `[::]`
//! routes to the service `cluster`.

use std::{collections::BTreeSet, net::SocketAddr, time::Duration};

use peregrine_e2e::{
    Envoy, PeregrineToml, ServiceTable, Supervisor, envoy_or_skip, free_port, hosts, http_get,
    wait_until, worker_pid,
};

const GUIDE_BOOTSTRAP: &str = include_str!("../fixtures/falcon-guide-envoy.yaml");

#[test]
fn the_guide_bootstrap_routes_to_the_service() {
    if envoy_or_skip("the_guide_bootstrap_routes_to_the_service").is_none() {
        return;
    }
    let (grpc, listen) = (free_port(), free_port());
    let mut config = PeregrineToml::local(grpc);
    config.supervisor.bind = Some(format!("http://[::]:{grpc}"));
    // The guide's bootstrap names the cluster `cluster`.
    config.service(
        "cluster",
        ServiceTable::at("http://localhost:0")
            .count(2)
            .command(["peregrine", "worker"]),
    );
    let supervisor = Supervisor::start(&config.toml());
    let bootstrap = format!(
        "admin:\n  address:\n    socket_address: {{ address: 127.0.0.1, port_value: 0 }}\n{}",
        GUIDE_BOOTSTRAP
            .replace("port_value: 18000", &format!("port_value: {grpc}"))
            .replace("port_value: 10000", &format!("port_value: {listen}"))
    );
    let envoy = Envoy::start(&bootstrap);
    wait_until(
        Duration::from_secs(30),
        "2 healthy hosts of cluster",
        || {
            let hosts = hosts(&envoy.clusters(), "cluster");
            (hosts.len() == 2 && hosts.iter().all(|h| h.healthy)).then_some(())
        },
    );
    let listener = SocketAddr::from(([127, 0, 0, 1], listen));
    let mut pids = BTreeSet::new();
    for _ in 0..50 {
        let (status, body) =
            http_get(listener, "/").expect("a request through the guide's listener");
        assert_eq!(status, 200, "{body}");
        pids.insert(worker_pid(&body).expect("a hello body"));
    }
    assert_eq!(
        pids.len(),
        2,
        "both workers answer: {pids:?}\n{}",
        supervisor.logs()
    );
}
