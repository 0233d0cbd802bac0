//! Zero-downtime lifecycle with real processes: rolling restarts (`peregrine restart`, SIGHUP), scaling
//! by reload, and a supervisor killed and started again, each under continuous HTTP/1.1 and HTTP/2
//! load through the real Envoy. Every request is checked; none may fail.

use std::{collections::BTreeSet, process::Command, time::Instant};

use peregrine_e2e::{
    CLUSTER, Load, LoadReport, PeregrineToml, ServiceTable, Stack, deploy::STEP, envoy_or_skip,
    gone, peregrine_path, wait_until,
};

/// Starts a [`Stack`] of `workers` (see [`Stack::start_configured`]) and waits until Envoy routes to
/// them all.
fn started(workers: u32, configure: impl FnOnce(&mut PeregrineToml)) -> Stack {
    let stack = Stack::start_configured(workers, configure);
    stack.wait_for_workers(workers as usize, &BTreeSet::new());
    stack
}

/// What the lifecycle tests do with a stack.
trait Deploys {
    fn envoy_pids(&self) -> (BTreeSet<u32>, BTreeSet<u32>);
    fn wait_for_workers(&self, n: usize, not: &BTreeSet<u32>) -> BTreeSet<u32>;
    fn load(&self) -> Load;
    fn control(&self, command: &str, extra: &[&str]) -> String;
    fn set_count(&self, count: u32);
    fn finish(&self, load: Load, more: u64, workers: &BTreeSet<u32>) -> LoadReport;
}

impl Deploys for Stack {
    fn envoy_pids(&self) -> (BTreeSet<u32>, BTreeSet<u32>) {
        self.deployed().envoy_pids()
    }

    fn wait_for_workers(&self, n: usize, not: &BTreeSet<u32>) -> BTreeSet<u32> {
        self.deployed().wait_for_workers(n, not)
    }

    fn load(&self) -> Load {
        self.deployed().load()
    }

    /// Runs `peregrine COMMAND CONFIG [EXTRA]` and returns its stdout; panics if it fails.
    fn control(&self, command: &str, extra: &[&str]) -> String {
        self.supervisor
            .control(command, extra)
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.supervisor.all_logs()))
    }

    /// Replaces `count = N` in the config file.
    fn set_count(&self, count: u32) {
        self.supervisor.set_count(count).expect("the config file");
    }

    fn finish(&self, load: Load, more: u64, workers: &BTreeSet<u32>) -> LoadReport {
        self.deployed().finish(load, more, workers)
    }
}

#[test]
fn a_rolling_restart_under_load_loses_no_request() {
    if envoy_or_skip("a_rolling_restart_under_load_loses_no_request").is_none() {
        return;
    }
    rolling_restarts(started(3, |_| {}));
}

#[test]
fn a_rolling_restart_over_ads_loses_no_request() {
    if envoy_or_skip("a_rolling_restart_over_ads_loses_no_request").is_none() {
        return;
    }
    rolling_restarts(started(3, |config| config.envoy_mut().ads = Some(true)));
}

#[test]
fn a_rolling_restart_over_delta_xds_loses_no_request() {
    if envoy_or_skip("a_rolling_restart_over_delta_xds_loses_no_request").is_none() {
        return;
    }
    rolling_restarts(started(3, |config| {
        config.envoy_mut().xds = Some("delta".into())
    }));
}

#[test]
fn a_rolling_restart_of_workers_on_unix_sockets_loses_no_request() {
    if envoy_or_skip("a_rolling_restart_of_workers_on_unix_sockets_loses_no_request").is_none() {
        return;
    }
    // A Unix socket path is the worker's fixed address: each worker is drained and stopped before its
    // successor binds the same path, while the other workers serve.
    rolling_restarts(started(3, |config| {
        config.service_mut(CLUSTER).url = Some("unix://{dir}/w-{index}.sock".into());
    }));
}

/// `peregrine restart`, then SIGHUP, under load: each replaces all 3 workers, and no request fails.
fn rolling_restarts(mut stack: Stack) {
    let first = stack.wait_for_workers(3, &BTreeSet::new());
    let load = stack.load();

    let begun = Instant::now();
    let out = stack.control("restart", &[]);
    let took = begun.elapsed();
    assert!(
        out.starts_with("3 replaced, 0 added, 0 removed, 0 failed"),
        "{out}"
    );
    // When the command returns, the old workers are gone and the new ones serve.
    let second = stack.wait_for_workers(3, &first);
    for pid in &first {
        assert!(gone(*pid), "worker {pid} still runs after the restart");
    }
    eprintln!("rolling restart of 3 workers took {took:?}");

    // SIGHUP restarts every worker too.
    stack
        .supervisor
        .process()
        .signal(rustix::process::Signal::HUP)
        .unwrap();
    let replaced: BTreeSet<u32> = first.union(&second).copied().collect();
    let third = stack.wait_for_workers(3, &replaced);
    wait_until(STEP, "the old workers to exit after SIGHUP", || {
        second.iter().all(|pid| gone(*pid)).then_some(())
    });

    // `peregrine status` shows Envoy's stream, in step with the registry.
    wait_until(
        STEP,
        "Envoy's stream synced at the registry's revision",
        || {
            let status = stack.supervisor.status_json().ok()?;
            let streams = status["xds_streams"].as_array()?;
            (streams.len() == 1 && streams[0]["synced_revision"] == status["revision"])
                .then_some(())
        },
    );

    // Every drain waited for Envoy's ACK of the DRAINING state, and got it.
    let logs = stack.supervisor.all_logs();
    let acked = logs
        .lines()
        .filter(|l| l.contains("Every Envoy has the worker as draining") && l.contains("streams=1"))
        .count();
    assert_eq!(
        acked, 6,
        "six drains, each ACKed by Envoy's one stream:\n{logs}"
    );
    assert!(!logs.contains("Not every Envoy ACKed"), "{logs}");

    let all: BTreeSet<u32> = replaced.union(&third).copied().collect();
    let report = stack.finish(load, 50, &all);
    for generation in [&first, &second, &third] {
        assert!(
            generation.iter().any(|pid| report.by_pid.contains_key(pid)),
            "each generation served: {generation:?} in {:?}",
            report.by_pid
        );
    }
    let status = stack.supervisor.stop().expect("the supervisor stops");
    assert!(status.success(), "{status}");
}

#[test]
fn scaling_by_reload_under_load_loses_no_request() {
    if envoy_or_skip("scaling_by_reload_under_load_loses_no_request").is_none() {
        return;
    }
    let stack = started(2, |_| {});
    let two = stack.wait_for_workers(2, &BTreeSet::new());
    let load = stack.load();

    stack.set_count(4);
    let out = stack.control("reload", &[]);
    assert!(
        out.starts_with("0 replaced, 2 added, 0 removed, 0 failed"),
        "{out}"
    );
    let four = stack.wait_for_workers(4, &BTreeSet::new());
    assert!(two.is_subset(&four), "scaling up keeps the running workers");

    stack.set_count(1);
    let out = stack.control("reload", &[]);
    assert!(
        out.starts_with("0 replaced, 0 added, 3 removed, 0 failed"),
        "{out}"
    );
    let one = stack.wait_for_workers(1, &BTreeSet::new());
    assert!(one.is_subset(&four));

    // An invalid config is refused and changes nothing.
    let path = stack.supervisor.config_path();
    let good = std::fs::read_to_string(path).unwrap();
    std::fs::write(path, good.replace("count = 1", "count = \"many\"")).unwrap();
    let output = Command::new(peregrine_path())
        .arg("reload")
        .arg(path)
        .arg("--socket")
        .arg(stack.supervisor.dir().join("peregrine.sock"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success(), "{stdout}");
    assert!(
        stdout.contains("count"),
        "the error names the key: {stdout}"
    );
    std::fs::write(path, good).unwrap();
    assert_eq!(stack.envoy_pids().0, one, "nothing changed");

    stack.finish(load, 50, &four);
}

#[test]
fn a_killed_supervisor_comes_back_and_adopts_its_workers_under_load() {
    if envoy_or_skip("a_killed_supervisor_comes_back_and_adopts_its_workers_under_load").is_none() {
        return;
    }
    let mut stack = started(2, |_| {});
    let workers = stack.wait_for_workers(2, &BTreeSet::new());
    let load = stack.load();

    let served_before = load.snapshot().by_pid;
    stack.supervisor.kill_and_start_again().unwrap();
    // The same processes serve, registered with the new supervisor.
    let registered = wait_until(STEP, "the workers to register again", || {
        let pids = stack.supervisor.status_pids().ok()?;
        (pids.len() == 2).then_some(pids)
    });
    assert_eq!(registered, workers, "the same worker pids are adopted");
    // Their request counters are still read: each counts what it served under the old supervisor too.
    wait_until(STEP, "the adopted workers' requests in the status", || {
        let status = stack.supervisor.status_json().ok()?;
        let counted = status["workers"].as_array()?.iter().all(|w| {
            let pid = w["pid"].as_u64().unwrap_or(0) as u32;
            let total = w["requests_total"].as_u64().unwrap_or(0);
            total > served_before.get(&pid).copied().unwrap_or(0)
        });
        counted.then_some(())
    });
    assert!(
        stack.supervisor.all_logs().contains("Adopting a worker"),
        "{}",
        stack.supervisor.all_logs()
    );
    // Envoy reconnects to the new supervisor and keeps the same hosts.
    wait_until(STEP, "Envoy to reconnect its CDS and EDS streams", || {
        let connected = |scope: &str| {
            stack
                .envoy
                .stat(&format!("{scope}.control_plane.connected_state"))
                == Some(1)
        };
        (connected("cluster_manager.cds") && connected("cluster.cluster")).then_some(())
    });
    assert_eq!(stack.envoy_pids().0, workers);

    // A rolling restart works again, adopted workers included.
    let out = stack.control("restart", &[]);
    assert!(out.starts_with("2 replaced"), "{out}");
    let fresh = stack.wait_for_workers(2, &workers);
    for pid in &workers {
        wait_until(STEP, "the adopted worker to exit", || {
            gone(*pid).then_some(())
        });
    }
    let all: BTreeSet<u32> = workers.union(&fresh).copied().collect();
    stack.finish(load, 50, &all);
}

#[test]
fn a_restart_right_after_the_supervisor_comes_back_waits_for_envoy_and_loses_no_request() {
    if envoy_or_skip(
        "a_restart_right_after_the_supervisor_comes_back_waits_for_envoy_and_loses_no_request",
    )
    .is_none()
    {
        return;
    }
    // The new supervisor has no Envoy stream yet when the restart comes: its drains must wait for
    // the Envoy the one before it served, not count zero streams and stop workers Envoy routes to.
    let mut stack = started(2, |_| {});
    let workers = stack.wait_for_workers(2, &BTreeSet::new());
    // The Envoy is proven (it ACKed its endpoints) before the kill.
    wait_until(STEP, "Envoy's stream synced", || {
        let status = stack.supervisor.status_json().ok()?;
        let streams = status["xds_streams"].as_array()?;
        (streams.len() == 1 && streams[0]["synced_revision"] == status["revision"]).then_some(())
    });
    let load = stack.load();

    // Killed, and started again once Envoy has failed to reconnect twice: its next try is then up to
    // 400 ms away (the bootstrap's xDS retry backoff, jittered, from 100 ms), so the new supervisor
    // starts with no stream for a while.
    let failures = || {
        stack
            .envoy
            .stat("cluster.cluster.update_failure")
            .unwrap_or(0)
    };
    let failed_before = failures();
    stack
        .supervisor
        .process()
        .signal(rustix::process::Signal::KILL)
        .unwrap();
    wait_until(STEP, "Envoy to fail to reconnect twice", || {
        (failures() >= failed_before + 2).then_some(())
    });
    wait_until(STEP, "the killed supervisor to exit", || {
        stack.supervisor.process().try_wait()
    });
    stack.supervisor.start_again().unwrap();
    // As soon as the control socket answers.
    let out = wait_until(STEP, "the new supervisor to take a restart", || {
        stack.supervisor.control("restart", &[]).ok()
    });
    assert!(out.starts_with("2 replaced"), "{out}");
    let fresh = stack.wait_for_workers(2, &workers);
    let all: BTreeSet<u32> = workers.union(&fresh).copied().collect();
    stack.finish(load, 50, &all);
    // Both drains waited for the Envoy the killed supervisor served, and got its ACK.
    let logs = stack.supervisor.logs();
    let drains: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("Every Envoy has the worker as draining"))
        .collect();
    eprintln!("{}", drains.join("\n"));
    assert_eq!(drains.len(), 2, "{logs}");
    assert!(
        drains.iter().all(|l| l.contains("streams=1")),
        "every drain waited for the Envoy to come back and ACK:\n{logs}"
    );
}

#[test]
fn a_replacement_that_cannot_start_leaves_the_old_worker_serving() {
    if envoy_or_skip("a_replacement_that_cannot_start_leaves_the_old_worker_serving").is_none() {
        return;
    }
    let stack = started(1, |_| {});
    let old = stack.wait_for_workers(1, &BTreeSet::new());
    let load = stack.load();

    // A new command whose workers exit at once: the reload replaces nothing and says why.
    let mut broken = stack.config.clone();
    broken.service_mut(CLUSTER).command = Some(["sh", "-c", "exit 3"].map(String::from).into());
    stack.supervisor.rewrite_config(&broken.toml()).unwrap();
    let error = format!("{:#}", stack.supervisor.control("reload", &[]).unwrap_err());
    assert!(
        error.contains("ended before registering (exit code 3); the old one keeps serving"),
        "{error}"
    );
    assert_eq!(stack.envoy_pids().0, old, "the old worker still serves");

    // Back to the good config: nothing to replace, the old worker is still the one.
    stack
        .supervisor
        .rewrite_config(&stack.config.toml())
        .unwrap();
    let out = stack.control("reload", &[]);
    assert!(
        out.starts_with("0 replaced, 0 added, 0 removed, 0 failed"),
        "{out}"
    );
    stack.finish(load, 50, &old);
}

#[test]
fn an_adopted_process_that_never_registers_is_replaced_and_a_stranger_is_left_alone() {
    // A process that is a worker of this control socket by its environment (the socket's path and
    // its lineage, as in the lock file an earlier supervisor left) but never registers: the supervisor
    // adopts it, waits `register_timeout_ms`, then replaces it. A process that names the socket but
    // does not carry the lineage is not ours: it is neither adopted nor signalled.
    use std::os::unix::fs::OpenOptionsExt;
    let dir = peregrine_e2e::TempDir::new().unwrap();
    let control = dir.path().join("peregrine.sock");
    let lineage = "0123456789abcdef0123456789abcdef";
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dir.path().join("peregrine.sock.lock"))
        .and_then(|mut f| std::io::Write::write_all(&mut f, format!("{lineage}\n").as_bytes()))
        .unwrap();
    let fake = |lineage: Option<&str>| {
        let mut command = Command::new("sleep");
        command
            .arg("120")
            .env("PEREGRINE_CONTROL_SOCKET", &control)
            .env("PEREGRINE_SERVICE", "cluster")
            .env("PEREGRINE_WORKER_INDEX", "0")
            .env(
                peregrine_contract::settings::ENV_CONTRACT,
                peregrine_contract::settings::CONTRACT.to_string(),
            );
        if let Some(lineage) = lineage {
            command.env("PEREGRINE_LINEAGE", lineage);
        }
        command.spawn().unwrap()
    };
    let mut impostor = fake(Some(lineage));
    let mut stranger = fake(None);
    let (impostor_pid, stranger_pid) = (impostor.id(), stranger.id());
    // `spawn` returns once the exec has begun: wait until the new environments are in place.
    wait_until(STEP, "the fake workers' environments", || {
        let mut found = peregrine_e2e::workers_in(dir.path());
        found.sort_unstable();
        let mut wanted = vec![impostor_pid, stranger_pid];
        wanted.sort_unstable();
        (found == wanted).then_some(())
    });
    let mut config = PeregrineToml::local(peregrine_e2e::free_port());
    config.supervisor.control = Some(control.display().to_string());
    config.supervisor.register_timeout_ms = Some(500);
    config.service(CLUSTER, ServiceTable::default());
    let supervisor =
        peregrine_e2e::Supervisor::start_in(&peregrine_path(), dir.path(), &config.toml()).unwrap();
    let replaced = wait_until(STEP, "a real worker in the impostor's slot", || {
        let status = supervisor.status_json().ok()?;
        let pid = status["workers"][0]["pid"].as_u64()? as u32;
        (pid != impostor_pid).then_some(pid)
    });
    // The impostor was stopped (SIGTERM), and reaped here, its parent.
    let status = impostor.wait().unwrap();
    assert!(!status.success(), "stopped by a signal: {status}");
    assert_eq!(
        stranger.try_wait().unwrap(),
        None,
        "the stranger still runs"
    );
    let logs = supervisor.logs();
    assert!(
        logs.contains(&format!("pid={impostor_pid}"))
            && logs.contains("Adopting a worker of an earlier supervisor"),
        "{logs}"
    );
    assert!(
        logs.contains("The adopted worker did not register again in time; replacing it"),
        "{logs}"
    );
    assert!(!logs.contains(&format!("pid={stranger_pid}")), "{logs}");
    assert_ne!(replaced, impostor_pid);
    let lock = std::fs::read_to_string(dir.path().join("peregrine.sock.lock")).unwrap();
    assert!(lock.starts_with(lineage), "the lineage is kept: {lock:?}");
    stranger.kill().unwrap();
    stranger.wait().unwrap();
}

#[test]
fn a_request_in_flight_when_its_worker_is_replaced_completes() {
    if envoy_or_skip("a_request_in_flight_when_its_worker_is_replaced_completes").is_none() {
        return;
    }
    let stack = started(2, |_| {});
    let old = stack.wait_for_workers(2, &BTreeSet::new());
    // A request that keeps its worker busy for 800 ms of CPU.
    let listen = stack.listen;
    let slow = std::thread::spawn(move || peregrine_e2e::http_get(listen, "/?cpu=800"));
    wait_until(STEP, "the slow request to reach a worker", || {
        let active = stack
            .envoy
            .stat(&format!("cluster.{CLUSTER}.upstream_rq_active"))?;
        (active == 1).then_some(())
    });
    let out = stack.control("restart", &[]);
    assert!(out.starts_with("2 replaced"), "{out}");
    let (status, body) = slow.join().unwrap().expect("the slow request completes");
    assert_eq!(status, 200, "{body}");
    let pid = peregrine_e2e::worker_pid(&body).expect("a worker's answer");
    assert!(
        old.contains(&pid),
        "answered by {pid}, one of the replaced workers {old:?}"
    );
    stack.wait_for_workers(2, &old);
}

#[test]
fn services_added_and_removed_by_reload_come_and_go_in_envoy() {
    if envoy_or_skip("services_added_and_removed_by_reload_come_and_go_in_envoy").is_none() {
        return;
    }
    let stack = started(2, |_| {});
    let workers = stack.wait_for_workers(2, &BTreeSet::new());
    let load = stack.load();
    let extra_hosts = |n: usize| {
        wait_until(
            STEP,
            &format!("{n} healthy hosts of `extra` in Envoy"),
            || {
                let hosts = peregrine_e2e::hosts(&stack.envoy.clusters(), "extra");
                (hosts.len() == n && hosts.iter().all(|h| h.healthy)).then_some(())
            },
        )
    };

    let mut with_extra = stack.config.clone();
    with_extra.service("extra", ServiceTable::at("http://127.0.0.1:0").count(2));
    stack.supervisor.rewrite_config(&with_extra.toml()).unwrap();
    let out = stack.control("reload", &[]);
    assert!(
        out.starts_with("0 replaced, 2 added, 0 removed, 0 failed"),
        "{out}"
    );
    extra_hosts(2);

    stack
        .supervisor
        .rewrite_config(&stack.config.toml())
        .unwrap();
    let out = stack.control("reload", &[]);
    assert!(
        out.starts_with("0 replaced, 0 added, 2 removed, 0 failed"),
        "{out}"
    );
    wait_until(STEP, "Envoy to drop the cluster `extra`", || {
        (!stack
            .envoy
            .clusters()
            .lines()
            .any(|l| l.starts_with("extra::")))
        .then_some(())
    });
    let status = stack.supervisor.status_json().unwrap();
    let services: BTreeSet<&str> = status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|w| w["service"].as_str())
        .collect();
    assert_eq!(services, BTreeSet::from([CLUSTER]), "{status}");
    stack.finish(load, 50, &workers);
}

/// A worker that swaps its inherited request counter for a memfd of its own, unsealed, so that it
/// can shrink the region under a supervisor that adopted it. The supervisor must refuse to map such
/// a region: before, each supervisor that adopted the worker died of SIGBUS at its next read, and a
/// restart turned into a crash loop.
#[test]
fn a_worker_that_could_shrink_its_counter_is_adopted_three_times_and_faults_no_supervisor() {
    // The wrapper replaces the counter descriptor with a memfd of the same size that carries no
    // seal, then execs the built-in worker on it (same pid, so the worker is still the supervisor's).
    let swap = "import os, sys\n\
                fd = int(os.environ['PEREGRINE_COUNTERS_FD'])\n\
                own = os.memfd_create('counter', 0)\n\
                os.ftruncate(own, os.fstat(fd).st_size)\n\
                os.dup2(own, fd)\n\
                os.close(own)\n\
                os.execv(sys.argv[1], sys.argv[1:])\n";
    let peregrine = peregrine_path();
    let mut config = PeregrineToml::local(peregrine_e2e::free_port());
    config.supervisor.register_timeout_ms = Some(5_000);
    config.service(
        CLUSTER,
        ServiceTable::at("http://127.0.0.1:0").count(1).command([
            "python3",
            "-c",
            swap,
            &peregrine.display().to_string(),
            "worker",
        ]),
    );
    let dir = peregrine_e2e::TempDir::new().unwrap();
    let mut supervisor =
        peregrine_e2e::Supervisor::start_in(&peregrine, dir.path(), &config.toml()).unwrap();
    let registered = |supervisor: &peregrine_e2e::Supervisor| {
        let status = supervisor.status_json().ok()?;
        let pid = status["workers"][0]["pid"].as_u64()? as u32;
        (status["workers"][0]["state"] == "ready").then_some(pid)
    };
    let worker = wait_until(STEP, "the worker registered", || registered(&supervisor));
    let fd: u32 = std::fs::read(format!("/proc/{worker}/environ"))
        .unwrap()
        .split(|b| *b == 0)
        .find_map(|var| {
            let var = std::str::from_utf8(var).ok()?;
            var.strip_prefix("PEREGRINE_COUNTERS_FD=")?.parse().ok()
        })
        .expect("the worker's counter descriptor");
    let region = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{worker}/fd/{fd}"))
        .expect("the worker's own memfd");
    let size = region.metadata().unwrap().len();
    assert!(size > 0, "the swapped region has the worker's size");
    for round in 1..=3 {
        supervisor.kill_and_start_again().unwrap();
        let adopted = wait_until(STEP, "the worker adopted and registered again", || {
            registered(&supervisor)
        });
        assert_eq!(adopted, worker, "round {round}: the same worker is adopted");
        // The worker cuts its region short under the supervisor...
        region.set_len(0).unwrap();
        let cut = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        // ...which samples it twice more, alive: a pass that read the region would have faulted.
        let sampled_after = |after: u64| {
            wait_until(STEP, "a sample after the region was cut", || {
                let status = supervisor.status_json().ok()?;
                let sampled = status["workers"][0]["sampled_at_unix_ms"].as_u64()?;
                (sampled > after).then_some(sampled)
            })
        };
        sampled_after(sampled_after(cut));
        assert_eq!(
            supervisor.process().try_wait(),
            None,
            "round {round}: the supervisor is alive\n{}",
            supervisor.all_logs()
        );
        // Whole again, so that the worker's own next count does not fault the worker.
        region.set_len(size).unwrap();
    }
    let logs = supervisor.all_logs();
    assert!(
        logs.contains("Cannot take the adopted worker's request counter")
            && logs.contains("not sealed against shrinking"),
        "the refusal is logged with its reason:\n{logs}"
    );
}

/// The live processes running `sleep SECONDS`: the marker a test gives its own.
fn sleepers(seconds: u32) -> BTreeSet<u32> {
    let wanted = format!("sleep\0{seconds}\0");
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == wanted.as_bytes())
                && !gone(*pid)
        })
        .collect()
}

/// A worker's child that keeps only the lineage of its environment is no helper of the supervisor,
/// and one that names another slot is not that slot's: when the worker is replaced, both are
/// stopped as its leftovers (while the other slot's worker serves on, and the log names the slot
/// that was claimed as only claimed), and so are the next worker's at the supervisor's stop.
#[test]
fn a_workers_children_that_keep_the_lineage_or_name_another_slot_are_its_leftovers() {
    // Markers no other test runs: `sleep` for this many seconds.
    let lineage_only = 1_000_000 + u32::from(peregrine_e2e::free_port());
    let naming_api = lineage_only + 100_000;
    let script = format!(
        "env -i PEREGRINE_LINEAGE=\"$PEREGRINE_LINEAGE\" sleep {lineage_only} & \
         env -i PEREGRINE_LINEAGE=\"$PEREGRINE_LINEAGE\" PEREGRINE_SERVICE=api \
         PEREGRINE_WORKER_INDEX=0 sleep {naming_api} & \
         exec {} worker",
        peregrine_path().display()
    );
    let mut config = PeregrineToml::local(peregrine_e2e::free_port());
    config.supervisor.stop_timeout_ms = Some(2000);
    config.service(
        "web",
        ServiceTable::at("http://127.0.0.1:0").command(["/bin/sh", "-c", script.as_str()]),
    );
    config.service("api", ServiceTable::at("http://127.0.0.1:0"));
    let mut supervisor = peregrine_e2e::Supervisor::start(&config.toml());
    let ready = |supervisor: &peregrine_e2e::Supervisor| {
        let status = supervisor.status_json().ok()?;
        let pid = |service: &str| {
            status["workers"].as_array()?.iter().find_map(|row| {
                (row["service"] == service && row["state"] == "ready")
                    .then(|| row["pid"].as_u64())
                    .flatten()
            })
        };
        Some((pid("web")?, pid("api")?))
    };
    let (web, api) = wait_until(STEP, "both workers ready", || ready(&supervisor));
    let children = |what| {
        wait_until(STEP, what, || {
            let (a, b) = (sleepers(lineage_only), sleepers(naming_api));
            (a.len() == 1 && b.len() == 1).then_some(a.into_iter().chain(b).collect::<Vec<_>>())
        })
    };
    let first = children("the first worker's two children");

    supervisor.control("restart", &["web"]).unwrap();
    wait_until(STEP, "the first worker's children stopped", || {
        first.iter().all(|pid| gone(*pid)).then_some(())
    });
    let (web_now, api_now) = wait_until(STEP, "web replaced", || {
        ready(&supervisor).filter(|(web_now, _)| *web_now != web)
    });
    assert_eq!(api_now, api, "api's worker serves on");
    let logs = supervisor.logs();
    let line = logs
        .lines()
        .find(|line| line.contains("names another slot"))
        .unwrap_or_else(|| panic!("no line on the child naming api:\n{logs}"));
    assert!(
        line.contains("service=web") && line.contains(&format!("left={}", first[1])),
        "attributed to web's worker that exited: {line}"
    );
    assert!(line.contains("names=api[0]"), "{line}");

    let second = children("the second worker's two children");
    assert!(second.iter().all(|pid| !first.contains(pid)));
    assert_ne!(web_now, web);
    supervisor.stop().unwrap();
    for pid in &second {
        assert!(gone(*pid), "process {pid} outlived the supervisor's stop");
    }
}
