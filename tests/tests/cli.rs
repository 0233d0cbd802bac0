//! The command line: configuration errors are one line per problem, naming the key and line, with exit
//! code 64, and `run` starts nothing on a bad config or a sampler it cannot run.

use std::process::Command;

use peregrine_e2e::peregrine_path;

fn peregrine(args: &[&str], config: &str) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peregrine.toml");
    std::fs::write(&path, config).unwrap();
    let output = Command::new(peregrine_path())
        .args(args)
        .arg(&path)
        .output()
        .expect("run peregrine");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn a_bad_value_is_one_line_naming_the_key() {
    let (code, _, stderr) = peregrine(
        &["check"],
        "[service.cluster]\ncount = 2\nurl = \"http://127.0.0.1:8080\"\n",
    );
    assert_eq!(code, 64, "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("line 3: service.cluster.url: fixed port 8080 cannot serve 2 workers"),
        "{stderr}"
    );
}

#[test]
fn a_type_error_and_an_unknown_key_are_named() {
    let (code, _, stderr) = peregrine(&["check"], "[supervisor]\nbind = 18000\n");
    assert_eq!(code, 64);
    assert!(
        stderr.contains("line 2: supervisor.bind: invalid type"),
        "{stderr}"
    );
    let (code, _, stderr) = peregrine(&["run"], "[service.cluster]\ncuont = 2\n");
    assert_eq!(
        code, 64,
        "run refuses a bad config before starting anything"
    );
    assert!(
        stderr.contains("line 2") && stderr.contains("cuont"),
        "{stderr}"
    );
}

#[test]
fn a_good_config_checks_and_bootstraps() {
    let config = "[service.cluster]\ncount = 2\n";
    let (code, stdout, stderr) = peregrine(&["check"], config);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("ok (1 service, 2 workers)"), "{stdout}");
    let (code, yaml, stderr) = peregrine(&["envoy-bootstrap"], config);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        yaml.contains("xds_cluster") && yaml.contains("cluster"),
        "{yaml}"
    );
}

#[test]
fn run_refuses_an_ebpf_sampler_that_cannot_load_before_starting_anything() {
    // No capabilities, even as root: the kernel refuses to load the programs.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peregrine.toml");
    std::fs::write(
        &path,
        "[supervisor]\nsampler = \"ebpf\"\n[service.cluster]\n",
    )
    .unwrap();
    let Ok(output) = Command::new("setpriv")
        .args(["--bounding-set=-all", "--inh-caps=-all", "--"])
        .arg(peregrine_path())
        .arg("run")
        .arg(&path)
        .output()
    else {
        peregrine_e2e::skip(
            &peregrine_e2e::current_test(),
            "setpriv (util-linux) is not installed",
        );
        return;
    };
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "nothing else ran: {stderr}");
    assert!(
        stderr.starts_with("error: sampler = \"ebpf\": the eBPF sampler cannot load"),
        "{stderr}"
    );
    assert!(
        stderr.contains("CAP_BPF") || stderr.contains("not built"),
        "the error says what is missing: {stderr}"
    );
}

#[test]
fn json_logs_are_one_object_per_line_from_the_supervisor_and_its_workers() {
    let dir = peregrine_e2e::TempDir::new().unwrap();
    let port = peregrine_e2e::free_port();
    let config = format!(
        "[supervisor]\nbind = \"http://127.0.0.1:{grpc}\"\ncontrol = \"{control}\"\n\n\
         [service.web]\nurl = \"http://127.0.0.1:{port}\"\n",
        grpc = peregrine_e2e::free_port(),
        control = dir.path().join("peregrine.sock").display(),
    );
    let mut supervisor = peregrine_e2e::Supervisor::start_in_with_env(
        &peregrine_path(),
        dir.path(),
        &config,
        &[("PEREGRINE_LOG_FORMAT", "json"), ("RUST_LOG", "info")],
    )
    .unwrap();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    peregrine_e2e::wait_until(
        std::time::Duration::from_secs(30),
        "the worker answering",
        || peregrine_e2e::http_get(addr, "/").ok(),
    );
    let stderr = dir.path().join("peregrine.stderr.log");
    // The worker logs its listener, the supervisor the registration.
    let lines = peregrine_e2e::wait_until(
        std::time::Duration::from_secs(10),
        "the registration in the log",
        || {
            let text = std::fs::read_to_string(&stderr).ok()?;
            text.contains("registered")
                .then(|| text.lines().map(str::to_owned).collect::<Vec<_>>())
        },
    );
    supervisor.stop().unwrap();
    let events: Vec<serde_json::Value> = lines
        .iter()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect();
    assert!(events.len() >= 3, "{lines:?}");
    for event in &events {
        for key in ["timestamp", "level", "target", "message"] {
            assert!(event.get(key).is_some(), "no {key} in {event}");
        }
    }
    // Fields are top-level keys beside the message, e.g. the sampler's kind.
    assert!(
        events
            .iter()
            .any(|e| e["message"] == "Sampling workers" && e.get("sampler").is_some()),
        "{lines:?}"
    );
    assert!(
        events.iter().any(|e| e["target"]
            .as_str()
            .is_some_and(|t| t.starts_with("peregrine_worker"))),
        "a worker's own line: {lines:?}"
    );
}

#[test]
fn an_unknown_log_format_is_a_usage_error() {
    let output = Command::new(peregrine_path())
        .args(["check", "/nonexistent.toml"])
        .env("PEREGRINE_LOG_FORMAT", "xml")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    assert_eq!(
        String::from_utf8_lossy(&output.stderr).trim(),
        "peregrine: PEREGRINE_LOG_FORMAT must be \"text\" or \"json\", got \"xml\""
    );
}
