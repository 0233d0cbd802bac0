//! `peregrine tls init`: the certificates it writes are taken by a real TLS stack. etcd (Go's TLS),
//! started with the etcd CA and server certificate and client-certificate auth, answers a client
//! that presents `etcd-client.pem` and refuses one that presents none or Envoy's (another CA's);
//! `openssl verify` checks every chain and purpose.

use std::{path::Path, process::Command, time::Duration};

use peregrine_e2e::{
    ChildGuard, etcd_or_skip, etcd_path, free_port, peregrine_path, try_wait_until,
};

/// `curl` of `url` with `args`; its exit code and output.
fn curl(url: &str, args: &[&str]) -> (i32, String) {
    let output = Command::new("curl")
        .args(["-sS", "--max-time", "5"])
        .args(args)
        .arg(url)
        .output()
        .expect("curl runs (apt install curl)");
    (
        output.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    )
}

fn openssl_verify(dir: &Path, ca: &str, purpose: &str, cert: &str) -> bool {
    Command::new("openssl")
        .current_dir(dir)
        .args(["verify", "-CAfile", ca, "-purpose", purpose, cert])
        .output()
        .expect("openssl runs (apt install openssl)")
        .status
        .success()
}

#[test]
fn the_test_certificates_are_taken_by_openssl_and_by_etcd_with_client_certificate_auth() {
    let test =
        "the_test_certificates_are_taken_by_openssl_and_by_etcd_with_client_certificate_auth";
    if !etcd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().expect("a temp dir");
    let tls = dir.path().join("tls");
    let output = Command::new(peregrine_path())
        .args(["tls", "init"])
        .arg(&tls)
        .args(["--san", "127.0.0.1"])
        .output()
        .expect("peregrine tls init");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for (ca, purpose, cert) in [
        ("ca.pem", "sslserver", "server.pem"),
        ("ca.pem", "sslclient", "envoy.pem"),
        ("etcd-ca.pem", "sslserver", "etcd-server.pem"),
        ("etcd-ca.pem", "sslclient", "etcd-client.pem"),
        // A member presents its peer certificate as the server of a peer connection and as its
        // client.
        ("etcd-ca.pem", "sslserver", "etcd-peer.pem"),
        ("etcd-ca.pem", "sslclient", "etcd-peer.pem"),
    ] {
        assert!(openssl_verify(&tls, ca, purpose, cert), "{cert} by {ca}");
    }
    // The two trust domains are apart.
    assert!(!openssl_verify(
        &tls,
        "etcd-ca.pem",
        "sslclient",
        "envoy.pem"
    ));

    let (client_port, peer_port) = (free_port(), free_port());
    let client = format!("https://127.0.0.1:{client_port}");
    let path = |name: &str| tls.join(name).display().to_string();
    let mut etcd = Command::new(etcd_path().expect("etcd"));
    etcd.args(["--name", "tls", "--data-dir"])
        .arg(dir.path().join("etcd-data"))
        .args([
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
        ])
        .arg("--listen-peer-urls")
        .arg(format!("http://127.0.0.1:{peer_port}"))
        .args(["--cert-file", &path("etcd-server.pem")])
        .args(["--key-file", &path("etcd-server.key")])
        .args(["--trusted-ca-file", &path("etcd-ca.pem")])
        .arg("--client-cert-auth");
    let _etcd = ChildGuard::spawn("etcd", &mut etcd, dir.path()).expect("etcd starts");
    let health = format!("{client}/health");
    let with_client_cert = [
        "--cacert",
        &path("etcd-ca.pem"),
        "--cert",
        &path("etcd-client.pem"),
        "--key",
        &path("etcd-client.key"),
    ];
    let answer = try_wait_until(Duration::from_secs(20), "etcd to answer over TLS", || {
        let (code, out) = curl(&health, &with_client_cert);
        (code == 0 && out.contains("\"health\":\"true\"")).then_some(out)
    })
    .unwrap_or_else(|e| panic!("{e}: {:?}", curl(&health, &with_client_cert)));
    assert!(answer.contains("true"), "{answer}");
    // No client certificate, or Envoy's (signed by the control plane's CA): refused.
    let (code, out) = curl(&health, &["--cacert", &path("etcd-ca.pem")]);
    assert_ne!(code, 0, "no client certificate: {out}");
    let (code, out) = curl(
        &health,
        &[
            "--cacert",
            &path("etcd-ca.pem"),
            "--cert",
            &path("envoy.pem"),
            "--key",
            &path("envoy.key"),
        ],
    );
    assert_ne!(code, 0, "a certificate of the other CA: {out}");
}
