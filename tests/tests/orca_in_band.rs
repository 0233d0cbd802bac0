//! In-band ORCA with the real Envoy (`orca = "in-band"`): every response of a worker carries its
//! latest load report (`endpoint-load-metrics-bin`), Envoy's client-side weighted round robin weighs
//! the workers from those headers, for TCP workers and for Unix-socket workers (which out-of-band
//! ORCA cannot reach), and no ORCA stream exists. A worker made busy with work Envoy does not send it
//! gets a clearly smaller weight than its idle peer; a supervisor that restarts and adopts its
//! workers goes on writing their reports.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use peregrine_e2e::{
    Envoy, PeregrineToml, ServiceTable, Supervisor,
    config::{Orca, OrcaTable},
    envoy_or_skip, free_port, hosts, http_get,
    load::answers_for,
    try_wait_until, wait_until,
};

/// Fast sampling, and `[orca]` settings that make weights apply within a second or two.
fn config() -> (String, SocketAddr) {
    let listen = free_port();
    let mut config = PeregrineToml::local(free_port()).with_envoy(listen, free_port());
    config.supervisor.sample_interval_ms = Some(200);
    config.orca = Some(OrcaTable {
        blackout_period_ms: Some(0),
        weight_update_period_ms: Some(100),
        ..OrcaTable::default()
    });
    for (name, url) in [
        ("tcp", "http://127.0.0.1:0"),
        ("uds", "unix://{dir}/uds-{index}.sock"),
    ] {
        let service = ServiceTable::at(url)
            .count(2)
            .prefix(format!("/{name}"))
            .orca(Orca::InBand);
        config.service(name, service);
    }
    (config.toml(), SocketAddr::from(([127, 0, 0, 1], listen)))
}

/// Where a worker listens, to reach it without Envoy.
#[derive(Clone, Debug)]
enum Direct {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

/// `GET path` straight to a worker, one request on its own connection; the whole response.
fn direct_get(to: &Direct, path: &str) -> std::io::Result<String> {
    let request = format!("GET {path} HTTP/1.1\r\nhost: worker\r\nconnection: close\r\n\r\n");
    let mut response = Vec::new();
    match to {
        Direct::Tcp(addr) => {
            let mut stream = TcpStream::connect_timeout(addr, Duration::from_secs(2))?;
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            stream.write_all(request.as_bytes())?;
            stream.read_to_end(&mut response)?;
        }
        Direct::Unix(path) => {
            let mut stream = UnixStream::connect(path)?;
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            stream.write_all(request.as_bytes())?;
            stream.read_to_end(&mut response)?;
        }
    }
    Ok(String::from_utf8_lossy(&response).into_owned())
}

/// The `endpoint-load-metrics-bin` value of a response, if it has one.
fn load_report(response: &str) -> Option<String> {
    let head = response.split("\r\n\r\n").next()?;
    head.lines()
        .find_map(|line| line.strip_prefix("endpoint-load-metrics-bin: "))
        .map(str::to_owned)
}

/// Worker 0 of `service`, reached directly.
fn worker_zero(supervisor: &Supervisor, service: &str, dir: &Path) -> Direct {
    if service == "uds" {
        return Direct::Unix(dir.join("uds-0.sock"));
    }
    let address = try_wait_until(Duration::from_secs(20), "worker 0's address", || {
        let rows = supervisor.status_rows(service).ok()?;
        let text = rows.get(&0)?["addresses"]
            .as_array()?
            .first()?
            .as_str()?
            .to_owned();
        text.trim_start_matches("http://")
            .parse::<SocketAddr>()
            .ok()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.logs()));
    Direct::Tcp(address)
}

/// Keeps `to` busy with CPU-heavy requests (20 ms each) from two clients until dropped.
struct Busy {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Busy {
    fn start(to: &Direct) -> Busy {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..2)
            .map(|_| {
                let (stop, to) = (stop.clone(), to.clone());
                thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let _ = direct_get(&to, "/?cpu=20");
                    }
                })
            })
            .collect();
        Busy { stop, threads }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Envoy's weights of `service`'s two hosts, worker 0's first (by EDS hostname `service-0-pid`).
fn weights(envoy: &Envoy, service: &str) -> Option<(u64, u64)> {
    let hosts = hosts(&envoy.clusters(), service);
    let weight = |index: &str| {
        let prefix = format!("{service}-{index}-");
        hosts
            .iter()
            .find(|h| h.hostname.starts_with(&prefix))
            .map(|h| h.weight)
    };
    Some((weight("0")?, weight("1")?))
}

#[test]
fn envoy_weighs_tcp_and_unix_workers_from_their_in_band_reports_with_no_stream() {
    let Some(_envoy_binary) = envoy_or_skip("in-band ORCA") else {
        return;
    };
    let started = std::time::Instant::now();
    let phase = |what: &str| eprintln!("{:>6.1?} {what}", started.elapsed());
    let (config, listen) = config();
    let mut supervisor = Supervisor::start(&config);
    phase("supervisor started");
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("bootstrap"));
    phase("envoy started");
    let dir = supervisor.dir().to_owned();
    for service in ["tcp", "uds"] {
        wait_until(Duration::from_secs(30), "both services answer", || {
            http_get(listen, &format!("/{service}"))
                .ok()
                .filter(|(code, _)| *code == 200)
        });
    }

    phase("both services answer");
    // Every response carries a report once the sampler has two readings.
    let zero: BTreeMap<&str, Direct> = ["tcp", "uds"]
        .into_iter()
        .map(|service| (service, worker_zero(&supervisor, service, &dir)))
        .collect();
    for (service, to) in &zero {
        try_wait_until(Duration::from_secs(10), "a report in the response", || {
            load_report(&direct_get(to, "/").ok()?)
        })
        .unwrap_or_else(|e| panic!("{service}: {e}\n{}", supervisor.logs()));
    }

    phase("reports in responses");
    // Light traffic through Envoy: the reports it reads set every host's weight (1 without them).
    for service in ["tcp", "uds"] {
        try_wait_until(
            Duration::from_secs(15),
            "weights from in-band reports",
            || {
                let (_, failed) = answers_for(
                    listen,
                    &format!("/{service}"),
                    2,
                    Duration::from_millis(300),
                );
                assert_eq!(failed, 0, "no request fails");
                weights(&envoy, service).filter(|&(a, b)| a > 1 && b > 1)
            },
        )
        .unwrap_or_else(|e| panic!("{service}: {e}\n{}", envoy.clusters()));
    }

    phase("weights from reports");
    // Worker 0 made busy behind Envoy's back: its utilization rises far more than its rate, and its
    // weight follows, well below its idle peer's.
    for (service, to) in &zero {
        let _busy = Busy::start(to);
        let (w0, w1) = try_wait_until(
            Duration::from_secs(15),
            "the busy worker weighed less",
            || {
                answers_for(
                    listen,
                    &format!("/{service}"),
                    2,
                    Duration::from_millis(300),
                );
                weights(&envoy, service).filter(|&(w0, w1)| w0 * 2 < w1)
            },
        )
        .unwrap_or_else(|e| panic!("{service}: {e}\n{}", envoy.clusters()));
        eprintln!("{service}: busy worker 0 weighs {w0}, idle worker 1 {w1}");
    }

    phase("busy workers weighed less");
    // No stream: Envoy opened none, and the supervisor served none.
    for service in ["tcp", "uds"] {
        for stat in ["reports_received", "active_sessions"] {
            let value = envoy.stat(&format!("cluster.{service}.lb_orca_oob.{stat}"));
            assert!(
                value.unwrap_or(0) == 0,
                "{service} {stat}: {value:?}\n{}",
                envoy.stats()
            );
        }
        let rows = supervisor.status_rows(service).expect("status");
        assert!(
            rows.values()
                .all(|row| row["orca_streams"].as_u64().unwrap_or(0) == 0),
            "{rows:?}"
        );
    }

    // A supervisor that restarts adopts the workers and finds their report slots again: the reports
    // keep changing.
    let tcp = zero["tcp"].clone();
    let before = load_report(&direct_get(&tcp, "/").expect("an answer")).expect("a report");
    supervisor
        .kill_and_start_again()
        .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.logs()));
    phase("supervisor started again");
    let _busy = Busy::start(&tcp);
    try_wait_until(
        Duration::from_secs(20),
        "a new report after the restart",
        || {
            let report = load_report(&direct_get(&tcp, "/").ok()?)?;
            (report != before).then_some(())
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.all_logs()));
    phase("reports after the restart");
}
