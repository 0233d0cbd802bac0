//! Shared listeners between hosts, weighed on ORCA: with `listener = "shared"` and `orca = true`,
//! each host's gunicorn sync workers are one endpoint to Envoy, and that endpoint's load report (its
//! workers' summed rate, and the requests on the listener per worker) comes from its own host's
//! supervisor. Two hosts on distinct loopback addresses (127.0.0.2 and 127.0.0.3) share one gRPC
//! port, as a fleet with ORCA must; host A's requests wait four times as long (a slower backend), so
//! its listener holds more requests for the same rate and Envoy weighs it less, whichever Envoy
//! sent them.
//!
//! Its own test binary: it runs two supervisors, four gunicorns and an Envoy under load.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use peregrine_e2e::{
    AppServers, Envoy, Etcd, PeregrineToml, ServiceTable, Supervisor, app_servers_or_skip,
    config::{ClusterTable, Orca, Sampler},
    current_test, ebpf_or_skip, envoy_or_skip, etcd_or_skip, free_port, gunicorn_command, hosts,
    requesting_while, wait_until,
};

/// The service (and Envoy cluster).
const SERVICE: &str = "web";
/// Each host's workers, on its one shared listener.
const WORKERS: u32 = 2;
/// What each request waits, on host B; host A's wait [`SLOWER`] times as long.
const PATH: &str = "/slow?ms=20";
const SLOWER: &str = "4";
/// Clients that send one request after another through Envoy.
const CLIENTS: usize = 4;
/// How long a step may take.
const STEP: Duration = Duration::from_secs(60);

/// One host of the fleet at `ip`, serving gRPC on `grpc` (the same on every host): gunicorn's sync
/// workers on one shared listener, weighed on ORCA, their waits `factor` times [`PATH`]'s.
fn host(name: &str, ip: &str, grpc: u16, etcd: &Etcd, servers: &AppServers, factor: &str) -> Host {
    let (listen, admin) = (free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    config.supervisor.bind = Some(format!("http://{ip}:{grpc}"));
    config.supervisor.sampler = Some(Sampler::Ebpf);
    config.supervisor.register_timeout_ms = Some(20000);
    let orca = config.orca_mut();
    orca.blackout_period_ms = Some(1000);
    orca.weight_update_period_ms = Some(200);
    // One machine's loopback: nothing leaves it.
    config.cluster = Some(ClusterTable {
        lease_ttl_ms: Some(3000),
        routing: Some("fleet".into()),
        ..ClusterTable::insecure([etcd.endpoint()], name)
    });
    config.service(
        SERVICE,
        ServiceTable {
            pass_socket: Some(true),
            ready_path: Some("/healthz".into()),
            url: Some(format!("http://{ip}:0")),
            listener: Some("shared".into()),
            orca: Some(Orca::On),
            env: Some(BTreeMap::from([(
                "APP_WAIT_FACTOR".to_owned(),
                factor.to_owned(),
            )])),
            ..ServiceTable::default()
                .count(WORKERS)
                .command(gunicorn_command(&servers.gunicorn))
        },
    );
    Host {
        supervisor: Supervisor::start(&config.toml()),
        listen: SocketAddr::from(([127, 0, 0, 1], listen)),
    }
}

struct Host {
    supervisor: Supervisor,
    /// Its Envoy's listener, once an Envoy is started from its bootstrap.
    listen: SocketAddr,
}

/// Each host's endpoint's weight in `envoy`, by host (its locality's sub-zone).
fn weights(envoy: &Envoy) -> BTreeMap<String, u64> {
    hosts(&envoy.clusters(), SERVICE)
        .into_iter()
        .map(|h| (h.sub_zone, h.weight))
        .collect()
}

#[test]
fn envoy_weighs_each_hosts_shared_listener_on_its_own_supervisors_report() {
    let test = current_test();
    if !etcd_or_skip(&test) || envoy_or_skip(&test).is_none() || !ebpf_or_skip(&test) {
        return;
    }
    let Some(servers) = app_servers_or_skip(&test) else {
        return;
    };
    let etcd = Etcd::start().expect("etcd starts");
    let grpc = free_port();
    let a = host("a", "127.0.0.2", grpc, &etcd, &servers, SLOWER);
    let b = host("b", "127.0.0.3", grpc, &etcd, &servers, "1");
    let checked = a.supervisor.check().expect("peregrine check");
    assert!(
        checked.contains("one shared listener, orca between hosts"),
        "{checked}"
    );
    let envoy = Envoy::start(&a.supervisor.envoy_bootstrap().expect("envoy-bootstrap"));
    wait_until(STEP, "each host's one endpoint in A's Envoy", || {
        let hosts = hosts(&envoy.clusters(), SERVICE);
        let named: Vec<&str> = hosts.iter().map(|h| h.hostname.as_str()).collect();
        (hosts.len() == 2
            && hosts.iter().all(|h| h.healthy)
            && named.contains(&"a-web-shared")
            && named.contains(&"b-web-shared"))
        .then_some(())
    });

    // Once the means settle (2 s) and Envoy's blackout passes, both endpoints carry weights from
    // their reports, and A's, whose requests take four times as long, is well below B's.
    let weights = requesting_while(a.listen, PATH, CLIENTS, || {
        wait_until(STEP, "A's shared listener weighed below B's", || {
            let now = weights(&envoy);
            (now.len() == 2 && now.values().all(|&w| w > 1) && now["a"] * 2 <= now["b"])
                .then_some(now)
        })
    });
    eprintln!("Envoy's weights of the hosts' shared listeners: {weights:?}");
    // Each report came from the endpoint's own host: B's supervisor serves B's listener's stream,
    // which A's Envoy opened across the port the fleet shares.
    for (host, name) in [(&a, "a"), (&b, "b")] {
        let logs = host.supervisor.logs();
        assert!(
            logs.contains(&format!("ORCA stream opened hostname={name}-web-shared")),
            "{logs}"
        );
    }
}
