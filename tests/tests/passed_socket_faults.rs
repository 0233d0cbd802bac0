//! Servers on a passed listener (`pass_socket`) that do not behave: one that daemonizes (its parent
//! exits at once and leaves the server running), and ones that never become ready. Each is stopped,
//! whole, restarted with backoff, and `peregrine status` says why; nothing is left running.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use peregrine_e2e::{
    PeregrineToml, ServiceTable, Supervisor, app_servers_or_skip, current_test, free_port, gone,
    gunicorn_command, test_app, wait_until, workers_in,
};

/// How long a test waits for the supervisor to do what it must.
const DEADLINE: Duration = Duration::from_secs(30);

/// A supervisor with restart delays of 100 to 400 ms and stop timeouts of 2 s, its config then
/// changed by `configure` (more `[supervisor]` keys, the services).
fn start(configure: impl FnOnce(&mut PeregrineToml)) -> Supervisor {
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    config.supervisor.restart_delay_ms = Some(100);
    config.supervisor.restart_delay_max_ms = Some(400);
    config.supervisor.stop_timeout_ms = Some(2000);
    configure(&mut config);
    Supervisor::start(&config.toml())
}

/// A service whose workers run `command` on a listener the supervisor passes.
fn passed_socket<S: Into<String>>(command: impl IntoIterator<Item = S>) -> ServiceTable {
    ServiceTable {
        pass_socket: Some(true),
        ..ServiceTable::default().command(command)
    }
}

/// The status row of `service`'s slot 0, once `ready` says it is the one wanted.
fn row_of(
    supervisor: &Supervisor,
    service: &str,
    what: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    wait_until(DEADLINE, what, || {
        let status = supervisor.status_json().ok()?;
        let row = status["workers"]
            .as_array()?
            .iter()
            .find(|row| row["service"] == service)?
            .clone();
        ready(&row).then_some(row)
    })
}

/// The children of `parent` that have exited and are not reaped yet.
fn zombies_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = peregrine_contract::procfs::stat(pid).ok()?;
            (stat.ppid == parent && stat.state == 'Z').then_some(pid)
        })
        .collect()
}

/// A server that forks, starts a session and forks again, serving from the grandchild while both
/// parents exit, is not taken for an exit alone: what it leaves is stopped before the slot starts
/// again (no try leaves a server holding its listener), the status says why it fails, and nothing
/// of it outlives `peregrine run`.
#[test]
fn a_daemonizing_server_is_stopped_whole_and_told_to_run_in_the_foreground() {
    let Some(servers) = app_servers_or_skip(&current_test()) else {
        return;
    };
    let python = servers.gunicorn.with_file_name("python");
    let mut supervisor = start(|config| {
        config.service(
            "daemon",
            passed_socket([
                python.display().to_string(),
                test_app("daemon_app.py").display().to_string(),
            ]),
        );
    });
    let dir = supervisor.dir().to_path_buf();

    // Every process of the service after a few tries: each try's server must be gone two tries
    // later (it is stopped before the next one starts).
    let restarts = |row: &serde_json::Value| row["restarts"].as_u64().unwrap_or(0);
    let first = row_of(&supervisor, "daemon", "two restarts", |row| {
        restarts(row) >= 2
    });
    let earlier: BTreeSet<u32> = workers_in(&dir).into_iter().collect();
    let row = row_of(&supervisor, "daemon", "three more restarts", |row| {
        restarts(row) >= restarts(&first) + 3 && row["state"] == "crash-loop"
    });
    let still: BTreeSet<u32> = workers_in(&dir).into_iter().collect();
    let leaked: Vec<&u32> = earlier.intersection(&still).collect();
    assert!(
        leaked.is_empty(),
        "processes of earlier tries still run: {leaked:?} (then {earlier:?}, now {still:?})\n{}",
        supervisor.logs()
    );

    // Why, in the status and in the log.
    let why =
        "the command exited and left children running: it daemonizes; run it in the foreground";
    let last_exit = row["last_exit"].as_str().unwrap_or_default();
    assert!(
        last_exit.starts_with("exit code 0") && last_exit.contains(why),
        "{row}"
    );
    assert!(supervisor.logs().contains(why), "{}", supervisor.logs());

    // The supervisor, their parent now, reaps what it stopped.
    wait_until(DEADLINE, "no zombie left under the supervisor", || {
        zombies_of(supervisor.pid()).is_empty().then_some(())
    });

    let status = supervisor.stop().expect("the supervisor stops");
    assert!(status.success(), "{status}\n{}", supervisor.logs());
    let left = workers_in(&dir);
    assert!(
        left.is_empty(),
        "still running after the supervisor stopped: {left:?}\n{}",
        supervisor.logs()
    );
}

/// Passed-socket servers that never answer their ready path on their first start: one closed its
/// listener (refused), one holds it and never accepts (no answer). Each shows what its last probe
/// found in `status --json` while it starts, is logged, and after `register_timeout_ms` is stopped
/// and started again with backoff, with the reason in its last exit.
#[test]
fn a_passed_socket_server_that_never_becomes_ready_is_reported_stopped_and_restarted() {
    let supervisor = start(|config| {
        config.supervisor.register_timeout_ms = Some(4000);
        config.service(
            "closed",
            passed_socket(["/bin/sh", "-c", "exec 3>&-; exec sleep 600"]),
        );
        config.service(
            "silent",
            passed_socket(["/bin/sh", "-c", "exec sleep 600"]).prefix("/silent"),
        );
    });
    for (service, probe) in [
        ("closed", "Connection refused"),
        ("silent", "no answer within 2s"),
    ] {
        let row = row_of(
            &supervisor,
            service,
            "the last probe in the status",
            |row| {
                row["last_probe"]
                    .as_str()
                    .is_some_and(|p| p.contains(probe))
            },
        );
        assert_eq!(row["state"], "starting", "{row}");
        assert!(row["pid"].is_null(), "{row}");
    }
    for (service, probe) in [
        ("closed", "Connection refused"),
        ("silent", "no answer within 2s"),
    ] {
        let row = row_of(&supervisor, service, "a restart after the timeout", |row| {
            row["restarts"].as_u64() >= Some(1)
        });
        let last_exit = row["last_exit"].as_str().unwrap_or_default();
        assert!(
            last_exit.starts_with("not ready within 4s") && last_exit.contains(probe),
            "{row}"
        );
    }
    let logs = supervisor.logs();
    assert!(
        logs.contains("Worker not ready yet") && logs.contains("last_probe="),
        "the wait is logged while it lasts: {logs}"
    );
    assert!(
        logs.contains("The worker never answered its ready path"),
        "{logs}"
    );
    // Each try was stopped: one process per service runs at most (the try under way).
    let running = workers_in(supervisor.dir());
    assert!(running.len() <= 2, "{running:?}\n{logs}");
}

/// The orphan watchers (`peregrine orphan-watch`) of the supervisor whose control socket is in
/// `dir`.
fn watchers_in(dir: &std::path::Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let socket = dir.display().to_string();
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let args: Vec<String> = cmdline
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            (args.iter().any(|a| a == "orphan-watch")
                && args.iter().any(|a| a.starts_with(&socket)))
            .then_some(pid)
        })
        .collect()
}

/// A server on a passed listener never dials the supervisor, yet it outlives a SIGKILLed one for
/// `orphan_timeout_ms` only, as a built-in worker does. A supervisor back within it adopts the
/// server, and the watcher of the dead one leaves it alone; with none back in time, the server and
/// the worker it forked are stopped.
#[test]
fn a_passed_socket_server_without_its_supervisor_stops_after_orphan_timeout() {
    let Some(servers) = app_servers_or_skip(&current_test()) else {
        return;
    };
    let orphan_timeout = Duration::from_millis(1500);
    let mut supervisor = start(|config| {
        config.supervisor.orphan_timeout_ms = Some(orphan_timeout.as_millis() as u64);
        config.service(
            "app",
            ServiceTable {
                ready_path: Some("/healthz".into()),
                ..passed_socket(gunicorn_command(&servers.gunicorn))
            },
        );
    });
    let dir = supervisor.dir().to_path_buf();
    let ready = |supervisor: &Supervisor| {
        row_of(supervisor, "app", "the server ready", |row| {
            row["pid"].is_u64()
        })["pid"]
            .as_u64()
            .unwrap() as u32
    };
    let server = ready(&supervisor);
    let watchers = watchers_in(&dir);
    assert_eq!(watchers.len(), 1, "one watcher: {watchers:?}");

    // Back in time: adopted, and the dead supervisor's watcher goes without touching it.
    supervisor.kill_and_start_again().unwrap();
    assert_eq!(ready(&supervisor), server, "adopted");
    wait_until(DEADLINE, "the first watcher to end", || {
        watchers.iter().all(|pid| gone(*pid)).then_some(())
    });
    assert!(!gone(server), "the adopted server still runs");
    assert_eq!(ready(&supervisor), server, "and is still the slot's");

    // Not back: the server and its worker stop after orphan_timeout_ms.
    let tree = workers_in(&dir);
    assert!(tree.len() >= 2, "gunicorn and its worker: {tree:?}");
    let killed = Instant::now();
    supervisor
        .process()
        .signal(rustix::process::Signal::KILL)
        .unwrap();
    wait_until(
        DEADLINE,
        "the orphaned server and its worker to stop",
        || tree.iter().all(|pid| gone(*pid)).then_some(()),
    );
    assert!(
        killed.elapsed() >= orphan_timeout,
        "stopped after {:?}, before orphan_timeout_ms",
        killed.elapsed()
    );
    let logs = supervisor.all_logs();
    assert!(
        logs.contains("No supervisor has come back within orphan_timeout_ms"),
        "{logs}"
    );
}
