//! The sampler's choice of source against the real supervisor: `auto` takes eBPF where it loads and
//! falls back to procfs, with a warning, where it cannot (a root supervisor stripped of every
//! capability); with eBPF, a real worker's CPU burn shows in its sampled CPU time.

use std::{net::SocketAddr, time::Duration};

use peregrine_e2e::{
    PeregrineToml, ServiceTable, Supervisor, config::Sampler, ebpf_or_skip, free_port, http_get,
    try_wait_until, worker_pid,
};
use serde_json::Value;

/// A config with one `web` worker on a fixed port, sampled by `sampler` every 100 ms.
fn config(sampler: Sampler, port: u16) -> String {
    let mut config = PeregrineToml::local(free_port()).with_envoy(free_port(), free_port());
    config.supervisor.sampler = Some(sampler);
    config.supervisor.sample_interval_ms = Some(100);
    config.service("web", ServiceTable::at(format!("http://127.0.0.1:{port}")));
    config.toml()
}

/// `status --json` once `ready` accepts it.
#[track_caller]
fn wait_for_status(supervisor: &Supervisor, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    try_wait_until(Duration::from_secs(30), what, || {
        last = supervisor.status_json().ok()?;
        ready(&last).then(|| last.clone())
    })
    .unwrap_or_else(|error| panic!("{error}; last status: {last}\n{}", supervisor.logs()))
}

fn web(status: &Value) -> &Value {
    &status["workers"][0]
}

#[test]
fn auto_chooses_ebpf_where_it_loads() {
    if !ebpf_or_skip("auto_chooses_ebpf_where_it_loads") {
        return;
    }
    let supervisor = Supervisor::start(&config(Sampler::Auto, free_port()));
    let status = wait_for_status(&supervisor, "a sampled worker", |s| {
        web(s)["cpu_cores"].is_f64()
    });
    assert_eq!(status["sampler"], "ebpf", "{status}");
    assert!(
        supervisor
            .logs()
            .contains("Sampler chosen for sampler = \"auto\""),
        "one line says which sampler auto chose:\n{}",
        supervisor.logs()
    );
}

#[test]
fn auto_falls_back_to_procfs_with_a_warning_where_ebpf_cannot_load() {
    if which("setpriv").is_none() {
        peregrine_e2e::skip(
            &peregrine_e2e::current_test(),
            "setpriv (util-linux) is not installed",
        );
        return;
    }
    let port = free_port();
    let supervisor = Supervisor::start_without_capabilities(&config(Sampler::Auto, port));
    let status = wait_for_status(&supervisor, "a sampled worker", |s| {
        web(s)["cpu_cores"].is_f64()
    });
    assert_eq!(status["sampler"], "procfs", "{status}");
    let logs = supervisor.logs();
    let warning = logs
        .lines()
        .find(|line| line.contains("falling back to procfs"))
        .unwrap_or_else(|| panic!("no fallback warning:\n{logs}"));
    assert!(
        warning.contains("WARN") && warning.contains("eBPF"),
        "the warning says why: {warning}"
    );
    // The workers serve as ever.
    let (code, body) = http_get(SocketAddr::from(([127, 0, 0, 1], port)), "/").unwrap();
    assert_eq!(code, 200, "{body}");
}

#[test]
fn a_workers_cpu_burn_shows_in_its_ebpf_sample() {
    if !ebpf_or_skip("a_workers_cpu_burn_shows_in_its_ebpf_sample") {
        return;
    }
    let port = free_port();
    let supervisor = Supervisor::start(&config(Sampler::Ebpf, port));
    let before = wait_for_status(&supervisor, "a sampled worker", |s| {
        web(s)["cpu_seconds_total"].is_f64()
    });
    let pid = web(&before)["pid"].as_u64().unwrap();
    let cpu_before = web(&before)["cpu_seconds_total"].as_f64().unwrap();
    let (code, body) = http_get(SocketAddr::from(([127, 0, 0, 1], port)), "/?cpu=400").unwrap();
    assert_eq!((code, worker_pid(&body)), (200, Some(pid as u32)), "{body}");
    let after = wait_for_status(&supervisor, "the burn sampled", |s| {
        web(s)["cpu_seconds_total"].as_f64() >= Some(cpu_before + 0.38)
    });
    let burned = web(&after)["cpu_seconds_total"].as_f64().unwrap() - cpu_before;
    assert!(
        burned < 1.0,
        "a 400 ms burn read as {burned:.3} s of CPU: {after}"
    );
}

fn which(program: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}
