//! An axum `Router`, served unchanged by a Peregrine worker (`worker/examples/axum.rs`), behind the real
//! Envoy: the supervisor runs the example binary as a service's command.

use std::{net::SocketAddr, time::Duration};

use peregrine_e2e::{
    Envoy, PeregrineToml, ServiceTable, Supervisor, envoy_or_skip, example_path, free_port, hosts,
    http_get, wait_until,
};

#[test]
fn an_axum_router_serves_through_envoy() {
    if envoy_or_skip("an_axum_router_serves_through_envoy").is_none() {
        return;
    }
    let axum = example_path("axum");
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    let api = ServiceTable::default()
        .count(2)
        .command([axum.display().to_string()]);
    config.service("api", api);
    let supervisor = Supervisor::start(&config.toml());
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().unwrap());
    wait_until(Duration::from_secs(30), "2 api hosts", || {
        (hosts(&envoy.clusters(), "api").len() == 2).then_some(())
    });
    let listener = SocketAddr::from(([127, 0, 0, 1], listen));
    let (status, body) = http_get(listener, "/").unwrap();
    assert_eq!(status, 200);
    assert!(body.starts_with("Hello from axum in worker "), "{body}");
    let (status, body) = http_get(listener, "/sum?a=2&b=40").unwrap();
    assert_eq!((status, body.as_str()), (200, r#"{"sum":42}"#));
    let (status, _) = http_get(listener, "/missing").unwrap();
    assert_eq!(status, 404, "axum's own fallback answers");
}
