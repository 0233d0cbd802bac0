//! A fleet of two hosts (two supervisors on this machine, each with its own control socket and gRPC
//! port) sharing membership through a real etcd: each serves the other's workers to its Envoy, a host
//! whose supervisor dies leaves every Envoy within its lease, and etcd going away changes nothing;
//! local-first routing keeps each Envoy's traffic on its own host until that host's workers drain.

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    time::{Duration, Instant},
};

use peregrine_e2e::{
    Envoy, Etcd, Host, PeregrineToml, ServiceTable, Supervisor,
    config::{ClusterTable, Sampler},
    envoy_or_skip, etcd_or_skip, free_port, hosts, http_get, try_wait_until, wait_until,
    worker_pid,
};

/// The service every host runs.
const SERVICE: &str = "web";
/// The lease's TTL; etcd counts whole seconds.
const TTL: Duration = Duration::from_secs(2);

/// One host: its supervisor, and the address of the Envoy it bootstraps.
struct FleetHost {
    supervisor: Supervisor,
    listen: SocketAddr,
}

fn host(name: &str, etcd: &Etcd, workers: u32) -> FleetHost {
    let grpc = free_port();
    // A server that is not there first: Envoy must find the one that is (any supervisor can serve
    // it).
    host_at(
        name,
        etcd,
        workers,
        "fleet",
        grpc,
        &[free_port(), grpc],
        |_| {},
    )
}

/// A host whose supervisor serves gRPC on `grpc`, whose Envoys dial the supervisors at `xds` in
/// order and are sent the fleet as `routing` says; its config is then changed by `configure`
/// (more keys of `[service.web]`, or more services).
fn host_at(
    name: &str,
    etcd: &Etcd,
    workers: u32,
    routing: &str,
    grpc: u16,
    xds: &[u16],
    configure: impl FnOnce(&mut PeregrineToml),
) -> FleetHost {
    let (listen, admin) = (free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    config.supervisor.sampler = Some(Sampler::Off);
    config.envoy_mut().xds_servers = Some(
        xds.iter()
            .map(|port| format!("http://127.0.0.1:{port}"))
            .collect(),
    );
    // One machine's loopback: nothing leaves it.
    config.cluster = Some(ClusterTable {
        zone: Some(format!("z-{name}")),
        lease_ttl_ms: Some(TTL.as_millis() as u64),
        routing: Some(routing.to_owned()),
        ..ClusterTable::insecure([etcd.endpoint()], name)
    });
    config.service(
        SERVICE,
        ServiceTable::at("http://127.0.0.1:0").count(workers),
    );
    configure(&mut config);
    FleetHost {
        supervisor: Supervisor::start(&config.toml()),
        listen: SocketAddr::from(([127, 0, 0, 1], listen)),
    }
}

fn hostnames(hosts: &[Host]) -> BTreeSet<String> {
    hosts.iter().map(|h| h.hostname.clone()).collect()
}

/// Waits until `envoy` holds exactly `n` healthy hosts of the service.
#[track_caller]
fn wait_for_hosts(envoy: &Envoy, n: usize, within: Duration) -> Vec<Host> {
    try_wait_until(within, &format!("{n} healthy hosts in Envoy"), || {
        let hosts = hosts(&envoy.clusters(), SERVICE);
        (hosts.len() == n && hosts.iter().all(|h| h.healthy)).then_some(hosts)
    })
    .unwrap_or_else(|error| panic!("{error}\n{}", envoy.clusters()))
}

/// The worker pids that answer `n` requests through Envoy at `listen`; panics on a failed request.
fn answering(listen: SocketAddr, n: usize) -> BTreeSet<u32> {
    (0..n)
        .map(|i| {
            let (status, body) =
                http_get(listen, "/").unwrap_or_else(|e| panic!("request {i} failed: {e:#}"));
            if status != 200 {
                eprintln!("FAILED AT {:?}", std::time::SystemTime::now());
            }
            assert_eq!(status, 200, "request {i}: {body}");
            worker_pid(&body).unwrap_or_else(|| panic!("not a hello body: {body:?}"))
        })
        .collect()
}

#[test]
fn every_host_serves_the_fleet_and_a_dead_host_leaves_within_its_lease() {
    let test = "every_host_serves_the_fleet_and_a_dead_host_leaves_within_its_lease";
    if !etcd_or_skip(test) || envoy_or_skip(test).is_none() {
        return;
    }
    let etcd = Etcd::start().expect("etcd starts");
    let a = host("a", &etcd, 2);
    let mut b = host("b", &etcd, 2);
    let envoy = Envoy::start(&a.supervisor.envoy_bootstrap().expect("envoy-bootstrap"));

    // A's Envoy holds both hosts' workers, and traffic reaches all four.
    let held = wait_for_hosts(&envoy, 4, Duration::from_secs(30));
    let a_pids: BTreeSet<u32> = a.supervisor.worker_pids().into_iter().collect();
    let b_pids: BTreeSet<u32> = b.supervisor.worker_pids().into_iter().collect();
    assert_eq!((a_pids.len(), b_pids.len()), (2, 2));
    let answered = answering(a.listen, 200);
    assert_eq!(
        answered,
        a_pids.union(&b_pids).copied().collect(),
        "every host's workers answer through A's Envoy; held: {held:?}"
    );
    // `peregrine status` on A lists every host's workers, with their host, and the etcd session.
    let status = a.supervisor.status_json().expect("status");
    let rows = status["workers"].as_array().expect("workers");
    let by_host = |host: &str| rows.iter().filter(|w| w["host"] == host).count();
    assert_eq!((by_host("a"), by_host("b")), (2, 2), "{status:#}");
    assert_eq!(status["fleet"]["etcd"], "connected", "{status:#}");
    assert_eq!(status["fleet"]["hosts"], serde_json::json!(["b"]));
    assert!(
        a.supervisor
            .status_table()
            .expect("status")
            .contains("HOST"),
        "a HOST column"
    );
    // B's own Envoy sees A's workers too.
    let b_envoy = Envoy::start(&b.supervisor.envoy_bootstrap().expect("envoy-bootstrap"));
    wait_for_hosts(&b_envoy, 4, Duration::from_secs(30));
    assert_eq!(
        answering(b.listen, 200),
        a_pids.union(&b_pids).copied().collect(),
        "and through B's Envoy"
    );
    drop(b_envoy);

    // B dies whole: its supervisor and its workers. A's Envoy drops B's workers once B's lease
    // expires: within the TTL and a margin.
    let killed = Instant::now();
    b.supervisor.kill_with_workers();
    let left = wait_for_hosts(&envoy, 2, TTL + Duration::from_secs(3));
    let gone_after = killed.elapsed();
    assert!(
        gone_after <= TTL + Duration::from_millis(2500),
        "B's workers left after {gone_after:?}"
    );
    let remaining: BTreeSet<u32> = left
        .iter()
        .filter_map(|h| h.hostname.rsplit('-').next()?.parse().ok())
        .collect();
    assert_eq!(remaining, a_pids, "only A's workers remain: {left:?}");
    assert_eq!(answering(a.listen, 50), a_pids);
    eprintln!("B left A's Envoy {gone_after:?} after it was killed (lease TTL {TTL:?})");
}

#[test]
fn etcd_going_away_keeps_every_host_in_the_view() {
    let test = "etcd_going_away_keeps_every_host_in_the_view";
    if !etcd_or_skip(test) || envoy_or_skip(test).is_none() {
        return;
    }
    let mut etcd = Etcd::start().expect("etcd starts");
    let a = host("a", &etcd, 1);
    let b = host("b", &etcd, 1);
    let envoy = Envoy::start(&a.supervisor.envoy_bootstrap().expect("envoy-bootstrap"));
    let held = hostnames(&wait_for_hosts(&envoy, 2, Duration::from_secs(30)));
    let every: BTreeSet<u32> = a
        .supervisor
        .worker_pids()
        .into_iter()
        .chain(b.supervisor.worker_pids())
        .collect();

    etcd.kill();
    wait_until(
        Duration::from_secs(10),
        "A to notice that etcd is away",
        || {
            a.supervisor
                .logs()
                .contains("etcd unavailable")
                .then_some(())
        },
    );
    // Watched for longer than a lease: had the view followed etcd's absence, B would be gone by
    // then. (This checks that something does not happen, so it looks for a fixed window.)
    let until = Instant::now() + TTL * 2;
    let mut answered = BTreeSet::new();
    while Instant::now() < until {
        let now = hostnames(&hosts(&envoy.clusters(), SERVICE));
        assert_eq!(now, held, "the view stays whole while etcd is away");
        answered.extend(answering(a.listen, 10));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(answered, every, "both hosts' workers keep answering");
    drop(b);
}

#[test]
fn a_supervisor_restart_keeps_its_workers_in_every_envoy() {
    let test = "a_supervisor_restart_keeps_its_workers_in_every_envoy";
    if !etcd_or_skip(test) || envoy_or_skip(test).is_none() {
        return;
    }
    let etcd = Etcd::start().expect("etcd starts");
    let a = host("a", &etcd, 1);
    let mut b = host("b", &etcd, 2);
    let envoy = Envoy::start(&a.supervisor.envoy_bootstrap().expect("envoy-bootstrap"));
    let held = hostnames(&wait_for_hosts(&envoy, 3, Duration::from_secs(30)));

    // B's supervisor dies and a new one adopts its workers: they re-register with it, and it puts
    // their keys back under its own lease before the old one expires.
    b.supervisor.kill_and_start_again().expect("B starts again");
    let restarted = Instant::now();
    let mut answered = BTreeSet::new();
    // Watched past the old lease's expiry: that is when B's workers would leave if their keys were
    // not put back. (This checks that something does not happen, so it looks for a fixed window.)
    while restarted.elapsed() < TTL * 2 + Duration::from_millis(500) {
        let now = hosts(&envoy.clusters(), SERVICE);
        assert_eq!(
            hostnames(&now),
            held,
            "B's workers stay in A's Envoy across B's restart ({:?} in)",
            restarted.elapsed()
        );
        assert!(now.iter().all(|h| h.healthy), "{now:?}");
        answered.extend(answering(a.listen, 10));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        answered.len(),
        3,
        "every worker kept answering: {answered:?}"
    );
    assert!(
        b.supervisor.logs().contains("Joined the fleet"),
        "{}",
        b.supervisor.logs()
    );
}

#[test]
fn local_first_keeps_traffic_on_its_host_and_spills_over_when_it_drains() {
    let test = "local_first_keeps_traffic_on_its_host_and_spills_over_when_it_drains";
    if !etcd_or_skip(test) || envoy_or_skip(test).is_none() {
        return;
    }
    let etcd = Etcd::start().expect("etcd starts");
    // Each host's Envoy dials its own supervisor first, and the other's when its own is away.
    let (a_grpc, b_grpc) = (free_port(), free_port());
    let mut a = host_at(
        "a",
        &etcd,
        2,
        "local-first",
        a_grpc,
        &[a_grpc, b_grpc],
        |_| {},
    );
    let b = host_at(
        "b",
        &etcd,
        2,
        "local-first",
        b_grpc,
        &[b_grpc, a_grpc],
        |_| {},
    );
    let a_envoy = Envoy::start(&a.supervisor.envoy_bootstrap().expect("envoy-bootstrap"));
    let b_envoy = Envoy::start(&b.supervisor.envoy_bootstrap().expect("envoy-bootstrap"));
    let a_pids: BTreeSet<u32> = a.supervisor.worker_pids().into_iter().collect();
    let b_pids: BTreeSet<u32> = b.supervisor.worker_pids().into_iter().collect();

    // Each Envoy holds both hosts' workers, its own host's at priority 0 and the other's at 1: each
    // supervisor serves its Envoy the variant of its Envoy's locality.
    for (envoy, own) in [(&a_envoy, "a"), (&b_envoy, "b")] {
        let held = wait_for_hosts(envoy, 4, Duration::from_secs(30));
        for h in &held {
            let expected = u32::from(h.sub_zone != own);
            assert_eq!(h.priority, expected, "{own}'s Envoy: {held:?}");
        }
    }
    // And all of its traffic goes to its own host.
    let a_listen = a.listen;
    assert_eq!(answering(a_listen, 100), a_pids, "A's Envoy stays on A");
    assert_eq!(answering(b.listen, 100), b_pids, "B's Envoy stays on B");

    // A's supervisor stops: it drains its workers first, so A's Envoy spills over to B with no
    // failed request, and then takes B's view from B's supervisor.
    let stopping = std::thread::spawn(move || {
        let status = a.supervisor.stop().expect("A stops");
        (a, status)
    });
    let mut answered = BTreeSet::new();
    wait_until(
        Duration::from_secs(30),
        "A's Envoy to answer from B only",
        || {
            let now = answering(a_listen, 20);
            answered.extend(&now);
            (now == b_pids).then_some(())
        },
    );
    let (a, status) = stopping.join().expect("the stop thread");
    assert!(status.success(), "A stopped cleanly: {status:?}");
    // Whichever supervisor A's Envoy was on, A waited for B's word that its Envoys had A's workers
    // as draining before it stopped them.
    let logs = a.supervisor.logs();
    assert_eq!(
        logs.matches("Every host of the fleet has the worker as draining")
            .count(),
        2,
        "{logs}"
    );
    assert!(
        answered.is_subset(&a_pids.union(&b_pids).copied().collect()),
        "{answered:?}"
    );
    // A's workers leave A's Envoy: B's supervisor serves it now, without them.
    let left = wait_for_hosts(&a_envoy, 2, Duration::from_secs(30));
    assert!(
        left.iter().all(|h| h.sub_zone == "b" && h.priority == 0),
        "{left:?}"
    );
    // Through all of it not one request failed (`answering` panics on any).
    drop(b_envoy);
}

#[test]
fn a_service_only_another_host_runs_is_served_with_the_spec_the_fleet_agrees_on() {
    let test = "a_service_only_another_host_runs_is_served_with_the_spec_the_fleet_agrees_on";
    if !etcd_or_skip(test) || envoy_or_skip(test).is_none() {
        return;
    }
    let etcd = Etcd::start().expect("etcd starts");
    let (a_grpc, b_grpc, c_grpc) = (free_port(), free_port(), free_port());
    let a = host_at("a", &etcd, 1, "fleet", a_grpc, &[a_grpc], |_| {});
    // B runs a second service, and balances web otherwise than A and C.
    let b = host_at("b", &etcd, 1, "fleet", b_grpc, &[b_grpc], |config| {
        config.service_mut(SERVICE).lb_policy = Some("least_request".into());
        config.service(
            "api",
            ServiceTable {
                lb_policy: Some("random".into()),
                ..ServiceTable::at("http://127.0.0.1:0").count(2)
            },
        );
    });
    let _c = host_at("c", &etcd, 1, "fleet", c_grpc, &[c_grpc], |_| {});
    let envoy = Envoy::start(&a.supervisor.envoy_bootstrap().expect("envoy-bootstrap"));

    // A's Envoy gets a cluster for api, with B's two workers, although A does not run it.
    let api = try_wait_until(
        Duration::from_secs(30),
        "api's workers in A's Envoy",
        || {
            let hosts = hosts(&envoy.clusters(), "api");
            (hosts.len() == 2 && hosts.iter().all(|h| h.healthy)).then_some(hosts)
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", envoy.clusters()));
    assert!(api.iter().all(|h| h.sub_zone == "b"), "{api:?}");
    let b_api: BTreeSet<u32> = b.supervisor.worker_pids().into_iter().collect();
    let in_envoy: BTreeSet<u32> = api
        .iter()
        .filter_map(|h| h.hostname.rsplit('-').next()?.parse().ok())
        .collect();
    assert!(in_envoy.is_subset(&b_api), "{in_envoy:?} of {b_api:?}");
    // web: A and C agree on round robin against B's least request; every host says so.
    for host in [&a, &b] {
        let conflicts = try_wait_until(Duration::from_secs(10), "the conflict in status", || {
            let status = host.supervisor.status_json().ok()?;
            let conflicts = status["fleet"]["conflicts"].as_array()?.clone();
            (!conflicts.is_empty()).then_some(conflicts)
        })
        .expect("status names the conflict");
        assert_eq!(
            conflicts,
            [serde_json::json!(
                "service web: b configured otherwise; every host serves a's spec"
            )]
        );
    }
    let dump: serde_json::Value = serde_json::from_str(
        &envoy
            .admin_get("/config_dump?resource=dynamic_active_clusters")
            .expect("config dump"),
    )
    .expect("JSON");
    let cluster = |name: &str| {
        dump["configs"]
            .as_array()
            .expect("configs")
            .iter()
            .map(|c| &c["cluster"])
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} in {dump:#}"))
    };
    // Round robin is the cluster's plain lb_policy; least request would be a typed policy.
    let web = cluster("web");
    assert!(web.get("load_balancing_policy").is_none(), "{web:#}");
    let api = cluster("api");
    assert_eq!(api["lb_policy"], "RANDOM", "api as B has it: {api:#}");
}

#[test]
fn a_host_on_another_grpc_port_is_refused_at_start_when_orca_needs_one_port() {
    let test = "a_host_on_another_grpc_port_is_refused_at_start_when_orca_needs_one_port";
    if !etcd_or_skip(test) {
        return;
    }
    let etcd = Etcd::start().expect("etcd starts");
    // Sampling on: TCP services are balanced on ORCA by default.
    let config = |name: &str, grpc: u16| {
        let mut config = PeregrineToml::local(grpc);
        config.supervisor.sampler = Some(Sampler::Procfs);
        // One machine's loopback: nothing leaves it.
        config.cluster = Some(ClusterTable::insecure([etcd.endpoint()], name));
        config.service(SERVICE, ServiceTable::at("http://127.0.0.1:0").count(1));
        config
    };
    let a_grpc = free_port();
    let a = Supervisor::start(&config("a", a_grpc).toml());
    wait_until(Duration::from_secs(10), "A in the fleet", || {
        let status = a.status_json().ok()?;
        (status["fleet"]["etcd"] == "connected").then_some(())
    });
    let b_grpc = free_port();
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("peregrine.toml");
    std::fs::write(&path, config("b", b_grpc).toml_in(dir.path())).expect("config written");
    let output = std::process::Command::new(peregrine_e2e::peregrine_path())
        .arg("run")
        .arg(&path)
        .env("PEREGRINE_METRICS", "")
        .output()
        .expect("peregrine run");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "B must not start: {stderr}");
    assert!(
        stderr.contains(&format!(
            "this host serves gRPC on port {b_grpc}, but 1 of the fleet at /peregrine serves it on another port (a: {a_grpc})"
        )),
        "{stderr}"
    );
    assert!(
        !stderr.contains("Worker registered"),
        "no worker started: {stderr}"
    );
}

/// `[cluster]` is held by the fleet session from its start: a reload that changes one of its keys
/// (here `allowed_networks`, the filter on other hosts' records) is refused, naming the key, and
/// changes nothing. It used to report success and apply nothing until the next start.
#[test]
fn a_reload_that_changes_what_the_fleet_session_holds_is_refused_naming_the_key() {
    if !etcd_or_skip("a_reload_that_changes_what_the_fleet_session_holds_is_refused_naming_the_key")
    {
        return;
    }
    let etcd = Etcd::start().expect("etcd starts");
    let mut config = PeregrineToml::local(free_port());
    config.supervisor.sampler = Some(Sampler::Off);
    config.cluster = Some(ClusterTable::insecure([etcd.endpoint()], "a"));
    config.service(SERVICE, ServiceTable::at("http://127.0.0.1:0").count(1));
    let supervisor = Supervisor::start(&config.toml());
    wait_until(Duration::from_secs(30), "the host joined the fleet", || {
        supervisor.logs().contains("Joined the fleet").then_some(())
    });
    config.cluster_mut().allowed_networks = Some(vec!["10.0.0.0/8".into()]);
    supervisor.rewrite_config(&config.toml()).unwrap();
    let error = supervisor
        .control("reload", &[])
        .expect_err("the reload is refused");
    let error = format!("{error:#}");
    assert!(
        error.contains("cluster.allowed_networks") && error.contains("nothing changed"),
        "{error}"
    );
    // Anything else still reloads once the table is as it runs.
    config.cluster_mut().allowed_networks = None;
    config.service_mut(SERVICE).count = Some(2);
    supervisor.rewrite_config(&config.toml()).unwrap();
    supervisor
        .control("reload", &[])
        .expect("the reload applies");
}
