//! End to end: the real Envoy, started with a bootstrap from [`envoy_bootstrap`], learns a registry's
//! workers over CDS/EDS from [`run::grpc::serve`], and follows registrations on its open streams; its ACKs
//! tell [`xds::acks::Acks`] when it has an update.
//!
//! Needs the Envoy binary (see `peregrine_e2e::envoy_path`); without one the test prints why it skipped
//! (`cargo xtask test` makes that a failure). Every wait is bounded by a deadline.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use peregrine_e2e::{Envoy, envoy_or_skip, hosts, wait_until};
use peregrine_supervisor::{
    bootstrap::{BootstrapInput, BootstrapService, envoy_bootstrap},
    config::XdsVariant,
    registry::{Address, Protocol, Registry, Worker},
    run,
    xds::{XdsOptions, acks::Acks, stream_kind::StreamKind},
};

const DEADLINE: Duration = Duration::from_secs(20);

fn worker(index: u32, pid: u32, addr: SocketAddr, protocols: &[Protocol]) -> Worker {
    Worker::ready(
        "web",
        index,
        pid,
        protocols.to_vec(),
        vec![Address::Tcp(addr)],
    )
}

/// The `web` hosts in admin `/clusters` as `(address, hostname)`.
fn web_hosts(envoy: &Envoy) -> Vec<(String, String)> {
    hosts(&envoy.clusters(), "web")
        .into_iter()
        .map(|h| (h.address, h.hostname))
        .collect()
}

/// Whether the Envoy test `test` can run (else it printed why it skips); logs go to the test's output
/// (`RUST_LOG=peregrine_supervisor=debug` shows the server's side of the conversation).
fn envoy_test(test: &str) -> bool {
    if envoy_or_skip(test).is_none() {
        return false;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    true
}

/// Starts Envoy routing to `web`, with its xDS at `xds_addr` (over ADS or not, in the `xds` variant).
fn start_envoy(xds_addr: SocketAddr, ads: bool, xds: XdsVariant) -> Envoy {
    Envoy::start(&envoy_bootstrap(&BootstrapInput {
        xds_address: xds_addr,
        listener_address: "127.0.0.1:0".parse().unwrap(),
        admin_address: "127.0.0.1:0".parse().unwrap(),
        services: vec![BootstrapService::new("web")],
        ads,
        xds,
        ..Default::default()
    }))
}

/// Waits until `check` holds for Envoy's admin `path`; returns the body.
fn until(envoy: &Envoy, what: &str, path: &str, check: impl Fn(&str) -> bool) -> String {
    wait_until(DEADLINE, what, || {
        let body = envoy.admin_get(path).ok()?;
        check(&body).then_some(body)
    })
}

/// A control plane serving a registry on a runtime of the test's.
struct Server {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), run::grpc::ServeError>>,
}

impl Server {
    /// Serves `registry` on `listener`, publishing ACKs to `acks`.
    fn spawn(
        runtime: &tokio::runtime::Runtime,
        registry: &Registry,
        listener: tokio::net::TcpListener,
        acks: Arc<Acks>,
    ) -> Server {
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = runtime.spawn(run::grpc::serve(
            run::grpc::Ports::single(listener, 1024),
            run::grpc::Inputs {
                snapshots: registry.subscribe(),
                options: tokio::sync::watch::channel(XdsOptions::default()).1,
                acks,
                counters: Default::default(),
                orca: None,
            },
            async {
                let _ = stop_rx.await;
            },
        ));
        Server { stop, task }
    }

    /// Stops the server and waits until it has.
    fn stop(self, runtime: &tokio::runtime::Runtime) {
        self.stop.send(()).unwrap();
        runtime
            .block_on(async { tokio::time::timeout(DEADLINE, self.task).await })
            .expect("the server stops in time")
            .unwrap()
            .unwrap();
    }
}

#[test]
fn envoy_follows_the_registry_over_dedicated_streams() {
    follows_the_registry(
        "envoy_follows_the_registry_over_dedicated_streams",
        false,
        XdsVariant::StateOfTheWorld,
    );
}

#[test]
fn envoy_follows_the_registry_over_ads() {
    follows_the_registry(
        "envoy_follows_the_registry_over_ads",
        true,
        XdsVariant::StateOfTheWorld,
    );
}

#[test]
fn envoy_follows_the_registry_over_delta_streams() {
    follows_the_registry(
        "envoy_follows_the_registry_over_delta_streams",
        false,
        XdsVariant::Delta,
    );
}

#[test]
fn envoy_follows_the_registry_over_delta_ads() {
    follows_the_registry(
        "envoy_follows_the_registry_over_delta_ads",
        true,
        XdsVariant::Delta,
    );
}

fn follows_the_registry(test: &str, ads: bool, xds: XdsVariant) {
    if !envoy_test(test) {
        return;
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let registry = Arc::new(Registry::new(["web".to_string()]));
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let xds_addr = listener.local_addr().unwrap();
    let server = Server::spawn(&runtime, &registry, listener, Arc::new(Acks::default()));

    // Fake workers: listeners nobody serves on; Envoy only needs their addresses.
    let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let second = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let first_addr = first.local_addr().unwrap();
    let second_addr = second.local_addr().unwrap();
    registry
        .register(worker(0, 4242, first_addr, &[Protocol::Http1]))
        .unwrap();

    let envoy = start_envoy(xds_addr, ads, xds);
    let first_host = (first_addr.to_string(), "web-0-4242".to_string());
    let second_host = |pid: u32| (second_addr.to_string(), format!("web-1-{pid}"));

    wait_until(DEADLINE, "the first worker in Envoy", || {
        web_hosts(&envoy).contains(&first_host).then_some(())
    });

    // A new worker is pushed on the open EDS stream.
    registry
        .register(worker(1, 4343, second_addr, &[Protocol::Http1]))
        .unwrap();
    wait_until(DEADLINE, "both workers in Envoy", || {
        let hosts = web_hosts(&envoy);
        (hosts.contains(&first_host) && hosts.contains(&second_host(4343))).then_some(())
    });

    // A removed worker disappears.
    assert!(registry.deregister("web", 0, 4242));
    wait_until(DEADLINE, "only the second worker in Envoy", || {
        (web_hosts(&envoy) == [second_host(4343)]).then_some(())
    });

    // A cluster change (HTTP/2 upstream) must finish warming with the endpoints intact. The new
    // instance takes over slot 1; its predecessor drains until it is gone (as the manager does).
    registry
        .register(worker(1, 4444, second_addr, &[Protocol::Http2]))
        .unwrap();
    assert!(registry.deregister("web", 1, 4343));
    wait_until(DEADLINE, "the HTTP/2 worker in a warm cluster", || {
        (web_hosts(&envoy) == [second_host(4444)]).then_some(())
    });
    until(
        &envoy,
        "no warming cluster",
        "/stats?filter=cluster_manager",
        |body| {
            body.contains("cluster_manager.warming_clusters: 0")
                && body.contains("cluster_manager.cds.update_success: 2")
        },
    );
    let dump = envoy
        .admin_get("/config_dump?resource=dynamic_active_clusters")
        .unwrap();
    assert!(
        dump.contains("http2_protocol_options"),
        "the active cluster has HTTP/2 upstream options:\n{dump}"
    );
    let source = match (ads, xds) {
        (true, _) => "\"ads\": {}",
        (false, XdsVariant::StateOfTheWorld) => "\"api_type\": \"GRPC\"",
        (false, XdsVariant::Delta) => "\"api_type\": \"DELTA_GRPC\"",
    };
    assert!(
        dump.contains(source),
        "the cluster's EDS source is {source}:\n{dump}"
    );
    let stats = envoy.admin_get("/stats?filter=(cds|eds)").unwrap();
    assert!(
        !stats.contains("update_rejected: 1"),
        "Envoy rejected an update:\n{stats}\n{}",
        envoy.logs()
    );

    drop(envoy);
    server.stop(&runtime);
}

#[test]
fn envoy_has_an_update_once_its_streams_acked_it() {
    let test = "envoy_has_an_update_once_its_streams_acked_it";
    if !envoy_test(test) {
        return;
    }
    for xds in [XdsVariant::StateOfTheWorld, XdsVariant::Delta] {
        for ads in [false, true] {
            acked_update_is_in_envoy(ads, xds);
        }
    }
}

/// Envoy following a control plane that serves `web`, whose first worker Envoy already has; a second
/// worker's address is ready for the scenario to register.
struct WithFirstWorker {
    runtime: tokio::runtime::Runtime,
    registry: Arc<Registry>,
    xds_addr: SocketAddr,
    server: Option<Server>,
    envoy: Envoy,
    first_host: (String, String),
    second_host: (String, String),
    second_addr: SocketAddr,
    /// The workers' listeners, bound for the test's length so nothing else takes their ports.
    _listeners: [std::net::TcpListener; 2],
}

impl WithFirstWorker {
    fn start(ads: bool, xds: XdsVariant, acks: Arc<Acks>) -> Self {
        Self::start_with(acks, |xds_addr| start_envoy(xds_addr, ads, xds))
    }

    /// Like [`WithFirstWorker::start`], with the Envoy `envoy` starts for the xDS address.
    fn start_with(acks: Arc<Acks>, envoy: impl FnOnce(SocketAddr) -> Envoy) -> Self {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let registry = Arc::new(Registry::new(["web".to_string()]));
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let xds_addr = listener.local_addr().unwrap();
        let server = Server::spawn(&runtime, &registry, listener, acks);
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let second = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (first_addr, second_addr) = (first.local_addr().unwrap(), second.local_addr().unwrap());
        registry
            .register(worker(0, 4242, first_addr, &[Protocol::Http1]))
            .unwrap();
        let envoy = envoy(xds_addr);
        let first_host = (first_addr.to_string(), "web-0-4242".to_string());
        wait_until(DEADLINE, "the first worker in Envoy", || {
            web_hosts(&envoy).contains(&first_host).then_some(())
        });
        WithFirstWorker {
            runtime,
            registry,
            xds_addr,
            server: Some(server),
            envoy,
            first_host,
            second_host: (second_addr.to_string(), "web-1-4343".to_string()),
            second_addr,
            _listeners: [first, second],
        }
    }

    /// Registers the second worker; returns the registry revision that has it.
    fn register_second(&self) -> u64 {
        self.registry
            .register(worker(1, 4343, self.second_addr, &[Protocol::Http1]))
            .unwrap();
        self.registry.snapshot().revision
    }

    /// Whether Envoy has both workers.
    fn has_both(&self) -> bool {
        let hosts = web_hosts(&self.envoy);
        hosts.contains(&self.first_host) && hosts.contains(&self.second_host)
    }

    /// Stops the control plane, calls `meanwhile`, then serves again on the same address.
    fn restart_server(&mut self, meanwhile: impl FnOnce(&Self), acks: Arc<Acks>) {
        self.server.take().expect("serving").stop(&self.runtime);
        meanwhile(self);
        let listener = self
            .runtime
            .block_on(tokio::net::TcpListener::bind(self.xds_addr))
            .unwrap();
        self.server = Some(Server::spawn(&self.runtime, &self.registry, listener, acks));
    }

    fn stop(self) {
        drop(self.envoy);
        if let Some(server) = self.server {
            server.stop(&self.runtime);
        }
    }
}

#[test]
fn a_static_eds_cluster_on_ads_gets_its_endpoints_and_its_acks_count() {
    let test = "a_static_eds_cluster_on_ads_gets_its_endpoints_and_its_acks_count";
    if !envoy_test(test) {
        return;
    }
    for xds in [XdsVariant::StateOfTheWorld, XdsVariant::Delta] {
        // An Envoy whose one cluster is static, of type EDS, its endpoints over ADS: its ADS stream
        // asks for endpoints and never for clusters.
        let acks = Arc::new(Acks::default());
        let running =
            WithFirstWorker::start_with(acks.clone(), |addr| start_static_eds_envoy(addr, xds));
        let revision = running.register_second();
        let begun = std::time::Instant::now();
        let outcome = running
            .runtime
            .block_on(acks.wait_synced(revision, Duration::from_secs(10)));
        assert!(
            outcome.is_synced() && outcome.synced == 1,
            "{xds:?}: the ADS stream ACKed revision {revision}: {outcome:?}\n{}",
            running.envoy.logs()
        );
        assert!(
            begun.elapsed() < Duration::from_secs(5),
            "{:?}",
            begun.elapsed()
        );
        assert!(
            running.has_both(),
            "{xds:?}: {:?}",
            web_hosts(&running.envoy)
        );
        running.stop();
    }
}

/// Starts Envoy with `web` as a static cluster of type EDS whose endpoints come over ADS, and no
/// CDS: the bootstrap of [`envoy_bootstrap`] without its `cds_config`, one static cluster added.
fn start_static_eds_envoy(xds_addr: SocketAddr, xds: XdsVariant) -> Envoy {
    let bootstrap = envoy_bootstrap(&BootstrapInput {
        xds_address: xds_addr,
        listener_address: "127.0.0.1:0".parse().unwrap(),
        admin_address: "127.0.0.1:0".parse().unwrap(),
        services: vec![BootstrapService::new("web")],
        ads: true,
        xds,
        ..Default::default()
    });
    let cds = "  cds_config:\n    resource_api_version: V3\n    ads: {}\n";
    assert!(bootstrap.contains(cds), "{bootstrap}");
    let mut bootstrap = bootstrap.replace(cds, "");
    bootstrap.push_str(
        "    - name: web
      connect_timeout: 1s
      type: EDS
      eds_cluster_config:
        eds_config:
          resource_api_version: V3
          ads: {}
",
    );
    Envoy::start(&bootstrap)
}

/// Registers a second worker while Envoy runs; once `wait_synced` says every endpoint stream ACKed
/// the registry's revision, admin `/clusters` must already show the new host.
fn acked_update_is_in_envoy(ads: bool, xds: XdsVariant) {
    let acks = Arc::new(Acks::default());
    let running = WithFirstWorker::start(ads, xds, acks.clone());
    let revision = running.register_second();
    let outcome = running
        .runtime
        .block_on(acks.wait_synced(revision, Duration::from_secs(10)));
    assert!(
        outcome.is_synced() && outcome.synced >= 1,
        "ads: {ads}, {xds:?}: every endpoint stream ACKed revision {revision}: {outcome:?}\n{}",
        running.envoy.logs()
    );
    // No wait: an ACKed update is already applied.
    assert!(
        running.has_both(),
        "ads: {ads}, {xds:?}: both workers in Envoy right after the ACK: {:?}",
        web_hosts(&running.envoy)
    );
    let kind = match (ads, xds) {
        (false, XdsVariant::StateOfTheWorld) => StreamKind::Eds,
        (true, XdsVariant::StateOfTheWorld) => StreamKind::Ads,
        (false, XdsVariant::Delta) => StreamKind::DeltaEds,
        (true, XdsVariant::Delta) => StreamKind::DeltaAds,
    };
    let streams = acks.streams();
    assert!(
        !streams.is_empty()
            && streams
                .iter()
                .all(|s| s.kind == kind && s.synced_revision >= Some(revision)),
        "ads: {ads}, {xds:?}: only {kind} streams count, all synced at {revision}: {streams:?}"
    );

    running.stop();
    wait_until(DEADLINE, "closed streams to stop counting", || {
        acks.streams().is_empty().then_some(())
    });
}

#[test]
fn envoy_reconnecting_over_delta_is_sent_only_what_changed() {
    let test = "envoy_reconnecting_over_delta_is_sent_only_what_changed";
    if !envoy_test(test) {
        return;
    }
    for ads in [false, true] {
        reconnects_over_delta(ads);
    }
}

/// Restarts the control plane under a running Envoy while a worker registers: the new server gets
/// Envoy's `initial_resource_versions` and sends only the changed endpoints, not the cluster again.
fn reconnects_over_delta(ads: bool) {
    let mut running = WithFirstWorker::start(ads, XdsVariant::Delta, Arc::new(Acks::default()));
    let cds_updates = running.envoy.stat("cluster_manager.cds.update_success");

    // The control plane goes away; a worker registers meanwhile; a new one serves on the same port.
    let acks = Arc::new(Acks::default());
    let mut revision = 0;
    running.restart_server(|running| revision = running.register_second(), acks.clone());
    wait_until(DEADLINE, "Envoy back and synced", || {
        let streams = acks.streams();
        (!streams.is_empty() && streams.iter().all(|s| s.synced_revision >= Some(revision)))
            .then_some(())
    });
    assert!(
        running.has_both(),
        "ads: {ads}: both workers after the reconnect: {:?}",
        web_hosts(&running.envoy)
    );
    assert_eq!(
        running.envoy.stat("cluster_manager.cds.update_success"),
        cds_updates,
        "ads: {ads}: the unchanged cluster is not sent again\n{}",
        running.envoy.stats()
    );
    running.stop();
}
