//! The gRPC port under floods of connections that never speak:
//!
//! - the supervisor keeps its descriptors for its workers and its control socket (a killed worker is
//!   restarted, `peregrine status` answers), sheds connections over its caps with a few log lines
//!   rather than one per connection, closes those that send no HTTP/2 preface in time and those that
//!   stay without a stream, and then serves again;
//! - with mutual TLS, one address holding 8,400 connections, or many addresses filling the port,
//!   keep no client with a certificate out: new mTLS clients are served, and a restarted Envoy gets
//!   its config;
//! - without TLS, streams that send nothing, more than Envoy's address may hold, keep no restarted
//!   Envoy of that address out.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use peregrine_e2e::{
    Envoy, PeregrineToml, ServiceTable, Supervisor,
    config::{Sampler, SupervisorTable},
    current_test, envoy_or_skip, free_port, hosts, http_get,
    pki::{ControlPlane, SERVER_NAME},
    skip, wait_until,
};

const STEP: Duration = Duration::from_secs(30);

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn rss_kib(pid: u32) -> u64 {
    peregrine_contract::procfs::status(pid).map_or(0, |status| status.rss_kib)
}

fn worker_pid(supervisor: &Supervisor) -> Option<u32> {
    let status = supervisor.status_json().ok()?;
    status["workers"][0]["pid"].as_u64().map(|p| p as u32)
}

/// `peregrine status` answers within `limit`.
fn status_answers_within(supervisor: &Supervisor, limit: Duration) {
    let started = Instant::now();
    supervisor.status_json().expect("status answers");
    assert!(
        started.elapsed() < limit,
        "status took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_flood_of_silent_connections_starves_nothing_and_is_closed() {
    let grpc = free_port();
    let mut config = PeregrineToml::local(grpc);
    config.supervisor.sampler = Some(Sampler::Off);
    config.supervisor.grpc_handshake_timeout_ms = Some(2000);
    config.supervisor.grpc_idle_timeout_ms = Some(1000);
    config.service(
        "web",
        ServiceTable::at(format!("http://127.0.0.1:{}", free_port())),
    );
    // 1024 open files: after the reserve for 4 lanes (256 + 32), 736 gRPC connections at most.
    let supervisor =
        Supervisor::start_wrapped_in(&["prlimit", "--nofile=1024:1024", "--"], &config.toml());
    let pid = supervisor.pid();
    let first = wait_until(STEP, "the worker registered", || worker_pid(&supervisor));
    let (fds_before, rss_before) = (open_fds(pid), rss_kib(pid));
    let addr = SocketAddr::from(([127, 0, 0, 1], grpc));

    // 1,500 connections that say nothing: twice what the supervisor may hold.
    let flood: Vec<TcpStream> = (0..1500)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok())
        .collect();
    assert!(flood.len() > 1000, "{} connected", flood.len());
    // All from one address: its cap (here the port's, lowered by the open-file limit) is reached, and
    // each new connection takes the place of its oldest silent one.
    wait_until(STEP, "the cap reached", || {
        supervisor
            .logs()
            .contains("an address reached its cap of open connections")
            .then_some(())
    });
    let held = open_fds(pid);
    assert!(
        held < 1024 - 200,
        "{held} descriptors open: the reserve is gone"
    );
    // The supervisor still does its job: status answers, and a killed worker is restarted.
    status_answers_within(&supervisor, Duration::from_secs(5));
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(first as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let second = wait_until(STEP, "the killed worker restarted", || {
        worker_pid(&supervisor).filter(|p| *p != first)
    });
    assert_ne!(second, first);
    let logs = supervisor.logs();
    assert!(
        !logs.contains("Too many open files"),
        "the supervisor ran out of descriptors:\n{logs}"
    );
    // Throttled: a line per 10 s, not one per connection shed.
    let lines = logs.matches("cap of open connections").count();
    assert!(lines <= 3, "{lines} lines for the connections shed");

    // Without a preface, the admitted ones are closed after the handshake timeout.
    wait_until(STEP, "the silent connections closed", || {
        (open_fds(pid) <= fds_before + 8).then_some(())
    });
    drop(flood);
    assert!(
        logs.contains("no HTTP/2 preface in time")
            || supervisor.logs().contains("no HTTP/2 preface in time")
    );
    let rss_after = rss_kib(pid);
    println!(
        "supervisor: {fds_before} fds and {rss_before} KiB before, {held} fds while flooded, \
         {rss_after} KiB after"
    );

    // A client that speaks HTTP/2 is served again (the server's SETTINGS come back), and is closed
    // once it has had no stream for the idle timeout.
    let mut client = TcpStream::connect(addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    client
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .unwrap();
    client.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).unwrap();
    let mut header = [0u8; 9];
    client.read_exact(&mut header).unwrap();
    assert_eq!(header[3], 4, "a SETTINGS frame first: {header:?}");
    let opened = Instant::now();
    let mut rest = Vec::new();
    // Ends (EOF, or a reset after GOAWAY) once idle too long; the read timeout would be an error.
    let result = client.read_to_end(&mut rest);
    assert!(
        !matches!(&result, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "still open after {:?}",
        opened.elapsed()
    );
    assert!(
        opened.elapsed() < Duration::from_secs(5),
        "closed after {:?}",
        opened.elapsed()
    );
}

// === Floods from one address and from many, against mutual TLS ===

/// The holder's connections, opened again when the server closes them, at most this many a second
/// (an attacker keeping its connections up).
const REOPEN_PER_SECOND: u32 = 1000;

/// Silent connections to `addr` held from source addresses: each opened again (at most
/// [`REOPEN_PER_SECOND`], all together) when the server closes it, until the holder is dropped.
struct Holder {
    counts: std::sync::Arc<HolderCounts>,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What a [`Holder`] did so far.
#[derive(Debug, Default)]
struct HolderCounts {
    /// Connections opened, first and again.
    opened: std::sync::atomic::AtomicUsize,
    /// Connections the server closed (refused, evicted, timed out).
    closed_by_server: std::sync::atomic::AtomicUsize,
}

impl Holder {
    /// `per_source` connections from each of `sources` (127.0.0.0/8 addresses: every one is this
    /// host's) to `addr`.
    fn start(addr: SocketAddr, sources: &[[u8; 4]], per_source: usize) -> Holder {
        let counts = std::sync::Arc::new(HolderCounts::default());
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let sources = sources.to_vec();
        let shared = counts.clone();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let pacing = Pacing::new();
                let mut tasks = tokio::task::JoinSet::new();
                for source in sources {
                    for _ in 0..per_source {
                        let hold = hold_one(addr, source, shared.clone(), pacing.clone());
                        tasks.spawn(hold);
                    }
                }
                let _ = stopped.wait_for(|stop| *stop).await;
                // Dropping the tasks closes their connections.
                tasks.abort_all();
            });
        });
        Holder {
            counts,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn opened(&self) -> usize {
        self.counts
            .opened
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn closed_by_server(&self) -> usize {
        self.counts
            .closed_by_server
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// How the holder's connections are opened: 256 connects in flight at most, and every reopening
/// paced at [`REOPEN_PER_SECOND`].
#[derive(Clone)]
struct Pacing {
    connecting: std::sync::Arc<tokio::sync::Semaphore>,
    reopen: std::sync::Arc<tokio::sync::Mutex<tokio::time::Interval>>,
}

impl Pacing {
    fn new() -> Pacing {
        let mut reopen = tokio::time::interval(Duration::from_secs(1) / REOPEN_PER_SECOND);
        reopen.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Pacing {
            connecting: std::sync::Arc::new(tokio::sync::Semaphore::new(256)),
            reopen: std::sync::Arc::new(tokio::sync::Mutex::new(reopen)),
        }
    }
}

/// One of the holder's connections, from `source`: opened, held until the server closes it, and
/// opened again, until the task is aborted.
async fn hold_one(
    addr: SocketAddr,
    source: [u8; 4],
    counts: std::sync::Arc<HolderCounts>,
    pacing: Pacing,
) {
    use std::sync::atomic::Ordering;
    let mut first = true;
    loop {
        if !first {
            pacing.reopen.lock().await.tick().await;
        }
        first = false;
        let connected = {
            let _permit = pacing.connecting.acquire().await.unwrap();
            let Ok(socket) = tokio::net::TcpSocket::new_v4() else {
                continue;
            };
            if socket.bind(SocketAddr::from((source, 0))).is_err() {
                continue;
            }
            tokio::time::timeout(Duration::from_secs(5), socket.connect(addr)).await
        };
        let Ok(Ok(mut stream)) = connected else {
            continue;
        };
        counts.opened.fetch_add(1, Ordering::Relaxed);
        let mut byte = [0u8; 1];
        let _ = tokio::io::AsyncReadExt::read(&mut stream, &mut byte).await;
        counts.closed_by_server.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Raises this process's soft open-file limit to its hard one (the holder's connections, and the
/// supervisor and Envoy it starts, which inherit it); the limit now in effect.
fn raise_nofile_limit() -> u64 {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    limit.current = limit.maximum;
    setrlimit(Resource::Nofile, limit).expect("raising RLIMIT_NOFILE to its hard limit");
    limit.current.unwrap_or(u64::MAX)
}

/// `curl` over HTTP/2 and mutual TLS to the gRPC port with Envoy's certificate from `plane`: whether
/// the gRPC server answered (any HTTP status).
fn mtls_client_served(grpc: u16, plane: &ControlPlane) -> bool {
    let dir = &plane.dir;
    let output = std::process::Command::new("curl")
        .args(["-sS", "--http2", "-o", "/dev/null", "-w", "%{http_code}"])
        .args(["--max-time", "5", "--cacert"])
        .arg(dir.join("ca.pem"))
        .arg("--cert")
        .arg(dir.join("envoy.pem"))
        .arg("--key")
        .arg(dir.join("envoy.key"))
        .args(["--resolve", &format!("{SERVER_NAME}:{grpc}:127.0.0.1")])
        .arg(format!("https://{SERVER_NAME}:{grpc}/"))
        .output()
        .expect("curl runs");
    let code: u32 = String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .unwrap_or(0);
    code >= 200
}

/// Under `holder`'s connections: how many of `clients` new mTLS clients (`curl` with Envoy's
/// certificate, from 127.0.0.1) are served, and how long a restarted Envoy takes to have the
/// clusters of its config again (panics past 20 s).
fn served_under_hold(
    supervisor: &Supervisor,
    envoy: Envoy,
    plane: &ControlPlane,
    grpc: u16,
    clients: usize,
) -> (usize, Duration) {
    let served = (0..clients)
        .filter(|_| mtls_client_served(grpc, plane))
        .count();
    let bootstrap = supervisor.envoy_bootstrap().expect("bootstrap");
    drop(envoy);
    let restarted = Instant::now();
    let envoy = Envoy::start(&bootstrap);
    peregrine_e2e::try_wait_until(
        Duration::from_secs(20),
        "the restarted Envoy to get its clusters (admin /clusters)",
        || (hosts(&envoy.clusters(), "web").len() == 2).then_some(()),
    )
    .unwrap_or_else(|e| {
        panic!(
            "{e}\nserved {served} of {clients} mTLS clients\n{}",
            supervisor.logs()
        )
    });
    (served, restarted.elapsed())
}

/// A supervisor with mutual TLS from `plane`, no sampler, no metrics, and two workers of `web`,
/// `[supervisor]` changed by `supervisor`; with the gRPC port, and an Envoy that routes through it.
fn mutual_tls_stack(
    plane: &ControlPlane,
    supervisor: impl FnOnce(&mut SupervisorTable),
) -> (Supervisor, Envoy, u16) {
    let (grpc, listen) = (free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, free_port());
    config.supervisor.sampler = Some(Sampler::Off);
    config.supervisor.metrics = Some(String::new());
    supervisor(&mut config.supervisor);
    plane.secure(&mut config);
    config.service("web", ServiceTable::at("http://127.0.0.1:0").count(2));
    let supervisor = Supervisor::start(&config.toml());
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("bootstrap"));
    let listen = SocketAddr::from(([127, 0, 0, 1], listen));
    peregrine_e2e::try_wait_until(STEP, "requests through Envoy", || {
        http_get(listen, "/")
            .is_ok_and(|(status, _)| status == 200)
            .then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", supervisor.logs(), envoy.logs()));
    (supervisor, envoy, grpc)
}

#[test]
fn a_holder_of_8400_connections_from_one_address_keeps_no_mtls_client_out() {
    let Some(_envoy) = envoy_or_skip("8,400 connections from one address") else {
        return;
    };
    const HELD: usize = 8400;
    let nofile = raise_nofile_limit();
    if nofile < HELD as u64 + 1000 {
        skip(
            &current_test(),
            format!("the open-file hard limit is {nofile}, and the holder needs {HELD} and more"),
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::write(dir.path());
    // The port's default caps: 8192 connections, 1024 per address.
    let (supervisor, envoy, grpc) = mutual_tls_stack(&plane, |_| {});
    let addr = SocketAddr::from(([127, 0, 0, 1], grpc));
    let holder = Holder::start(addr, &[[127, 0, 0, 2]], HELD);
    wait_until(STEP, "the holder's connections opened", || {
        (holder.opened() >= HELD).then_some(())
    });
    let (served, restart) = served_under_hold(&supervisor, envoy, &plane, grpc, 15);
    let open_fds = open_fds(supervisor.pid());
    println!(
        "holding {HELD} connections from 127.0.0.2 ({} opened, {} closed by the supervisor): \
         {served} of 15 new mTLS clients served; a restarted Envoy had its clusters in {restart:.2?}; \
         the supervisor had {open_fds} descriptors open",
        holder.opened(),
        holder.closed_by_server(),
    );
    assert_eq!(served, 15, "every mTLS client is served");
    assert!(
        open_fds < 1024 + 200,
        "{open_fds} descriptors: more than one address's cap of the holder's connections"
    );
    assert!(
        supervisor
            .logs()
            .contains("an address reached its cap of open connections"),
        "{}",
        supervisor.logs()
    );
}

#[test]
fn silent_connections_from_many_addresses_that_fill_the_port_make_room_for_mtls_clients() {
    let Some(_envoy) = envoy_or_skip("a port full of silent connections") else {
        return;
    };
    raise_nofile_limit();
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::write(dir.path());
    let (supervisor, envoy, grpc) = mutual_tls_stack(&plane, |supervisor| {
        supervisor.grpc_max_connections = Some(256);
        supervisor.grpc_max_connections_per_peer = Some(32);
    });
    let addr = SocketAddr::from(([127, 0, 0, 1], grpc));
    // Ten addresses of 32: 320, more than the port's 256.
    let sources: Vec<[u8; 4]> = (10..20).map(|last| [127, 0, 0, last]).collect();
    let holder = Holder::start(addr, &sources, 32);
    wait_until(STEP, "the port full", || {
        supervisor
            .logs()
            .contains("the cap of open connections is reached; the oldest connection")
            .then_some(())
    });
    let (served, restart) = served_under_hold(&supervisor, envoy, &plane, grpc, 15);
    println!(
        "the port full of silent connections from 10 addresses ({} opened, {} closed by the \
         supervisor): {served} of 15 new mTLS clients served; a restarted Envoy had its clusters \
         in {restart:.2?}",
        holder.opened(),
        holder.closed_by_server(),
    );
    assert_eq!(served, 15, "every mTLS client is served");
}

/// Connections from 127.0.0.1 to the gRPC port, each with an ADS stream open that never sends a
/// request: opened, held until the server ends them, and opened again, until dropped.
struct StreamHolder {
    /// How many connections have their stream open now.
    open: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StreamHolder {
    fn start(grpc: u16, connections: usize) -> StreamHolder {
        use std::sync::atomic::Ordering;

        use envoy_types::pb::envoy::service::discovery::v3::{
            DiscoveryRequest, aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
        };

        let open = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let shared = open.clone();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let connecting = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
                let mut tasks = tokio::task::JoinSet::new();
                for _ in 0..connections {
                    let (open, connecting) = (shared.clone(), connecting.clone());
                    tasks.spawn(async move {
                        loop {
                            let stream = {
                                let _permit = connecting.acquire().await.unwrap();
                                tokio::time::timeout(Duration::from_secs(5), async {
                                    let mut client = AggregatedDiscoveryServiceClient::connect(
                                        format!("http://127.0.0.1:{grpc}"),
                                    )
                                    .await
                                    .ok()?;
                                    let silent = tokio_stream::pending::<DiscoveryRequest>();
                                    client.stream_aggregated_resources(silent).await.ok()
                                })
                                .await
                            };
                            if let Ok(Some(response)) = stream {
                                open.fetch_add(1, Ordering::Relaxed);
                                let mut stream = response.into_inner();
                                while let Ok(Some(_)) = stream.message().await {}
                                open.fetch_sub(1, Ordering::Relaxed);
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    });
                }
                let _ = stopped.wait_for(|stop| *stop).await;
                tasks.abort_all();
            });
        });
        StreamHolder {
            open,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn open(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for StreamHolder {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[test]
fn a_restarted_envoy_gets_its_clusters_while_its_address_holds_its_cap_of_silent_streams() {
    if envoy_or_skip(&current_test()).is_none() {
        return;
    }
    raise_nofile_limit();
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let supervisor = Supervisor::start(&PeregrineToml::one_service(grpc, listen, admin, 1).toml());
    let bootstrap = supervisor.envoy_bootstrap().unwrap();
    let envoy = Envoy::start(&bootstrap);
    let has_its_cluster = |envoy: &Envoy| {
        let hosts = hosts(&envoy.clusters(), "cluster");
        (hosts.len() == 1 && hosts[0].healthy).then_some(())
    };
    wait_until(STEP, "Envoy has its cluster", || has_its_cluster(&envoy));

    // A local process holds more streams from 127.0.0.1, Envoy's address, than its cap (1,024):
    // streams that Envoy would open, on which it sends nothing.
    let holder = StreamHolder::start(grpc, 1100);
    wait_until(STEP, "the address's cap of streams held", || {
        (holder.open() >= 1000).then_some(())
    });
    drop(envoy);
    let started = Instant::now();
    let envoy = Envoy::start(&bootstrap);
    wait_until(
        Duration::from_secs(15),
        "the restarted Envoy has its cluster",
        || has_its_cluster(&envoy),
    );
    eprintln!(
        "the restarted Envoy had its cluster after {:?}, while {} silent streams were held",
        started.elapsed(),
        holder.open()
    );
    assert!(
        holder.open() >= 900,
        "the holder kept its streams: {}",
        holder.open()
    );
}
