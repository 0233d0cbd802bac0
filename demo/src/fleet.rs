//! `cargo xtask demo fleet [--keep-running]`: a fleet of three hosts sharing membership through
//! etcd, each host a network namespace on one bridge (as `tests/tests/fleet_hosts.rs` builds it),
//! under traffic the whole time; then a host dies and comes back, and another is cut off and
//! restored, each timed until every Envoy holds the change.
//!
//! - etcd: 3 members in a namespace of their own (`etcd`);
//! - hosts `a`, `b`, `c`: a supervisor each with 2 hello workers on the host's address, the same gRPC
//!   port everywhere (Envoy dials every worker's IP on one ORCA port), `routing = "local-first"`,
//!   a 3 s lease; a and b share zone `z1`, c is in `z2` (all in region `r1`), so each Envoy is sent
//!   its own host at priority 0, then its zone, then its region;
//! - an Envoy on every host, bootstrapped by `peregrine envoy-bootstrap` and fed by its own host's
//!   supervisor, listener and admin on the host's loopback; an HTTP/1.1 and an HTTP/2 client on each
//!   host send requests through it (paced: two cores run everything), and every answer is counted
//!   by the worker (and so the host) that gave it;
//! - a watch of every Envoy's admin `/clusters` from inside its host, every [`POLL`]: each change of
//!   the endpoints it holds (priority, sub-zone, health) is timed, to within the time since the
//!   poll before.
//!
//! What happens: c's supervisor and workers are SIGKILLed (c's Envoy and its clients stay: the
//! supervisor crashed, not the machine), until a's and b's Envoys drop c's workers (its lease
//! expires); c's Envoy, left without its xDS server, keeps the endpoints it had, and outlier
//! detection moves its traffic to the next priority; c's supervisor starts again, until every Envoy
//! holds c's new workers; then b's link is cut (`NetHost::cut`) until a's and c's Envoys drop b,
//! while b's Envoy serves on from b's own workers, and restored until they hold b again. Each phase
//! ends with a table: which host's workers answered through which Envoy, and the priorities each
//! Envoy holds; the summary has every timing and the request counts.
//!
//! Needs root (namespaces). Everything started is owned by a guard (processes, namespaces), so it
//! goes on return, on error and on Ctrl-C (the first one makes the next wait fail, see
//! [`xtask::interrupt`]; a second one exits at once, and the next run sweeps what was left).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::ExitCode,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, bail};
use peregrine_e2e::{
    AdminWatch, Envoy, EtcdCluster, EtcdTls, FleetHostConfig, Load, LoadOptions, LoadReport,
    NetHost, Network, Supervisor, admin_watch::Change, hostname_pid, hosts, http_post_json,
    pki::peregrine_tls_init,
};
use xtask::{envoy, interrupt, logs};

/// The hosts, in the order they are named.
const HOSTS: [&str; 3] = ["a", "b", "c"];
/// The namespace that runs etcd's members.
const ETCD_HOST: &str = "etcd";
/// Each host's region and zone: a and b share a zone.
const LOCALITY: [(&str, &str, &str); 3] = [("a", "r1", "z1"), ("b", "r1", "z1"), ("c", "r1", "z2")];
/// The host killed and started again, and the host cut off and restored.
const KILLED: &str = "c";
const CUT: &str = "b";
/// The one service, its workers per host.
const SERVICE: &str = "web";
const WORKERS: u32 = 2;
/// The lease: a host that stops renewing it leaves the fleet after this.
const TTL: Duration = Duration::from_secs(3);
/// Every supervisor's gRPC port, on its host's address.
const GRPC_PORT: u16 = 18000;
/// Envoy's listener and admin, on each host's own loopback.
const ENVOY_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10000);
const ENVOY_ADMIN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9901);
/// A try to a worker that does not answer is retried on another after this long.
const PER_TRY_TIMEOUT: Duration = Duration::from_secs(1);
/// How often each Envoy's `/clusters` is polled.
const POLL: Duration = Duration::from_millis(10);
/// Each client's pause after each answer (two cores run every process of the demo).
const LOAD_PAUSE: Duration = Duration::from_millis(10);
/// The clients stop by themselves after this (the demo stops them long before).
const LOAD_LIMIT: Duration = Duration::from_secs(300);
/// Traffic counted in a phase where nothing changes.
const STEADY: Duration = Duration::from_secs(2);
/// Traffic counted once a change has reached every Envoy, before the next step.
const AFTER: Duration = Duration::from_secs(1);
/// The most any one step may take (the whole demo is a dozen steps).
const STEP: Duration = Duration::from_secs(20);
/// The most the demo may take from the network's creation to its last step (it takes about 20 s):
/// every wait ends by then.
const WHOLE: Duration = Duration::from_secs(90);
/// How often a wait looks again at what it waits for.
const WAIT_EVERY: Duration = Duration::from_millis(10);
/// The supervisor's log line that says which sampler it runs: the first it logs, once the sampler
/// is loaded (eBPF's load is much of a debug build's start).
const SAMPLER_CHOSEN: &str = "Sampler chosen";

/// One endpoint an Envoy holds, as admin `/clusters` lists it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Held {
    priority: u32,
    /// The host it runs on (its locality's sub-zone).
    host: String,
    hostname: String,
    /// `healthy`, or why not (e.g. `/failed_outlier_check`: ejected by outlier detection).
    health: String,
}

impl Held {
    fn healthy(&self) -> bool {
        self.health == "healthy"
    }
}

/// What an Envoy holds of [`SERVICE`], sorted by priority.
type View = Vec<Held>;

fn view(clusters: &str) -> View {
    let mut view: View = hosts(clusters, SERVICE)
        .into_iter()
        .map(|h| Held {
            priority: h.priority,
            host: h.sub_zone,
            hostname: h.hostname,
            health: h.health_flags,
        })
        .collect();
    view.sort();
    view
}

/// The hostnames of `host`'s workers in `view`, if all of them are healthy.
fn healthy_of(view: &View, host: &str) -> Option<BTreeSet<String>> {
    view.iter()
        .filter(|held| held.host == host)
        .map(|held| held.healthy().then(|| held.hostname.clone()))
        .collect()
}

/// `P0 a 2/2  P1 b 2/2  P2 c 2/2`: each priority's hosts, with their healthy and listed workers.
fn priorities(view: &View) -> String {
    let mut tiers: BTreeMap<u32, BTreeMap<&str, (usize, usize)>> = BTreeMap::new();
    for held in view {
        let counts = tiers
            .entry(held.priority)
            .or_default()
            .entry(&held.host)
            .or_default();
        counts.0 += usize::from(held.healthy());
        counts.1 += 1;
    }
    if tiers.is_empty() {
        return "(no endpoints)".to_owned();
    }
    tiers
        .iter()
        .map(|(priority, hosts)| {
            let hosts: Vec<String> = hosts
                .iter()
                .map(|(host, (healthy, listed))| format!("{host} {healthy}/{listed}"))
                .collect();
            format!("P{priority} {}", hosts.join(", "))
        })
        .collect::<Vec<_>>()
        .join("   ")
}

/// One host: its namespace, its supervisor, its Envoy, the watch of that Envoy and the clients
/// sending through it. Dropped in this order: the clients, the watch, Envoy, the supervisor (and
/// its workers).
struct FleetHost {
    name: String,
    load: Option<Load>,
    watch: AdminWatch<View>,
    envoy: Envoy,
    supervisor: Supervisor,
    /// Its supervisor was killed and not started again.
    down: bool,
    net: NetHost,
}

impl FleetHost {
    /// `cluster.web.<name>` of this host's Envoy, asked from inside the host.
    fn stat(&self, name: &str) -> u64 {
        self.net
            .run(|| self.envoy.stat(&format!("cluster.{SERVICE}.{name}")))
            .unwrap_or(0)
    }

    fn view(&self) -> View {
        self.watch.latest().map(|c| c.state).unwrap_or_default()
    }
}

/// The fleet. Dropped in this order: the hosts (clients, watches, Envoys, supervisors), etcd, the
/// network (which kills whatever still runs in a namespace, and removes them).
struct Fleet {
    hosts: Vec<FleetHost>,
    etcd: EtcdCluster,
    _network: Network,
    dir: PathBuf,
    /// How long etcd took to answer healthy (a leader elected).
    etcd_up: Duration,
    /// When the first `peregrine run` started.
    supervisors_started: Instant,
    /// When every wait ends, whatever it waits for (see [`WHOLE`]).
    deadline: Instant,
}

impl Fleet {
    fn host(&self, name: &str) -> &FleetHost {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .expect("a host of the fleet")
    }

    fn host_mut(&mut self, name: &str) -> &mut FleetHost {
        self.hosts
            .iter_mut()
            .find(|h| h.name == name)
            .expect("a host of the fleet")
    }

    /// An error if a process that should run has exited, or a watch could not start.
    fn ensure_running(&mut self) -> anyhow::Result<()> {
        for host in &mut self.hosts {
            if !host.down {
                host.supervisor
                    .process()
                    .ensure_running()
                    .with_context(|| format!("host {}'s supervisor", host.name))?;
            }
            host.envoy
                .process()
                .ensure_running()
                .with_context(|| format!("host {}'s Envoy", host.name))?;
            if let Some(error) = host.watch.error() {
                bail!("watching host {}'s Envoy: {error}", host.name);
            }
        }
        Ok(())
    }

    /// Waits until `f` holds for each of the Envoys of `envoys` at or after `since`; returns, per
    /// Envoy, the first state that showed it.
    fn wait_all(
        &mut self,
        envoys: &[&str],
        since: Instant,
        what: &str,
        f: impl Fn(&str, &View) -> bool,
    ) -> anyhow::Result<Vec<(String, Change<View>)>> {
        let mut seen: BTreeMap<String, Change<View>> = BTreeMap::new();
        let left = self.deadline.saturating_duration_since(Instant::now());
        let waited = interrupt::wait_until(STEP.min(left), WAIT_EVERY, what, || {
            self.ensure_running()?;
            for name in envoys {
                if !seen.contains_key(*name)
                    && let Some(change) = self.host(name).watch.first_since(since, |v| f(name, v))
                {
                    seen.insert((*name).to_owned(), change);
                }
            }
            Ok((seen.len() == envoys.len()).then_some(()))
        });
        if let Err(error) = waited {
            if interrupt::check().is_err() {
                return Err(error);
            }
            let held: Vec<String> = envoys
                .iter()
                .map(|name| format!("{name}'s Envoy: {}", priorities(&self.host(name).view())))
                .collect();
            bail!("{error:#} (they hold: {})", held.join("; "));
        }
        Ok(envoys
            .iter()
            .map(|name| ((*name).to_owned(), seen[*name].clone()))
            .collect())
    }

    /// What every host's clients and Envoy have counted so far.
    fn counts(&self) -> BTreeMap<String, Counted> {
        self.hosts
            .iter()
            .map(|host| {
                let report = host.load.as_ref().map(Load::snapshot).unwrap_or_default();
                let counted = Counted {
                    report,
                    retries: host.stat("upstream_rq_retry"),
                    at: Instant::now(),
                };
                (host.name.clone(), counted)
            })
            .collect()
    }

    /// The host of every worker pid any Envoy has listed so far.
    fn pid_hosts(&self) -> BTreeMap<u32, String> {
        self.hosts
            .iter()
            .flat_map(|host| host.watch.changes())
            .flat_map(|change| change.state)
            .filter_map(|held| Some((hostname_pid(&held.hostname)?, held.host)))
            .collect()
    }
}

/// One host's counts at one moment.
#[derive(Clone, Debug)]
struct Counted {
    report: LoadReport,
    retries: u64,
    at: Instant,
}

/// One Envoy's traffic over a phase.
#[derive(Clone, Debug, Default)]
struct Traffic {
    /// Answers by the host whose worker gave them.
    by_host: BTreeMap<String, u64>,
    failed: u64,
    /// Every failure's reason, with how often.
    failures: BTreeMap<String, u64>,
    /// Envoy's retries (`upstream_rq_retry`).
    retried: u64,
}

impl Traffic {
    fn answered(&self) -> u64 {
        self.by_host.values().sum()
    }

    fn add(&mut self, other: &Traffic) {
        for (host, n) in &other.by_host {
            *self.by_host.entry(host.clone()).or_default() += n;
        }
        for (reason, n) in &other.failures {
            *self.failures.entry(reason.clone()).or_default() += n;
        }
        self.failed += other.failed;
        self.retried += other.retried;
    }
}

/// A phase of the demo: its traffic per Envoy, and how long it lasted.
#[derive(Clone, Debug)]
struct Phase {
    name: String,
    took: Duration,
    traffic: BTreeMap<String, Traffic>,
}

/// How long after an event one Envoy first showed its effect.
#[derive(Clone, Debug)]
struct Timed {
    envoy: String,
    after: Duration,
    /// The time since the poll before, which did not show it yet.
    resolution: Duration,
}

impl Timed {
    /// Per Envoy, the first state that showed the effect of what happened at `from`.
    fn each(from: Instant, seen: &[(String, Change<View>)]) -> Vec<Timed> {
        seen.iter()
            .map(|(envoy, change)| Timed {
                envoy: envoy.clone(),
                after: change.at.saturating_duration_since(from),
                resolution: change.resolution,
            })
            .collect()
    }
}

impl std::fmt::Display for Timed {
    /// `2.91 s (seen to within 11 ms)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2} s (seen to within {} ms)",
            self.after.as_secs_f64(),
            self.resolution.as_millis()
        )
    }
}

/// Everything the summary prints.
#[derive(Debug, Default)]
struct Story {
    /// etcd's start until it answered healthy.
    etcd_up: Duration,
    /// From the first supervisor's start until every Envoy held every host's workers.
    fleet_up: Duration,
    /// Per Envoy: after the SIGKILL, when it no longer held the killed host's workers.
    killed_gone: Vec<Timed>,
    /// Per Envoy: after the killed host's supervisor started again, when it held its new workers.
    killed_back: Vec<Timed>,
    /// Per Envoy: after the cut, when it no longer held the cut host's workers.
    cut_gone: Vec<Timed>,
    /// Per Envoy: after the link came back, when it held the cut host's workers again.
    cut_back: Vec<Timed>,
    phases: Vec<Phase>,
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let keep_running = super::keep_running(args)?;
    if !rustix::process::geteuid().is_root() {
        eprintln!(
            "error: `cargo xtask demo fleet` needs root: each host is a network namespace \
             (`ip netns`), and it installs etcd and iproute2 when they are missing. Run it \
             as root (e.g. `sudo -E env \"PATH=$PATH\" cargo xtask demo fleet`)."
        );
        return Ok(ExitCode::FAILURE);
    }
    interrupt::install()?;
    xtask::packages::ensure(xtask::packages::FLEET)?;
    let peregrine = super::peregrine_binary()?;
    let envoy_binary = envoy::install()?;
    let dir = super::demo_dir("fleet-")?;
    println!("demo directory (configs and logs): {}", dir.display());

    let started = Instant::now();
    let mut fleet = start(&peregrine, &envoy_binary, &dir)?;
    let result = show(&mut fleet, keep_running);
    if result.is_err() && interrupt::check().is_ok() {
        let etcd_log = fleet.dir.join("etcd.log");
        let _ = std::fs::write(&etcd_log, fleet.etcd.logs());
        eprintln!(
            "the logs: {} (every host's supervisor and Envoy, etcd.log)",
            fleet.dir.display()
        );
    }
    drop(fleet);
    println!(
        "stopped every process and removed the namespaces ({:.1} s in all)",
        started.elapsed().as_secs_f64()
    );
    result.map(|()| ExitCode::SUCCESS)
}

/// The network, etcd, and on each host a supervisor and an Envoy with a watch; returns once each
/// is started (not yet converged).
fn start(peregrine: &Path, envoy_binary: &Path, dir: &Path) -> anyhow::Result<Fleet> {
    let deadline = Instant::now() + WHOLE;
    let mut names = HOSTS.to_vec();
    names.push(ETCD_HOST);
    let network = Network::create(&names).context("creating the network namespaces")?;
    let etcd_host = network.host(ETCD_HOST);
    println!(
        "\nnetwork: a bridge at {}/24, one namespace per host:",
        network.bridge_address()
    );
    for host in network.hosts() {
        println!(
            "  {:<5} {:<15} {}",
            host.name(),
            host.address().to_string(),
            host.netns()
        );
    }
    // Mutual TLS wherever the control plane leaves a host, as a fleet runs it: certificates from
    // `peregrine tls init`, naming every host's address.
    let certificates = dir.join("tls");
    let sans: Vec<String> = network
        .hosts()
        .iter()
        .map(|h| h.address().to_string())
        .collect();
    peregrine_tls_init(peregrine, &certificates, &sans);
    println!(
        "TLS: `peregrine tls init {} --san ...` (one per host address): mutual TLS on every gRPC \
         port (xDS and ORCA) and to etcd",
        certificates.display()
    );
    let etcd_started = Instant::now();
    let etcd = EtcdCluster::start_with(
        &etcd_host.wrapper(),
        etcd_host.address().into(),
        3,
        Some(EtcdTls::in_dir(&certificates)),
    )
    .context("starting etcd")?;
    let etcd_up = etcd_started.elapsed();
    println!(
        "etcd: 3 members on {} (client certificates required), healthy after {:.2} s",
        etcd.endpoints().join(", "),
        etcd_up.as_secs_f64()
    );
    interrupt::check()?;
    let supervisors_started = Instant::now();

    let mut hosts = Vec::new();
    for (name, region, zone) in LOCALITY {
        let net = network.host(name).clone();
        let host_dir = dir.join(name);
        std::fs::create_dir_all(&host_dir)
            .with_context(|| format!("creating {}", host_dir.display()))?;
        let config = FleetHostConfig {
            name,
            address: net.address(),
            grpc_port: GRPC_PORT,
            service: SERVICE,
            workers: WORKERS,
            xds_servers: vec![format!("http://{}:{GRPC_PORT}", net.address())],
            etcd: etcd.endpoints(),
            routing: "local-first",
            lease_ttl: TTL,
            region,
            zone,
            envoy_listen: ENVOY_LISTEN,
            envoy_admin: ENVOY_ADMIN,
            per_try_timeout: PER_TRY_TIMEOUT,
            // A sampler, so that the service is balanced on ORCA reports, with outlier detection.
            sampler: peregrine_e2e::config::Sampler::Auto,
            tls: Some(&certificates),
        }
        .toml();
        let supervisor =
            Supervisor::start_wrapped_at(&net.wrapper(), peregrine, &host_dir, &config)
                .with_context(|| format!("starting host {name}'s supervisor"))?;
        let envoy_dir = host_dir.join("envoy");
        std::fs::create_dir_all(&envoy_dir)
            .with_context(|| format!("creating {}", envoy_dir.display()))?;
        let bootstrap = supervisor.envoy_bootstrap()?;
        let envoy = Envoy::start_wrapped_in(&net.wrapper(), envoy_binary, &envoy_dir, &bootstrap)
            .with_context(|| format!("starting host {name}'s Envoy"))?;
        let watch = AdminWatch::start(ENVOY_ADMIN, POLL, Some(Box::new(net.entry())), view);
        hosts.push(FleetHost {
            name: name.to_owned(),
            load: None,
            watch,
            envoy,
            supervisor,
            down: false,
            net,
        });
        interrupt::check()?;
    }
    println!(
        "hosts a, b, c: a supervisor each ({WORKERS} workers on the host's address, gRPC on port \
         {GRPC_PORT}, routing \"local-first\", lease {TTL:?}) and an Envoy (listener {ENVOY_LISTEN}, \
         admin {ENVOY_ADMIN}, on the host's loopback) fed by its own host's supervisor"
    );
    println!(
        "localities: a and b in r1/z1, c in r1/z2 (each host is its own sub-zone): an Envoy is \
         sent its own host at priority 0, then the rest of its zone, then the rest of its region"
    );
    Ok(Fleet {
        hosts,
        etcd,
        _network: network,
        dir: dir.to_path_buf(),
        etcd_up,
        supervisors_started,
        deadline,
    })
}

/// Everything after the start.
fn show(fleet: &mut Fleet, keep_running: bool) -> anyhow::Result<()> {
    let mut story = Story {
        etcd_up: fleet.etcd_up,
        ..Story::default()
    };
    let started = fleet.supervisors_started;
    let up = fleet.wait_all(
        &HOSTS,
        started,
        "every Envoy to hold every host's workers, its own at priority 0",
        |name, view| {
            HOSTS.iter().all(|host| {
                healthy_of(view, host).is_some_and(|workers| workers.len() == WORKERS as usize)
            }) && view
                .iter()
                .all(|held| (held.priority == 0) == (held.host == name))
        },
    )?;
    story.fleet_up = Timed::each(started, &up)
        .iter()
        .map(|timed| timed.after)
        .max()
        .unwrap_or_default();
    println!(
        "\nevery Envoy holds every host's {WORKERS} workers, {:.2} s after the first `peregrine run`",
        story.fleet_up.as_secs_f64()
    );

    for host in &mut fleet.hosts {
        let options = LoadOptions {
            pause: LOAD_PAUSE,
            enter: Some(Box::new(host.net.entry())),
            ..LoadOptions::new(1, 1, LOAD_LIMIT)
        };
        host.load = Some(Load::start_with(ENVOY_LISTEN, options));
    }
    println!(
        "traffic: on each host an HTTP/1.1 and an HTTP/2 client send `GET /` through its own \
         Envoy, one request after another ({LOAD_PAUSE:?} pause)"
    );

    let begun = fleet.counts();
    interrupt::sleep(STEADY)?;
    let phase = traffic_since(fleet, "every host up", &begun);
    print_phase(fleet, &phase);
    story.phases.push(phase);

    kill(fleet, &mut story)?;
    cut(fleet, &mut story)?;

    for host in &mut fleet.hosts {
        host.load.take().map(Load::stop);
    }
    summary(&story);
    if keep_running {
        let a = fleet.host("a").net.netns().to_owned();
        println!(
            "\nrunning; try `ip netns exec {a} curl -s http://{ENVOY_LISTEN}/` or `ip netns exec \
             {a} curl -s http://{ENVOY_ADMIN}/clusters`, and `{} status {}`; Ctrl-C to stop",
            fleet.host("a").supervisor.binary().display(),
            fleet.host("a").supervisor.config_path().display()
        );
        while interrupt::sleep(Duration::from_secs(3600)).is_ok() {}
        println!("\nstopping");
    }
    Ok(())
}

/// c's supervisor and workers SIGKILLed until every other Envoy drops them, then started again
/// until every Envoy holds c's new workers.
fn kill(fleet: &mut Fleet, story: &mut Story) -> anyhow::Result<()> {
    let others: Vec<&str> = HOSTS.iter().copied().filter(|h| *h != KILLED).collect();
    let old = healthy_of(&fleet.host(KILLED).view(), KILLED).unwrap_or_default();
    println!(
        "\n=== {KILLED} dies: SIGKILL to its supervisor and its {WORKERS} workers (its Envoy and \
         its clients stay up) ==="
    );
    let begun = fleet.counts();
    let killed = Instant::now();
    {
        let host = fleet.host_mut(KILLED);
        host.supervisor.kill_with_workers();
        host.down = true;
    }
    let gone = fleet.wait_all(
        &others,
        killed,
        &format!("{KILLED}'s workers to leave the other Envoys"),
        |_, view| !view.iter().any(|held| held.host == KILLED),
    )?;
    story.killed_gone = Timed::each(killed, &gone);
    for timed in &story.killed_gone {
        println!(
            "  {}'s Envoy dropped {KILLED}'s workers {timed} after the kill",
            timed.envoy
        );
    }
    println!(
        "  (nobody tells them but etcd: {KILLED}'s lease ({TTL:?}) expires, etcd deletes its keys, \
         and every supervisor's watch passes that on to its Envoys)"
    );
    interrupt::sleep(AFTER)?;
    println!(
        "  {KILLED}'s own Envoy lost its xDS server with the supervisor: it keeps the endpoints it \
         had, {KILLED}'s dead workers at priority 0; what it held since the kill:"
    );
    print_timeline(fleet.host(KILLED), killed);
    let phase = traffic_since(fleet, &format!("{KILLED} down"), &begun);
    print_phase(fleet, &phase);
    story.phases.push(phase);

    println!("\n=== {KILLED} comes back: `peregrine run` again on its config ===");
    let begun = fleet.counts();
    let restarted = Instant::now();
    let restarted_at = SystemTime::now();
    {
        let host = fleet.host_mut(KILLED);
        host.supervisor.start_again()?;
        host.down = false;
    }
    let back = fleet.wait_all(
        &HOSTS,
        restarted,
        &format!("every Envoy to hold {KILLED}'s new workers"),
        |name, view| {
            healthy_of(view, KILLED).is_some_and(|new| {
                new.len() == WORKERS as usize
                    && new.is_disjoint(&old)
                    && view
                        .iter()
                        .all(|held| (held.priority == 0) == (held.host == name))
            })
        },
    )?;
    story.killed_back = Timed::each(restarted, &back);
    for timed in &story.killed_back {
        println!(
            "  {}'s Envoy holds {KILLED}'s new workers {timed} after the start",
            timed.envoy
        );
    }
    if let Some(steps) = start_steps(fleet.host_mut(KILLED), restarted_at) {
        println!("  ({KILLED}'s new supervisor, by its log: {steps})");
    }
    interrupt::sleep(AFTER)?;
    let phase = traffic_since(fleet, &format!("{KILLED} back"), &begun);
    print_phase(fleet, &phase);
    story.phases.push(phase);
    Ok(())
}

/// b's link cut until every other Envoy drops b's workers, then restored until they hold them
/// again.
fn cut(fleet: &mut Fleet, story: &mut Story) -> anyhow::Result<()> {
    let others: Vec<&str> = HOSTS.iter().copied().filter(|h| *h != CUT).collect();
    let workers = healthy_of(&fleet.host(CUT).view(), CUT).unwrap_or_default();
    println!(
        "\n=== {CUT} is cut off: its link goes down (it reaches only itself; its Envoy's clients \
         are on it) ==="
    );
    let begun = fleet.counts();
    let cut = Instant::now();
    fleet.host(CUT).net.cut()?;
    let gone = fleet.wait_all(
        &others,
        cut,
        &format!("{CUT}'s workers to leave the other Envoys"),
        |_, view| !view.iter().any(|held| held.host == CUT),
    )?;
    story.cut_gone = Timed::each(cut, &gone);
    for timed in &story.cut_gone {
        println!(
            "  {}'s Envoy dropped {CUT}'s workers {timed} after the cut",
            timed.envoy
        );
    }
    interrupt::sleep(AFTER)?;
    println!(
        "  {CUT}'s own Envoy, fed by {CUT}'s supervisor (which serves its last view of the fleet \
         while it cannot reach etcd): {}",
        priorities(&fleet.host(CUT).view())
    );
    print_session(fleet, CUT);
    let phase = traffic_since(fleet, &format!("{CUT} cut off"), &begun);
    print_phase(fleet, &phase);
    story.phases.push(phase);

    println!("\n=== {CUT}'s link is back ===");
    let begun = fleet.counts();
    let restored = Instant::now();
    fleet.host(CUT).net.restore()?;
    let back = fleet.wait_all(
        &others,
        restored,
        &format!("every other Envoy to hold {CUT}'s workers again"),
        |_, view| healthy_of(view, CUT).is_some_and(|held| held == workers),
    )?;
    story.cut_back = Timed::each(restored, &back);
    for timed in &story.cut_back {
        println!(
            "  {}'s Envoy holds {CUT}'s workers again {timed} after the link came back",
            timed.envoy
        );
    }
    interrupt::sleep(AFTER)?;
    let phase = traffic_since(fleet, &format!("{CUT} back"), &begun);
    print_phase(fleet, &phase);
    story.phases.push(phase);
    Ok(())
}

/// When a supervisor started at `since` chose its sampler, joined the fleet and had every worker
/// registered, by its log: `sampler (ebpf) +1.05 s, joined the fleet +1.12 s, 2 workers registered
/// +1.16 s`.
fn start_steps(host: &mut FleetHost, since: SystemTime) -> Option<String> {
    let path = host.supervisor.process().log_paths().1.to_path_buf();
    let log = std::fs::read_to_string(path).ok()?;
    let after = |at: SystemTime| {
        format!(
            "+{:.2} s",
            at.duration_since(since).unwrap_or_default().as_secs_f64()
        )
    };
    let mut steps = Vec::new();
    if let Some(line) = logs::first_after(&log, SAMPLER_CHOSEN, since, |_| true) {
        let sampler = line.field("sampler").unwrap_or("?").trim_matches('"');
        steps.push(format!("sampler ({sampler}) {}", after(line.at)));
    }
    steps.push(format!(
        "joined the fleet {}",
        after(logs::first_after(&log, logs::JOINED, since, |_| true)?.at)
    ));
    let registered: Vec<SystemTime> = logs::lines(&log, logs::REGISTERED)
        .filter(|line| line.at >= since)
        .map(|line| line.at)
        .collect();
    if registered.len() >= WORKERS as usize {
        steps.push(format!(
            "{WORKERS} workers registered {}",
            after(registered[WORKERS as usize - 1])
        ));
    }
    Some(steps.join(", "))
}

/// What `host`'s supervisor says of its etcd session (`peregrine status`), and whether etcd still
/// has the lease it names.
fn print_session(fleet: &Fleet, host: &str) {
    let supervisor = &fleet.host(host).supervisor;
    let said = supervisor.status_table().ok().and_then(|table| {
        table
            .lines()
            .find(|line| line.starts_with("fleet:"))
            .map(str::to_owned)
    });
    let Some(said) = said else {
        return;
    };
    println!("  {host}'s `peregrine status` meanwhile: {said}");
    let lease = supervisor
        .status_json()
        .ok()
        .and_then(|status| status["fleet"]["lease"].as_i64());
    if let Some(lease) = lease
        && let Some(ttl) = lease_ttl(&fleet.etcd, lease)
    {
        if ttl < 0 {
            println!("  etcd, asked about lease {lease:x}: expired (etcd deleted {host}'s keys)");
        } else {
            println!("  etcd, asked about lease {lease:x}: {ttl} s left");
        }
    }
}

/// The seconds lease `id` has left, as a member of `etcd` answers (`-1`: expired, or never granted).
fn lease_ttl(etcd: &EtcdCluster, id: i64) -> Option<i64> {
    etcd.endpoints().iter().find_map(|endpoint| {
        let addr: SocketAddr = endpoint.strip_prefix("http://")?.parse().ok()?;
        let (status, body) =
            http_post_json(addr, "/v3/lease/timetolive", &format!("{{\"ID\":{id}}}")).ok()?;
        if status != 200 {
            return None;
        }
        let answer: serde_json::Value = serde_json::from_str(&body).ok()?;
        answer["TTL"].as_str()?.parse().ok()
    })
}

/// Every state `host`'s Envoy held since `since` (the one it held then first).
fn print_timeline(host: &FleetHost, since: Instant) {
    let changes = host.watch.changes();
    let first = changes.iter().rposition(|c| c.at < since).unwrap_or(0);
    for change in &changes[first..] {
        let at = change.at.saturating_duration_since(since).as_secs_f64();
        let ejected: Vec<&str> = change
            .state
            .iter()
            .filter(|held| !held.healthy())
            .map(|held| held.health.trim_start_matches('/'))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let why = if ejected.is_empty() {
            String::new()
        } else {
            format!("   (not healthy: {})", ejected.join(", "))
        };
        println!("    +{at:.2} s  {}{why}", priorities(&change.state));
    }
}

/// The traffic of every Envoy since `begun`.
fn traffic_since(fleet: &Fleet, name: &str, begun: &BTreeMap<String, Counted>) -> Phase {
    let now = fleet.counts();
    let hosts = fleet.pid_hosts();
    let mut took = Duration::ZERO;
    let traffic = now
        .iter()
        .map(|(envoy, counted)| {
            let before = &begun[envoy];
            took = took.max(counted.at.saturating_duration_since(before.at));
            let mut traffic = Traffic {
                retried: counted.retries.saturating_sub(before.retries),
                ..Traffic::default()
            };
            for (pid, n) in &counted.report.by_pid {
                let earlier = before.report.by_pid.get(pid).copied().unwrap_or(0);
                if *n > earlier {
                    let host = hosts.get(pid).cloned().unwrap_or_else(|| "?".to_owned());
                    *traffic.by_host.entry(host).or_default() += n - earlier;
                }
            }
            for failed in counted
                .report
                .failures
                .iter()
                .skip(before.report.failures.len())
            {
                traffic.failed += 1;
                *traffic.failures.entry(failed.what.clone()).or_default() += 1;
            }
            (envoy.clone(), traffic)
        })
        .collect();
    Phase {
        name: name.to_owned(),
        took,
        traffic,
    }
}

/// The phase's table: answers through each Envoy by the answering worker's host, failures and
/// Envoy's retries; then the priorities each Envoy holds now.
fn print_phase(fleet: &Fleet, phase: &Phase) {
    println!(
        "\n  phase \"{}\" ({:.1} s): requests through each host's Envoy, by the host whose worker \
         answered",
        phase.name,
        phase.took.as_secs_f64()
    );
    print!("{}", traffic_table(&phase.traffic, "    "));
    println!(
        "  priorities each Envoy holds now (admin /clusters: priority, sub-zone healthy/listed):"
    );
    for host in &fleet.hosts {
        println!("    {}'s Envoy: {}", host.name, priorities(&host.view()));
    }
}

/// `Envoy  answered  a  b  c  failed  retried`, one row per Envoy.
fn traffic_table(traffic: &BTreeMap<String, Traffic>, indent: &str) -> String {
    let mut text = String::new();
    let _ = write!(text, "{indent}{:<8}{:>9}", "Envoy", "answered");
    for host in HOSTS {
        let _ = write!(text, "{:>7}", format!("by {host}"));
    }
    let _ = writeln!(text, "{:>8}{:>9}", "failed", "retried");
    for (envoy, t) in traffic {
        let _ = write!(text, "{indent}{envoy:<8}{:>9}", t.answered());
        for host in HOSTS {
            let _ = write!(text, "{:>7}", t.by_host.get(host).copied().unwrap_or(0));
        }
        let _ = writeln!(text, "{:>8}{:>9}", t.failed, t.retried);
        for (reason, n) in &t.failures {
            let _ = writeln!(text, "{indent}  {n} failed: {reason}");
        }
    }
    text
}

/// Every timing, and every request counted.
fn summary(story: &Story) {
    println!("\n=== summary ===");
    println!(
        "  etcd healthy {:.2} s after its start; every Envoy held all {} workers {:.2} s after the \
         first `peregrine run`",
        story.etcd_up.as_secs_f64(),
        HOSTS.len() as u32 * WORKERS,
        story.fleet_up.as_secs_f64()
    );
    let times = |label: &str, timings: &[Timed]| {
        let each: Vec<String> = timings
            .iter()
            .map(|t| {
                format!(
                    "{} {:.2} s (±{} ms)",
                    t.envoy,
                    t.after.as_secs_f64(),
                    t.resolution.as_millis()
                )
            })
            .collect();
        println!("  {label:<40} {}", each.join(", "));
    };
    println!("  until each Envoy showed it:");
    times(
        &format!("{KILLED} killed -> its workers gone"),
        &story.killed_gone,
    );
    times(
        &format!("{KILLED} started again -> its new workers in"),
        &story.killed_back,
    );
    times(
        &format!("{CUT} cut off -> its workers gone"),
        &story.cut_gone,
    );
    times(
        &format!("{CUT}'s link back -> its workers in"),
        &story.cut_back,
    );
    println!(
        "  (lease {TTL:?}, renewed every third of it; admin /clusters polled every {} ms from inside \
         each host, ± the time since the poll before)",
        POLL.as_millis()
    );

    println!("\n  requests through each Envoy: answered / failed (retried by Envoy)");
    print!("  {:<16}", "phase");
    for host in HOSTS {
        print!("{:>20}", format!("{host}'s Envoy"));
    }
    println!();
    let mut total: BTreeMap<String, Traffic> = BTreeMap::new();
    let row = |name: &str, traffic: &BTreeMap<String, Traffic>| {
        print!("  {name:<16}");
        for host in HOSTS {
            let t = traffic.get(host).cloned().unwrap_or_default();
            print!(
                "{:>20}",
                format!("{} / {} ({})", t.answered(), t.failed, t.retried)
            );
        }
        println!();
    };
    for phase in &story.phases {
        row(&phase.name, &phase.traffic);
        for (envoy, traffic) in &phase.traffic {
            total.entry(envoy.clone()).or_default().add(traffic);
        }
    }
    row("all", &total);
    let failed: u64 = total.values().map(|t| t.failed).sum();
    let answered: u64 = total.values().map(|t| t.answered()).sum();
    let from_own: BTreeMap<&str, u64> = total
        .iter()
        .map(|(envoy, t)| (envoy.as_str(), t.by_host.get(envoy).copied().unwrap_or(0)))
        .collect();
    println!(
        "  {answered} requests answered, {failed} failed; answered by the Envoy's own host: {}",
        from_own
            .iter()
            .map(|(envoy, n)| {
                let all = total[*envoy].answered().max(1);
                format!("{envoy} {:.1}%", *n as f64 * 100.0 / all as f64)
            })
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (envoy, t) in &total {
        for (reason, n) in &t.failures {
            println!("  {envoy}'s Envoy, {n} failed: {reason}");
        }
    }
    if failed > 0 {
        println!(
            "  (a request fails when every try, the first and Envoy's 3 retries, goes to a dead \
             worker: only {KILLED}'s own Envoy sends requests to {KILLED}'s workers, and it does \
             until outlier detection ejects them (3 gateway failures in a row each) or its new \
             supervisor sends it the new ones)"
        );
    }
}
