//! `cargo xtask demo [--keep-running]`: the supervisor and a real Envoy on free ports, traffic through
//! Envoy, one worker killed, its replacement taking traffic, then what the workers' load reports are
//! for ([`steering`]): the two workers pinned to a core each under steady load, a CPU hog started
//! beside one and stopped again, and Envoy's weights and the requests moving away from the hogged
//! worker and back, printed as a timeline as they happen; then a rolling restart and a supervisor
//! killed and started again under continuous load, without a failed request.
//!
//! `peregrine` is built in the debug profile: the demo shows how fast endpoints converge, not request
//! throughput, and a debug build is much quicker to make (and shared with the tests). Every child runs in
//! a guard that kills its process group on drop, and the supervisor's guard also kills its workers (found
//! by their environment), so nothing outlives the demo, even on error.
//!
//! `cargo xtask demo --app python` runs the same show with gunicorn serving a WSGI app as the workers,
//! on listeners the supervisor binds and passes (`pass_socket`), without the load-steering part (its
//! CPU-heavy requests are the built-in worker's).
//!
//! `cargo xtask demo fleet [--keep-running]` is the fleet's demo ([`fleet`]): three hosts as network
//! namespaces sharing membership through etcd, a host killed and one cut off under traffic.
//!
//! This binary (`peregrine-demo`) is what `cargo xtask demo` runs, with the arguments after `demo`;
//! it shares the package list, Envoy's install, Ctrl-C and `cargo()` with the xtask through the
//! `xtask` library, and the end-to-end harness with the tests.

#![forbid(unsafe_code)]

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::ExitCode,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, bail};
use peregrine_e2e::{
    Envoy, Load, PeregrineToml, ServiceTable, Supervisor, free_port, hostname_pid, hosts, http_get,
    target_dir, try_wait_until, worker_pid,
};
use rustix::process::{Pid, Signal, kill_process};
use xtask::{USAGE, cargo, envoy, run_checked};

mod fleet;
mod steering;

/// The service (and Envoy cluster) the demo config declares.
const CLUSTER: &str = peregrine_e2e::CLUSTER;
/// Workers in the demo config.
const WORKERS: usize = 2;
/// Requests per traffic round.
const REQUESTS: usize = 100;
/// How long to wait for Envoy to see the workers.
const CONVERGE: Duration = Duration::from_secs(60);

/// What the workers of the demo are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum App {
    /// The built-in hello worker.
    Hello,
    /// gunicorn serving a WSGI app (`tests/apps/wsgi_app.py`), on listeners the supervisor passes.
    Python,
}

fn main() -> ExitCode {
    xtask::main_with(run)
}

fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    if args.first().is_some_and(|arg| arg == "fleet") {
        return fleet::run(&args[1..]);
    }
    let (app, keep_running) = options(args)?;
    let peregrine = peregrine_binary()?;
    let envoy_binary = envoy::install()?;
    let dir = demo_dir("")?;
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config =
        PeregrineToml::one_service(grpc, listen, admin, WORKERS as u32).control_in(&dir);
    if app == App::Python {
        python_service(&mut config)?;
    }
    println!("demo directory: {}", dir.display());
    println!(
        "xDS on 127.0.0.1:{grpc}, Envoy listener on 127.0.0.1:{listen}, admin on 127.0.0.1:{admin}"
    );

    let mut supervisor = Supervisor::start_in(&peregrine, &dir, &config.toml())?;
    let result = with_envoy(
        &mut supervisor,
        &envoy_binary,
        &dir,
        listen,
        (app, keep_running),
    );
    if result.is_err() {
        eprintln!("{}", supervisor.logs());
    }
    match supervisor.stop() {
        Ok(status) => println!("supervisor exited: {status}"),
        Err(error) => eprintln!("supervisor did not stop cleanly: {error:#}"),
    }
    result.map(|()| ExitCode::SUCCESS)
}

/// `--keep-running` or nothing (the fleet demo's options).
fn keep_running(args: &[String]) -> anyhow::Result<bool> {
    match args {
        [] => Ok(false),
        [flag] if flag == "--keep-running" => Ok(true),
        _ => bail!("unexpected arguments {args:?}\n\n{USAGE}"),
    }
}

/// `[--app python] [--keep-running]`.
fn options(args: &[String]) -> anyhow::Result<(App, bool)> {
    let (mut app, mut keep_running) = (App::Hello, false);
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--keep-running" => keep_running = true,
            "--app" => match args.next().map(String::as_str) {
                Some("python") => app = App::Python,
                Some("hello") => app = App::Hello,
                other => bail!("--app takes python or hello, not {other:?}\n\n{USAGE}"),
            },
            _ => bail!("unexpected argument {arg:?}\n\n{USAGE}"),
        }
    }
    Ok((app, keep_running))
}

/// The demo config with its service run by gunicorn (installed now, pinned, into
/// `target/pyapps/`) on listeners the supervisor binds and passes, ready once `/healthz` answers.
fn python_service(config: &mut PeregrineToml) -> anyhow::Result<()> {
    let bin = xtask::pyapps::install()?;
    let command = peregrine_e2e::gunicorn_command(&bin.join("gunicorn"));
    config.service(
        CLUSTER,
        // Each worker an endpoint of its own, which the demo follows in Envoy one by one
        // (gunicorn's sync worker would share one listener by default).
        ServiceTable::app_server(command)
            .count(WORKERS as u32)
            .per_worker(),
    );
    Ok(())
}

/// The `peregrine` to demonstrate: `PEREGRINE` (another build, or a stand-in, as in the harness),
/// else the debug build, built now, after the system packages the demo needs
/// ([`xtask::packages::DEMO`]: clang and libbpf's headers for the eBPF sampler, python3-venv for Envoy's virtualenv) are installed, or named in the one `apt-get` line
/// to run.
fn peregrine_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("PEREGRINE").filter(|path| !path.is_empty()) {
        return Ok(path.into());
    }
    xtask::packages::ensure(xtask::packages::DEMO)?;
    xtask::ebpf::tools::check_clang_var()?;
    run_checked(cargo().args(["build", "-p", "peregrine", "--bin", "peregrine"]))?;
    Ok(target_dir().join("debug/peregrine"))
}

/// A fresh directory for one run's configs and logs: `target/demo/<prefix><unix time>-<pid>`.
fn demo_dir(prefix: &str) -> anyhow::Result<PathBuf> {
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let dir = target_dir()
        .join("demo")
        .join(format!("{prefix}{stamp}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Starts Envoy on the supervisor's bootstrap and runs the show; Envoy is killed on return, before the
/// supervisor stops, so it does not log the supervisor's departure.
fn with_envoy(
    supervisor: &mut Supervisor,
    envoy_binary: &Path,
    dir: &Path,
    listen: u16,
    (app, keep_running): (App, bool),
) -> anyhow::Result<()> {
    let bootstrap = supervisor.envoy_bootstrap()?;
    let mut envoy = Envoy::start_in(envoy_binary, dir, &bootstrap)?;
    let listener = SocketAddr::from((Ipv4Addr::LOCALHOST, listen));
    let result = show(supervisor, &mut envoy, listener, (app, keep_running));
    if result.is_err() {
        eprintln!("{}", envoy.logs());
    }
    result
}

fn show(
    supervisor: &mut Supervisor,
    envoy: &mut Envoy,
    listener: SocketAddr,
    (app, keep_running): (App, bool),
) -> anyhow::Result<()> {
    let start = Instant::now();
    let first = converge(supervisor, envoy, "Envoy to list 2 hosts", |hosts| {
        hosts.len() == WORKERS
    })?;
    println!(
        "\nEnvoy lists {} hosts after {:.2?}:",
        first.len(),
        start.elapsed()
    );
    print_hosts(&first);

    let answers = traffic(listener)?;
    let victim = *answers.keys().next().context("no worker answered")?;

    println!("\nkilling worker {victim} with SIGKILL");
    let old: BTreeSet<String> = first.iter().map(|host| host.hostname.clone()).collect();
    let killed = Instant::now();
    kill_process(
        Pid::from_raw(victim as i32).context("bad pid")?,
        Signal::KILL,
    )
    .with_context(|| format!("killing worker {victim}"))?;
    let replaced = converge(
        supervisor,
        envoy,
        "Envoy to list the replacement worker",
        |hosts| hosts.len() == WORKERS && hosts.iter().any(|host| !old.contains(&host.hostname)),
    )?;
    println!(
        "Envoy lists the replacement after {:.2?}:",
        killed.elapsed()
    );
    print_hosts(&replaced);

    let answers = traffic(listener)?;
    if answers.contains_key(&victim) {
        bail!("the killed worker {victim} still answers");
    }

    if app == App::Python {
        println!(
            "\nThe load steering is shown with the built-in worker (`cargo xtask demo`). gunicorn's \
             workers are weighed on ORCA too, from the kernel's count of their responses where the \
             eBPF sampler runs, else balanced by least request (docs/apps.md)"
        );
        return finish(supervisor, envoy, listener, keep_running);
    }

    // What the load reports are for: the workers pinned to a core each, a CPU hog beside worker 0,
    // and Envoy's weights and the requests moving away from it and back.
    steering::show(supervisor, envoy, listener)?;
    finish(supervisor, envoy, listener, keep_running)
}

/// The deploys under load, then, with `--keep-running`, the stack until Ctrl-C.
fn finish(
    supervisor: &mut Supervisor,
    envoy: &mut Envoy,
    listener: SocketAddr,
    keep_running: bool,
) -> anyhow::Result<()> {
    deploys(supervisor, envoy, listener)?;

    if keep_running {
        println!(
            "\nrunning; try `curl http://{listener}/` and `curl http://{}/clusters`; Ctrl-C to stop",
            envoy.admin_addr()
        );
        let mut signals = signal_hook::iterator::Signals::new([
            signal_hook::consts::SIGINT,
            signal_hook::consts::SIGTERM,
        ])?;
        signals.forever().next();
        println!("\nstopping");
    }
    Ok(())
}

/// A rolling restart, then a supervisor killed and started again, each under continuous HTTP/1.1 and
/// HTTP/2 load through Envoy; fails if a single request fails.
fn deploys(
    supervisor: &mut Supervisor,
    envoy: &mut Envoy,
    listener: SocketAddr,
) -> anyhow::Result<()> {
    let pids = |hosts: &[peregrine_e2e::Host]| -> BTreeSet<u32> {
        hosts
            .iter()
            .filter_map(|h| hostname_pid(&h.hostname))
            .collect()
    };
    let before = pids(&converge(supervisor, envoy, "the workers", |h| {
        h.len() == WORKERS
    })?);

    println!(
        "\n`peregrine restart` while 2 HTTP/1.1 and 2 HTTP/2 clients send requests through Envoy"
    );
    let load = Load::start(listener, 2, 2, Duration::from_secs(120));
    try_wait_until(CONVERGE, "the load to be served", || {
        (load.snapshot().served() >= 100).then_some(())
    })?;
    let begun = Instant::now();
    let output = std::process::Command::new(supervisor.binary())
        .arg("restart")
        .arg(supervisor.config_path())
        .output()
        .context("running peregrine restart")?;
    let took = begun.elapsed();
    let said = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "peregrine restart failed: {said}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let after = pids(&converge(supervisor, envoy, "the new workers", |hosts| {
        hosts.len() == WORKERS && hosts.iter().all(|h| h.healthy)
    })?);
    println!(
        "  {} in {took:.2?}: workers {before:?} -> {after:?}",
        said.trim()
    );
    report_load(load, 500)?;

    println!("\nSIGKILL to the supervisor, then `peregrine run` again, under the same load");
    let load = Load::start(listener, 2, 2, Duration::from_secs(120));
    try_wait_until(CONVERGE, "the load to be served", || {
        (load.snapshot().served() >= 100).then_some(())
    })?;
    let killed = Instant::now();
    supervisor.kill_and_start_again()?;
    let adopted = try_wait_until(CONVERGE, "the workers to register again", || {
        let status = supervisor.status_json().ok()?;
        let registered: BTreeSet<u32> = status["workers"]
            .as_array()?
            .iter()
            .filter_map(|w| w["pid"].as_u64().map(|p| p as u32))
            .collect();
        (registered == after).then_some(registered)
    })?;
    println!(
        "  the new supervisor adopted workers {adopted:?} ({:.2?} after the kill)",
        killed.elapsed()
    );
    report_load(load, 500)
}

/// Lets `load` serve `more` requests, stops it, prints what it saw and fails if any request failed.
fn report_load(load: Load, more: u64) -> anyhow::Result<()> {
    let served = load.snapshot().served();
    try_wait_until(CONVERGE, "more requests to be served", || {
        (load.snapshot().served() >= served + more).then_some(())
    })?;
    let report = load.stop();
    println!(
        "  {} requests in {:.2?}, {} failed; by worker: {:?}",
        report.served(),
        report.elapsed,
        report.failures.len(),
        report.by_pid
    );
    if let Some(first) = report.failures.first() {
        bail!("a request failed ({:?}): {}", first.protocol, first.what);
    }
    Ok(())
}

/// Polls Envoy's `/clusters` until `done` holds for the demo cluster's hosts, failing early if a process
/// exits.
fn converge(
    supervisor: &mut Supervisor,
    envoy: &mut Envoy,
    what: &str,
    mut done: impl FnMut(&[peregrine_e2e::Host]) -> bool,
) -> anyhow::Result<Vec<peregrine_e2e::Host>> {
    let mut exited = None;
    let found = try_wait_until(CONVERGE, what, || {
        if let Err(error) = supervisor
            .process()
            .ensure_running()
            .and_then(|()| envoy.process().ensure_running())
        {
            exited = Some(error);
            return Some(None);
        }
        let text = envoy.admin_get("/clusters").ok()?;
        let hosts = hosts(&text, CLUSTER);
        done(&hosts).then_some(Some(hosts))
    })?;
    match (found, exited) {
        (Some(hosts), _) => Ok(hosts),
        (None, Some(error)) => Err(error),
        (None, None) => unreachable!("the wait ends with hosts or an exit"),
    }
}

fn print_hosts(hosts: &[peregrine_e2e::Host]) {
    println!(
        "  {:<24} {:<28} {:<8} weight",
        "address", "hostname", "health"
    );
    for host in hosts {
        println!(
            "  {:<24} {:<28} {:<8} {}",
            host.address, host.hostname, host.health_flags, host.weight
        );
    }
}

/// Sends [`REQUESTS`] requests through Envoy and prints which worker answered how many.
fn traffic(listener: SocketAddr) -> anyhow::Result<BTreeMap<u32, usize>> {
    let mut answers = BTreeMap::new();
    let mut failures = BTreeMap::new();
    for _ in 0..REQUESTS {
        match http_get(listener, "/") {
            Ok((200, body)) => match worker_pid(&body) {
                Some(pid) => *answers.entry(pid).or_insert(0) += 1,
                None => {
                    *failures
                        .entry(format!("200 {:?}", body.trim()))
                        .or_insert(0) += 1
                }
            },
            Ok((status, body)) => {
                *failures
                    .entry(format!("{status} {:?}", body.trim()))
                    .or_insert(0) += 1
            }
            Err(error) => *failures.entry(format!("{error:#}")).or_insert(0) += 1,
        }
    }
    println!("\n{REQUESTS} requests through {listener}:");
    println!("  {:>10} {:>9}", "worker pid", "requests");
    for (pid, count) in &answers {
        println!("  {pid:>10} {count:>9}");
    }
    for (failure, count) in &failures {
        println!("  failed {count:>3}: {failure}");
    }
    if answers.is_empty() {
        bail!("no request reached a worker");
    }
    Ok(answers)
}
