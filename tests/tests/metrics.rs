//! Prometheus metrics, scraped by a real Prometheus (Debian's `prometheus`, started here with a scrape
//! config pointing at the supervisor): its query API returns the workers' series, a killed worker
//! shows in `peregrine_worker_restarts_total`, and sampler passes and drains are timed. Without
//! Prometheus that test skips (fails with `PEREGRINE_REQUIRE_PROMETHEUS=1`). A real Envoy's
//! convergence on a restart is timed too, read from a plain scrape.

use std::{net::SocketAddr, process::Command, time::Duration};

use peregrine_e2e::{
    ChildGuard, Envoy, PeregrineToml, ServiceTable, Supervisor, TempDir, free_port, http_get,
    peregrine_path, tool_or_skip, try_wait_until, wait_until,
};
use serde_json::Value;

/// The series of an instant query: each one's labels and value.
fn query(prometheus: SocketAddr, expr: &str) -> Option<Vec<(Value, f64)>> {
    let (status, body) = http_get(prometheus, &format!("/api/v1/query?query={expr}")).ok()?;
    if status != 200 {
        return None;
    }
    let json: Value = serde_json::from_str(&body).ok()?;
    json["data"]["result"]
        .as_array()?
        .iter()
        .map(|series| {
            let value = series["value"][1].as_str()?.parse().ok()?;
            Some((series["metric"].clone(), value))
        })
        .collect()
}

/// examples/prometheus-alerts.yml is valid for Prometheus (`promtool check rules`), and every metric it
/// reads is one docs/operating.md lists as served (a renamed metric would leave an alert that never
/// fires).
#[test]
fn the_example_alerts_are_valid_rules_on_served_metrics() {
    if !tool_or_skip(
        "Prometheus's promtool",
        "promtool",
        "--version",
        "PEREGRINE_REQUIRE_PROMETHEUS",
        "apt install prometheus",
    ) {
        return;
    }
    let rules = peregrine_e2e::workspace_root().join("examples/prometheus-alerts.yml");
    let output = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&rules)
        .output()
        .expect("promtool");
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let text = std::fs::read_to_string(&rules).unwrap();
    let documented =
        std::fs::read_to_string(peregrine_e2e::workspace_root().join("docs/operating.md")).unwrap();
    let metrics: std::collections::BTreeSet<&str> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("peregrine_"))
        .collect();
    assert!(metrics.len() >= 6, "{metrics:?}");
    for metric in metrics {
        // A histogram's series are its name with `_bucket`, `_sum` and `_count`.
        let name = metric.trim_end_matches("_bucket");
        assert!(
            documented.contains(&format!("| `{name}` |")),
            "{metric} is no metric docs/operating.md lists"
        );
    }
}

#[test]
fn prometheus_scrapes_the_workers_and_sees_a_restart() {
    if !tool_or_skip(
        "Prometheus metrics",
        "prometheus",
        "--version",
        "PEREGRINE_REQUIRE_PROMETHEUS",
        "apt install prometheus",
    ) {
        return;
    }
    let dir = TempDir::new().unwrap();
    let metrics = free_port();
    let mut config = PeregrineToml::local(free_port());
    config.supervisor.restart_delay_ms = Some(50);
    config.service("web", ServiceTable::at("http://127.0.0.1:0").count(2));
    let supervisor = Supervisor::start_in_with_env(
        &peregrine_path(),
        dir.path(),
        &config.toml(),
        &[("PEREGRINE_METRICS", &format!("http://127.0.0.1:{metrics}"))],
    )
    .unwrap();
    let scrape = dir.path().join("prometheus.yml");
    std::fs::write(
        &scrape,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: peregrine\n    \
             static_configs:\n      - targets: ['127.0.0.1:{metrics}']\n"
        ),
    )
    .unwrap();
    let web = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let _prometheus = ChildGuard::spawn(
        "prometheus",
        Command::new("prometheus")
            .arg(format!("--config.file={}", scrape.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={web}")),
        dir.path(),
    )
    .unwrap();
    let logs = || {
        format!(
            "{}\n{}",
            supervisor.logs(),
            std::fs::read_to_string(dir.path().join("prometheus.stderr.log")).unwrap_or_default()
        )
    };

    // Both workers' series, labelled by service and slot (no pid), sampled (a value exists).
    let series = try_wait_until(Duration::from_secs(30), "the workers' CPU series", || {
        let series = query(web, "peregrine_worker_cpu_cores")?;
        (series.len() == 2).then_some(series)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
    let mut indexes: Vec<&str> = series
        .iter()
        .map(|(labels, _)| {
            assert_eq!(labels["service"], "web", "{labels}");
            assert!(labels.get("pid").is_none(), "{labels}");
            labels["index"].as_str().unwrap()
        })
        .collect();
    indexes.sort_unstable();
    assert_eq!(indexes, ["0", "1"]);
    let ready = query(web, "peregrine_workers").unwrap();
    assert!(
        ready
            .iter()
            .any(|(l, v)| l["state"] == "ready" && *v == 2.0),
        "{ready:?}"
    );
    assert!(query(web, "process_resident_memory_bytes").is_some_and(|s| s.len() == 1));

    // A killed worker is restarted, and the counter says so.
    let status = supervisor.status_json().unwrap();
    let pid = status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["index"] == 0)
        .and_then(|w| w["pid"].as_u64())
        .unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    try_wait_until(Duration::from_secs(30), "the restart in Prometheus", || {
        let restarts = query(web, "peregrine_worker_restarts_total")?;
        restarts
            .iter()
            .any(|(l, v)| l["index"] == "0" && *v >= 1.0)
            .then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));

    // Every sampler pass is timed, and a restart's drains too (no Envoy here: each drain ends at
    // once, with no stream to wait for).
    supervisor.control("restart", &[]).unwrap();
    try_wait_until(Duration::from_secs(30), "the timings in Prometheus", || {
        let passes = query(web, "peregrine_sampler_pass_seconds_count")?;
        let drains = query(web, "peregrine_drain_seconds_count")?;
        (passes.first()?.1 >= 2.0 && drains.first()?.1 >= 2.0).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
}

/// The value of the unlabelled sample `name` in a scrape.
fn sample(scrape: &str, name: &str) -> Option<f64> {
    scrape.lines().find_map(|line| {
        let (series, value) = line.split_once(' ')?;
        (series == name).then(|| value.parse().ok())?
    })
}

#[test]
fn a_real_envoys_convergence_on_a_restart_is_timed() {
    let dir = TempDir::new().unwrap();
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::one_service(grpc, listen, admin, 2);
    config.supervisor.restart_delay_ms = Some(50);
    let supervisor = Supervisor::start_in_with_env(
        &peregrine_path(),
        dir.path(),
        &config.toml(),
        &[("PEREGRINE_METRICS", &format!("http://{metrics}"))],
    )
    .unwrap();
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().unwrap());
    let hosts = || peregrine_e2e::hosts(&envoy.clusters(), "cluster");
    let scrape = || {
        http_get(metrics, "/metrics")
            .map(|(_, body)| body)
            .unwrap_or_default()
    };
    wait_until(Duration::from_secs(30), "2 hosts in Envoy", || {
        (hosts().len() == 2).then_some(())
    });
    let before = sample(&scrape(), "peregrine_xds_convergence_seconds_count").unwrap_or(0.0);

    // A killed worker: its removal and its successor are registry changes Envoy must ACK.
    let pid = supervisor.worker_pids()[0];
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    wait_until(Duration::from_secs(30), "the successor in Envoy", || {
        let hosts = hosts();
        (hosts.len() == 2
            && hosts
                .iter()
                .all(|h| peregrine_e2e::hostname_pid(&h.hostname) != Some(pid)))
        .then_some(())
    });
    let (count, sum) = wait_until(Duration::from_secs(10), "the convergence timed", || {
        let scrape = scrape();
        let count = sample(&scrape, "peregrine_xds_convergence_seconds_count")?;
        let sum = sample(&scrape, "peregrine_xds_convergence_seconds_sum")?;
        (count >= before + 2.0).then_some((count, sum))
    });
    // On loopback an Envoy ACKs within milliseconds; the bound leaves room for a loaded machine.
    let mean = sum / count;
    eprintln!("{count} changes converged, {:.2} ms on average", mean * 1e3);
    assert!(
        mean > 0.0 && mean < 1.0,
        "mean convergence {mean} s over {count}"
    );
    let scrape = scrape();
    assert!(
        scrape.contains("peregrine_xds_streams{type=\"eds\",variant=\"sotw\"} 1"),
        "{scrape}"
    );
    assert!(
        sample(&scrape, "peregrine_xds_pushes_total{type=\"eds\"}").is_some_and(|n| n >= 3.0),
        "{scrape}"
    );
}
