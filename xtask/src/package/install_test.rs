//! `cargo xtask package --test`: the package installed as an operator installs it, on a fresh
//! Debian 12 root ([`fresh::Root`]: debootstrap's minbase, and systemd, as a server has it), then
//! run, served through Envoy, and purged.
//!
//! 1. `apt-get install ./peregrine_*.deb` (apt brings its dependencies); the binary says it has the
//!    eBPF sampler, the unit is enabled, the system user exists, `peregrine check` (no argument)
//!    passes on the installed config as root (its service runs as that user), `systemd-analyze
//!    verify` passes on the installed unit, and the unit's bounding set holds what switching a
//!    worker to its user takes (CAP_SETUID, CAP_SETGID, CAP_SETPCAP, CAP_CHOWN).
//! 2. The unit's `ExecStartPre` and `ExecStart` commands, read from the installed unit file, run as
//!    systemd would run them: in its runtime directory made with its mode, with its capability
//!    bounding set, `NoNewPrivileges` and resource limits (the rest of its sandbox is not
//!    reproduced). `peregrine status`, typed with no flags, shows both workers registered and the
//!    eBPF sampler running. Each worker, on every thread, runs as the package's user with no
//!    capabilities and `NoNewPrivs: 1` (`/proc/PID/task/*/status`, [`privileges`]); the control
//!    socket and its lock are root's alone, the service's registration socket its group's; and
//!    that user's `peregrine status` is refused.
//! 3. A stock Envoy (the binary `cargo xtask envoy` installs, copied in as the operator's) starts
//!    with the bootstrap the package ships, which is what `peregrine envoy-bootstrap` prints for the
//!    installed config, and both workers answer through it with 200.
//! 4. Everything stops as `systemctl stop` stops it (SIGTERM to the supervisor, which stops its
//!    workers), then `apt-get purge --autoremove` leaves nothing of the package: the root's file
//!    listing is the one taken before the install, but for what Debian keeps (the system user, and
//!    the backups adduser makes of the user files) and what changes with any package operation
//!    (dpkg's and apt's state, caches and logs).
//!
//! The processes run in a network namespace of their own: the installed config's fixed ports
//! (18000, 9464, 9901, 10000) and Envoy's hot-restart socket cannot meet another process's.

mod listing;
mod privileges;
mod unit;

use std::{
    collections::BTreeSet,
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail, ensure};
use xtask::{envoy, interrupt};

use super::{
    Package,
    layout::{BINARY, CONFIG, ENVOY_BOOTSTRAP, UNIT},
    output,
};
use crate::fresh;

/// The fresh root's name (`target/fresh/package/`).
const ROOT: &str = "package";
/// Added to the minimal root before the package: what a Debian server has.
const BASE_PACKAGES: &[&str] = &["systemd"];
/// Where the operator's Envoy is, in the root.
const ENVOY: &str = "/usr/local/bin/envoy";
/// Envoy's listener in the installed config.
const ENVOY_LISTENER: &str = "127.0.0.1:10000";
/// The installed config's service and its workers.
const SERVICE: &str = "hello";
const WORKERS: usize = 2;
/// The system user postinst makes, which the installed config's service runs as.
const USER: &str = "peregrine";
/// The installed config's control socket (`supervisor.control`).
const CONTROL: &str = "/run/peregrine/peregrine.sock";
/// What switching a worker to its service's user takes, as the unit names them (less `CAP_`, in
/// lower case).
const SWITCH_CAPABILITIES: &[&str] = &["setuid", "setgid", "setpcap", "chown"];
/// How long the supervisor may take to register its workers, and Envoy to route to them.
const START_DEADLINE: Duration = Duration::from_secs(60);

/// Runs the test on `package`, which took `built` to build (for the table of times).
pub(super) fn run(package: &Package, built: Duration) -> anyhow::Result<()> {
    interrupt::install()?;
    let started = Instant::now();
    let mut phases = vec![("the release build and the package".to_owned(), built)];
    let step = Instant::now();
    let envoy = envoy::install()?;
    phases.push(("cargo xtask envoy".to_owned(), step.elapsed()));
    let root = fresh::Root::builder(ROOT)
        .packages(BASE_PACKAGES)
        .prepare()?;
    phases.extend(root.phases().iter().cloned());
    // The operator's Envoy, there before the package.
    root.copy_in(&envoy, ENVOY)?;
    let before = listing::take(root.path())?;

    let step = Instant::now();
    let deb = package
        .deb
        .file_name()
        .context("the package's file name")?
        .to_string_lossy()
        .into_owned();
    root.copy_in(&package.deb, &format!("/tmp/{deb}"))?;
    println!(
        "\n$ apt-get install ./peregrine_*.deb   (in the root {})",
        root.path().display()
    );
    root.run("cd /tmp && DEBIAN_FRONTEND=noninteractive apt-get install -y ./peregrine_*.deb")?;
    phases.push((
        "apt-get install ./peregrine_*.deb".to_owned(),
        step.elapsed(),
    ));

    let step = Instant::now();
    let account = check_installed(&root, package)?;
    phases.push((
        "checks of the installed files, peregrine check, systemd-analyze verify".to_owned(),
        step.elapsed(),
    ));

    let step = Instant::now();
    serve(&root, &account)?;
    phases.push((
        "the unit's commands, peregrine status, Envoy, 200s, stop".to_owned(),
        step.elapsed(),
    ));

    let step = Instant::now();
    println!("\n$ apt-get purge --autoremove peregrine");
    root.run("DEBIAN_FRONTEND=noninteractive apt-get purge -y --autoremove peregrine")?;
    let after = listing::take(root.path())?;
    check_purged(&root, &before, &after)?;
    phases.push(("apt-get purge, and what is left".to_owned(), step.elapsed()));

    let step = Instant::now();
    drop(root);
    phases.push(("teardown".to_owned(), step.elapsed()));
    println!("\npackage test times:");
    for (phase, took) in &phases {
        println!("  {phase:<72} {:>6.1}s", took.as_secs_f64());
    }
    println!(
        "  {:<72} {:>6.1}s",
        "total",
        (built + started.elapsed()).as_secs_f64()
    );
    println!(
        "package test passed: {deb} installs on a fresh Debian 12 root, serves through Envoy with \
         the eBPF sampler and workers of the {USER} user without privileges, and purges clean"
    );
    Ok(())
}

/// What the install left: the binary, the unit enabled, the user (returned), the man page, a
/// config that checks, a unit that verifies and may switch users.
fn check_installed(root: &fresh::Root, package: &Package) -> anyhow::Result<privileges::Account> {
    let installed = in_root(root, "dpkg-query -W -f='${Status} ${Version}' peregrine")?;
    ensure!(
        installed == format!("install ok installed {}", package.version),
        "dpkg says {installed:?}"
    );
    let said = in_root(root, &format!("{BINARY} --version"))?;
    ensure!(
        said == package.version_line,
        "the installed binary says {said:?}, the built one {:?}",
        package.version_line
    );
    println!("{said}");
    let enabled = in_root(root, "systemctl is-enabled peregrine.service")?;
    ensure!(enabled == "enabled", "the unit is {enabled:?}, not enabled");
    // The maintainer scripts have run: nothing of them may still run in the root.
    let running = processes_in(root.path())?;
    ensure!(
        running.is_empty(),
        "the install left processes running in the root: {running:?}"
    );
    println!("peregrine.service: {enabled}, and no process runs: the install starts nothing");
    let user = in_root(root, &format!("getent passwd {USER}"))?;
    let fields: Vec<&str> = user.split(':').collect();
    ensure!(
        fields.len() == 7
            && fields[2].parse::<u32>().is_ok_and(|uid| uid < 1000)
            && fields[5] == "/nonexistent"
            && !root.host_path("/nonexistent").exists(),
        "the system user is not as postinst makes it: {user:?}"
    );
    println!("system user: {user}");
    let account =
        privileges::Account::parse(USER, &user, &in_root(root, &format!("id -G {USER}"))?)?;
    let page = in_root(root, "zcat /usr/share/man/man1/peregrine.1.gz | head -n 3")?;
    ensure!(page.contains(".TH peregrine 1"), "no manual page: {page:?}");
    let page = in_root(
        root,
        "zcat /usr/share/man/man5/peregrine.toml.5.gz | grep -c '^.TP'",
    )?;
    ensure!(
        page.trim().parse::<u32>().is_ok_and(|keys| keys > 50),
        "no peregrine.toml(5) with the configuration's keys: {page:?}"
    );

    println!("\n$ peregrine check");
    let checked = in_root(root, "peregrine check")?;
    println!("{checked}");
    ensure!(
        checked
            .lines()
            .next()
            .is_some_and(|first| first == format!("{CONFIG}: ok (1 service, {WORKERS} workers)")),
        "peregrine check said {checked:?}"
    );
    println!("\n$ systemd-analyze verify {UNIT}");
    let verify = root.transcript(
        &format!("systemd-analyze verify --man=no {UNIT} 2>&1"),
        Duration::from_secs(60),
    )?;
    // A misspelt key is only a warning (exit 0): nothing may be printed at all.
    ensure!(
        verify.status.success() && verify.text.trim().is_empty(),
        "systemd-analyze verify {UNIT}: {}\n{}",
        verify.status,
        verify.text
    );
    println!("(nothing to say)");
    let service = unit::Service::parse(&fs::read_to_string(root.host_path(UNIT))?)?;
    let missing: Vec<&str> = SWITCH_CAPABILITIES
        .iter()
        .copied()
        .filter(|cap| !service.capabilities.iter().any(|c| c == cap))
        .collect();
    ensure!(
        missing.is_empty() && service.no_new_privileges,
        "the unit cannot switch workers to their user: its CapabilityBoundingSet lacks {missing:?} \
         (it holds {:?}), NoNewPrivileges={}",
        service.capabilities,
        service.no_new_privileges
    );
    println!(
        "the unit's CapabilityBoundingSet: {} (NoNewPrivileges=yes)",
        service.capabilities.join(" ")
    );
    Ok(account)
}

/// Runs the unit's commands, waits for the workers, checks they run as `account` with no
/// privileges, serves through Envoy, and stops everything.
fn serve(root: &fresh::Root, account: &privileges::Account) -> anyhow::Result<()> {
    let service = unit::Service::parse(&fs::read_to_string(root.host_path(UNIT))?)?;
    let limits = limits_here(&service.limits)?;
    let netns = Netns::add()?;
    // The runtime directory, as systemd makes it before the first command.
    let runtime = root.host_path(&format!("/run/{}", service.runtime_directory));
    fs::create_dir_all(&runtime)?;
    fs::set_permissions(
        &runtime,
        fs::Permissions::from_mode(service.runtime_directory_mode),
    )?;
    for command in &service.exec_start_pre {
        println!("\n$ {}   (ExecStartPre)", command.join(" "));
        let out = output(&mut netns.command(root, &service.wrap(command, &limits)))?;
        println!("{out}");
    }
    println!("\n$ {}   (ExecStart)", service.exec_start.join(" "));
    let log = root.log_dir().join("supervisor.log");
    let mut supervisor = Running::spawn(
        "the supervisor",
        netns.command(root, &service.wrap(&service.exec_start, &limits)),
        &log,
    )?;

    println!("\n$ peregrine status");
    let table = interrupt::wait_until(
        START_DEADLINE,
        Duration::from_millis(250),
        "peregrine status to show the workers registered",
        || {
            supervisor.check_running()?;
            let Ok(table) = output(&mut netns.command(root, &["peregrine", "status"])) else {
                return Ok(None);
            };
            Ok((ready_workers(&table).len() == WORKERS).then_some(table))
        },
    )?;
    println!("{table}");
    let sampler = table.lines().next().unwrap_or_default();
    ensure!(
        sampler.starts_with("sampler: ebpf"),
        "the supervisor runs another sampler: {sampler:?}"
    );
    let pids = ready_workers(&table);
    check_privileges(root, &netns, &service, &pids, account)?;

    // The shipped bootstrap is the command's output for the installed config.
    let shipped = fs::read_to_string(root.host_path(ENVOY_BOOTSTRAP))?;
    let printed = in_root(root, "peregrine envoy-bootstrap")?;
    let body: Vec<&str> = shipped.lines().filter(|l| !l.starts_with('#')).collect();
    ensure!(
        body == printed.lines().collect::<Vec<_>>(),
        "{ENVOY_BOOTSTRAP} is not what `peregrine envoy-bootstrap` prints"
    );
    println!("\n$ envoy -c {ENVOY_BOOTSTRAP}");
    let mut envoy = Running::spawn(
        "Envoy",
        netns.command(root, &[ENVOY, "-c", ENVOY_BOOTSTRAP]),
        &root.log_dir().join("envoy.log"),
    )?;
    let url = format!("http://{ENVOY_LISTENER}/");
    let answered = interrupt::wait_until(
        START_DEADLINE,
        Duration::from_millis(250),
        "a 200 through Envoy",
        || {
            envoy.check_running()?;
            supervisor.check_running()?;
            Ok(netns.get(&url)?.filter(|(code, _)| *code == 200))
        },
    )?;
    println!("GET {url}: {} {}", answered.0, answered.1.trim());
    // Both workers answer: each request names its worker's pid.
    let mut seen = BTreeSet::new();
    for _ in 0..100 {
        let Some((200, body)) = netns.get(&url)? else {
            bail!("a request through Envoy failed");
        };
        let pid = body
            .trim()
            .strip_prefix("Hello from worker ")
            .and_then(|rest| rest.strip_suffix('!'))
            .and_then(|pid| pid.parse::<u32>().ok())
            .with_context(|| format!("not the hello worker's answer: {body:?}"))?;
        ensure!(
            pids.contains(&pid),
            "{pid} is not a registered worker: {table}"
        );
        seen.insert(pid);
        if seen.len() == WORKERS {
            break;
        }
    }
    ensure!(
        seen.len() == WORKERS,
        "only workers {seen:?} of {pids:?} answered 100 requests"
    );
    println!("200 from both workers through Envoy: {seen:?}");

    // `systemctl stop`: KillMode=process sends SIGTERM to the supervisor alone, which drains and
    // stops its workers; then systemd removes the runtime directory.
    envoy.stop(Duration::from_secs(10))?;
    let took = supervisor.stop(service.timeout_stop)?;
    println!(
        "the supervisor stopped its workers and exited {:.1}s after SIGTERM",
        took.as_secs_f64()
    );
    interrupt::wait_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        "every process in the root to be gone",
        || Ok(processes_in(root.path())?.is_empty().then_some(())),
    )?;
    fs::remove_dir_all(&runtime)?;
    Ok(())
}

/// The workers `pids` run as `account` with no privileges; the runtime directory lets that user
/// reach its registration socket and nothing else; that user's `peregrine status` is refused.
fn check_privileges(
    root: &fresh::Root,
    netns: &Netns,
    service: &unit::Service,
    pids: &[u32],
    account: &privileges::Account,
) -> anyhow::Result<()> {
    println!();
    for pid in pids {
        println!("{}", privileges::check_worker(*pid, account)?);
    }
    let runtime = format!("/run/{}", service.runtime_directory);
    let registration = format!("{CONTROL}.{SERVICE}.workers");
    let lock = format!("{CONTROL}.lock");
    for (inside, wanted) in [
        (
            runtime.as_str(),
            privileges::file_line("folder", service.runtime_directory_mode, 0, 0),
        ),
        (CONTROL, privileges::file_line("socket", 0o600, 0, 0)),
        (lock.as_str(), privileges::file_line("file", 0o600, 0, 0)),
        (
            registration.as_str(),
            privileges::file_line("socket", 0o660, 0, account.gid),
        ),
    ] {
        let found = privileges::describe(&root.host_path(inside))?;
        ensure!(found == wanted, "{inside}: {found}, not {wanted}");
        println!("{inside}: {found}");
    }
    // The workers' user cannot reach the control socket: no status, no command.
    let as_user = [
        "setpriv",
        &format!("--reuid={USER}"),
        &format!("--regid={USER}"),
        "--init-groups",
        "peregrine",
        "status",
    ];
    println!("\n$ {}", as_user.join(" "));
    let refused = netns
        .command(root, &as_user)
        .output()
        .context("running peregrine status as the workers' user")?;
    let said = String::from_utf8_lossy(&refused.stderr);
    ensure!(
        !refused.status.success(),
        "{USER} was answered by the control socket: {}",
        String::from_utf8_lossy(&refused.stdout)
    );
    println!("{} ({})", said.trim(), refused.status);
    Ok(())
}

/// The unit's limits, or, on a machine where this process may not raise a hard limit (no
/// CAP_SYS_RESOURCE, as in some containers), as much of them as its own hard limits allow: said so.
fn limits_here(limits: &[unit::Limit]) -> anyhow::Result<Vec<unit::Limit>> {
    let effective = peregrine_contract::procfs::StatusText::read_self()?
        .hex("CapEff")
        .context("no CapEff in /proc/self/status")?;
    // CAP_SYS_RESOURCE is capability 24.
    if effective & (1 << 24) != 0 {
        return Ok(limits.to_vec());
    }
    Ok(limits
        .iter()
        .map(|limit| {
            let hard = rustix::process::getrlimit(limit.resource).maximum;
            let wanted = limit.value.unwrap_or(u64::MAX);
            match hard {
                Some(hard) if hard < wanted => {
                    println!(
                        "note: Limit {}={} cannot be set here (no CAP_SYS_RESOURCE): {hard}, this \
                         machine's hard limit, instead",
                        limit.option,
                        limit
                            .value
                            .map_or_else(|| "infinity".to_owned(), |v| v.to_string())
                    );
                    unit::Limit {
                        value: Some(hard),
                        ..*limit
                    }
                }
                _ => *limit,
            }
        })
        .collect())
}

/// The pids of the `hello` workers that `peregrine status`'s table shows ready.
fn ready_workers(table: &str) -> Vec<u32> {
    table
        .lines()
        .filter_map(|line| {
            let columns: Vec<&str> = line.split_whitespace().collect();
            match columns.as_slice() {
                [service, _, pid, "ready", addresses, ..]
                    if *service == SERVICE && addresses.starts_with("127.0.0.1:") =>
                {
                    pid.parse().ok()
                }
                _ => None,
            }
        })
        .collect()
}

/// Nothing of the package left after the purge: the listing is the one before the install, but
/// for what Debian keeps and what every package operation changes; the user stays.
fn check_purged(
    root: &fresh::Root,
    before: &listing::Listing,
    after: &listing::Listing,
) -> anyhow::Result<()> {
    let (appeared, vanished) = listing::compare(before, after);
    println!(
        "\nthe root's files before the install and after the purge ({} entries): {} appeared, {} vanished",
        before.len(),
        appeared.len(),
        vanished.len()
    );
    for path in &appeared {
        println!("  + {path}");
    }
    for path in &vanished {
        println!("  - {path}");
    }
    let left: Vec<&String> = appeared
        .iter()
        .filter(|path| !listing::KEPT.contains(&path.as_str()))
        .collect();
    ensure!(
        left.is_empty() && vanished.is_empty(),
        "the purge left {left:?} and took {vanished:?}"
    );
    let user = in_root(root, "getent passwd peregrine")?;
    println!("kept, as Debian keeps users: {user}");
    let state = in_root(
        root,
        "dpkg-query -W -f='${db:Status-Status}' peregrine 2>&1 || true",
    )?;
    ensure!(
        state.contains("no packages found") || state == "not-installed",
        "dpkg still knows the package: {state:?}"
    );
    Ok(())
}

/// `sh -c script` in the root: its stdout, trimmed; an error with its stderr unless it exits 0.
fn in_root(root: &fresh::Root, script: &str) -> anyhow::Result<String> {
    output(root.command("/bin/sh").args(["-c", script]))
}

/// The pids of the processes whose root directory is `root`.
fn processes_in(root: &Path) -> anyhow::Result<Vec<u32>> {
    let mut pids = Vec::new();
    for entry in fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if fs::read_link(entry.path().join("root")).is_ok_and(|r| r.starts_with(root)) {
            pids.push(pid);
        }
    }
    Ok(pids)
}

// === impl Netns ===

/// A network namespace with its loopback up, deleted on drop.
#[derive(Debug)]
struct Netns {
    name: String,
}

impl Netns {
    fn add() -> anyhow::Result<Netns> {
        let name = format!("peregrine-package-{}", std::process::id());
        xtask::run_checked(Command::new("ip").args(["netns", "add", &name]))?;
        let netns = Netns { name };
        xtask::run_checked(Command::new("ip").args([
            "-n",
            &netns.name,
            "link",
            "set",
            "lo",
            "up",
        ]))?;
        Ok(netns)
    }

    /// `args` run in the root, in this namespace, with the root's environment alone.
    fn command(&self, root: &fresh::Root, args: &[impl AsRef<str>]) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.name, "/usr/sbin/chroot"])
            .arg(root.path())
            .args(args.iter().map(AsRef::as_ref))
            .env_clear()
            .envs(root.env().iter().map(|(key, value)| (key, value)))
            .current_dir("/");
        command
    }

    /// `GET url` from this namespace with the host's curl: the status and body, or `None` when
    /// nothing answered.
    fn get(&self, url: &str) -> anyhow::Result<Option<(u16, String)>> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args([
                "curl",
                "-sS",
                "--max-time",
                "5",
                "-w",
                "\n%{http_code}",
                url,
            ])
            .output()
            .context("running curl")?;
        if !out.status.success() {
            return Ok(None);
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let (body, code) = text.rsplit_once('\n').context("curl wrote no status")?;
        Ok(Some((code.trim().parse()?, body.to_owned())))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.name])
            .status();
    }
}

// === impl Running ===

/// A process the test started, its output in a log file; killed on drop unless stopped.
#[derive(Debug)]
struct Running {
    what: &'static str,
    child: Option<Child>,
    log: PathBuf,
}

impl Running {
    fn spawn(what: &'static str, mut command: Command, log: &Path) -> anyhow::Result<Running> {
        let file = fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {what}: {command:?}"))?;
        Ok(Running {
            what,
            child: Some(child),
            log: log.to_owned(),
        })
    }

    /// An error with the end of its log if it has exited.
    fn check_running(&mut self) -> anyhow::Result<()> {
        let child = self.child.as_mut().context("stopped already")?;
        if let Some(status) = child.try_wait()? {
            bail!("{} exited ({status}); {}", self.what, self.log_tail());
        }
        Ok(())
    }

    /// SIGTERM, then waits at most `deadline` for it to exit 0; how long it took.
    fn stop(&mut self, deadline: Duration) -> anyhow::Result<Duration> {
        let mut child = self.child.take().context("stopped already")?;
        let started = Instant::now();
        let pid = rustix::process::Pid::from_raw(child.id() as i32).context("a pid")?;
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)?;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if started.elapsed() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{} did not exit within {deadline:?} of SIGTERM", self.what);
            }
            interrupt::sleep(Duration::from_millis(50))?;
        };
        ensure!(
            status.success(),
            "{} exited with {status} after SIGTERM; {}",
            self.what,
            self.log_tail()
        );
        Ok(started.elapsed())
    }

    fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        format!(
            "the end of {}:\n{}",
            self.log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ready_workers;

    #[test]
    fn the_ready_workers_are_read_from_the_status_table() {
        let table = "\
sampler: ebpf, every 200 ms
xds: revision 3; no Envoy connected
SERVICE  WORKER  PID   STATE     ADDRESSES        CPU   RUNQ WAIT  REQ/S  REQUESTS  ORCA  RESTARTS
hello         0  4242  ready     127.0.0.1:40001  0.00       0.00    0.0         0     -         0
hello         1     -  starting  -                   -          -      -         -     -         0
";
        assert_eq!(ready_workers(table), [4242]);
        let both = table.replace(
            "hello         1     -  starting  -                ",
            "hello         1  4243  ready     127.0.0.1:40002  ",
        );
        assert_eq!(ready_workers(&both), [4242, 4243]);
    }
}
