//! End to end: the real Envoy, started with a bootstrap from [`envoy_bootstrap`], learns a registry's
//! workers over CDS/EDS from [`xds::serve`], and follows registrations on its open streams; its ACKs
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
    xds::{self, XdsOptions, acks::Acks, transport::StreamKind},
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

/// Waits until `check` holds for Envoy's admin `path`; returns the body.
fn until(envoy: &Envoy, what: &str, path: &str, check: impl Fn(&str) -> bool) -> String {
    wait_until(DEADLINE, what, || {
        let body = envoy.admin_get(path).ok()?;
        check(&body).then_some(body)
    })
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
    if envoy_or_skip(test).is_none() {
        return;
    }
    // `RUST_LOG=peregrine_supervisor=debug` shows the server's side of the conversation.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let registry = Arc::new(Registry::new(["web".to_string()]));
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let xds_addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = runtime.spawn(xds::serve(
        vec![listener],
        vec![],
        registry.subscribe(),
        tokio::sync::watch::channel(XdsOptions::default()).1,
        Arc::new(Acks::default()),
        None,
        async {
            let _ = stop_rx.await;
        },
    ));

    // Fake workers: listeners nobody serves on; Envoy only needs their addresses.
    let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let second = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let first_addr = first.local_addr().unwrap();
    let second_addr = second.local_addr().unwrap();
    registry
        .register(worker(0, 4242, first_addr, &[Protocol::Http1]))
        .unwrap();

    let bootstrap = envoy_bootstrap(&BootstrapInput {
        xds_address: xds_addr,
        listener_address: "127.0.0.1:0".parse().unwrap(),
        admin_address: "127.0.0.1:0".parse().unwrap(),
        services: vec![BootstrapService::new("web")],
        ads,
        xds,
        ..Default::default()
    });
    let envoy = Envoy::start(&bootstrap);
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
    stop_tx.send(()).unwrap();
    runtime
        .block_on(async { tokio::time::timeout(DEADLINE, server).await })
        .expect("the server stops in time")
        .unwrap()
        .unwrap();
}

#[test]
fn envoy_has_an_update_once_its_streams_acked_it() {
    let test = "envoy_has_an_update_once_its_streams_acked_it";
    if envoy_or_skip(test).is_none() {
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    for xds in [XdsVariant::StateOfTheWorld, XdsVariant::Delta] {
        for ads in [false, true] {
            acked_update_is_in_envoy(ads, xds);
        }
    }
}

/// Registers a second worker while Envoy runs; once `wait_synced` says every endpoint stream ACKed
/// the registry's revision, admin `/clusters` must already show the new host.
fn acked_update_is_in_envoy(ads: bool, xds: XdsVariant) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let registry = Arc::new(Registry::new(["web".to_string()]));
    let acks = Arc::new(Acks::default());
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let xds_addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = runtime.spawn(xds::serve(
        vec![listener],
        vec![],
        registry.subscribe(),
        tokio::sync::watch::channel(XdsOptions::default()).1,
        acks.clone(),
        None,
        async {
            let _ = stop_rx.await;
        },
    ));
    let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let second = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let first_host = (
        first.local_addr().unwrap().to_string(),
        "web-0-4242".to_string(),
    );
    let second_host = (
        second.local_addr().unwrap().to_string(),
        "web-1-4343".to_string(),
    );
    registry
        .register(worker(
            0,
            4242,
            first.local_addr().unwrap(),
            &[Protocol::Http1],
        ))
        .unwrap();
    let envoy = Envoy::start(&envoy_bootstrap(&BootstrapInput {
        xds_address: xds_addr,
        listener_address: "127.0.0.1:0".parse().unwrap(),
        admin_address: "127.0.0.1:0".parse().unwrap(),
        services: vec![BootstrapService::new("web")],
        ads,
        xds,
        ..Default::default()
    }));
    wait_until(DEADLINE, "the first worker in Envoy", || {
        web_hosts(&envoy).contains(&first_host).then_some(())
    });

    registry
        .register(worker(
            1,
            4343,
            second.local_addr().unwrap(),
            &[Protocol::Http1],
        ))
        .unwrap();
    let revision = registry.snapshot().revision;
    let outcome = runtime.block_on(acks.wait_synced(revision, Duration::from_secs(10)));
    assert!(
        outcome.is_synced() && outcome.synced >= 1,
        "ads: {ads}, {xds:?}: every endpoint stream ACKed revision {revision}: {outcome:?}\n{}",
        envoy.logs()
    );
    // No wait: an ACKed update is already applied.
    let hosts = web_hosts(&envoy);
    assert!(
        hosts.contains(&first_host) && hosts.contains(&second_host),
        "ads: {ads}, {xds:?}: both workers in Envoy right after the ACK: {hosts:?}"
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

    drop(envoy);
    stop_tx.send(()).unwrap();
    runtime
        .block_on(async { tokio::time::timeout(DEADLINE, server).await })
        .expect("the server stops in time")
        .unwrap()
        .unwrap();
    wait_until(DEADLINE, "closed streams to stop counting", || {
        acks.streams().is_empty().then_some(())
    });
}

#[test]
fn envoy_reconnecting_over_delta_is_sent_only_what_changed() {
    let test = "envoy_reconnecting_over_delta_is_sent_only_what_changed";
    if envoy_or_skip(test).is_none() {
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    for ads in [false, true] {
        reconnects_over_delta(ads);
    }
}

/// Restarts the control plane under a running Envoy while a worker registers: the new server gets
/// Envoy's `initial_resource_versions` and sends only the changed endpoints, not the cluster again.
fn reconnects_over_delta(ads: bool) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let registry = Arc::new(Registry::new(["web".to_string()]));
    let serve = |listener: tokio::net::TcpListener, acks: Arc<Acks>| {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = runtime.spawn(xds::serve(
            vec![listener],
            vec![],
            registry.subscribe(),
            tokio::sync::watch::channel(XdsOptions::default()).1,
            acks,
            None,
            async {
                let _ = stop_rx.await;
            },
        ));
        (stop_tx, server)
    };
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let xds_addr = listener.local_addr().unwrap();
    let (stop_tx, server) = serve(listener, Arc::new(Acks::default()));
    let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let second = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let first_host = (first.local_addr().unwrap().to_string(), "web-0-4242".into());
    let second_host = (
        second.local_addr().unwrap().to_string(),
        "web-1-4343".into(),
    );
    registry
        .register(worker(
            0,
            4242,
            first.local_addr().unwrap(),
            &[Protocol::Http1],
        ))
        .unwrap();
    let envoy = Envoy::start(&envoy_bootstrap(&BootstrapInput {
        xds_address: xds_addr,
        listener_address: "127.0.0.1:0".parse().unwrap(),
        admin_address: "127.0.0.1:0".parse().unwrap(),
        services: vec![BootstrapService::new("web")],
        ads,
        xds: XdsVariant::Delta,
        ..Default::default()
    }));
    wait_until(DEADLINE, "the first worker in Envoy", || {
        (web_hosts(&envoy) == [first_host.clone()]).then_some(())
    });
    let cds_updates = envoy.stat("cluster_manager.cds.update_success");

    // The control plane goes away; a worker registers meanwhile; a new one serves on the same port.
    stop_tx.send(()).unwrap();
    runtime
        .block_on(async { tokio::time::timeout(DEADLINE, server).await })
        .expect("the server stops in time")
        .unwrap()
        .unwrap();
    registry
        .register(worker(
            1,
            4343,
            second.local_addr().unwrap(),
            &[Protocol::Http1],
        ))
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(xds_addr))
        .unwrap();
    let acks = Arc::new(Acks::default());
    let (stop_tx, server) = serve(listener, acks.clone());
    let revision = registry.snapshot().revision;
    wait_until(DEADLINE, "Envoy back and synced", || {
        let streams = acks.streams();
        (!streams.is_empty() && streams.iter().all(|s| s.synced_revision >= Some(revision)))
            .then_some(())
    });
    let hosts = web_hosts(&envoy);
    assert!(
        hosts.contains(&first_host) && hosts.contains(&second_host),
        "ads: {ads}: both workers after the reconnect: {hosts:?}"
    );
    assert_eq!(
        envoy.stat("cluster_manager.cds.update_success"),
        cds_updates,
        "ads: {ads}: the unchanged cluster is not sent again\n{}",
        envoy.stats()
    );

    drop(envoy);
    stop_tx.send(()).unwrap();
    runtime
        .block_on(async { tokio::time::timeout(DEADLINE, server).await })
        .expect("the server stops in time")
        .unwrap()
        .unwrap();
}
