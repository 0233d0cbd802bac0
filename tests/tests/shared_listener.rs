//! A shared listener (`listener = "shared"`, the default for gunicorn's sync worker): the supervisor
//! binds one listener for the service and passes it to every worker, which all accept from its one
//! queue; Envoy sees one endpoint. Behind the real Envoy and under load: a SIGKILLed worker, a rolling
//! restart and a supervisor SIGKILLed and started again lose no request, and the listener and its
//! endpoint stay the same throughout.

use std::{collections::BTreeSet, net::SocketAddr};

use peregrine_e2e::{
    AppServers, Envoy, Host, PeregrineToml, ServiceTable, Supervisor, app_servers_or_skip,
    current_test,
    deploy::{Deployed, STEP},
    envoy_or_skip, free_port, gone, gunicorn_command, wait_until,
};

/// The service (and Envoy cluster) the test runs.
const SERVICE: &str = "app";
/// Its workers.
const WORKERS: usize = 3;

/// The servers, or `None` when the test skips (no Envoy, or a server missing).
fn servers() -> Option<AppServers> {
    let test = current_test();
    envoy_or_skip(&test)?;
    app_servers_or_skip(&test)
}

/// The workers the supervisor lists, once all of `WORKERS` are registered and none of `not` is.
fn registered(supervisor: &Supervisor, not: &BTreeSet<u32>) -> BTreeSet<u32> {
    wait_until(
        STEP,
        &format!("{WORKERS} workers registered, none of {not:?}"),
        || {
            let rows = supervisor.status_rows(SERVICE).ok()?;
            let pids: BTreeSet<u32> = rows
                .values()
                .filter(|row| row["state"] == "ready")
                .filter_map(|row| row["pid"].as_u64().map(|p| p as u32))
                .collect();
            (pids.len() == WORKERS && pids.is_disjoint(not)).then_some(pids)
        },
    )
}

/// The service's endpoint in Envoy, once it lists exactly one, healthy and weighted by all the
/// workers.
fn one_endpoint(envoy: &Envoy) -> Host {
    wait_until(
        STEP,
        &format!("one healthy endpoint of weight {WORKERS} in Envoy"),
        || {
            let text = envoy.admin_get("/clusters").ok()?;
            let hosts = peregrine_e2e::hosts(&text, SERVICE);
            match hosts.as_slice() {
                [host] if host.healthy && host.weight == WORKERS as u64 => Some(host.clone()),
                _ => None,
            }
        },
    )
}

#[test]
fn workers_on_one_shared_listener_lose_no_request_to_kills_restarts_and_adoption() {
    let Some(servers) = servers() else {
        return;
    };
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    config.supervisor.register_timeout_ms = Some(20000);
    // gunicorn's sync worker (no worker class): one request at a time, so a shared listener by
    // default, with nothing about it in the config.
    config.service(
        SERVICE,
        ServiceTable::app_server(gunicorn_command(&servers.gunicorn)).count(WORKERS as u32),
    );
    let mut supervisor = Supervisor::start(&config.toml());
    let checked = supervisor.check().expect("peregrine check");
    assert!(
        checked.contains("shared listener") && checked.contains("gunicorn's sync worker"),
        "{checked}"
    );
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("envoy-bootstrap"));
    let listen = SocketAddr::from(([127, 0, 0, 1], listen));
    let deployed = Deployed {
        envoy: &envoy,
        supervisor: &supervisor,
        cluster: SERVICE,
        listen,
    };
    let first = registered(&supervisor, &BTreeSet::new());
    let endpoint = one_endpoint(&envoy);
    assert_eq!(
        endpoint.hostname,
        format!("{SERVICE}-shared"),
        "{endpoint:?}"
    );
    // Every worker listens on it, and the status says how the service is balanced.
    let status = supervisor.status_json().expect("status");
    assert_eq!(
        status["services"][SERVICE],
        "concurrency 1 (gunicorn's sync worker), one shared listener, least_request between hosts",
        "{status}"
    );
    let addresses: BTreeSet<String> = status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["addresses"][0].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        addresses,
        BTreeSet::from([endpoint.address.clone()]),
        "{status}"
    );
    let load = deployed.load();

    // SIGKILL one: its successor joins the same listener; the others serve meanwhile. Only an
    // answer the victim had begun to write may be lost with it.
    let victim = *first.iter().next().unwrap();
    let killed_at = load.elapsed();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(victim as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let second = registered(&supervisor, &BTreeSet::from([victim]));
    let killed = killed_at..load.elapsed();

    // A rolling restart: every worker replaced, the endpoint never gone.
    let out = supervisor.control("restart", &[]).unwrap();
    assert!(
        out.starts_with("3 replaced, 0 added, 0 removed, 0 failed"),
        "{out}"
    );
    let third = registered(&supervisor, &second);
    for pid in &second {
        wait_until(STEP, "the old workers to exit", || gone(*pid).then_some(()));
    }
    assert_eq!(one_endpoint(&envoy).address, endpoint.address);

    // The supervisor SIGKILLed and started again: it adopts the workers and takes their listener
    // back, so the workers it starts after (a rolling restart) share it still.
    supervisor.kill_and_start_again().unwrap();
    let adopted = registered(&supervisor, &BTreeSet::new());
    assert_eq!(adopted, third, "the same workers are adopted");
    let logs = supervisor.all_logs();
    assert!(logs.contains("Took the shared listener back"), "{logs}");
    let out = supervisor.control("restart", &[]).unwrap();
    assert!(
        out.starts_with("3 replaced, 0 added, 0 removed, 0 failed"),
        "{out}"
    );
    let fourth = registered(&supervisor, &third);
    assert_eq!(one_endpoint(&envoy).address, endpoint.address);

    let deployed = Deployed {
        envoy: &envoy,
        supervisor: &supervisor,
        cluster: SERVICE,
        listen,
    };
    let all: BTreeSet<u32> = first
        .iter()
        .chain(&second)
        .chain(&third)
        .chain(&fourth)
        .copied()
        .collect();
    let report = deployed.finish_through_kill(load, 50, &all, killed);
    assert!(
        fourth.iter().any(|pid| report.by_pid.contains_key(pid)),
        "the last workers served: {fourth:?} in {:?}",
        report.by_pid
    );
    let status = supervisor.stop().expect("the supervisor stops");
    assert!(status.success(), "{status}\n{}", supervisor.all_logs());
}
