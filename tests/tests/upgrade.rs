//! `peregrine upgrade`: the supervisor execs the program file it was started from, replaced on disk
//! by a new one (as a package upgrade does), in the same process, and adopts its own workers; under
//! continuous HTTP/1.1 and HTTP/2 load through the real Envoy, no request may fail. A program that
//! fails its checks is refused and changes nothing.

use std::{
    collections::BTreeSet,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use peregrine_e2e::{
    PeregrineToml, ServiceTable, Stack, Supervisor, TempDir, app_servers_or_skip, deploy::STEP,
    envoy_or_skip, free_port, gone, gunicorn_command, install_program, peregrine_path, wait_until,
};

/// A stack whose supervisor runs from a copy of `peregrine` in a directory of its own (returned
/// first: it must outlive the stack), `workers` hello workers routed by Envoy.
fn started_from_a_copy(workers: u32) -> (TempDir, PathBuf, Stack) {
    started_from_a_copy_with(workers, |_| {})
}

/// [`started_from_a_copy`], the config changed by `configure` first.
fn started_from_a_copy_with(
    workers: u32,
    configure: impl FnOnce(&mut PeregrineToml),
) -> (TempDir, PathBuf, Stack) {
    let dir = TempDir::new().unwrap();
    let program = dir.path().join("peregrine");
    install_program(&peregrine_path(), &program);
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::one_service(grpc, listen, admin, workers);
    configure(&mut config);
    let supervisor = Supervisor::start_in(&program, dir.path(), &config.toml()).unwrap();
    let stack = Stack::around(supervisor, config, listen);
    stack
        .deployed()
        .wait_for_workers(workers as usize, &BTreeSet::new());
    (dir, program, stack)
}

/// `peregrine upgrade` on the stack's config, through the build under test; what it printed, or a
/// panic with the supervisor's logs.
fn upgrade(stack: &Stack) -> String {
    let config = stack.supervisor.config_path().to_owned();
    let out = peregrine(&["upgrade".as_ref(), config.as_os_str()]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "peregrine upgrade failed: {stdout}{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        stack.supervisor.all_logs()
    );
    eprintln!("{stdout}");
    stdout
}

/// The orphan watchers (`peregrine orphan-watch`) whose control socket is in `dir`, each with its
/// parent.
fn watchers_in(dir: &Path) -> Vec<(u32, u32)> {
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
            let stat = peregrine_contract::procfs::stat(pid).ok()?;
            (stat.state != 'Z'
                && args.iter().any(|a| a == "orphan-watch")
                && args.iter().any(|a| a.starts_with(&socket)))
            .then_some((pid, stat.ppid))
        })
        .collect()
}

/// `peregrine ARGS...` of the build under test (not the copy, which a test may break).
fn peregrine(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(peregrine_path()).args(args).output().unwrap()
}

/// What the supervisor process executes now: `/proc/PID/exe`'s link and the inode behind it.
fn executing(pid: u32) -> (String, u64) {
    let exe = format!("/proc/{pid}/exe");
    let link = std::fs::read_link(&exe).unwrap().display().to_string();
    (link, std::fs::metadata(&exe).unwrap().ino())
}

/// The descriptors of process `pid` open on `path`.
fn descriptors_on(pid: u32, path: &Path) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target == path))
        .count()
}

/// The zombies among process `pid`'s children.
fn zombie_children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            peregrine_contract::procfs::stat(*child)
                .is_ok_and(|stat| stat.ppid == pid && stat.state == 'Z')
        })
        .collect()
}

#[test]
fn an_upgrade_in_place_keeps_the_pid_and_the_workers_and_loses_no_request() {
    if envoy_or_skip("an_upgrade_in_place_keeps_the_pid_and_the_workers_and_loses_no_request")
        .is_none()
    {
        return;
    }
    let (dir, program, mut stack) = started_from_a_copy(2);
    let pid = stack.supervisor.pid();
    let workers = stack.supervisor.status_pids().unwrap();
    let image = |stack: &Stack| stack.supervisor.status_json().unwrap()["supervisor"].clone();
    let before = image(&stack);
    assert_eq!(before["pid"], pid, "{before}");
    assert_eq!(workers.len(), 2, "{workers:?}");
    let load = stack.deployed().load();

    // A new file in the program's place, as a package upgrade leaves it: the running image is now
    // a deleted file.
    let (_, old_inode) = executing(pid);
    install_program(&peregrine_path(), &program);
    let new_inode = std::fs::metadata(&program).unwrap().ino();
    assert_ne!(new_inode, old_inode, "install makes a new file");
    let (link, _) = executing(pid);
    assert!(link.ends_with(" (deleted)"), "{link}");

    let stdout = upgrade(&stack);
    assert!(
        stdout.starts_with(&format!("upgraded in place: pid {pid}, ")),
        "{stdout}"
    );
    assert!(stdout.contains("2 workers kept"), "{stdout}");

    // The same process runs the new file, with the same workers, registered again.
    assert!(
        stack.supervisor.process().try_wait().is_none(),
        "the supervisor exited"
    );
    assert_eq!(stack.supervisor.pid(), pid);
    assert_eq!(
        executing(pid),
        (program.display().to_string(), new_inode),
        "the supervisor executes the new file"
    );
    assert_eq!(stack.supervisor.status_pids().unwrap(), workers);
    let after = image(&stack);
    assert_eq!(after["pid"], pid, "{after}");
    assert!(
        after["started_unix_ms"].as_u64() > before["started_unix_ms"].as_u64(),
        "a new image: {before} then {after}"
    );
    let logs = stack.supervisor.all_logs();
    assert!(logs.contains("Adopting a worker"), "{logs}");
    // The lock was taken again, through one descriptor: the old image's went with it.
    let lock = dir.path().join("peregrine.sock.lock");
    assert_eq!(
        descriptors_on(pid, &lock),
        1,
        "descriptors on {}",
        lock.display()
    );
    // Envoy routes to the same workers; the checks' processes are reaped.
    wait_until(STEP, "Envoy to route to the same workers", || {
        (stack.deployed().envoy_pids().0 == workers).then_some(())
    });
    wait_until(STEP, "no zombie child of the supervisor", || {
        zombie_children(pid).is_empty().then_some(())
    });
    stack.deployed().finish(load, 50, &workers);
}

#[test]
fn an_upgrade_to_a_program_that_does_not_run_is_refused_and_changes_nothing() {
    if envoy_or_skip("an_upgrade_to_a_program_that_does_not_run_is_refused_and_changes_nothing")
        .is_none()
    {
        return;
    }
    let (dir, program, mut stack) = started_from_a_copy(1);
    let pid = stack.supervisor.pid();
    let workers = stack.deployed().envoy_pids().0;
    let load = stack.deployed().load();

    let broken = dir.path().join("broken");
    std::fs::write(&broken, "#!/bin/sh\necho 'not a peregrine' >&2\nexit 1\n").unwrap();
    install_program(&broken, &program);
    let config = stack.supervisor.config_path().to_owned();
    let out = peregrine(&["upgrade".as_ref(), config.as_os_str()]);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("the upgrade was refused"), "{said}");
    assert!(said.contains("nothing changed"), "{said}");
    assert!(
        said.contains("--version` failed (exit status: 1): not a peregrine"),
        "{said}"
    );

    // Still the old image, serving with the same worker.
    assert!(
        stack.supervisor.process().try_wait().is_none(),
        "the supervisor exited"
    );
    let (link, _) = executing(pid);
    assert!(link.ends_with(" (deleted)"), "{link}");
    let status = peregrine(&["status".as_ref(), config.as_os_str()]);
    assert!(status.status.success(), "{status:?}");
    assert_eq!(stack.deployed().envoy_pids().0, workers);
    stack.deployed().finish(load, 50, &workers);
}

/// A server on a passed listener is adopted across the upgrade like a built-in worker (probed on
/// its listener again), and the orphan watcher its service needs is replaced by the new image's:
/// one watcher before, one after, a child of the same supervisor, the old one gone and reaped.
#[test]
fn an_upgrade_keeps_a_passed_socket_server_and_replaces_its_orphan_watcher() {
    let test = "an_upgrade_keeps_a_passed_socket_server_and_replaces_its_orphan_watcher";
    if envoy_or_skip(test).is_none() {
        return;
    }
    let Some(servers) = app_servers_or_skip(test) else {
        return;
    };
    let (dir, program, mut stack) = started_from_a_copy_with(1, |config| {
        config.service(
            "app",
            ServiceTable {
                pass_socket: Some(true),
                ready_path: Some("/healthz".into()),
                prefix: Some("/app".into()),
                ..ServiceTable::default().command(gunicorn_command(&servers.gunicorn))
            },
        );
    });
    let pid = stack.supervisor.pid();
    let server = |stack: &Stack| {
        wait_until(STEP, "the passed-socket server registered", || {
            let rows = stack.supervisor.status_rows("app").ok()?;
            rows.get(&0)?["pid"].as_u64().map(|p| p as u32)
        })
    };
    let before = server(&stack);
    let workers = stack.deployed().envoy_pids().0;
    let watchers = watchers_in(dir.path());
    assert_eq!(watchers.len(), 1, "one watcher: {watchers:?}");
    assert_eq!(watchers[0].1, pid, "a child of the supervisor");
    let load = stack.deployed().load();

    install_program(&peregrine_path(), &program);
    let stdout = upgrade(&stack);
    assert!(stdout.contains("2 workers kept"), "{stdout}");
    assert_eq!(server(&stack), before, "the server is adopted");
    assert_eq!(stack.supervisor.status_pids().unwrap().len(), 2);
    assert!(
        stack.supervisor.process().try_wait().is_none(),
        "the supervisor exited"
    );
    let now = wait_until(STEP, "one watcher, the new image's", || {
        let now = watchers_in(dir.path());
        (now.len() == 1 && now[0].0 != watchers[0].0).then_some(now)
    });
    assert_eq!(
        now[0].1, pid,
        "the new watcher is a child of the same supervisor"
    );
    assert!(gone(watchers[0].0), "the old watcher is gone");
    wait_until(STEP, "no zombie child of the supervisor", || {
        zombie_children(pid).is_empty().then_some(())
    });
    stack.deployed().finish(load, 50, &workers);
}
