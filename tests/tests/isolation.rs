//! Supervisors of one user keep to their own workers: two started with the same relative config in
//! different directories (the same socket file name) never signal or adopt each other's workers, even
//! under load; and a supervisor SIGKILLed while busy is started again at once, every time, and adopts
//! its own workers.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use peregrine_e2e::{
    Load, PeregrineToml, ServiceTable, Supervisor, config::Sampler, free_port, gone, wait_until,
};

const STEP: Duration = Duration::from_secs(30);

/// Two services of one worker each, on fixed ports; the control socket is the relative `p.sock`.
fn config(grpc: u16, web: u16, api: u16) -> String {
    let mut config = PeregrineToml::local(grpc);
    config.supervisor.control = Some("p.sock".into());
    config.supervisor.sampler = Some(Sampler::Off);
    config.supervisor.register_timeout_ms = Some(2000);
    config.service("web", ServiceTable::at(format!("http://127.0.0.1:{web}")));
    config.service("api", ServiceTable::at(format!("http://127.0.0.1:{api}")));
    config.toml()
}

/// The pid of each slot (service) with a registered worker, once every slot of `services` has one.
fn registered(supervisor: &Supervisor, services: &[&str]) -> BTreeMap<String, u32> {
    wait_until(STEP, "every worker registered", || {
        let status = supervisor.status_json().ok()?;
        let pids: BTreeMap<String, u32> = status["workers"]
            .as_array()?
            .iter()
            .filter(|w| w["state"] == "ready")
            .filter_map(|w| Some((w["service"].as_str()?.to_owned(), w["pid"].as_u64()? as u32)))
            .collect();
        (pids.len() == services.len()).then_some(pids)
    })
}

fn restarts(supervisor: &Supervisor) -> u64 {
    let status = supervisor.status_json().expect("status");
    status["workers"]
        .as_array()
        .expect("workers")
        .iter()
        .filter_map(|w| w["restarts"].as_u64())
        .sum()
}

#[test]
fn two_supervisors_with_one_relative_socket_name_keep_to_their_own_workers() {
    let ports = [free_port(), free_port(), free_port()];
    let first = Supervisor::start_relative(&config(ports[0], ports[1], ports[2]));
    let first_pids = registered(&first, &["api", "web"]);
    let addr = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    // Load on the first supervisor's workers, straight to them.
    let load = Load::start(addr(ports[1]), 1, 1, Duration::from_secs(60));
    let load_api = Load::start(addr(ports[2]), 1, 1, Duration::from_secs(60));

    let others = [free_port(), free_port(), free_port()];
    let second = Supervisor::start_relative(&config(others[0], others[1], others[2]));
    let second_pids = registered(&second, &["api", "web"]);
    let load_second = Load::start(addr(others[1]), 1, 1, Duration::from_secs(60));
    // Long enough for a mistaken adoption to show: the second supervisor would have stopped or
    // adopted the first one's workers within milliseconds, and replaced an adopted one that never
    // registered with it after register_timeout_ms (2 s).
    let second_started = std::time::Instant::now();
    wait_until(STEP, "both loads served for a while", || {
        (load_second.snapshot().served() > 200 && second_started.elapsed() > Duration::from_secs(3))
            .then_some(())
    });

    for (service, pid) in &first_pids {
        assert!(
            !gone(*pid),
            "{service}: the first supervisor's worker {pid} was stopped"
        );
    }
    assert_eq!(
        registered(&first, &["api", "web"]),
        first_pids,
        "the first supervisor's workers are its own"
    );
    assert_eq!(registered(&second, &["api", "web"]), second_pids);
    assert!(
        first_pids
            .values()
            .all(|pid| !second_pids.values().any(|p| p == pid)),
        "{first_pids:?} vs {second_pids:?}"
    );
    assert_eq!(restarts(&first), 0);
    assert_eq!(restarts(&second), 0);
    let logs = second.logs();
    assert!(
        !logs.contains("earlier supervisor"),
        "the second supervisor took the first one's workers for its own:\n{logs}"
    );
    // Each socket is the canonical path in its own directory.
    let socket_of = |s: &Supervisor| std::fs::canonicalize(s.dir()).unwrap().join("p.sock");
    assert!(socket_of(&first).exists() && socket_of(&second).exists());
    for (name, report) in [
        ("first web", load.stop()),
        ("first api", load_api.stop()),
        ("second web", load_second.stop()),
    ] {
        assert!(report.served() > 0, "{name}: nothing served");
        assert!(
            report.failures.is_empty(),
            "{name}: {:?}",
            &report.failures[..report.failures.len().min(5)]
        );
    }
}

#[test]
fn a_supervisor_sigkilled_while_busy_starts_again_at_once_and_adopts_its_workers() {
    let ports = [free_port(), free_port(), free_port()];
    let mut supervisor = Supervisor::start_relative(&config(ports[0], ports[1], ports[2]));
    let pids = registered(&supervisor, &["api", "web"]);
    let load = Load::start(
        SocketAddr::from(([127, 0, 0, 1], ports[1])),
        2,
        2,
        Duration::from_secs(90),
    );
    for round in 0..5 {
        // Busy: status requests in flight on the control socket while it dies.
        let status = std::thread::spawn({
            let binary = supervisor.binary().to_owned();
            let dir = supervisor.dir().to_owned();
            move || {
                for _ in 0..20 {
                    let _ = std::process::Command::new(&binary)
                        .args(["status", "peregrine.toml"])
                        .current_dir(&dir)
                        .output();
                }
            }
        });
        supervisor.kill_and_start_again().expect("started again");
        let _ = status.join();
        // It did not exit with "in use": it runs, and the workers are the same ones.
        let adopted = registered(&supervisor, &["api", "web"]);
        assert!(
            supervisor.process().try_wait().is_none(),
            "round {round}: the new supervisor exited:\n{}",
            supervisor.logs()
        );
        assert_eq!(adopted, pids, "round {round}: the same workers, adopted");
    }
    let report = load.stop();
    assert!(report.served() > 0);
    assert!(
        report.failures.is_empty(),
        "{:?}",
        &report.failures[..report.failures.len().min(5)]
    );
}
