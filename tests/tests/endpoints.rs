//! The whole path with real processes: `peregrine run` starts hello workers, they register, the
//! supervisor publishes them over CDS/EDS, and the real Envoy routes traffic to them.

use std::{
    collections::BTreeSet,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::Duration,
};

use peregrine_e2e::{
    Host, PeregrineToml, ServiceTable, Stack, envoy_or_skip, http_get, wait_until, worker_pid,
};

fn hostnames(hosts: &[Host]) -> BTreeSet<String> {
    hosts.iter().map(|h| h.hostname.clone()).collect()
}

fn pid_in_hostname(hostname: &str) -> u32 {
    hostname
        .rsplit('-')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("hostname {hostname:?} does not end in a pid"))
}

#[test]
fn two_workers_share_the_traffic_through_envoy() {
    if envoy_or_skip("two_workers_share_the_traffic_through_envoy").is_none() {
        return;
    }
    let mut stack = Stack::start(2);
    let hosts = stack.wait_for_hosts(2);
    let published: BTreeSet<u32> = hosts.iter().map(|h| pid_in_hostname(&h.hostname)).collect();

    let answered = stack.spread(200);
    let pids: BTreeSet<u32> = answered.keys().copied().collect();
    assert_eq!(
        pids, published,
        "every published worker answers, and only they: {answered:?}"
    );
    assert_eq!(answered.values().sum::<usize>(), 200);

    let status = stack
        .supervisor
        .stop()
        .expect("the supervisor stops on SIGTERM");
    assert!(status.success(), "SIGTERM exits 0, got {status}");
    for pid in published {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "worker {pid} outlived its supervisor"
        );
    }
}

#[test]
fn a_killed_worker_is_replaced_without_a_failed_request() {
    if envoy_or_skip("a_killed_worker_is_replaced_without_a_failed_request").is_none() {
        return;
    }
    let stack = Stack::start(2);
    let before = stack.wait_for_hosts(2);

    // A client loop runs throughout; Envoy retries connect failures and resets on another host.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let client = {
        let (stop, ok, failed, listen) = (stop.clone(), ok.clone(), failed.clone(), stack.listen);
        thread::spawn(move || {
            let mut errors = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match http_get(listen, "/") {
                    Ok((200, body)) if worker_pid(&body).is_some() => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    other => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        errors.push(format!("{other:?}"));
                    }
                }
            }
            errors
        })
    };
    wait_until(Duration::from_secs(10), "traffic flowing", || {
        (ok.load(Ordering::Relaxed) >= 20).then_some(())
    });

    let victim = pid_in_hostname(&before[0].hostname);
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(victim as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .expect("kill the worker");

    let after = wait_until(Duration::from_secs(30), "the replacement in Envoy", || {
        let hosts = stack.hosts();
        let names = hostnames(&hosts);
        (hosts.len() == 2
            && hosts.iter().all(|h| h.healthy)
            && !names.contains(&before[0].hostname)
            && names.contains(&before[1].hostname))
        .then_some(hosts)
    });
    let replacement = after
        .iter()
        .map(|h| pid_in_hostname(&h.hostname))
        .find(|pid| *pid != pid_in_hostname(&before[1].hostname))
        .unwrap();
    assert_ne!(replacement, victim);

    // The replacement takes traffic, measured through Envoy while the client loop still runs.
    wait_until(Duration::from_secs(10), "the replacement answering", || {
        let (_, body) = http_get(stack.listen, "/").ok()?;
        (worker_pid(&body) == Some(replacement)).then_some(())
    });
    let served_before_stop = ok.load(Ordering::Relaxed);
    wait_until(
        Duration::from_secs(10),
        "more traffic after the restart",
        || (ok.load(Ordering::Relaxed) >= served_before_stop + 20).then_some(()),
    );
    stop.store(true, Ordering::Relaxed);
    let errors = client.join().unwrap();
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "failed requests while a worker was killed and replaced: {errors:?}"
    );
    assert!(
        stack.supervisor.logs().contains("Restarting worker"),
        "{}",
        stack.supervisor.logs()
    );
}

#[test]
fn envoy_over_ads_follows_a_restart() {
    if envoy_or_skip("envoy_over_ads_follows_a_restart").is_none() {
        return;
    }
    let stack = Stack::start_configured(2, |config| config.envoy_mut().ads = Some(true));
    assert!(
        stack
            .supervisor
            .envoy_bootstrap()
            .unwrap()
            .contains("ads_config"),
        "the bootstrap asks for ADS"
    );
    let before = stack.wait_for_hosts(2);
    let answered = stack.spread(50);
    assert_eq!(answered.len(), 2, "{answered:?}");

    let victim = &before[1].hostname;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid_in_hostname(victim) as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .expect("kill the worker");
    let after = wait_until(Duration::from_secs(30), "the replacement over ADS", || {
        let hosts = stack.hosts();
        (hosts.len() == 2 && hosts.iter().all(|h| h.healthy) && !hostnames(&hosts).contains(victim))
            .then_some(hosts)
    });
    let pids: BTreeSet<u32> = after.iter().map(|h| pid_in_hostname(&h.hostname)).collect();
    wait_until(
        Duration::from_secs(10),
        "both current workers answering",
        || {
            let answered = stack.spread(20);
            (answered.keys().copied().collect::<BTreeSet<_>>() == pids).then_some(())
        },
    );
    assert_eq!(
        stack.envoy.stat("cluster_manager.cds.update_rejected"),
        Some(0)
    );
}

/// Two services behind one Envoy, on dedicated state-of-the-world CDS/EDS streams (`envoy_extra`
/// empty) or ADS: `extra`'s workers are killed and replaced three times. `cluster`'s workers never
/// leave Envoy, and its assignment is never sent again: an EDS response carries only what changed
/// (Envoy counts each update a cluster takes in `cluster.<name>.update_attempt`).
fn a_change_to_one_service_leaves_the_other_as_it_was(test: &str, ads: bool) {
    if envoy_or_skip(test).is_none() {
        return;
    }
    let (grpc, listen, admin) = (
        peregrine_e2e::free_port(),
        peregrine_e2e::free_port(),
        peregrine_e2e::free_port(),
    );
    let mut config = PeregrineToml::one_service(grpc, listen, admin, 2);
    config.envoy_mut().ads = ads.then_some(true);
    config.service("extra", ServiceTable::at("http://localhost:0").count(2));
    let supervisor = peregrine_e2e::Supervisor::start(&config.toml());
    let envoy = peregrine_e2e::Envoy::start(&supervisor.envoy_bootstrap().expect("bootstrap"));
    let healthy = |cluster: &str| {
        let hosts = peregrine_e2e::hosts(&envoy.clusters(), cluster);
        (hosts.len() == 2 && hosts.iter().all(|h| h.healthy)).then_some(hostnames(&hosts))
    };
    let step = Duration::from_secs(30);
    let others = wait_until(step, "cluster's 2 workers in Envoy", || healthy("cluster"));
    let mut extra = wait_until(step, "extra's 2 workers in Envoy", || healthy("extra"));
    let updates = |cluster: &str| {
        envoy
            .stat(&format!("cluster.{cluster}.update_attempt"))
            .unwrap_or_else(|| panic!("cluster.{cluster}.update_attempt: {}", envoy.stats()))
    };
    let (others_before, extra_before) = (updates("cluster"), updates("extra"));
    for round in 0..3 {
        let victim = pid_in_hostname(extra.iter().next().unwrap());
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(victim as i32).unwrap(),
            rustix::process::Signal::KILL,
        )
        .expect("kill the worker");
        extra = wait_until(step, &format!("extra's replacement, round {round}"), || {
            healthy("extra").filter(|now| !now.iter().any(|h| pid_in_hostname(h) == victim))
        });
        assert_eq!(
            healthy("cluster").as_ref(),
            Some(&others),
            "cluster's workers left Envoy in round {round}"
        );
    }
    assert!(updates("extra") > extra_before, "extra took its changes");
    assert_eq!(
        updates("cluster"),
        others_before,
        "cluster's assignment was sent again though it did not change"
    );
}

#[test]
fn a_change_to_one_service_leaves_the_other_as_it_was_over_dedicated_streams() {
    a_change_to_one_service_leaves_the_other_as_it_was(
        "a_change_to_one_service_leaves_the_other_as_it_was_over_dedicated_streams",
        false,
    );
}

#[test]
fn a_change_to_one_service_leaves_the_other_as_it_was_over_ads() {
    a_change_to_one_service_leaves_the_other_as_it_was(
        "a_change_to_one_service_leaves_the_other_as_it_was_over_ads",
        true,
    );
}
