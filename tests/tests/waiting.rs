//! Workers that wait: requests in flight in the load signal.
//!
//! gunicorn's sync workers on passed sockets, each on a listener of its own (`listener =
//! "per-worker"`), serve requests that sleep (`/slow`, as on a database) and use next to no CPU;
//! worker 0's sleeps are five times as long (`APP_WAIT_FACTOR`, `APP_SLOW_INDEX`). The kernel's
//! socket tables show what each worker holds open, and the slow worker holds the most; its report
//! to Envoy says it busy (the share of the time it serves a request, though its CPU is next to
//! nothing), and Envoy weighs it least. The same figure is measured with the procfs sampler,
//! where the kernel counts no response and the service is balanced by least request. Workers on one
//! shared listener have no figure of their own. And a built-in worker keeps its own count, which the
//! supervisor reads from its line.

use std::{collections::BTreeMap, net::SocketAddr};

use peregrine_e2e::{
    AppServers, Envoy, PeregrineToml, ServiceTable, Supervisor, app_servers_or_skip,
    config::Sampler, current_test, deploy::STEP, envoy_or_skip, free_port, gunicorn_command,
    requesting_while, wait_until,
};

/// The service (and Envoy cluster) the tests run.
const SERVICE: &str = "app";
/// Its workers.
const WORKERS: u32 = 3;
/// The worker whose requests wait longer, and how much longer.
const SLOW: u32 = 0;
const FACTOR: &str = "5";
/// What each request waits (times the factor in the slow worker).
const PATH: &str = "/slow?ms=20";
/// Clients that send one request after another.
const CLIENTS: usize = 2;

/// The servers, or `None` when the test skips (no Envoy, or a server missing).
fn servers() -> Option<AppServers> {
    let test = current_test();
    envoy_or_skip(&test)?;
    app_servers_or_skip(&test)
}

/// A supervisor running the gunicorn workers with `sampler`, and an Envoy bootstrapped from it.
struct Waiting {
    // Envoy first: it is killed before the supervisor when dropped. The load goes through it.
    envoy: Envoy,
    supervisor: Supervisor,
    listen: SocketAddr,
}

impl Waiting {
    fn start(servers: &AppServers, sampler: Option<Sampler>) -> Waiting {
        Waiting::start_with(servers, sampler, ServiceTable::per_worker)
    }

    /// [`Waiting::start`], with the service's listener set by `listener`.
    fn start_with(
        servers: &AppServers,
        sampler: Option<Sampler>,
        listener: fn(ServiceTable) -> ServiceTable,
    ) -> Waiting {
        let (grpc, listen, admin) = (free_port(), free_port(), free_port());
        let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
        config.supervisor.register_timeout_ms = Some(20000);
        config.supervisor.sampler = sampler;
        config.service(
            SERVICE,
            ServiceTable {
                pass_socket: Some(true),
                ready_path: Some("/healthz".into()),
                env: Some(BTreeMap::from([
                    ("APP_WAIT_FACTOR".to_owned(), FACTOR.to_owned()),
                    ("APP_SLOW_INDEX".to_owned(), SLOW.to_string()),
                ])),
                ..listener(
                    ServiceTable::default()
                        .count(WORKERS)
                        .command(gunicorn_command(&servers.gunicorn)),
                )
            },
        );
        let supervisor = Supervisor::start(&config.toml());
        let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("envoy-bootstrap"));
        Waiting {
            envoy,
            supervisor,
            listen: SocketAddr::from(([127, 0, 0, 1], listen)),
        }
    }

    /// The workers' status rows by index, once every worker has a mean in flight.
    fn in_flight_rows(&self) -> Option<BTreeMap<u64, serde_json::Value>> {
        let rows = self.supervisor.status_rows(SERVICE).ok()?;
        (rows.len() == WORKERS as usize && rows.values().all(|row| row["in_flight"].is_f64()))
            .then_some(rows)
    }

    /// Runs `check` while `CLIENTS` clients send requests through Envoy.
    fn under_load<T>(&self, check: impl FnOnce() -> T) -> T {
        requesting_while(self.listen, PATH, CLIENTS, check)
    }
}

/// A figure of a status row.
fn figure(row: &serde_json::Value, key: &str) -> f64 {
    row[key].as_f64().unwrap_or(f64::NAN)
}

#[test]
fn the_gunicorn_worker_that_waits_longer_is_busy_by_the_kernels_count_and_weighs_least_in_envoy() {
    let Some(servers) = servers() else {
        return;
    };
    let waiting = Waiting::start(&servers, None);
    wait_until(STEP, "every worker registered", || {
        let rows = waiting.supervisor.status_rows(SERVICE).ok()?;
        (rows.len() == WORKERS as usize && rows.values().all(|r| r["state"] == "ready"))
            .then_some(())
    });
    let status = waiting.supervisor.status_json().expect("status");
    if status["sampler"] != "ebpf" {
        assert!(
            std::env::var("PEREGRINE_REQUIRE_EBPF").map_or(true, |v| v != "1"),
            "PEREGRINE_REQUIRE_EBPF=1 but the supervisor runs without the eBPF sampler"
        );
        peregrine_e2e::skip(
            "the_gunicorn_worker_that_waits_longer_is_busy_by_the_kernels_count_and_weighs_least_in_envoy",
            "no eBPF sampler here, so no ORCA for a passed-socket service",
        );
        return;
    }
    waiting.under_load(|| {
        // The slow worker holds its requests open while it sleeps: the most in flight of the three,
        // and busy most of the time, though its CPU is next to nothing. Its report says it busy, and
        // Envoy weighs it (rate over utilization: one over its time per request) well below the
        // others.
        let (rows, weights) = wait_until(
            STEP * 3,
            "the slow worker busy in its report and weighed least by Envoy",
            || {
                let rows = waiting.in_flight_rows()?;
                let slow = &rows[&u64::from(SLOW)];
                let report = &slow["orca_last_report"];
                let others = || rows.iter().filter(|(index, _)| **index != u64::from(SLOW));
                let most =
                    others().all(|(_, row)| figure(row, "in_flight") < figure(slow, "in_flight"));
                let busy = report["application_utilization"].as_f64()? > 0.5
                    && report["cpu_utilization"].as_f64()? < 0.2;
                let hosts = peregrine_e2e::hosts(&waiting.envoy.clusters(), SERVICE);
                let weight = |row: &serde_json::Value| {
                    let pid = u32::try_from(row["pid"].as_u64()?).ok()?;
                    hosts
                        .iter()
                        .find(|h| peregrine_e2e::hostname_pid(&h.hostname) == Some(pid))
                        .map(|h| h.weight)
                };
                let slow_weight = weight(slow)?;
                let weights: Vec<u64> = others()
                    .map(|(_, row)| weight(row))
                    .collect::<Option<_>>()?;
                let least = weights.iter().all(|&w| w >= 2 * slow_weight.max(1));
                (most && busy && least).then_some((rows.clone(), (slow_weight, weights)))
            },
        );
        eprintln!("status rows: {rows:#?}\nEnvoy's weights (slow, others): {weights:?}");
    });
}

#[test]
fn with_procfs_the_kernel_still_shows_what_gunicorn_workers_hold_open() {
    let Some(servers) = servers() else {
        return;
    };
    let waiting = Waiting::start(&servers, Some(Sampler::Procfs));
    waiting.under_load(|| {
        // No response count without eBPF: balanced by least request, and the requests in flight
        // are measured all the same, the slow worker's the highest.
        let rows = wait_until(STEP * 2, "the slow worker with the most in flight", || {
            let rows = waiting.in_flight_rows()?;
            let slow = figure(&rows[&u64::from(SLOW)], "in_flight");
            let others = rows
                .iter()
                .filter(|(index, _)| **index != u64::from(SLOW))
                .map(|(_, row)| figure(row, "in_flight"));
            (slow > 0.3 && others.clone().all(|other| other < slow)).then_some(rows)
        });
        eprintln!("status rows: {rows:#?}");
        let slow = &rows[&u64::from(SLOW)];
        // Concurrency 1 (gunicorn's sync worker): the utilization is the mean itself.
        assert_eq!(
            figure(slow, "in_flight_utilization"),
            figure(slow, "in_flight")
        );
        assert!(slow["in_flight_now"].is_u64(), "{slow}");
    });
}

#[test]
fn workers_on_a_shared_listener_have_no_requests_in_flight_of_their_own_their_service_has_them() {
    let Some(servers) = servers() else {
        return;
    };
    let waiting = Waiting::start_with(&servers, None, ServiceTable::shared);
    waiting.under_load(|| {
        // The accept queue and the connections on the one port are every worker's: no worker is
        // given them as its own.
        let rows = wait_until(STEP * 2, "every worker sampled", || {
            let rows = waiting.supervisor.status_rows(SERVICE).ok()?;
            (rows.len() == WORKERS as usize && rows.values().all(|r| r["cpu_cores"].is_f64()))
                .then_some(rows)
        });
        for row in rows.values() {
            assert!(row["in_flight"].is_null(), "{row}");
            assert!(row["in_flight_now"].is_null(), "{row}");
        }
        // They are the service's, on its listener: with two clients always waiting on an answer, a
        // sample sees one or two held.
        let listener = wait_until(STEP * 2, "a request held on the shared listener", || {
            let status = waiting.supervisor.status_json().ok()?;
            let listener = status["listeners"][SERVICE].clone();
            (listener["serving"].as_u64()? >= 1).then_some(listener)
        });
        assert!(
            listener["serving"].as_u64() <= Some(CLIENTS as u64),
            "{listener}"
        );
        assert!(listener["queued"].is_u64(), "{listener}");
    });
}

#[test]
fn a_built_in_worker_keeps_its_requests_in_flight() {
    let mut config = PeregrineToml::local(free_port());
    config.service(SERVICE, ServiceTable::at("http://127.0.0.1:0").count(1));
    let supervisor = Supervisor::start(&config.toml());
    let address: SocketAddr = wait_until(STEP, "the worker registered", || {
        let rows = supervisor.status_rows(SERVICE).ok()?;
        rows.get(&0)?["addresses"][0].as_str()?.parse().ok()
    });
    // One request after another, each on the CPU for 20 ms: about one in flight all the time.
    requesting_while(address, "/?cpu=20", 1, || {
        let row = wait_until(STEP * 2, "the worker's own count of its requests", || {
            let rows = supervisor.status_rows(SERVICE).ok()?;
            let row = rows.get(&0)?.clone();
            (figure(&row, "in_flight") > 0.5).then_some(row)
        });
        eprintln!("status row: {row:#}");
        assert!(figure(&row, "in_flight") <= 1.05, "one client: {row}");
        // Many at once (the built-in worker): the utilization is the mean, unscaled.
        assert_eq!(
            figure(&row, "in_flight_utilization"),
            figure(&row, "in_flight")
        );
    });
}
