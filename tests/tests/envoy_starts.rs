//! The harness against a real Envoy: a static bootstrap with one listener that answers directly on `/`
//! and routes `/worker` to a static cluster whose one host is a stand-in hello worker in this test.
//! Skips (saying so) only when there is no Envoy binary; `cargo xtask test` makes that a failure.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener},
    thread,
    time::Duration,
};

use peregrine_e2e::{Envoy, envoy_or_skip, free_port, hosts, http_get, wait_until, worker_pid};

fn bootstrap(listen_port: u16, upstream_port: u16) -> String {
    format!(
        r#"
admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: 0 }}
static_resources:
  listeners:
  - name: listener_0
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {listen_port} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ path: "/worker" }}
                route: {{ cluster: static_workers }}
              - match: {{ prefix: "/" }}
                direct_response:
                  status: 200
                  body: {{ inline_string: "hello from envoy\n" }}
  clusters:
  - name: static_workers
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: static_workers
      endpoints:
      - lb_endpoints:
        - endpoint:
            hostname: static-worker-4242
            address:
              socket_address: {{ address: 127.0.0.1, port_value: {upstream_port} }}
"#
    )
}

/// A stand-in worker answering `count` requests like the hello worker.
fn fake_worker(listener: TcpListener, count: usize) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        for _ in 0..count {
            let (mut stream, _) = listener.accept().unwrap();
            // Envoy may reuse the connection; one request per connection is enough here, so close it.
            let mut request = Vec::new();
            let mut buffer = [0; 1024];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = stream.read(&mut buffer).unwrap();
                assert_ne!(n, 0, "Envoy closed before sending a request");
                request.extend_from_slice(&buffer[..n]);
            }
            let body = "Hello from worker 4242!\n";
            write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
        }
    })
}

#[test]
fn envoy_answers_through_its_listener_and_admin() {
    if envoy_or_skip("envoy_answers_through_its_listener_and_admin").is_none() {
        return;
    }
    let upstream = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let upstream_port = upstream.local_addr().unwrap().port();
    let worker = fake_worker(upstream, 3);
    let listen_port = free_port();
    let envoy = Envoy::start(&bootstrap(listen_port, upstream_port));
    let listener = SocketAddr::from((Ipv4Addr::LOCALHOST, listen_port));

    // Admin answers as soon as Envoy wrote its address; the listener may come a moment later.
    wait_until(Duration::from_secs(10), "Envoy to be live", || {
        envoy
            .admin_get("/ready")
            .ok()
            .filter(|body| body.trim() == "LIVE")
    });
    let (status, body) = wait_until(Duration::from_secs(10), "Envoy's listener", || {
        http_get(listener, "/").ok()
    });
    assert_eq!((status, body.as_str()), (200, "hello from envoy\n"));

    for _ in 0..3 {
        let (status, body) = http_get(listener, "/worker").unwrap();
        assert_eq!(status, 200, "{body}");
        assert_eq!(worker_pid(&body), Some(4242));
    }
    worker.join().unwrap();

    let clusters = envoy.clusters();
    let hosts = hosts(&clusters, "static_workers");
    assert_eq!(hosts.len(), 1, "{clusters}");
    let host = &hosts[0];
    assert_eq!(host.address, format!("127.0.0.1:{upstream_port}"));
    assert_eq!(host.hostname, "static-worker-4242");
    assert!(host.healthy, "{clusters}");
    assert_eq!(host.rq_success, 3, "{clusters}");
    assert_eq!(host.rq_total, 3, "{clusters}");

    assert_eq!(
        envoy.stat("cluster.static_workers.upstream_rq_200"),
        Some(3)
    );
    assert!(
        envoy
            .stats()
            .contains("cluster.static_workers.upstream_rq_total: 3")
    );
}
