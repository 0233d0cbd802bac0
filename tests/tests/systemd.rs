//! Under systemd: the unit in `packaging/systemd/` passes `systemd-analyze verify` with the config
//! the package installs beside it, which passes `peregrine check` and puts the control socket in the
//! unit's runtime directory, and so does the example Envoy unit in `examples/`; and the supervisor
//! speaks the readiness protocol to a real datagram socket set as `NOTIFY_SOCKET`: `READY=1` once
//! xDS serves, watchdog pings, `RELOADING=1` then `READY=1` around a reload and around an upgrade in
//! place (SIGUSR2: the new image, same pid, says `READY=1`), `STOPPING=1`; its workers inherit none
//! of it.

use std::{
    os::unix::net::UnixDatagram,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use peregrine_e2e::{
    PeregrineToml, ServiceTable, Supervisor, TempDir, free_port, peregrine_path, tool_or_skip,
    workspace_root,
};

#[test]
fn the_unit_passes_systemd_analyze_verify() {
    if !systemd_analyze_or_skip("the systemd unit") {
        return;
    }
    let unit =
        std::fs::read_to_string(workspace_root().join("packaging/systemd/peregrine.service"))
            .unwrap();
    assert_lines(
        &unit,
        "the unit",
        &[
            "Type=notify",
            "KillMode=process",
            "ExecStart=/usr/bin/peregrine run /etc/peregrine/peregrine.toml",
            "ExecReload=/usr/bin/peregrine reload /etc/peregrine/peregrine.toml",
            "RuntimeDirectory=peregrine",
            "RuntimeDirectoryPreserve=restart",
            "WatchdogSec=",
        ],
    );
    // The socket's path is the config's alone: a shell's `peregrine status` has no unit environment.
    assert!(
        !unit
            .lines()
            .any(|l| l.starts_with("Environment=PEREGRINE_CONTROL")),
        "the unit overrides the config's control socket"
    );
    // The installed paths, pointed at this build and the config the package installs, so verify
    // can check them.
    let dir = TempDir::new().unwrap();
    let config = dir.path().join("peregrine.toml");
    std::fs::copy(workspace_root().join("packaging/peregrine.toml"), &config).unwrap();
    let local = unit
        .replace(
            "/usr/bin/peregrine",
            &peregrine_path().display().to_string(),
        )
        .replace(
            "/etc/peregrine/peregrine.toml",
            &config.display().to_string(),
        );
    verify(&dir.path().join("peregrine.service"), &local);
}

/// Fails unless `unit` (named `name`) has a line starting with each of `lines`.
fn assert_lines(unit: &str, name: &str, lines: &[&str]) {
    for line in lines {
        assert!(
            unit.lines().any(|l| l.starts_with(line)),
            "no {line:?} in {name}"
        );
    }
}

/// Whether `systemd-analyze` is here to check `what`; the test skips (or, with
/// `PEREGRINE_REQUIRE_SYSTEMD=1`, fails) when it is not.
fn systemd_analyze_or_skip(what: &str) -> bool {
    tool_or_skip(
        what,
        "systemd-analyze",
        "--version",
        "PEREGRINE_REQUIRE_SYSTEMD",
        "apt install systemd",
    )
}

/// `systemd-analyze verify` of `unit` written at `path`: not one word of complaint.
fn verify(path: &Path, unit: &str) {
    std::fs::write(path, unit).unwrap();
    let output = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(path)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // A misspelt value is only a warning (exit 0): nothing may be printed at all.
    assert!(output.status.success() && said.trim().is_empty(), "{said}");
}

#[test]
fn the_envoy_unit_in_the_examples_passes_systemd_analyze_verify() {
    if !systemd_analyze_or_skip("the example Envoy unit") {
        return;
    }
    let unit = std::fs::read_to_string(workspace_root().join("examples/envoy.service")).unwrap();
    // Its bootstrap is the packaged config's, written at each start into its runtime directory.
    assert_lines(
        &unit,
        "the Envoy unit",
        &[
            "RuntimeDirectory=envoy",
            "ExecStartPre=+/bin/sh -c 'umask 022 && /usr/bin/peregrine envoy-bootstrap /etc/peregrine/peregrine.toml > /run/envoy/envoy.yaml'",
            "ExecStart=/usr/local/bin/envoy -c /run/envoy/envoy.yaml",
            "DynamicUser=yes",
        ],
    );
    // The programs it names, pointed at ones that exist here (verify checks they do).
    let dir = TempDir::new().unwrap();
    let local = unit
        .replace(
            "/usr/bin/peregrine",
            &peregrine_path().display().to_string(),
        )
        .replace("/usr/local/bin/envoy", "/bin/true");
    verify(&dir.path().join("envoy.service"), &local);
}

/// The config the package installs, as `peregrine check` on a host with the package would read it:
/// its service runs as the `peregrine` system user the package makes; on a machine without that user
/// (this one, unless the package is installed), a copy in `dir` names `nobody` instead.
fn installed_config(dir: &Path) -> std::path::PathBuf {
    let config = workspace_root().join("packaging/peregrine.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    let line = "user = \"peregrine\"";
    assert!(text.lines().any(|l| l == line), "{text}");
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    if passwd.lines().any(|l| l.starts_with("peregrine:")) {
        return config;
    }
    let copy = dir.join("peregrine.toml");
    std::fs::write(&copy, text.replace(line, "user = \"nobody\"")).unwrap();
    copy
}

#[test]
fn the_installed_config_checks_and_puts_the_socket_in_the_units_runtime_directory() {
    let dir = TempDir::new().unwrap();
    let config = installed_config(dir.path());
    let output = Command::new(peregrine_path())
        .arg("check")
        .arg(&config)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("ok (1 service, 2 workers)"), "{stdout}");
    // `RuntimeDirectory=peregrine` is /run/peregrine.
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(
        text.lines()
            .any(|l| l == "control = \"/run/peregrine/peregrine.sock\""),
        "{text}"
    );
    // Loopback only, as the comments say: the workers, the gRPC port, the metrics and Envoy.
    let bootstrap = Command::new(peregrine_path())
        .arg("envoy-bootstrap")
        .arg(&config)
        .output()
        .unwrap();
    assert!(bootstrap.status.success());
    let yaml = String::from_utf8_lossy(&bootstrap.stdout);
    assert!(!yaml.contains("0.0.0.0"), "{yaml}");
    for line in text
        .lines()
        .filter(|l| l.contains("http://") && !l.starts_with('#'))
    {
        assert!(line.contains("127.0.0.1"), "not on loopback: {line}");
    }
}

/// An upgrade in place (SIGUSR2 here) is a reload to systemd: `RELOADING=1` from the old image,
/// `READY=1` from the new one, in the same process (systemd's main pid), never `STOPPING=1`; the
/// worker stays.
#[test]
fn an_upgrade_is_a_reload_to_systemd_and_keeps_the_main_pid() {
    let dir = TempDir::new().unwrap();
    let socket_path = dir.path().join("notify.sock");
    let mut notify = NotifySocket::bind(&socket_path);
    let (grpc, port) = (free_port(), free_port());
    let mut config = PeregrineToml::local(grpc);
    config.service("web", ServiceTable::at(format!("http://127.0.0.1:{port}")));
    let mut supervisor = Supervisor::start_in_with_env(
        &peregrine_path(),
        dir.path(),
        &config.toml_in(dir.path()),
        &[("NOTIFY_SOCKET", &socket_path.display().to_string())],
    )
    .unwrap();
    notify.wait_for(Duration::from_secs(30), "READY=1", |m| {
        m.lines().any(|l| l == "READY=1")
    });
    let pid = supervisor.pid();
    let worker =
        peregrine_e2e::wait_until(Duration::from_secs(30), "the worker registered", || {
            supervisor.status_pids().ok()?.first().copied()
        });

    let target = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(target, rustix::process::Signal::USR2).unwrap();
    notify.wait_for(Duration::from_secs(30), "RELOADING=1", |m| {
        m.lines().any(|l| l == "RELOADING=1")
    });
    let ready = notify.wait_for(Duration::from_secs(30), "READY=1 from the new image", |m| {
        m.lines().any(|l| l == "READY=1")
    });
    assert!(ready.contains("STATUS=serving xDS"), "{ready}");
    assert!(
        !notify.seen.iter().any(|m| m.contains("STOPPING=1")),
        "{:?}",
        notify.seen
    );
    assert!(
        supervisor.process().try_wait().is_none(),
        "the supervisor exited"
    );
    assert_eq!(supervisor.pid(), pid);
    let logs = supervisor.logs();
    assert!(logs.contains("SIGUSR2: upgrading in place"), "{logs}");
    assert!(logs.contains("Adopting a worker"), "{logs}");
    let kept = peregrine_e2e::wait_until(
        Duration::from_secs(30),
        "the worker registered again",
        || supervisor.status_pids().ok()?.first().copied(),
    );
    assert_eq!(kept, worker, "the worker is kept");
}

/// The notify socket's datagrams, as they arrive.
struct NotifySocket {
    socket: UnixDatagram,
    seen: Vec<String>,
}

impl NotifySocket {
    fn bind(path: &Path) -> Self {
        let socket = UnixDatagram::bind(path).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        NotifySocket {
            socket,
            seen: Vec::new(),
        }
    }

    /// Reads datagrams until one satisfies `want` (returned), or `within` passes (a panic naming
    /// `what` and everything seen).
    fn wait_for(&mut self, within: Duration, what: &str, want: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + within;
        let mut buffer = [0u8; 4096];
        while Instant::now() < deadline {
            if let Ok(n) = self.socket.recv(&mut buffer) {
                let message = String::from_utf8_lossy(&buffer[..n]).into_owned();
                self.seen.push(message.clone());
                if want(&message) {
                    return message;
                }
            }
        }
        panic!("no {what} within {within:?}; seen: {:?}", self.seen);
    }
}

#[test]
fn the_supervisor_notifies_ready_watchdog_reloading_and_stopping() {
    let dir = TempDir::new().unwrap();
    let socket_path = dir.path().join("notify.sock");
    let mut notify = NotifySocket::bind(&socket_path);
    let (grpc, port) = (free_port(), free_port());
    let mut config = PeregrineToml::local(grpc);
    config.service("web", ServiceTable::at(format!("http://127.0.0.1:{port}")));
    let mut supervisor = Supervisor::start_in_with_env(
        &peregrine_path(),
        dir.path(),
        &config.toml_in(dir.path()),
        &[
            ("NOTIFY_SOCKET", &socket_path.display().to_string()),
            ("WATCHDOG_USEC", "400000"),
        ],
    )
    .unwrap();
    let ready = notify.wait_for(Duration::from_secs(30), "READY=1", |m| {
        m.lines().any(|l| l == "READY=1")
    });
    assert!(
        ready.contains(&format!("STATUS=serving xDS on 127.0.0.1:{grpc}")),
        "{ready}"
    );
    // Ready means served: the gRPC port takes a connection now.
    std::net::TcpStream::connect(("127.0.0.1", grpc)).expect("xDS serves once READY=1 is sent");
    // Pings every half WATCHDOG_USEC (200 ms): two within a second.
    notify.wait_for(Duration::from_secs(1), "a watchdog ping", |m| {
        m == "WATCHDOG=1\n"
    });
    notify.wait_for(Duration::from_secs(1), "a second ping", |m| {
        m == "WATCHDOG=1\n"
    });
    // The worker inherits none of the protocol's variables.
    let worker = peregrine_e2e::wait_until(Duration::from_secs(30), "the worker", || {
        supervisor.worker_pids().first().copied()
    });
    let environ = std::fs::read(format!("/proc/{worker}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    for name in ["NOTIFY_SOCKET=", "WATCHDOG_USEC=", "WATCHDOG_PID="] {
        assert!(
            !environ.split('\0').any(|v| v.starts_with(name)),
            "the worker inherited {name}"
        );
    }

    // A reload: RELOADING=1 with the monotonic clock, then READY=1 once it is done.
    supervisor.control("reload", &[]).unwrap();
    let reloading = notify.wait_for(Duration::from_secs(10), "RELOADING=1", |m| {
        m.lines().any(|l| l == "RELOADING=1")
    });
    assert!(
        reloading.lines().any(|l| l
            .strip_prefix("MONOTONIC_USEC=")
            .is_some_and(|v| v.parse::<u64>().is_ok())),
        "{reloading}"
    );
    notify.wait_for(Duration::from_secs(10), "READY=1 after the reload", |m| {
        m.lines().any(|l| l == "READY=1")
    });

    supervisor.stop().unwrap();
    notify.wait_for(Duration::from_secs(5), "STOPPING=1", |m| {
        m.lines().any(|l| l == "STOPPING=1")
    });
}
