//! Unchanged third-party servers as workers (`pass_socket`): gunicorn with a WSGI app, uvicorn with an
//! ASGI app and a Node `http` server, each on a listener the supervisor binds and passes as descriptor
//! 3, registered on its behalf once `GET /healthz` answers, behind the real Envoy and under load.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use peregrine_e2e::{
    AppServers, Envoy, PeregrineToml, ServiceTable, Supervisor, app_servers_or_skip,
    config::Sampler,
    current_test,
    deploy::{Deployed, STEP},
    envoy_or_skip, free_port, gone, gunicorn_command, http_get, requesting_while, test_app,
    wait_until, worker_pid,
};

/// The service (and Envoy cluster) the tests run.
const SERVICE: &str = "app";

/// The servers under test.
#[derive(Clone, Copy, Debug)]
enum Server {
    /// gunicorn as apps.md documents it: it takes the listener from `LISTEN_FDS`.
    Gunicorn,
    /// gunicorn told of the listener by its command, `--bind fd://{fd}`, as it is usually run.
    GunicornBindFd,
    Uvicorn,
    Node,
}

impl Server {
    /// The service's `command`.
    fn command(self, servers: &AppServers) -> Vec<String> {
        match self {
            Server::Gunicorn => gunicorn_command(&servers.gunicorn),
            Server::GunicornBindFd => {
                let mut words = gunicorn_command(&servers.gunicorn);
                words.extend(["--bind".into(), "fd://{fd}".into()]);
                words
            }
            Server::Uvicorn => vec![
                servers.uvicorn.display().to_string(),
                "--fd".into(),
                "{fd}".into(),
                "--app-dir".into(),
                test_app("").display().to_string(),
                "asgi_app:app".into(),
            ],
            Server::Node => vec![
                servers.node.display().to_string(),
                test_app("node_app.js").display().to_string(),
            ],
        }
    }

    /// Whether the server closes, on its stop signal, a connection that has not begun a request
    /// (gunicorn's sync worker waits for the request, up to its `--timeout`).
    fn closes_unused_connections(self) -> bool {
        matches!(self, Server::Uvicorn | Server::Node)
    }
}

/// A supervisor running `count` workers of `server` and an Envoy bootstrapped from it.
struct Apps {
    // Envoy first: it is killed before the supervisor when dropped.
    envoy: Envoy,
    supervisor: Supervisor,
    listen: SocketAddr,
    /// The supervisor's config.
    config: PeregrineToml,
}

impl Apps {
    fn start(server: Server, servers: &AppServers, count: u32) -> Apps {
        Apps::start_with(server, servers, count, |_| {})
    }

    /// As [`Apps::start`], with `change` made to the config first.
    fn start_with(
        server: Server,
        servers: &AppServers,
        count: u32,
        change: impl FnOnce(&mut PeregrineToml),
    ) -> Apps {
        let (grpc, listen, admin) = (free_port(), free_port(), free_port());
        let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
        config.supervisor.register_timeout_ms = Some(20000);
        config.service(
            SERVICE,
            // Each worker on a listener of its own, which these tests follow worker by worker
            // (gunicorn's sync worker would share one by default: see shared_listener.rs).
            ServiceTable {
                pass_socket: Some(true),
                ready_path: Some("/healthz".into()),
                ..ServiceTable::default()
                    .count(count)
                    .command(server.command(servers))
                    .per_worker()
            },
        );
        change(&mut config);
        let supervisor = Supervisor::start(&config.toml());
        let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("envoy-bootstrap"));
        Apps {
            envoy,
            supervisor,
            listen: SocketAddr::from(([127, 0, 0, 1], listen)),
            config,
        }
    }

    /// The stack as the zero-downtime steps see it.
    fn deployed(&self) -> Deployed<'_> {
        Deployed {
            envoy: &self.envoy,
            supervisor: &self.supervisor,
            cluster: SERVICE,
            listen: self.listen,
        }
    }

    /// The name of the load-balancing policy of the service's cluster in Envoy (`None` before Envoy
    /// has the cluster, or for a plain `lb_policy`).
    fn cluster_policy(&self) -> Option<String> {
        let dump: serde_json::Value = serde_json::from_str(
            &self
                .envoy
                .admin_get("/config_dump?resource=dynamic_active_clusters")
                .ok()?,
        )
        .ok()?;
        let cluster = dump["configs"]
            .as_array()?
            .iter()
            .map(|c| &c["cluster"])
            .find(|c| c["name"] == SERVICE)?;
        cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"]
            .as_str()
            .map(str::to_owned)
    }

    /// The address the supervisor published for worker `pid`.
    fn address_of(&self, pid: u32) -> String {
        let status = self.supervisor.status_json().expect("status");
        status["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|w| w["pid"].as_u64() == Some(u64::from(pid)))
            .and_then(|w| w["addresses"][0].as_str().map(str::to_owned))
            .unwrap_or_else(|| panic!("worker {pid} in the status: {status}"))
    }
}

/// The servers, or `None` when the test skips (no Envoy, or a server missing).
fn servers() -> Option<AppServers> {
    let test = current_test();
    envoy_or_skip(&test)?;
    app_servers_or_skip(&test)
}

/// `server` serves through Envoy; a SIGKILLed worker is replaced on a new port while the load loses
/// no request; a rolling restart under load loses none either.
fn serves_and_recovers(server: Server) {
    let Some(servers) = servers() else {
        return;
    };
    let mut apps = Apps::start(server, &servers, 2);
    let first = apps.deployed().wait_for_workers(2, &BTreeSet::new());
    let (status, body) = http_get(apps.listen, "/").unwrap();
    assert_eq!(status, 200, "{body}");
    let pid = worker_pid(&body).expect("a worker's answer");
    assert!(
        first.contains(&pid),
        "{pid} answered, Envoy routes to {first:?}"
    );
    let load = apps.deployed().load();

    // SIGKILL: the slot's next worker gets a listener of its own, on another port. Only an answer
    // the victim had begun to write may be lost with it (uvicorn and gunicorn write a response's
    // head and body in two calls).
    let victim = *first.iter().next().unwrap();
    let old_address = apps.address_of(victim);
    let killed_at = load.elapsed();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(victim as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let not: BTreeSet<u32> = [victim].into();
    let second = apps.deployed().wait_for_workers(2, &not);
    let replacement = *second.difference(&first).next().expect("a new worker");
    let new_address = apps.address_of(replacement);
    assert_ne!(new_address, old_address, "a new listener");
    wait_until(STEP, "the replacement answering", || {
        let (_, body) = http_get(apps.listen, "/").ok()?;
        (worker_pid(&body) == Some(replacement)).then_some(())
    });
    let killed = killed_at..load.elapsed();

    // A rolling restart: each new worker is ready before its predecessor drains.
    let out = apps.supervisor.control("restart", &[]).unwrap();
    assert!(
        out.starts_with("2 replaced, 0 added, 0 removed, 0 failed"),
        "{out}"
    );
    let third = apps.deployed().wait_for_workers(2, &second);
    for pid in &second {
        wait_until(STEP, "the old workers to exit", || gone(*pid).then_some(()));
    }
    let all: BTreeSet<u32> = first.iter().chain(&second).chain(&third).copied().collect();
    let report = apps.deployed().finish_through_kill(load, 50, &all, killed);
    assert!(
        third.iter().all(|pid| report.by_pid.contains_key(pid)),
        "the new workers served: {third:?} in {:?}",
        report.by_pid
    );
    // With the eBPF sampler (as in CI) the kernel counts each server's responses in its lane, its
    // children's included (gunicorn answers from a process it forked).
    if apps.supervisor.status_json().unwrap()["sampler"] == "ebpf" {
        wait_until(STEP, "the new workers' responses counted", || {
            let status = apps.supervisor.status_json().ok()?;
            let counted = status["workers"].as_array()?.iter().all(|w| {
                let pid = w["pid"].as_u64().unwrap_or(0) as u32;
                third.contains(&pid) && w["requests_total"].as_u64().unwrap_or(0) >= 10
            });
            counted.then_some(())
        });
    }
    let logs = apps.supervisor.all_logs();
    assert!(logs.contains("Worker ready"), "{logs}");
    // It counts no requests for the supervisor: never taken for a stalled worker for that.
    assert!(!logs.contains("Worker stalled"), "{logs}");
    // A connection that never carries a request (Envoy opens some ahead of need) holds up no
    // drained worker until its SIGKILL, where the server closes such connections on its stop
    // signal (apps.md: gunicorn's sync worker waits on one).
    let unused: Vec<TcpStream> = if server.closes_unused_connections() {
        third
            .iter()
            .map(|pid| TcpStream::connect(apps.address_of(*pid)).expect("a connection"))
            .collect()
    } else {
        Vec::new()
    };
    let status = apps.supervisor.stop().expect("the supervisor stops");
    assert!(status.success(), "{status}\n{}", apps.supervisor.all_logs());
    let logs = apps.supervisor.all_logs();
    assert!(!logs.contains("Worker did not stop in time"), "{logs}");
    drop(unused);
}

/// gunicorn is given its listener both ways: through `LISTEN_FDS` (no `--bind`), and by its command
/// (`--bind fd://{fd}`), when the supervisor leaves systemd's variables out (gunicorn would act on
/// both and open the descriptor twice).
#[test]
fn gunicorn_serves_on_the_passed_listener_with_or_without_bind_fd() {
    let Some(servers) = servers() else {
        return;
    };
    for (server, listen_fds) in [(Server::Gunicorn, true), (Server::GunicornBindFd, false)] {
        let apps = Apps::start(server, &servers, 1);
        let workers = apps.deployed().wait_for_workers(1, &BTreeSet::new());
        let (status, body) = http_get(apps.listen, "/").unwrap();
        assert_eq!(status, 200, "{server:?}: {body}");
        let pid = *workers.iter().next().unwrap();
        assert_eq!(worker_pid(&body), Some(pid), "{server:?}: {body}");
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let has = |name: &str| {
            environ
                .split(|b| *b == 0)
                .any(|var| var.starts_with(format!("{name}=").as_bytes()))
        };
        for name in ["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"] {
            assert_eq!(has(name), listen_fds, "{server:?}: {name}");
        }
        let logs = apps.supervisor.all_logs();
        assert!(logs.contains("Worker ready"), "{server:?}: {logs}");
    }
}

#[test]
fn gunicorn_serves_through_envoy_and_recovers_from_kills_and_restarts() {
    serves_and_recovers(Server::Gunicorn);
}

#[test]
fn uvicorn_serves_through_envoy_and_recovers_from_kills_and_restarts() {
    serves_and_recovers(Server::Uvicorn);
}

#[test]
fn node_serves_through_envoy_and_recovers_from_kills_and_restarts() {
    serves_and_recovers(Server::Node);
}

#[test]
fn a_gunicorn_that_never_becomes_ready_is_reported_and_does_not_replace_the_old_one() {
    never_ready(Server::Gunicorn);
}

#[test]
fn a_uvicorn_that_never_becomes_ready_is_reported_and_does_not_replace_the_old_one() {
    never_ready(Server::Uvicorn);
}

#[test]
fn a_node_server_that_never_becomes_ready_is_reported_and_does_not_replace_the_old_one() {
    never_ready(Server::Node);
}

/// A reload whose `server` never answers its ready path replaces nothing, says why, and the old
/// worker serves on without a failed request.
fn never_ready(server: Server) {
    let Some(servers) = servers() else {
        return;
    };
    let apps = Apps::start(server, &servers, 1);
    let old = apps.deployed().wait_for_workers(1, &BTreeSet::new());
    let load = apps.deployed().load();

    // The new command's servers answer their ready path 503: the reload replaces nothing.
    let mut unready = apps.config.clone();
    unready.supervisor.register_timeout_ms = Some(3000);
    unready.service_mut(SERVICE).env =
        Some(BTreeMap::from([("APP_UNREADY".to_owned(), "1".to_owned())]));
    std::fs::write(
        apps.supervisor.config_path(),
        unready.toml_in(apps.supervisor.dir()),
    )
    .unwrap();
    let begun = Instant::now();
    let error = format!("{:#}", apps.supervisor.control("reload", &[]).unwrap_err());
    assert!(
        error.contains("did not register") && error.contains("the old one keeps serving"),
        "{error}"
    );
    assert!(
        begun.elapsed() >= Duration::from_secs(3),
        "waited for the ready path"
    );
    let logs = apps.supervisor.all_logs();
    assert!(
        logs.contains("The worker never answered its ready path")
            && logs.contains("GET /healthz answered 503"),
        "{logs}"
    );
    assert_eq!(
        apps.envoy.host_pids(SERVICE).unwrap().0,
        old,
        "the old worker still serves"
    );
    apps.deployed().finish(load, 50, &old);
}

#[test]
fn a_restarted_supervisor_adopts_gunicorn_and_not_its_workers_children() {
    adopts(Server::Gunicorn);
}

#[test]
fn a_restarted_supervisor_adopts_uvicorn() {
    adopts(Server::Uvicorn);
}

#[test]
fn a_restarted_supervisor_adopts_node() {
    adopts(Server::Node);
}

/// A supervisor SIGKILLed and started again adopts `server`'s workers (they never dial the control
/// socket: it finds them by their environment and probes them again), under load, losing nothing. The
/// children a server forks (gunicorn's workers) carry the same environment and are left to it.
fn adopts(server: Server) {
    let Some(servers) = servers() else {
        return;
    };
    let mut apps = Apps::start(server, &servers, 2);
    let workers = apps.deployed().wait_for_workers(2, &BTreeSet::new());
    let load = apps.deployed().load();
    apps.supervisor.kill_and_start_again().unwrap();
    let registered = wait_until(STEP, "the servers registered again", || {
        let pids = apps.supervisor.status_pids().ok()?;
        (pids.len() == 2).then_some(pids)
    });
    assert_eq!(registered, workers, "the same servers are adopted");
    let logs = apps.supervisor.all_logs();
    assert!(
        logs.contains("Adopting a worker") && logs.contains("passed=Some"),
        "{logs}"
    );
    assert!(
        !logs.contains("has no slot here"),
        "nothing was stopped: {logs}"
    );
    wait_until(STEP, "Envoy to reconnect", || {
        (apps
            .envoy
            .stat("cluster_manager.cds.control_plane.connected_state")
            == Some(1))
        .then_some(())
    });
    assert_eq!(apps.envoy.host_pids(SERVICE).unwrap().0, workers);
    apps.deployed().finish(load, 50, &workers);
}

/// The procfs sampler counts no response of a server on a passed socket (nor does the eBPF one on a
/// kernel before 6.3): with no request rate to report, the service is balanced by least request from
/// the start, with a warning, and stays so after a reload.
#[test]
fn without_the_kernels_count_a_passed_socket_service_gets_least_request_at_start_and_reload() {
    let Some(servers) = servers() else {
        return;
    };
    let apps = Apps::start_with(Server::Gunicorn, &servers, 2, |config| {
        config.supervisor.sampler = Some(Sampler::Procfs);
    });
    let least_request = "envoy.load_balancing_policies.least_request";
    apps.deployed().wait_for_workers(2, &BTreeSet::new());
    let at_start = apps.cluster_policy();
    assert_eq!(
        at_start.as_deref(),
        Some(least_request),
        "{}",
        apps.supervisor.all_logs()
    );
    let logs = apps.supervisor.all_logs();
    assert!(logs.contains("least request instead of ORCA"), "{logs}");
    // A reload publishes the clusters again, from the same decision.
    apps.supervisor.set_count(3).expect("config");
    apps.supervisor.control("reload", &[]).expect("reload");
    apps.deployed().wait_for_workers(3, &BTreeSet::new());
    assert_eq!(apps.cluster_policy().as_deref(), Some(least_request));
}

/// With the eBPF sampler the kernel counts a passed-socket server's responses, so its service is
/// balanced on ORCA by default: Envoy weighs gunicorn's workers from their reports. With procfs only
/// it balances by least request and says so.
#[test]
fn envoy_weighs_gunicorn_workers_on_orca_reports_of_the_kernels_count() {
    let Some(servers) = servers() else {
        return;
    };
    let apps = Apps::start(Server::Gunicorn, &servers, 2);
    let workers = apps.deployed().wait_for_workers(2, &BTreeSet::new());
    if apps.supervisor.status_json().unwrap()["sampler"] != "ebpf" {
        let logs = apps.supervisor.all_logs();
        assert!(logs.contains("least request instead of ORCA"), "{logs}");
        return;
    }
    requesting_while(apps.listen, "/?cpu=2", 2, || {
        wait_until(STEP, "ORCA reports of every worker's request rate", || {
            let status = apps.supervisor.status_json().ok()?;
            let rows = status["workers"].as_array()?;
            (rows.len() == 2
                && rows.iter().all(|row| {
                    row["orca_last_report"]["rps_fractional"]
                        .as_f64()
                        .is_some_and(|rps| rps > 1.0)
                }))
            .then_some(())
        });
        let weighted = wait_until(STEP, "Envoy to weigh the workers", || {
            let hosts = peregrine_e2e::hosts(&apps.envoy.clusters(), SERVICE);
            (hosts.len() == 2 && hosts.iter().all(|h| h.weight > 1)).then_some(hosts)
        });
        eprintln!("Envoy's weights for {workers:?}: {weighted:?}");
    });
}
