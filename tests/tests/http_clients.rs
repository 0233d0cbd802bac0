//! Real HTTP clients against a real worker (started by the supervisor on a known port): curl, and
//! Python's h11 and h2, strict implementations that reject any protocol violation in our responses.

use std::process::Command;

use peregrine_e2e::{one_worker, python_clients_or_skip, workspace_root};

fn curl(args: &[&str]) -> (bool, String, String) {
    let output = Command::new("curl")
        .args(["--silent", "--show-error", "--max-time", "10"])
        .args(args)
        .output()
        .expect("curl runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn curl_speaks_http1_with_the_one_worker() {
    let (_supervisor, addr) = one_worker();
    let url = format!("http://{addr}/");

    let (ok, body, err) = curl(&["--http1.1", &url, &url]);
    assert!(ok, "{err}");
    assert_eq!(
        body.matches("Hello from worker ").count(),
        2,
        "two requests, one connection: {body}"
    );

    let (ok, head, err) = curl(&["--http1.1", "--head", &url]);
    assert!(ok, "{err}");
    assert!(
        head.starts_with("HTTP/1.1 200 OK\r\n") && head.contains("content-length: "),
        "{head}"
    );

    let (ok, body, err) = curl(&["--http1.0", &url]);
    assert!(ok, "{err}");
    assert!(body.starts_with("Hello from worker "), "{body}");

    // A chunked upload below the body limit is accepted.
    let (ok, body, err) = curl(&[
        "--http1.1",
        "-H",
        "Transfer-Encoding: chunked",
        "--data-binary",
        &"z".repeat(100_000),
        &url,
    ]);
    assert!(ok, "{err}");
    assert!(body.starts_with("Hello from worker "), "{body}");

    let big = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(big.path(), vec![b'q'; 2 * 1024 * 1024]).unwrap();
    let (ok, status, err) = curl(&[
        "--http1.1",
        "--output",
        "/dev/null",
        "--write-out",
        "%{http_code}",
        "--data-binary",
        &format!("@{}", big.path().display()),
        &url,
    ]);
    assert!(ok, "{err}");
    assert_eq!(status, "413", "a body over the 1 MiB limit");
}

/// Runs `tests/clients/<script>` against a worker; `None` (skipped) without the Python clients.
fn python_client(test: &str, script: &str) -> Option<String> {
    let python = python_clients_or_skip(test)?;
    let (_supervisor, addr) = one_worker();
    let output = Command::new(python)
        .arg(workspace_root().join("tests/clients").join(script))
        .arg(addr.ip().to_string())
        .arg(addr.port().to_string())
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(stdout)
}

#[test]
fn h11_finds_no_protocol_violation() {
    let Some(stdout) = python_client("h11_finds_no_protocol_violation", "h11_client.py") else {
        return;
    };
    for check in ["keep-alive", "100-continue", "head", "connection close"] {
        assert!(stdout.contains(check), "{check} not reached:\n{stdout}");
    }
}

#[test]
fn curl_speaks_h2c_with_the_one_worker() {
    let (_supervisor, addr) = one_worker();
    let url = format!("http://{addr}/");
    // One URL per run: curl 7.88 fails to reuse an h2c connection for a second URL (it does so against
    // a hyper server as well); the python h2 test below covers many streams on one connection.
    let (ok, out, err) = curl(&[
        "--http2-prior-knowledge",
        "--include",
        "--write-out",
        "\n%{http_version}",
        &url,
    ]);
    assert!(ok, "{err}");
    assert!(out.starts_with("HTTP/2 200"), "{out}");
    assert!(out.contains("content-length: "), "{out}");
    assert!(out.contains("Hello from worker "), "{out}");
    assert!(out.ends_with("\n2"), "spoken over HTTP/2: {out}");
}

#[test]
fn python_h2_finds_no_protocol_violation() {
    let Some(stdout) = python_client("python_h2_finds_no_protocol_violation", "h2_client.py")
    else {
        return;
    };
    assert!(stdout.contains("50 concurrent streams ok"), "{stdout}");
    assert!(stdout.contains("malformed stream reset ok"), "{stdout}");
}
