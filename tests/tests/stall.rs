//! A stopped worker loses its traffic, not its neighbours': under continuous load through the real
//! Envoy, SIGSTOP one of two workers for 10 s. The supervisor sees it stopped and publishes it
//! unhealthy (an idle-looking load report would have drawn more traffic to it), Envoy retries the
//! tries that time out in its hands on the other worker, throughput stays within 60% of what it was,
//! and after SIGCONT the worker is back in rotation with no failed request.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use peregrine_e2e::{
    CLUSTER, Envoy, Load, PeregrineToml, Supervisor, envoy_or_skip, free_port, wait_until,
};
use rustix::process::{Pid, Signal, kill_process};

const STEP: Duration = Duration::from_secs(30);

fn signal(pid: u32, signal: Signal) {
    kill_process(Pid::from_raw(pid as i32).unwrap(), signal).unwrap();
}

/// Requests served per second over `window`, measured on `load`.
fn rate(load: &Load, window: Duration) -> f64 {
    let before = load.snapshot().served();
    let started = Instant::now();
    std::thread::sleep(window);
    (load.snapshot().served() - before) as f64 / started.elapsed().as_secs_f64()
}

#[test]
fn a_stopped_worker_is_taken_out_of_rotation_and_comes_back() {
    if envoy_or_skip("a_stopped_worker_is_taken_out_of_rotation_and_comes_back").is_none() {
        return;
    }
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::one_service(grpc, listen, admin, 2);
    config.supervisor.sample_interval_ms = Some(250);
    config.envoy_mut().per_try_timeout_ms = Some(500);
    let supervisor = Supervisor::start(&config.toml());
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("bootstrap"));
    let healthy = || -> BTreeSet<u32> {
        envoy
            .host_pids(CLUSTER)
            .map(|(healthy, _)| healthy)
            .unwrap_or_default()
    };
    let workers = wait_until(STEP, "two healthy workers in Envoy", || {
        let pids = healthy();
        (pids.len() == 2).then_some(pids)
    });
    let stopped = *workers.iter().next().unwrap();
    let load = Load::start(
        std::net::SocketAddr::from(([127, 0, 0, 1], listen)),
        2,
        2,
        Duration::from_secs(90),
    );
    wait_until(STEP, "the load served", || {
        (load.snapshot().served() > 100).then_some(())
    });
    let normal = rate(&load, Duration::from_secs(3));

    signal(stopped, Signal::STOP);
    let stopped_at = Instant::now();
    let out = wait_until(STEP, "the stopped worker out of rotation", || {
        (!healthy().contains(&stopped)).then(|| stopped_at.elapsed())
    });
    let status = supervisor.status_table().expect("status");
    assert!(status.contains("stalled"), "{status}");
    let during = rate(
        &load,
        Duration::from_secs(10).saturating_sub(stopped_at.elapsed()),
    );
    signal(stopped, Signal::CONT);
    let continued = Instant::now();
    let back = wait_until(STEP, "the worker back in rotation", || {
        healthy().contains(&stopped).then(|| continued.elapsed())
    });
    let served_before = load.snapshot().by_pid.get(&stopped).copied().unwrap_or(0);
    wait_until(STEP, "the worker serving again", || {
        (load.snapshot().by_pid.get(&stopped).copied().unwrap_or(0) > served_before + 20)
            .then_some(())
    });
    let report = load.stop();
    for stat in [
        "upstream_rq_per_try_timeout",
        "upstream_rq_timeout",
        "upstream_rq_retry",
        "upstream_rq_retry_success",
        "upstream_rq_retry_overflow",
        "outlier_detection.ejections_enforced_total",
    ] {
        let name = format!("cluster.{CLUSTER}.{stat}");
        println!("{name}: {:?}", envoy.stat(&name));
    }
    println!(
        "normal {normal:.0} req/s; stopped: out of rotation after {out:?}, {during:.0} req/s \
         ({:.0}%); back {back:?} after SIGCONT; {} served, {} failed",
        100.0 * during / normal,
        report.served(),
        report.failures.len()
    );
    assert!(
        during >= 0.6 * normal,
        "throughput fell from {normal:.0} to {during:.0} req/s"
    );
    assert!(
        report.failures.is_empty(),
        "{} failed: {:?}",
        report.failures.len(),
        &report.failures[..report.failures.len().min(5)]
    );
    let logs = supervisor.logs();
    assert!(logs.contains("Worker stalled"), "{logs}");
    assert!(logs.contains("Stalled worker moves again"), "{logs}");
}
