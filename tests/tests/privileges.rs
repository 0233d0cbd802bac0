//! Workers under their own user, checked from outside against a supervisor that runs as root:
//!
//! - built-in workers and gunicorn (`pass_socket`) with `user = "nobody"`: every worker and every
//!   process it forks runs with nobody's uid, gid and groups, no capability in any set and
//!   `no_new_privs`, and serves through Envoy; a SIGKILLed worker comes back so, a rolling restart
//!   loses no request, and a SIGKILLed supervisor started again adopts them (and not a process of a
//!   user no service names);
//! - registration: a `nobody` process that is not a worker, and a worker of one service claiming
//!   another service or slot, are refused, and the log names their uid and pid;
//! - commands: a worker that asks for `restart` is refused and nothing is replaced; a `nobody`
//!   worker cannot even open the control socket;
//! - files: a `nobody` worker cannot read the TLS keys `peregrine tls init` wrote;
//! - port 80 in a network namespace, where nobody may not bind it, served by a `nobody` gunicorn on
//!   the listener the supervisor passes;
//! - request counters: each built-in worker holds a one-line counter of its own, so one worker
//!   cannot change another's count;
//! - the procfs sampler reads a `nobody` worker's CPU time;
//! - `peregrine check` names the key and line of a user or group that does not exist.
//!
//! Wherever the checkout is: what a `nobody` worker runs (the supervisor's binary, gunicorn and its
//! application, `register-as`) comes through a [`Stage`], which copies it where nobody reaches it
//! when the checkout is in a directory nobody may enter (CI under `/root`, a `mktemp -d`).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    os::unix::{
        fs::{FileExt, MetadataExt, PermissionsExt},
        process::CommandExt,
    },
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use peregrine_e2e::{
    Account, AppServers, CLUSTER, ChildGuard, Envoy, Network, PeregrineToml, ServiceTable, Stack,
    Stage, Supervisor, app_servers_or_skip, assert_unprivileged,
    config::{AccountId, Sampler},
    current_test,
    deploy::{Deployed, STEP},
    envoy_or_skip, free_port, gone, http_get, netns_or_skip, peregrine_path,
    pki::{peregrine_tls_init, secure_control_plane},
    proc_status::environment,
    try_wait_until, wait_until, worker_pid,
};
use rustix::process::{Pid, Signal, kill_process};
use serde_json::Value;

/// The registration client that claims what it is told to (`tests/src/bin/register-as.rs`), as
/// the account of `stage` can run it.
fn register_as(stage: &Stage) -> String {
    let built = Path::new(env!("CARGO_BIN_EXE_register-as"));
    stage.program(built).display().to_string()
}

/// The user every test runs its workers as.
fn nobody() -> Account {
    Account::lookup("nobody")
}

/// `service` with `user = "nobody"`.
fn as_nobody(service: ServiceTable) -> ServiceTable {
    ServiceTable {
        user: Some(AccountId::Name("nobody".into())),
        ..service
    }
}

/// The config of a test without Envoy: gRPC on a free port, the control socket in the
/// supervisor's directory, `sampler`; no service yet.
fn without_envoy(sampler: Sampler) -> PeregrineToml {
    let mut config = PeregrineToml::local(free_port());
    config.supervisor.sampler = Some(sampler);
    config
}

/// The control socket of a supervisor started from [`PeregrineToml::local`] (`{dir}/peregrine.sock`).
fn control_socket(supervisor: &Supervisor) -> PathBuf {
    supervisor.dir().join("peregrine.sock")
}

/// Where the workers of `service`, which has a `user`, register: `<control>.<service>.workers`.
fn worker_socket(supervisor: &Supervisor, service: &str) -> PathBuf {
    supervisor
        .dir()
        .join(format!("peregrine.sock.{service}.workers"))
}

/// SIGKILLs process `pid`.
fn sigkill(pid: u32) {
    let pid = Pid::from_raw(pid as i32).expect("a pid is positive");
    kill_process(pid, Signal::KILL).expect("SIGKILL");
}

/// The rows of `status --json` for `service`'s workers, by index.
fn rows(status: &Value, service: &str) -> BTreeMap<u64, Value> {
    status["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|row| row["service"] == service)
        .filter_map(|row| Some((row["index"].as_u64()?, row.clone())))
        .collect()
}

/// Panics with its logs if `supervisor` has exited (it refused its config, or failed).
#[track_caller]
fn assert_running(supervisor: &Supervisor) {
    assert!(
        !gone(supervisor.pid()),
        "the supervisor exited:\n{}",
        supervisor.logs()
    );
}

/// `status --json` once `ready` accepts it; panics with the last one and the logs after 30 s, or
/// at once if the supervisor exits.
#[track_caller]
fn wait_for_status(supervisor: &Supervisor, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    try_wait_until(Duration::from_secs(30), what, || {
        assert_running(supervisor);
        last = supervisor.status_json().ok()?;
        ready(&last).then(|| last.clone())
    })
    .unwrap_or_else(|error| panic!("{error}; last status: {last}\n{}", supervisor.logs()))
}

/// Waits until each of `service`'s `count` workers is registered; returns their pids by index.
#[track_caller]
fn ready_workers(supervisor: &Supervisor, service: &str, count: usize) -> BTreeMap<u64, u32> {
    let status = wait_for_status(
        supervisor,
        &format!("{count} ready workers of {service}"),
        |status| {
            let rows = rows(status, service);
            rows.len() == count && rows.values().all(|row| row["state"] == "ready")
        },
    );
    rows(&status, service)
        .into_iter()
        .map(|(index, row)| (index, row["pid"].as_u64().expect("a pid") as u32))
        .collect()
}

/// Waits until the supervisor's logs (its workers' output included) hold a line with `marker`;
/// returns the first such line.
#[track_caller]
fn logged_line(supervisor: &Supervisor, marker: &str) -> String {
    try_wait_until(STEP, &format!("a line with {marker:?} in the logs"), || {
        assert_running(supervisor);
        supervisor
            .logs()
            .lines()
            .find(|line| line.contains(marker))
            .map(str::to_owned)
    })
    .unwrap_or_else(|error| panic!("{error}\n{}", supervisor.logs()))
}

/// Whether a line of `logs` refuses the peer with `uid` and `pid`, naming both.
fn refusal_logged(logs: &str, uid: u32, pid: u32) -> bool {
    logs.lines().any(|line| {
        line.to_lowercase().contains("refus")
            && line.contains(&format!("uid={uid}"))
            && line.contains(&format!("pid={pid}"))
    })
}

/// The exit code a probe script printed in `line` (`...: exit N: ...`).
fn exit_code(line: &str) -> i32 {
    line.split("exit ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .and_then(|code| code.trim().parse().ok())
        .unwrap_or_else(|| panic!("no exit code in {line:?}"))
}

/// The lineage the supervisor keeps in its lock file (`<control>.lock`, first line).
fn lineage(supervisor: &Supervisor) -> String {
    let lock = supervisor.dir().join("peregrine.sock.lock");
    let text = std::fs::read_to_string(&lock)
        .unwrap_or_else(|error| panic!("reading {}: {error}", lock.display()));
    text.lines().next().unwrap_or_default().trim().to_owned()
}

/// Checks that every worker in `pids`, and everything it forked, runs as `nobody` without any
/// privilege, and that it registers (or would) on its service's own socket, not the control socket.
#[track_caller]
fn assert_workers_unprivileged(
    supervisor: &Supervisor,
    service: &str,
    pids: &BTreeSet<u32>,
    nobody: &Account,
) {
    for pid in pids {
        assert_unprivileged(*pid, nobody);
        let environment = environment(*pid).expect("the worker's environment");
        assert_eq!(
            environment
                .get("PEREGRINE_CONTROL_SOCKET")
                .map(PathBuf::from),
            Some(worker_socket(supervisor, service)),
            "worker {pid} registers on its service's socket"
        );
    }
}

/// Starts `command` as `account` (its uid and gid, no supplementary group), in a process group of
/// its own, logging into `dir`.
fn spawn_as(account: &Account, name: &str, command: &mut Command, dir: &Path) -> ChildGuard {
    command.uid(account.uid).gid(account.gid);
    ChildGuard::spawn(name, command, dir).unwrap_or_else(|error| panic!("{name}: {error:#}"))
}

#[test]
fn built_in_workers_as_nobody_hold_no_privilege_through_kills_restarts_adoption_and_upgrades() {
    if envoy_or_skip(&current_test()).is_none() {
        return;
    }
    let nobody = nobody();
    let stage = Stage::new(&nobody);
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::one_service(grpc, listen, admin, 2);
    config.service_mut(CLUSTER).user = Some(AccountId::Name("nobody".into()));
    let supervisor = Supervisor::start_open_to_workers(&stage, &[], &config.toml());
    let mut stack = Stack::around(supervisor, config, listen);
    let first = stack.deployed().wait_for_workers(2, &BTreeSet::new());
    assert_workers_unprivileged(&stack.supervisor, CLUSTER, &first, &nobody);
    // Their registration socket: the service's group may open it, nobody else.
    let socket = std::fs::metadata(worker_socket(&stack.supervisor, CLUSTER)).unwrap();
    assert_eq!(
        (socket.mode() & 0o777, socket.gid()),
        (0o660, nobody.gid),
        "the worker socket's mode and group"
    );
    let answered = stack.spread(20);
    assert!(
        answered.keys().all(|pid| first.contains(pid)),
        "{answered:?} answered through Envoy, not {first:?}"
    );

    // A SIGKILLed worker comes back as nobody, without privileges.
    let victim = *first.iter().next().unwrap();
    sigkill(victim);
    let second = stack.deployed().wait_for_workers(2, &[victim].into());
    assert_workers_unprivileged(&stack.supervisor, CLUSTER, &second, &nobody);

    // A rolling restart of the service under load: no request lost, the new workers as nobody.
    let load = stack.deployed().load();
    let out = stack
        .supervisor
        .control("restart", &[CLUSTER])
        .unwrap_or_else(|error| panic!("{error:#}\n{}", stack.supervisor.all_logs()));
    assert!(
        out.starts_with("2 replaced, 0 added, 0 removed, 0 failed"),
        "{out}"
    );
    let third = stack.deployed().wait_for_workers(2, &second);
    for pid in &second {
        wait_until(STEP, "the replaced workers to exit", || {
            gone(*pid).then_some(())
        });
    }
    assert_workers_unprivileged(&stack.supervisor, CLUSTER, &third, &nobody);

    // A process of a user no service names, dressed as a worker of this supervisor (its lineage,
    // its service's socket) in a slot that does not exist: never adopted, never signalled.
    let daemon = Account::lookup("daemon");
    let mut dressed = Command::new("sleep");
    dressed
        .arg("120")
        .env(
            "PEREGRINE_CONTROL_SOCKET",
            worker_socket(&stack.supervisor, CLUSTER),
        )
        .env("PEREGRINE_SERVICE", CLUSTER)
        .env("PEREGRINE_WORKER_INDEX", "5")
        .env("PEREGRINE_LINEAGE", lineage(&stack.supervisor));
    let mut stranger = spawn_as(&daemon, "stranger", &mut dressed, stack.supervisor.dir());
    let stranger_pid = stranger.id();
    wait_until(STEP, "the stranger's environment", || {
        peregrine_e2e::workers_in(stack.supervisor.dir())
            .contains(&stranger_pid)
            .then_some(())
    });

    // A SIGKILLed supervisor started again adopts its nobody workers: the same pids serve on.
    stack.supervisor.kill_and_start_again().unwrap();
    let adopted = wait_until(STEP, "the workers adopted and registered again", || {
        let pids = stack.supervisor.status_pids().ok()?;
        (pids.len() == 2).then_some(pids)
    });
    assert_eq!(adopted, third, "the same workers are adopted");
    let logs = stack.supervisor.logs();
    assert!(logs.contains("Adopting a worker"), "{logs}");
    assert!(
        !logs.contains(&format!("pid={stranger_pid}")),
        "the stranger {stranger_pid} is left alone:\n{logs}"
    );
    assert!(stranger.try_wait().is_none(), "the stranger still runs");
    wait_until(STEP, "Envoy to reconnect", || {
        (stack
            .envoy
            .stat("cluster_manager.cds.control_plane.connected_state")
            == Some(1))
        .then_some(())
    });

    // An upgrade in place adopts them again, as the same process: still nobody, without
    // privileges, and the stranger still left alone.
    let supervisor_pid = stack.supervisor.pid();
    let out = stack
        .supervisor
        .control("upgrade", &[])
        .unwrap_or_else(|error| panic!("{error:#}\n{}", stack.supervisor.all_logs()));
    assert!(
        out.starts_with(&format!("upgraded in place: pid {supervisor_pid}, ")),
        "{out}"
    );
    assert_eq!(stack.supervisor.status_pids().unwrap(), third, "{out}");
    assert_workers_unprivileged(&stack.supervisor, CLUSTER, &third, &nobody);
    assert!(stranger.try_wait().is_none(), "the stranger still runs");

    let all: BTreeSet<u32> = second.union(&third).copied().collect();
    let report = stack.deployed().finish(load, 50, &all);
    assert!(
        third.iter().all(|pid| report.by_pid.contains_key(pid)),
        "the restarted workers served: {third:?} in {:?}",
        report.by_pid
    );
    assert!(stranger.try_wait().is_none(), "the stranger still runs");
}

/// `cluster` of `supervisor` behind `envoy`, as the zero-downtime steps see it.
fn deployed<'a>(
    envoy: &'a Envoy,
    supervisor: &'a Supervisor,
    cluster: &'a str,
    listen: SocketAddr,
) -> Deployed<'a> {
    Deployed {
        envoy,
        supervisor,
        cluster,
        listen,
    }
}

/// gunicorn, as `stage` gives it, runs as its account: its virtualenv's python is one every user
/// may run (not one under a home directory only root may enter, such as a pyenv in `/root`).
#[track_caller]
fn assert_runs_as(stage: &Stage, servers: &AppServers) {
    let account = stage.account();
    let gunicorn = stage.gunicorn(&servers.gunicorn);
    // From a directory the account may enter, as the supervisor starts its workers: gunicorn
    // changes to its working directory when it starts, and the test's own may be in the checkout.
    let ran = Command::new(&gunicorn[0])
        .args(&gunicorn[1..])
        .arg("--version")
        .current_dir(stage.dir())
        .uid(account.uid)
        .gid(account.gid)
        .output();
    let why = match ran {
        Ok(output) if output.status.success() => return,
        Ok(output) => format!(
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Err(error) => error.to_string(),
    };
    panic!(
        "{gunicorn:?} does not run as {} ({why}): its virtualenv must be made from a python every \
         user can run (/usr/bin/python3)",
        account.name,
    );
}

/// The servers for the running test, or `None` after saying why it skips.
fn app_servers() -> Option<AppServers> {
    let test = current_test();
    envoy_or_skip(&test)?;
    app_servers_or_skip(&test)
}

#[test]
fn gunicorn_as_nobody_and_every_process_it_forks_hold_no_privilege_through_kills_restarts_and_adoption()
 {
    const SERVICE: &str = "app";
    let Some(servers) = app_servers() else {
        return;
    };
    let nobody = nobody();
    let stage = Stage::new(&nobody);
    assert_runs_as(&stage, &servers);
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    config.supervisor.register_timeout_ms = Some(20000);
    config.service(
        SERVICE,
        as_nobody(ServiceTable {
            pass_socket: Some(true),
            ready_path: Some("/healthz".into()),
            ..ServiceTable::default()
                .count(2)
                .command(stage.gunicorn_command(&servers.gunicorn))
                .per_worker()
        }),
    );
    let mut supervisor = Supervisor::start_open_to_workers(&stage, &[], &config.toml());
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("envoy-bootstrap"));
    let listen = SocketAddr::from(([127, 0, 0, 1], listen));
    // gunicorn's arbiter, and the worker it forked to answer (ready means it answered).
    let forked = |pids: &BTreeSet<u32>| {
        for pid in pids {
            wait_until(STEP, "gunicorn's worker process", || {
                (!peregrine_e2e::proc_status::descendants(*pid).is_empty()).then_some(())
            });
            assert!(assert_unprivileged(*pid, &nobody) >= 2);
        }
    };
    let first =
        deployed(&envoy, &supervisor, SERVICE, listen).wait_for_workers(2, &BTreeSet::new());
    forked(&first);
    let (status, body) = http_get(listen, "/").unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(
        worker_pid(&body).is_some_and(|pid| first.contains(&pid)),
        "{body}"
    );

    // A SIGKILLed server comes back as nobody, and so does what it forks.
    let victim = *first.iter().next().unwrap();
    sigkill(victim);
    let second =
        deployed(&envoy, &supervisor, SERVICE, listen).wait_for_workers(2, &[victim].into());
    forked(&second);

    // A rolling restart under load loses no request.
    let load = deployed(&envoy, &supervisor, SERVICE, listen).load();
    let out = supervisor
        .control("restart", &[SERVICE])
        .unwrap_or_else(|error| panic!("{error:#}\n{}", supervisor.all_logs()));
    assert!(
        out.starts_with("2 replaced, 0 added, 0 removed, 0 failed"),
        "{out}"
    );
    let third = deployed(&envoy, &supervisor, SERVICE, listen).wait_for_workers(2, &second);
    for pid in &second {
        wait_until(STEP, "the replaced servers to exit", || {
            gone(*pid).then_some(())
        });
    }
    forked(&third);

    // A SIGKILLed supervisor started again adopts them.
    supervisor.kill_and_start_again().unwrap();
    let adopted = wait_until(STEP, "the servers adopted", || {
        let pids = supervisor.status_pids().ok()?;
        (pids.len() == 2).then_some(pids)
    });
    assert_eq!(adopted, third, "the same servers are adopted");
    let logs = supervisor.logs();
    assert!(logs.contains("Adopting a worker"), "{logs}");
    wait_until(STEP, "Envoy to reconnect", || {
        (envoy.stat("cluster_manager.cds.control_plane.connected_state") == Some(1)).then_some(())
    });
    forked(&third);
    let all: BTreeSet<u32> = second.union(&third).copied().collect();
    let report = deployed(&envoy, &supervisor, SERVICE, listen).finish(load, 50, &all);
    assert!(
        third.iter().all(|pid| report.by_pid.contains_key(pid)),
        "the restarted servers served: {third:?} in {:?}",
        report.by_pid
    );
}

/// One line `register-as` printed: `register-as: uid U pid P: SERVICE/INDEX as pid C on SOCKET:
/// OUTCOME`; the uid, the pid and the outcome.
fn claim(line: &str) -> (u32, u32, String) {
    let parse = || -> Option<(u32, u32, String)> {
        let rest = line.split("register-as: uid ").nth(1)?;
        let (uid, rest) = rest.split_once(" pid ")?;
        let (pid, rest) = rest.split_once(": ")?;
        let (_, outcome) = rest.split_once(": ")?;
        Some((uid.parse().ok()?, pid.parse().ok()?, outcome.to_owned()))
    };
    parse().unwrap_or_else(|| panic!("not a line of register-as: {line:?}"))
}

/// The code of a `register-as` outcome `refused CODE: REASON`; panics on any other outcome.
fn refused_code(outcome: &str) -> &str {
    outcome
        .strip_prefix("refused ")
        .and_then(|rest| rest.split(':').next())
        .unwrap_or_else(|| panic!("not a refusal: {outcome}"))
}

#[test]
fn a_nobody_process_that_is_no_worker_and_a_worker_claiming_another_service_are_refused() {
    let nobody = nobody();
    let stage = Stage::new(&nobody);
    let register_as = register_as(&stage);
    let mut config = without_envoy(Sampler::Off);
    config.service("web", as_nobody(ServiceTable::at("http://127.0.0.1:0")));
    config.service(
        "imp",
        as_nobody(ServiceTable::default().command([
            register_as.as_str(),
            "--stay",
            "120",
            // On its own socket: the other service's slot, then another slot of its own service.
            "-,web,0",
            "-,imp,1",
            // On the other service's socket, which its group may open, as that service.
            "{dir}/peregrine.sock.web.workers,web,0",
        ])),
    );
    let supervisor = Supervisor::start_open_to_workers(&stage, &[], &config.toml());
    let web = ready_workers(&supervisor, "web", 1)[&0];
    assert_unprivileged(web, &nobody);

    // The worker of `imp` claiming to be `web`, or another slot of `imp`.
    let logs = wait_until(STEP, "the three claims of imp's worker", || {
        let logs = supervisor.logs();
        (logs.matches("register-as: uid").count() >= 3).then_some(logs)
    });
    let claims: Vec<(u32, u32, String)> = logs
        .lines()
        .filter(|line| line.contains("register-as: uid"))
        .map(claim)
        .collect();
    let imp = claims[0].1;
    for (uid, pid, _) in &claims {
        assert_eq!((*uid, *pid), (nobody.uid, imp), "one worker, as nobody");
    }
    let codes: Vec<&str> = claims
        .iter()
        .map(|(_, _, outcome)| refused_code(outcome))
        .collect();
    assert_eq!(
        codes,
        [
            "CODE_SLOT_MISMATCH",
            "CODE_SLOT_MISMATCH",
            "CODE_WRONG_SOCKET"
        ],
        "{claims:?}"
    );
    let environment = environment(imp).expect("imp's worker still runs");
    assert_eq!(
        environment.get("PEREGRINE_SERVICE").map(String::as_str),
        Some("imp"),
        "the claims came from imp's worker"
    );
    wait_until(STEP, "the refusals logged with uid and pid", || {
        refusal_logged(&supervisor.logs(), nobody.uid, imp).then_some(())
    });

    // A nobody process that is no worker: refused on the worker socket, whatever pid it claims,
    // and it cannot open the control socket at all.
    let web_socket = worker_socket(&supervisor, "web").display().to_string();
    let mut stranger = Command::new(&register_as);
    stranger.args([
        format!("{web_socket},web,0"),
        format!("{web_socket},web,0,{web}"),
        format!("{},web,0", control_socket(&supervisor).display()),
    ]);
    let guard = spawn_as(&nobody, "stranger", &mut stranger, supervisor.dir());
    let (stdout, _) = guard.log_paths();
    let stdout = stdout.to_owned();
    let lines = wait_until(STEP, "the stranger's three claims", || {
        let text = std::fs::read_to_string(&stdout).ok()?;
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        (lines.len() == 3).then_some(lines)
    });
    let claims: Vec<(u32, u32, String)> = lines.iter().map(|line| claim(line)).collect();
    let stranger_pid = claims[0].1;
    assert_eq!(claims[0].0, nobody.uid, "{claims:?}");
    assert_eq!(refused_code(&claims[0].2), "CODE_NOT_OURS", "{claims:?}");
    assert_eq!(refused_code(&claims[1].2), "CODE_NOT_OURS", "{claims:?}");
    assert!(
        claims[2].2.starts_with("cannot connect") && claims[2].2.contains("Permission denied"),
        "{claims:?}"
    );
    wait_until(
        STEP,
        "the stranger's refusals logged with uid and pid",
        || refusal_logged(&supervisor.logs(), nobody.uid, stranger_pid).then_some(()),
    );

    // Nothing changed: web's worker is the one registered, and only it.
    let status = supervisor.status_json().unwrap();
    let web_rows = rows(&status, "web");
    assert_eq!(web_rows.len(), 1, "{status}");
    assert_eq!(web_rows[&0]["pid"], web, "{status}");
    assert_eq!(web_rows[&0]["state"], "ready", "{status}");
    assert_eq!(web_rows[&0]["restarts"], 0, "{status}");
}

#[test]
fn a_worker_asking_for_a_restart_is_refused_and_a_nobody_worker_cannot_open_the_control_socket() {
    let stage = Stage::new(&nobody());
    let peregrine = stage.program(&peregrine_path()).display().to_string();
    // A worker of the supervisor's own user asks for a restart of every service, through its own
    // control socket, and says what it got.
    let ask = "\"$1\" restart --socket \"$PEREGRINE_CONTROL_SOCKET\" > \"$2/ctl.out\" 2>&1 & \
               pid=$!; wait $pid; code=$?; \
               echo \"ctl asked for a restart: pid $pid: exit $code:\" $(cat \"$2/ctl.out\"); \
               touch \"$2/ctl.done\"; exec sleep 120";
    // A nobody worker tries the control socket, then asks for a restart on its own socket.
    let try_as_nobody = "out=$(\"$1\" status --socket \"$2\" 2>&1); \
               echo \"nobody asked for the status: exit $?:\" $out; \
               out=$(\"$1\" restart --socket \"$PEREGRINE_CONTROL_SOCKET\" 2>&1); \
               echo \"nobody asked for a restart: exit $?:\" $out; \
               exec sleep 120";
    // A worker of the supervisor's own user that double-forks: the grandchild, an orphan handed to
    // the supervisor (the subreaper of everything it starts), waits until it is the supervisor's
    // child, then asks for a restart. It is in no worker's tree any more, but it is in the
    // supervisor's. It asks once the first worker has had its answer: refusals of one kind are
    // logged once per period, and the first must be that worker's, whose line names its pid.
    let orphan = "sup=$PPID; ( sh -c 'while [ \"$(cut -d\" \" -f4 /proc/$$/stat)\" != \"$0\" ] \
                  || [ ! -e \"$2/ctl.done\" ]; do sleep 0.05; done; \
                  \"$1\" restart --socket \"$PEREGRINE_CONTROL_SOCKET\" > \"$2/orphan.out\" 2>&1; \
                  echo \"orphan asked for a restart: pid $$: exit $?:\" $(cat \"$2/orphan.out\")' \
                  \"$sup\" \"$1\" \"$2\" & ); exec sleep 120";
    let mut config = without_envoy(Sampler::Off);
    config.service("web", ServiceTable::at("http://127.0.0.1:0").count(2));
    config.service(
        "ctl",
        ServiceTable::default().command(["/bin/sh", "-c", ask, "ctl", &peregrine, "{dir}"]),
    );
    config.service(
        "orphan",
        ServiceTable::default().command(["/bin/sh", "-c", orphan, "orphan", &peregrine, "{dir}"]),
    );
    config.service(
        "probe",
        as_nobody(ServiceTable::default().command([
            "/bin/sh",
            "-c",
            try_as_nobody,
            "probe",
            &peregrine,
            "{dir}/peregrine.sock",
        ])),
    );
    let supervisor = Supervisor::start_open_to_workers(&stage, &[], &config.toml());
    let web = ready_workers(&supervisor, "web", 2);

    let asked = logged_line(&supervisor, "ctl asked for a restart: ");
    assert_ne!(exit_code(&asked), 0, "{asked}");
    assert!(asked.contains("refused"), "{asked}");
    let child: u32 = asked
        .split("pid ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {asked:?}"));
    wait_until(STEP, "the refusal logged with uid and pid", || {
        refusal_logged(&supervisor.logs(), 0, child).then_some(())
    });

    let orphaned = logged_line(&supervisor, "orphan asked for a restart: ");
    assert_ne!(exit_code(&orphaned), 0, "{orphaned}");
    assert!(
        orphaned.contains("descends from this supervisor"),
        "{orphaned}"
    );

    // `peregrine` itself ran and said so: not a shell that could not execute it.
    let status_line = logged_line(&supervisor, "nobody asked for the status: ");
    assert_ne!(exit_code(&status_line), 0, "{status_line}");
    assert!(
        status_line.contains("this user may not ask the supervisor")
            && status_line.contains("only its own user, root, may"),
        "{status_line}"
    );
    let restart_line = logged_line(&supervisor, "nobody asked for a restart: ");
    assert_ne!(exit_code(&restart_line), 0, "{restart_line}");
    assert!(
        restart_line.contains("registrations only"),
        "{restart_line}"
    );

    // No worker was replaced: not web's, not the one that asked.
    let status = supervisor.status_json().unwrap();
    let now: BTreeMap<u64, u32> = rows(&status, "web")
        .into_iter()
        .map(|(index, row)| (index, row["pid"].as_u64().unwrap_or(0) as u32))
        .collect();
    assert_eq!(now, web, "{status}");
    for (service, rows) in [("web", rows(&status, "web")), ("ctl", rows(&status, "ctl"))] {
        for row in rows.values() {
            assert_eq!(row["restarts"], 0, "{service}: {status}");
        }
    }
    let logs = supervisor.logs();
    assert!(!logs.contains("Control command received"), "{logs}");
}

#[test]
fn a_nobody_worker_cannot_read_the_tls_keys_tls_init_wrote() {
    let stage = Stage::new(&nobody());
    // A directory the worker may enter: only the keys' own mode may stop it.
    let dir = stage.open_temp_dir("peregrine-tls-");
    let pki = dir.path().join("pki");
    peregrine_tls_init(&peregrine_path(), &pki, &[]);
    std::fs::set_permissions(&pki, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut keys = Vec::new();
    let mut certificates = Vec::new();
    for entry in std::fs::read_dir(&pki).unwrap() {
        let path = entry.unwrap().path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("key") => keys.push(path),
            Some("pem") => certificates.push(path),
            _ => {}
        }
    }
    assert!(keys.len() >= 3 && !certificates.is_empty(), "{keys:?}");
    // Read as root: each key is the supervisor's alone.
    for key in &keys {
        let meta = std::fs::metadata(key).unwrap();
        assert_eq!(
            (meta.mode() & 0o777, meta.uid()),
            (0o600, 0),
            "{}",
            key.display()
        );
    }
    let files: Vec<String> = keys
        .iter()
        .chain(&certificates)
        .map(|path| path.display().to_string())
        .collect();
    let read_each = "for f in \"$@\"; do \
               if err=$(cat \"$f\" 2>&1 >/dev/null); then echo \"probe read $f: ok\"; \
               else echo \"probe read $f:\" $err; fi; done; exec sleep 120";
    let mut command = vec![
        "/bin/sh".to_owned(),
        "-c".into(),
        read_each.into(),
        "probe".into(),
    ];
    command.extend(files);
    let mut config = PeregrineToml::local(free_port()).with_envoy(free_port(), free_port());
    secure_control_plane(&mut config, &pki);
    config.service("probe", as_nobody(ServiceTable::default().command(command)));
    let supervisor = Supervisor::start_open_to_workers(&stage, &[], &config.toml());
    for key in &keys {
        let line = logged_line(&supervisor, &format!("probe read {}:", key.display()));
        assert!(line.contains("Permission denied"), "{line}");
    }
    // The certificates, in the same directory, are read: only the keys' mode stops the worker.
    for certificate in &certificates {
        let line = logged_line(
            &supervisor,
            &format!("probe read {}:", certificate.display()),
        );
        assert!(line.ends_with(": ok"), "{line}");
    }
}

#[test]
fn a_nobody_gunicorn_serves_port_80_on_the_listener_the_supervisor_passes() {
    let test = current_test();
    if !netns_or_skip(&test) {
        return;
    }
    let Some(servers) = app_servers_or_skip(&test) else {
        return;
    };
    let nobody = nobody();
    let stage = Stage::new(&nobody);
    assert_runs_as(&stage, &servers);
    let network = Network::create(&["web"]).expect("a network namespace");
    let host = network.host("web");
    // In a fresh namespace only a privileged process may bind a port below 1024.
    let output = host
        .command("cat")
        .arg("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        .output()
        .unwrap();
    let first_unprivileged: u32 = String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .expect("ip_unprivileged_port_start");
    assert!(first_unprivileged > 80, "port 80 is not privileged here");
    let mut config = without_envoy(Sampler::Procfs);
    config.supervisor.register_timeout_ms = Some(20000);
    config.service(
        "app",
        as_nobody(ServiceTable {
            pass_socket: Some(true),
            ready_path: Some("/healthz".into()),
            ..ServiceTable::at("http://127.0.0.1:80")
                .command(stage.gunicorn_command(&servers.gunicorn))
        }),
    );
    let supervisor = Supervisor::start_open_to_workers(&stage, &host.wrapper(), &config.toml());
    let pid = ready_workers(&supervisor, "app", 1)[&0];
    let (status, body) = host
        .run(|| http_get(SocketAddr::from(([127, 0, 0, 1], 80)), "/"))
        .unwrap_or_else(|error| panic!("GET port 80: {error:#}\n{}", supervisor.logs()));
    assert_eq!((status, worker_pid(&body)), (200, Some(pid)), "{body}");
    assert!(
        assert_unprivileged(pid, &nobody) >= 2,
        "gunicorn and its worker"
    );
}

/// A built-in worker's request counter as the kernel shows it: the descriptor it inherited
/// (`PEREGRINE_COUNTERS_FD`), its line in it (`PEREGRINE_COUNTERS_LANE`) and the file behind it.
#[derive(Debug)]
struct Counter {
    pid: u32,
    lane: String,
    /// `/proc/PID/fd/N`.
    path: PathBuf,
    /// The file's device, inode and size.
    file: (u64, u64, u64),
}

impl Counter {
    fn of(pid: u32) -> Counter {
        let environment = environment(pid).expect("the worker's environment");
        let fd = environment
            .get("PEREGRINE_COUNTERS_FD")
            .unwrap_or_else(|| panic!("worker {pid} has no counter: {environment:?}"));
        let path = PathBuf::from(format!("/proc/{pid}/fd/{fd}"));
        let meta = std::fs::metadata(&path).unwrap();
        Counter {
            pid,
            lane: environment["PEREGRINE_COUNTERS_LANE"].clone(),
            path,
            file: (meta.dev(), meta.ino(), meta.size()),
        }
    }

    /// Every file the worker holds a descriptor on (device and inode).
    fn open_files(&self) -> BTreeSet<(u64, u64)> {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid))
            .unwrap()
            .filter_map(|entry| {
                let meta = std::fs::metadata(entry.ok()?.path()).ok()?;
                Some((meta.dev(), meta.ino()))
            })
            .collect()
    }
}

#[test]
fn one_built_in_worker_cannot_change_another_workers_request_count() {
    let mut config = without_envoy(Sampler::Procfs);
    config.supervisor.sample_interval_ms = Some(100);
    config.service(
        "web",
        as_nobody(ServiceTable::at("http://127.0.0.1:0").count(2)),
    );
    let supervisor = Supervisor::start_open_to_workers(&Stage::new(&nobody()), &[], &config.toml());
    let pids = ready_workers(&supervisor, "web", 2);
    let (a, b) = (Counter::of(pids[&0]), Counter::of(pids[&1]));
    for counter in [&a, &b] {
        assert_eq!(
            counter.lane, "0",
            "each worker counts in line 0 of its own: {counter:?}"
        );
        assert_eq!(
            counter.file.2,
            peregrine_contract::report_slot::WORKER_REGION_BYTES as u64,
            "its own counter line and load report slot, no other worker's: {counter:?}"
        );
    }
    assert_ne!(
        (a.file.0, a.file.1),
        (b.file.0, b.file.1),
        "two counters, not one shared"
    );
    assert!(
        !a.open_files().contains(&(b.file.0, b.file.1)),
        "worker {} holds a descriptor on {}'s counter",
        a.pid,
        b.pid
    );

    // Requests to b, counted exactly.
    let status = supervisor.status_json().unwrap();
    let address: SocketAddr = rows(&status, "web")[&1]["addresses"][0]
        .as_str()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("b's address in {status}"));
    const SENT: u64 = 5;
    for _ in 0..SENT {
        let (code, body) = http_get(address, "/").unwrap();
        assert_eq!((code, worker_pid(&body)), (200, Some(b.pid)), "{body}");
    }
    let count = |status: &Value, index: u64| rows(status, "web")[&index]["requests_total"].as_u64();
    let before = wait_for_status(&supervisor, "b's requests counted", |s| {
        count(s, 1) == Some(SENT)
    });
    let a_before = count(&before, 0).unwrap_or(0);

    // What a's descriptor allows: its own region (its line and its load report slot) and nothing
    // past it.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&a.path)
        .unwrap();
    assert!(
        file.write_at(
            &[0xff; 8],
            peregrine_contract::report_slot::WORKER_REGION_BYTES as u64
        )
        .is_err(),
        "a write past a's region succeeded"
    );
    let mut line = [0u8; 8];
    file.read_exact_at(&mut line, 0).unwrap();
    let scribbled = u64::from_le_bytes(line) + 1_000_000;
    file.write_all_at(&scribbled.to_le_bytes(), 0).unwrap();
    let after = wait_for_status(&supervisor, "a's own count changed", |s| {
        count(s, 0).is_some_and(|n| n >= a_before + 1_000_000)
    });
    assert_eq!(
        count(&after, 1),
        Some(SENT),
        "b's count is untouched: {after}"
    );
    let (code, body) = http_get(address, "/").unwrap();
    assert_eq!((code, worker_pid(&body)), (200, Some(b.pid)), "{body}");
    wait_for_status(&supervisor, "b counting on exactly", |s| {
        count(s, 1) == Some(SENT + 1)
    });
}

#[test]
fn the_procfs_sampler_reads_a_nobody_workers_cpu_time() {
    let port = free_port();
    let mut config = without_envoy(Sampler::Procfs);
    config.supervisor.sample_interval_ms = Some(100);
    config.service(
        "web",
        as_nobody(ServiceTable::at(format!("http://127.0.0.1:{port}"))),
    );
    let nobody = nobody();
    let supervisor = Supervisor::start_open_to_workers(&Stage::new(&nobody), &[], &config.toml());
    let pid = ready_workers(&supervisor, "web", 1)[&0];
    assert_unprivileged(pid, &nobody);
    let cpu = |status: &Value| rows(status, "web")[&0]["cpu_seconds_total"].as_f64();
    let before = wait_for_status(&supervisor, "a first sample", |s| cpu(s).is_some());
    let before = cpu(&before).unwrap();
    let (code, body) = http_get(SocketAddr::from(([127, 0, 0, 1], port)), "/?cpu=300").unwrap();
    assert_eq!((code, worker_pid(&body)), (200, Some(pid)), "{body}");
    let after = wait_for_status(&supervisor, "the burn sampled", |s| {
        cpu(s).is_some_and(|cpu| cpu >= before + 0.25)
    });
    assert_eq!(after["sampler"], "procfs", "{after}");
}

/// `peregrine check` on `config`: its exit code and stderr.
fn check(config: &str) -> (i32, String) {
    let dir = peregrine_e2e::TempDir::new().unwrap();
    let path = dir.path().join("peregrine.toml");
    std::fs::write(&path, config).unwrap();
    let output = Command::new(peregrine_path())
        .arg("check")
        .arg(&path)
        .output()
        .expect("peregrine runs");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A program the service's user cannot reach (a virtualenv under a folder only root may enter) is
/// refused by `check` at its line: `run` would start workers that fail with `Permission denied`.
#[test]
fn check_refuses_a_command_the_services_user_cannot_run() {
    let dir = peregrine_e2e::TempDir::new().unwrap();
    // Only root may enter it (a temporary folder is its owner's alone).
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let server = dir.path().join("server");
    std::fs::write(&server, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&server, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (code, stderr) = check(&format!(
        "[service.web]\npass_socket = true\nuser = \"nobody\"\ncommand = [\"{}\"]\n",
        server.display()
    ));
    assert_eq!(code, 78, "{stderr}");
    assert!(
        stderr.contains("line 4: service.web.command: user nobody cannot run")
            && stderr.contains("(mode 0700) is not searchable by it"),
        "{stderr}"
    );
    // Once it may enter, the same config checks.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (code, stderr) = check(&format!(
        "[service.web]\npass_socket = true\nuser = \"nobody\"\ncommand = [\"{}\"]\n",
        server.display()
    ));
    if code != 0 {
        // The temporary folder's own parents may be closed to nobody (a checkout under /root).
        assert!(stderr.contains("is not searchable by it"), "{stderr}");
    }
}

/// `envoy-bootstrap` depends on what the config says, not on who reads it: a user who could not start
/// the supervisor (it could not switch to the service's user) still gets the bootstrap, where
/// `check`, which predicts a start by this very user, refuses.
#[test]
fn envoy_bootstrap_is_written_for_any_user_who_may_read_the_config() {
    // Wherever the checkout and the temporary folders are: a folder and a copy nobody may reach.
    let stage = Stage::new(&nobody());
    let dir = stage.open_temp_dir("bootstrap-");
    let config = dir.path().join("peregrine.toml");
    std::fs::write(
        &config,
        "[envoy]\nlisten = \"127.0.0.1:10000\"\n[service.web]\nuser = \"www-data\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    let peregrine = stage.program(&peregrine_path());
    let as_nobody = |command: &str| {
        std::process::Command::new(&peregrine)
            .arg(command)
            .arg(&config)
            .uid(65534)
            .gid(65534)
            .output()
            .expect("peregrine runs as nobody")
    };
    let bootstrap = as_nobody("envoy-bootstrap");
    let stdout = String::from_utf8_lossy(&bootstrap.stdout);
    assert!(
        bootstrap.status.success() && stdout.contains("static_resources"),
        "{stdout}{}",
        String::from_utf8_lossy(&bootstrap.stderr)
    );
    let check = as_nobody("check");
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert_eq!(check.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("cannot switch users"), "{stderr}");
}

#[test]
fn check_names_the_key_and_line_of_an_unknown_user_or_group() {
    let (code, stderr) = check("[service.web]\ncount = 1\nuser = \"no-such-user-of-peregrine\"\n");
    assert_eq!(code, 78, "{stderr}");
    assert!(
        stderr.contains("line 3")
            && stderr.contains("service.web.user")
            && stderr.contains("no-such-user-of-peregrine"),
        "{stderr}"
    );
    let (code, stderr) =
        check("[service.web]\nuser = \"nobody\"\ngroup = \"no-such-group-of-peregrine\"\n");
    assert_eq!(code, 78, "{stderr}");
    assert!(
        stderr.contains("line 3")
            && stderr.contains("service.web.group")
            && stderr.contains("no-such-group-of-peregrine"),
        "{stderr}"
    );
    // A group alone says whose group it would be.
    let (code, stderr) = check("[service.web]\ngroup = \"root\"\n");
    assert_eq!(code, 78, "{stderr}");
    assert!(
        stderr.contains("line 2") && stderr.contains("service.web.group"),
        "{stderr}"
    );
    // Both known: the config is good.
    let (code, stderr) = check("[service.web]\nuser = \"nobody\"\n");
    assert_eq!(code, 0, "{stderr}");
}

/// 256 built-in workers of one user, under a supervisor whose `RLIMIT_MEMLOCK` is the common
/// default of 8 MiB. Each worker's io_uring is charged to its user's locked memory, shared by every
/// process of the uid: with the rings of before (216 KiB a worker) about 40 could start and the rest
/// crash-looped on `Cannot allocate memory`. The supervisor now raises each worker's limit to fit
/// its user's workers, and the rings are smaller. A uid of its own, with no entry in the user
/// database, so that no other test's workers share its allowance.
#[test]
fn two_hundred_fifty_six_workers_of_one_user_serve_within_an_8_mib_locked_memory_limit() {
    const COUNT: usize = 256;
    const LIMIT: &str = "--memlock=8388608:8388608";
    let account = Account {
        name: "61256".into(),
        uid: 61_256,
        gid: 65_534,
        groups: [65_534].into(),
    };
    let stage = Stage::new(&account);
    let mut config = without_envoy(Sampler::Auto);
    config.service(
        "wide",
        ServiceTable {
            user: Some(AccountId::Id(account.uid)),
            group: Some(AccountId::Id(account.gid)),
            ..ServiceTable::at("http://127.0.0.1:0").count(COUNT as u32)
        },
    );
    let supervisor =
        Supervisor::start_open_to_workers(&stage, &["prlimit", LIMIT, "--"], &config.toml());
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", supervisor.pid())).unwrap();
    assert!(
        limits
            .lines()
            .any(|l| l.starts_with("Max locked memory") && l.contains("8388608")),
        "the supervisor runs at 8 MiB:\n{limits}"
    );
    let mut last = Value::Null;
    let status = try_wait_until(Duration::from_secs(90), "256 ready workers", || {
        assert_running(&supervisor);
        last = supervisor.status_json().ok()?;
        let rows = rows(&last, "wide");
        (rows.len() == COUNT && rows.values().all(|row| row["state"] == "ready"))
            .then(|| last.clone())
    })
    .unwrap_or_else(|error| {
        let states = rows(&last, "wide").values().fold(
            BTreeMap::<String, usize>::new(),
            |mut states, row| {
                *states.entry(row["state"].to_string()).or_default() += 1;
                states
            },
        );
        panic!(
            "{error}; workers by state: {states:?}\n{}",
            tail(&supervisor.logs(), 40)
        )
    });
    for (index, row) in rows(&status, "wide") {
        let address: SocketAddr = row["addresses"][0]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("worker {index}'s address in {row}"));
        let (code, body) = http_get(address, "/").unwrap();
        assert_eq!(code, 200, "worker {index}: {body}");
        assert_eq!(worker_pid(&body), row["pid"].as_u64().map(|p| p as u32));
    }
    let logs = supervisor.logs();
    assert!(
        !logs.contains("locked memory") && !logs.contains("Cannot allocate memory"),
        "{}",
        tail(&logs, 40)
    );
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Workers that run as root by `user = "root"` get the same warning as those with no `user`, and a
/// file the supervisor trusts (here its config) that a service's user could replace is named, at
/// start and at each reload.
#[test]
fn the_supervisor_warns_of_root_workers_and_of_a_config_a_worker_could_replace() {
    let stage = Stage::new(&nobody());
    let mut config = without_envoy(Sampler::Off);
    config.service(
        "rooted",
        ServiceTable {
            user: Some(AccountId::Name("root".into())),
            ..ServiceTable::at("http://127.0.0.1:0")
        },
    );
    config.service("web", as_nobody(ServiceTable::at("http://127.0.0.1:0")));
    let supervisor = Supervisor::start_open_to_workers(&stage, &[], &config.toml());
    ready_workers(&supervisor, "web", 1);
    let rooted = logged_line(&supervisor, "These workers run as root");
    assert!(rooted.contains("service=rooted"), "{rooted}");
    assert!(
        !supervisor.logs().contains("can replace the config"),
        "{}",
        supervisor.logs()
    );
    // Anyone may write the config now: a nobody worker could rewrite what the next reload applies.
    std::fs::set_permissions(
        supervisor.config_path(),
        std::fs::Permissions::from_mode(0o666),
    )
    .unwrap();
    supervisor.control("reload", &[]).expect("reload");
    let replace = logged_line(&supervisor, "can replace the config");
    assert!(
        replace.contains("service=web") && replace.contains("(user nobody)"),
        "{replace}"
    );
}

/// The capabilities the package's unit leaves the supervisor (its `CapabilityBoundingSet=`), as
/// `setpriv` names them (`bpf`, `dac_read_search`, ...).
fn units_capabilities() -> Vec<String> {
    let unit = std::fs::read_to_string(
        peregrine_e2e::workspace_root().join("packaging/systemd/peregrine.service"),
    )
    .unwrap();
    let line = unit
        .lines()
        .find_map(|line| line.strip_prefix("CapabilityBoundingSet="))
        .expect("a CapabilityBoundingSet= line in the unit");
    line.split_whitespace()
        .map(|cap| cap.trim_start_matches("CAP_").to_lowercase())
        .collect()
}

#[test]
fn a_supervisor_with_only_the_units_capabilities_adopts_workers_of_a_services_user() {
    let nobody = nobody();
    let stage = Stage::new(&nobody);
    let granted = units_capabilities();
    assert!(
        granted.iter().any(|cap| cap == "dac_read_search"),
        "{granted:?}"
    );
    // Without CAP_DAC_READ_SEARCH the supervisor cannot read a `nobody` worker's environment (its
    // /proc/PID/environ is nobody's, mode 0400), so it cannot tell its own workers and replaces
    // them, and says why; with the unit's set it keeps them. Both under no_new_privs, as the unit
    // runs it (an upgrade in place execs under it too).
    let without: Vec<String> = granted
        .iter()
        .filter(|cap| *cap != "dac_read_search")
        .cloned()
        .collect();
    for (caps, adopts) in [(without, false), (granted, true)] {
        let bounding = format!(
            "--bounding-set=-all,{}",
            caps.iter()
                .map(|cap| format!("+{cap}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let wrapper = ["setpriv", "--no-new-privs", bounding.as_str(), "--"];
        let mut config = PeregrineToml::local(free_port());
        config.service(CLUSTER, as_nobody(ServiceTable::default().count(2)));
        let mut supervisor = Supervisor::start_open_to_workers(&stage, &wrapper, &config.toml());
        let before = wait_until(STEP, "both workers registered", || {
            let pids = supervisor.status_pids().ok()?;
            (pids.len() == 2).then_some(pids)
        });
        supervisor.kill_and_start_again().unwrap();
        let after = wait_until(STEP, "two workers registered again", || {
            let pids = supervisor.status_pids().ok()?;
            (pids.len() == 2 && (adopts || pids.is_disjoint(&before))).then_some(pids)
        });
        let logs = supervisor.all_logs();
        if adopts {
            assert_eq!(after, before, "with {caps:?}, not adopted:\n{logs}");
            assert!(
                !logs.contains("Cannot read the environment"),
                "with {caps:?}:\n{logs}"
            );
        } else {
            for said in [
                "no CAP_DAC_READ_SEARCH",
                "Cannot read the environment of processes of a service's user",
            ] {
                assert!(logs.contains(said), "with {caps:?}, no {said:?}:\n{logs}");
            }
        }
    }
}
