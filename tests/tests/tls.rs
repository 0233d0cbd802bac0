//! The gRPC port over mutual TLS with the real Envoy and real TLS clients (curl, openssl):
//!
//! - Envoy gets clusters and endpoints over TLS in every xDS variant (state of the world and delta,
//!   dedicated streams and ADS), and its ORCA streams to the workers' addresses take the cluster's
//!   TLS entry, so weights still arrive;
//! - a client with no certificate, one from another CA, an expired one, or one speaking cleartext
//!   HTTP/2 is refused, and the supervisor's log says which, and from where (the cleartext preface
//!   is closed at once);
//! - a new certificate put in place under load is served to new connections without a restart:
//!   no request fails, Envoy's xDS stream is never dropped, and a new Envoy trusts the new
//!   certificate; `peregrine reload` takes new paths, and refuses a bad key or TLS switched off;
//! - a certificate that cannot be used stops `check` and `run`, naming its key; a gRPC port off
//!   loopback without TLS is warned about.

use std::{
    io::{ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use peregrine_e2e::{
    Envoy, Load, PeregrineToml, ServiceTable, Supervisor,
    config::{EnvoyTable, ServerTls},
    envoy_or_skip, free_port, hosts, http_get,
    pki::{Ca, ControlPlane, SERVER_NAME, Usage},
    try_wait_until, wait_until,
};

/// A supervisor config with mutual TLS from `plane`, `[envoy]` changed by `envoy`, samples every
/// 200 ms and fast ORCA weights (so that they apply within a few seconds), and two workers of
/// `web`; with Envoy's listener address and the gRPC port.
fn config(
    plane: &ControlPlane,
    envoy: impl FnOnce(&mut EnvoyTable),
) -> (PeregrineToml, SocketAddr, u16) {
    let (grpc, listen) = (free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, free_port());
    config.supervisor.sample_interval_ms = Some(200);
    envoy(config.envoy_mut());
    plane.secure(&mut config);
    let orca = config.orca_mut();
    orca.blackout_period_ms = Some(1000);
    orca.weight_update_period_ms = Some(200);
    config.service("web", ServiceTable::at("http://127.0.0.1:0").count(2));
    (config, SocketAddr::from(([127, 0, 0, 1], listen)), grpc)
}

/// Over mutual TLS as it is ([`config`]'s `[envoy]` unchanged).
fn as_is(_: &mut EnvoyTable) {}

/// `[supervisor.tls]` of `config`.
fn server_tls(config: &mut PeregrineToml) -> &mut ServerTls {
    config.supervisor.tls.as_mut().expect("[supervisor.tls]")
}

/// Whether a GET through Envoy's listener is answered 200 by a worker.
fn served(listen: SocketAddr) -> bool {
    http_get(listen, "/").is_ok_and(|(status, _)| status == 200)
}

#[test]
fn envoy_gets_every_xds_variant_and_orca_weights_over_mutual_tls() {
    let Some(_envoy) = envoy_or_skip("xDS over mutual TLS") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::write(dir.path());
    for (variant, ads, xds) in [
        ("sotw", None, None),
        ("delta", None, Some("delta")),
        ("ads", Some(true), None),
        ("delta-ads", Some(true), Some("delta")),
    ] {
        let started = Instant::now();
        let (config, listen, _) = config(&plane, |envoy| {
            envoy.ads = ads;
            envoy.xds = xds.map(str::to_owned);
        });
        let supervisor = Supervisor::start(&config.toml());
        let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("bootstrap"));
        try_wait_until(
            Duration::from_secs(30),
            &format!("{variant}: requests through Envoy"),
            || served(listen).then_some(()),
        )
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", supervisor.logs(), envoy.logs()));
        // The xDS connection is TLS, handshaken once.
        assert!(
            envoy.stat("cluster.xds_cluster.ssl.handshake") >= Some(1),
            "{variant}: {}",
            envoy.stats()
        );
        assert_eq!(
            envoy.stat("cluster.xds_cluster.ssl.connection_error"),
            Some(0)
        );
        // ORCA streams to the workers' IP and the gRPC port: over TLS, reports arrive, weights apply.
        try_wait_until(
            Duration::from_secs(30),
            &format!("{variant}: ORCA reports over TLS"),
            || (envoy.stat("cluster.web.lb_orca_oob.reports_received")? >= 6).then_some(()),
        )
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", supervisor.logs(), envoy.stats()));
        assert_eq!(
            envoy.stat("cluster.web.lb_orca_oob.stream_failures"),
            Some(0),
            "{variant}: {}",
            envoy.stats()
        );
        assert!(
            envoy.stat("cluster.web.ssl.handshake") >= Some(2),
            "{variant}: the ORCA streams are TLS: {}",
            envoy.stats()
        );
        wait_until(
            Duration::from_secs(20),
            &format!("{variant}: weights from ORCA"),
            || {
                let hosts = hosts(&envoy.clusters(), "web");
                (hosts.len() == 2 && hosts.iter().all(|h| h.weight > 1)).then_some(())
            },
        );
        eprintln!(
            "{variant}: xDS and ORCA over mutual TLS in {:.1?}",
            started.elapsed()
        );
    }
}

/// `curl` to the gRPC port at `port` over HTTP/2 with TLS, trusting `ca`, presenting `identity`:
/// the HTTP status (0 when no answer came) and curl's error output.
fn curl(port: u16, ca: &Path, identity: Option<(&Path, &Path)>) -> (u32, String) {
    let mut command = Command::new("curl");
    command
        .args(["-sS", "--http2", "-o", "/dev/null", "-w", "%{http_code}"])
        .args(["--max-time", "5", "--cacert"])
        .arg(ca)
        .args(["--resolve", &format!("{SERVER_NAME}:{port}:127.0.0.1")]);
    if let Some((cert, key)) = identity {
        command.arg("--cert").arg(cert).arg("--key").arg(key);
    }
    let output = command
        .arg(format!("https://{SERVER_NAME}:{port}/"))
        .output()
        .expect("curl runs");
    let code = String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .unwrap_or(0);
    (code, String::from_utf8_lossy(&output.stderr).into_owned())
}

#[test]
fn clients_without_a_good_certificate_are_refused_and_the_log_says_why_and_from_where() {
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::write(dir.path());
    let (config, _, grpc) = config(&plane, as_is);
    let supervisor = Supervisor::start(&config.toml());
    let ca = plane.dir.join("ca.pem");
    let envoy = (plane.dir.join("envoy.pem"), plane.dir.join("envoy.key"));
    let intruder = Ca::new("Someone else's CA")
        .leaf("intruder", Usage::Client)
        .write(dir.path(), "intruder");
    let expired = plane
        .ca
        .leaf_valid("old-envoy", Usage::Client, -30..-2)
        .write(dir.path(), "expired");

    // A client with Envoy's certificate gets an HTTP/2 answer from the gRPC server (once it
    // listens: the supervisor opens it after its workers have started).
    let (code, error) = try_wait_until(Duration::from_secs(10), "the gRPC port to answer", || {
        let (code, error) = curl(grpc, &ca, Some((&envoy.0, &envoy.1)));
        (code >= 200).then_some((code, error))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.logs()));
    assert!(code >= 200, "answered: {code} {error}");

    for (what, identity, logged) in [
        ("no certificate", None, "it presented no client certificate"),
        (
            "another CA's",
            Some((&intruder.0, &intruder.1)),
            "which no CA in supervisor.tls.client_ca signed",
        ),
        (
            "an expired one",
            Some((&expired.0, &expired.1)),
            "it presented an expired or not yet valid certificate \"CN=old-envoy\"",
        ),
    ] {
        let (code, error) = curl(
            grpc,
            &ca,
            identity.map(|(c, k): (&std::path::PathBuf, &std::path::PathBuf)| {
                (c.as_path(), k.as_path())
            }),
        );
        assert_eq!(code, 0, "{what}: no HTTP answer ({error})");
        try_wait_until(
            Duration::from_secs(5),
            &format!("the log line for {what}"),
            || {
                supervisor
                    .logs()
                    .lines()
                    .any(|line| {
                        line.contains("gRPC port: TLS client refused")
                            && line.contains(logged)
                            && line.contains("peer=127.0.0.1:")
                    })
                    .then_some(())
            },
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.logs()));
    }
    // The CN of another CA's certificate is named.
    assert!(
        supervisor.logs().contains("CN=intruder"),
        "{}",
        supervisor.logs()
    );

    // Cleartext HTTP/2 (an Envoy without [envoy.tls]).
    let output = Command::new("curl")
        .args(["-sS", "--http2-prior-knowledge", "--max-time", "5"])
        .arg(format!("http://127.0.0.1:{grpc}/"))
        .output()
        .expect("curl runs");
    assert!(!output.status.success());
    try_wait_until(Duration::from_secs(5), "the log line for cleartext", || {
        supervisor
            .logs()
            .contains("it sent cleartext HTTP/2 to a TLS port")
            .then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.logs()));

    // The cleartext preface alone is closed at once: it holds no connection slot.
    let mut cleartext = TcpStream::connect(("127.0.0.1", grpc)).unwrap();
    cleartext
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    cleartext
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .unwrap();
    let sent = Instant::now();
    let read = cleartext.read(&mut [0u8; 1]);
    assert!(
        matches!(&read, Ok(0)) || matches!(&read, Err(e) if e.kind() == ErrorKind::ConnectionReset),
        "not closed within 1 s of the preface: {read:?} after {:?}",
        sent.elapsed()
    );
}

#[test]
fn a_certificate_that_cannot_be_used_stops_the_start_and_says_which() {
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::write(dir.path());
    // The key of another certificate.
    std::fs::copy(plane.dir.join("envoy.key"), plane.dir.join("server.key")).unwrap();
    let (config, _, _) = config(&plane, as_is);
    let path = dir.path().join("peregrine.toml");
    std::fs::write(&path, config.toml_in(dir.path())).unwrap();
    for command in ["check", "run"] {
        let output = Command::new(peregrine_e2e::peregrine_path())
            .arg(command)
            .arg(&path)
            // No metrics port: the default one may be another supervisor's on this machine.
            .env("PEREGRINE_METRICS", "")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{command}: {stderr}");
        assert!(
            stderr.contains("supervisor.tls.key") && stderr.contains("not the key of"),
            "{command}: {stderr}"
        );
    }
    assert!(
        peregrine_e2e::workers_in(dir.path()).is_empty(),
        "no worker started"
    );
}

/// The subject of the certificate a new TLS connection to `port` is shown (`openssl s_client`).
fn served_subject(port: u16, plane: &ControlPlane) -> String {
    let dir = &plane.dir;
    let output = Command::new("openssl")
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}")])
        .args(["-servername", SERVER_NAME, "-alpn", "h2", "-CAfile"])
        .arg(dir.join("ca.pem"))
        .arg("-cert")
        .arg(dir.join("envoy.pem"))
        .arg("-key")
        .arg(dir.join("envoy.key"))
        .stdin(std::process::Stdio::null())
        .output()
        .expect("openssl runs");
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .find_map(|line| line.strip_prefix("subject="))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

#[test]
fn a_certificate_rotated_under_load_is_served_to_new_connections_with_nothing_lost() {
    let Some(_envoy) = envoy_or_skip("certificate rotation") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::write(dir.path());
    let (config, listen, grpc) = config(&plane, as_is);
    let supervisor = Supervisor::start(&config.toml());
    let bootstrap = supervisor.envoy_bootstrap().expect("bootstrap");
    let envoy = Envoy::start(&bootstrap);
    try_wait_until(Duration::from_secs(30), "requests through Envoy", || {
        served(listen).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", supervisor.logs(), envoy.logs()));
    wait_until(Duration::from_secs(30), "ORCA reports over TLS", || {
        (envoy.stat("cluster.web.lb_orca_oob.reports_received")? >= 4).then_some(())
    });
    assert_eq!(served_subject(grpc, &plane), format!("CN = {SERVER_NAME}"));
    let xds_connections = envoy.stat("cluster.xds_cluster.upstream_cx_total");
    let orca_connections = envoy.stat("cluster.web.upstream_cx_total");
    let load = Load::start(listen, 2, 2, Duration::from_secs(60));
    wait_until(Duration::from_secs(10), "the load to flow", || {
        (load.snapshot().served() >= 50).then_some(())
    });

    // The new pair, written beside the old and renamed over it (as cert-manager and certbot do).
    let rotated = plane.ca.leaf("peregrine-rotated", Usage::Server);
    let (cert, key) = rotated.write(dir.path(), "next");
    std::fs::rename(&key, plane.dir.join("server.key")).unwrap();
    std::fs::rename(&cert, plane.dir.join("server.pem")).unwrap();
    let rotated_at = Instant::now();
    try_wait_until(
        Duration::from_secs(10),
        "new connections to be shown the new certificate",
        || (served_subject(grpc, &plane) == "CN = peregrine-rotated").then_some(()),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.logs()));
    eprintln!(
        "the new certificate was served {:.2?} after its files were in place",
        rotated_at.elapsed()
    );
    assert!(
        supervisor
            .logs()
            .contains("new TLS certificates in effect for new connections"),
        "{}",
        supervisor.logs()
    );
    // A new Envoy trusts it (its own ports; the same supervisor).
    let (listen2, admin2) = (free_port(), free_port());
    let second = Envoy::start(
        &bootstrap
            .replace(
                &format!("port_value: {}", listen.port()),
                &format!("port_value: {listen2}"),
            )
            .replace(
                &format!("port_value: {}", envoy.admin_addr().port()),
                &format!("port_value: {admin2}"),
            ),
    );
    try_wait_until(Duration::from_secs(30), "the new Envoy to route", || {
        served(SocketAddr::from(([127, 0, 0, 1], listen2))).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", supervisor.logs(), second.logs()));

    // Load on through the first Envoy for a while after the rotation.
    let after = load.snapshot().served();
    wait_until(
        Duration::from_secs(10),
        "more load after the rotation",
        || (load.snapshot().served() >= after + 100).then_some(()),
    );
    let report = load.stop();
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(
        envoy.stat("cluster.xds_cluster.upstream_cx_total"),
        xds_connections,
        "the xDS connection was never dropped"
    );
    for scope in ["cluster_manager.cds", "cluster.web"] {
        assert_eq!(
            envoy.stat(&format!("{scope}.control_plane.connected_state")),
            Some(1),
            "{scope}'s stream is connected"
        );
    }
    assert_eq!(
        envoy.stat("cluster.web.lb_orca_oob.stream_failures"),
        Some(0),
        "no ORCA stream failed"
    );
    eprintln!(
        "served {} requests, 0 failed; ORCA connections {orca_connections:?} -> {:?}",
        report.served(),
        envoy.stat("cluster.web.upstream_cx_total")
    );
}

#[test]
fn reload_takes_new_certificate_paths_and_refuses_to_switch_tls_off_or_a_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::write(dir.path());
    let (mut config, _, grpc) = config(&plane, as_is);
    let supervisor = Supervisor::start(&config.toml());
    try_wait_until(
        Duration::from_secs(10),
        "the gRPC port to serve TLS",
        || (served_subject(grpc, &plane) == format!("CN = {SERVER_NAME}")).then_some(()),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.logs()));
    let path = supervisor.config_path().to_owned();
    let rewrite = |config: &PeregrineToml| {
        std::fs::write(&path, config.toml_in(supervisor.dir())).unwrap();
    };

    // Other files, named by the reloaded config: in effect at once for new connections.
    let (cert, key) = plane
        .ca
        .leaf("peregrine-next", Usage::Server)
        .write(dir.path(), "next");
    server_tls(&mut config).cert = Some(cert);
    server_tls(&mut config).key = Some(key);
    rewrite(&config);
    supervisor.control("reload", &[]).expect("the reload");
    assert_eq!(served_subject(grpc, &plane), "CN = peregrine-next");

    // A key that is not the certificate's: the reload fails, saying why, and nothing changes.
    let mut wrong_key = config.clone();
    server_tls(&mut wrong_key).key = Some(plane.dir.join("envoy.key"));
    rewrite(&wrong_key);
    let error = supervisor.control("reload", &[]).unwrap_err().to_string();
    assert!(
        error.contains("the new TLS files cannot be used; nothing changed")
            && error.contains("supervisor.tls.key"),
        "{error}"
    );
    assert_eq!(served_subject(grpc, &plane), "CN = peregrine-next");

    // TLS off by reload: refused (it is switched only at start).
    let mut cleartext = config.clone();
    cleartext.supervisor.tls = None;
    cleartext.envoy_mut().tls = None;
    rewrite(&cleartext);
    let error = supervisor.control("reload", &[]).unwrap_err().to_string();
    assert!(
        error
            .contains("TLS on the gRPC port is switched on or off only when the supervisor starts"),
        "{error}"
    );
    assert_eq!(served_subject(grpc, &plane), "CN = peregrine-next");
}

#[test]
fn a_grpc_port_off_loopback_without_tls_is_warned_about() {
    let listen = free_port();
    let grpc = free_port();
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, free_port());
    config.supervisor.bind = Some(format!("http://0.0.0.0:{grpc}"));
    config.service("web", ServiceTable::at("http://127.0.0.1:0").count(1));
    let supervisor = Supervisor::start(&config.toml());
    try_wait_until(Duration::from_secs(10), "the warning", || {
        supervisor
            .logs()
            .contains(&format!(
                "The gRPC port (0.0.0.0:{grpc}) is reachable from other hosts and has no TLS"
            ))
            .then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.logs()));
}
