//! A worker that exits at once is restarted with a growing delay, never in a tight loop, `peregrine
//! status` shows the loop, and the other service's workers keep serving through Envoy meanwhile.

use std::{collections::BTreeSet, net::SocketAddr, time::Duration};

use peregrine_e2e::{
    Envoy, PeregrineToml, ServiceTable, Supervisor, envoy_or_skip, free_port, hosts, http_get,
    wait_until, worker_pid,
};

/// The restart delays the supervisor logged for the service `crashy`, in milliseconds.
fn crashy_delays(logs: &str) -> Vec<f64> {
    logs.lines()
        .filter(|l| l.contains("service=crashy") && l.contains("Restarting worker after backoff"))
        .filter_map(|l| {
            let delay = l.split("delay=").nth(1)?.split_whitespace().next()?;
            let ms = match delay.strip_suffix("ms") {
                Some(ms) => ms.parse::<f64>().ok()?,
                None => delay.strip_suffix('s')?.parse::<f64>().ok()? * 1000.0,
            };
            Some(ms)
        })
        .collect()
}

#[test]
fn a_crashing_worker_backs_off_and_the_others_serve() {
    if envoy_or_skip("a_crashing_worker_backs_off_and_the_others_serve").is_none() {
        return;
    }
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    config.service("web", ServiceTable::default().count(2));
    let crashy = ServiceTable::default()
        .command(["sh", "-c", "exit 3"])
        .prefix("/crashy");
    config.service("crashy", crashy);
    let supervisor = Supervisor::start(&config.toml());
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().unwrap());
    wait_until(Duration::from_secs(30), "2 web hosts", || {
        (hosts(&envoy.clusters(), "web").len() == 2).then_some(())
    });

    // 100 + 200 + 400 + 800 ms: four restarts take at least 1.5 s.
    let delays = wait_until(Duration::from_secs(30), "four restarts of crashy", || {
        let delays = crashy_delays(&supervisor.logs());
        (delays.len() >= 4).then_some(delays)
    });
    assert_eq!(
        delays[..4],
        [100.0, 200.0, 400.0, 800.0],
        "the delay doubles from 100 ms"
    );
    assert!(
        supervisor.logs().contains("exit=exit code 3"),
        "the exit status is logged"
    );

    // `peregrine status` shows the loop: the slot's state, its last exit, its growing delay.
    let crashy = wait_until(Duration::from_secs(30), "status to show the loop", || {
        let status = supervisor.status_json().ok()?;
        let rows = status["workers"].as_array()?.clone();
        let crashy = rows.iter().find(|r| r["service"] == "crashy")?.clone();
        let webs_ready = rows
            .iter()
            .filter(|r| r["service"] == "web")
            .all(|r| r["state"] == "ready");
        (webs_ready && crashy["restarts"].as_u64() >= Some(4)).then_some(crashy)
    });
    assert_eq!(crashy["state"], "crash-loop", "{crashy}");
    assert_eq!(crashy["last_exit"], "exit code 3", "{crashy}");
    assert!(crashy["pid"].is_null(), "{crashy}");
    assert!(
        crashy["restart_delay_ms"].as_u64() >= Some(800),
        "the delay grew: {crashy}"
    );
    let table = supervisor.status_table().unwrap();
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("crashy") && l.contains("crash-loop")),
        "{table}"
    );

    // Meanwhile the web workers serve, and crashy has no endpoint.
    let listener = SocketAddr::from(([127, 0, 0, 1], listen));
    let pids: BTreeSet<u32> = (0..20)
        .map(|_| {
            let (status, body) = http_get(listener, "/").unwrap();
            assert_eq!(status, 200, "{body}");
            worker_pid(&body).unwrap()
        })
        .collect();
    assert_eq!(pids.len(), 2);
    assert!(hosts(&envoy.clusters(), "crashy").is_empty());
    let (status, _) = http_get(listener, "/crashy").unwrap();
    assert_eq!(status, 503, "no crashy worker to route to");
}
