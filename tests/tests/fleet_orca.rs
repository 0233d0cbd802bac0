//! ORCA across hosts: with `routing = "fleet"`, one Envoy balances every host's workers on their
//! load reports, each worker's report coming from its own host's supervisor. Two hosts on distinct
//! loopback addresses (127.0.0.2 and 127.0.0.3) share one gRPC port, as a fleet with ORCA must; a
//! CPU hog on the core of host A's worker steers traffic to host B's.
//!
//! Its own test binary: the shares it measures need the machine's cores free of other tests.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use peregrine_e2e::{
    Envoy, Etcd, PeregrineToml, ServiceTable, Supervisor,
    config::{ClusterTable, Sampler},
    cpus::Hog,
    envoy_or_skip, etcd_or_skip, free_port, hosts, http_get,
    load::answers_for,
    peregrine_path, try_wait_until, wait_until,
};

/// One host of the fleet at `ip`, serving gRPC on `grpc` (the same on every host), with one worker
/// pinned to `cpu`.
fn host(name: &str, ip: &str, grpc: u16, cpu: u32, etcd: &Etcd) -> (Supervisor, SocketAddr) {
    let (listen, admin) = (free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    config.supervisor.bind = Some(format!("http://{ip}:{grpc}"));
    config.supervisor.sampler = Some(Sampler::Procfs);
    config.supervisor.sample_interval_ms = Some(200);
    let orca = config.orca_mut();
    orca.blackout_period_ms = Some(1000);
    orca.weight_update_period_ms = Some(200);
    // One machine's loopback: nothing leaves it.
    config.cluster = Some(ClusterTable {
        lease_ttl_ms: Some(2000),
        routing: Some("fleet".into()),
        ..ClusterTable::insecure([etcd.endpoint()], name)
    });
    config.service(
        "web",
        ServiceTable::at(format!("http://{ip}:0"))
            .count(1)
            .command([
                "taskset".to_owned(),
                "-c".into(),
                cpu.to_string(),
                peregrine_path().display().to_string(),
                "worker".into(),
            ]),
    );
    (
        Supervisor::start(&config.toml()),
        SocketAddr::from(([127, 0, 0, 1], listen)),
    )
}

/// Each host's worker's weight in `envoy`, by host.
fn weights(envoy: &Envoy) -> BTreeMap<String, u64> {
    hosts(&envoy.clusters(), "web")
        .into_iter()
        .map(|h| (h.sub_zone, h.weight))
        .collect()
}

#[test]
fn fleet_routing_steers_traffic_away_from_a_hogged_host_on_orca_weights() {
    let test = "fleet_routing_steers_traffic_away_from_a_hogged_host_on_orca_weights";
    if !etcd_or_skip(test) || envoy_or_skip(test).is_none() {
        return;
    }
    if !peregrine_e2e::cpus::two_free_cores_or_skip() {
        return;
    }
    let etcd = Etcd::start().expect("etcd starts");
    let grpc = free_port();
    let (a, listen) = host("a", "127.0.0.2", grpc, 0, &etcd);
    let (b, _) = host("b", "127.0.0.3", grpc, 1, &etcd);
    let envoy = Envoy::start(&a.envoy_bootstrap().expect("envoy-bootstrap"));
    let pid_of = |s: &Supervisor| {
        try_wait_until(Duration::from_secs(30), "the host's worker", || {
            s.worker_pids().first().copied()
        })
        .unwrap()
    };
    let (a_pid, b_pid) = (pid_of(&a), pid_of(&b));
    wait_until(
        Duration::from_secs(30),
        "both hosts' workers in A's Envoy",
        || {
            let hosts = hosts(&envoy.clusters(), "web");
            (hosts.len() == 2 && hosts.iter().all(|h| h.healthy)).then_some(())
        },
    );
    wait_until(Duration::from_secs(10), "Envoy to answer", || {
        http_get(listen, "/").ok().filter(|(code, _)| *code == 200)
    });

    let _hog = Hog::on(0);
    // Each request burns 4 ms of CPU; 4 clients keep both workers busy. Under load, the reports show
    // the hog and Envoy's blackout passes: both hosts' workers carry ORCA weights (B's from B's
    // supervisor, over the port the fleet shares), A's the lower.
    let mut warm_answers = 0;
    let weights = try_wait_until(Duration::from_secs(20), "A's weight below B's", || {
        let (warm, _) = answers_for(listen, "/?cpu=4", 4, Duration::from_secs(1));
        warm_answers += warm.values().sum::<u64>();
        let now = weights(&envoy);
        (now.len() == 2 && now.values().all(|&w| w > 1) && now["a"] < now["b"]).then_some(now)
    })
    .unwrap_or_else(|e| panic!("{e}: {:?}", weights(&envoy)));
    assert!(warm_answers > 0, "no answer during the warm-up");
    // Round robin would give each host half; CSWRR weighs A's worker, waiting for its core as long
    // as it runs, at about half of B's. Other processes on B's core (a build, another test) lift A's
    // share: a window in which they took a core is measured again, and two quiet windows may still
    // show the weights settling.
    peregrine_e2e::cpus::passes_on_free_cores("the hogged host's share", 6, 2, || {
        let (counts, failed) = answers_for(listen, "/?cpu=4", 4, Duration::from_secs(5));
        let total = counts.values().sum::<u64>().max(1) as f64;
        let share = counts.get(&a_pid).copied().unwrap_or(0) as f64 / total;
        eprintln!(
            "hogged host A's share: {:.1}% (A {a_pid}, B {b_pid}: {counts:?}); weights: {:?} (after the warm-up: {weights:?})",
            share * 100.0,
            self::weights(&envoy)
        );
        assert_eq!(failed, 0, "no request failed");
        if share < 0.42 {
            Ok(())
        } else {
            Err(anyhow::anyhow!(
                "CSWRR gave the hogged host {:.1}% of the requests",
                share * 100.0
            ))
        }
    });
}
