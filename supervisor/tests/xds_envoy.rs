//! End to end: the real Envoy, started with a bootstrap from [`envoy_bootstrap`], learns a registry's
//! workers over CDS/EDS from [`xds::serve`], and follows registrations on its open streams.
//!
//! Needs an Envoy binary (`ENVOY`, else `target/envoy/venv/lib/python3*/site-packages/envoy/_bin/envoy`
//! under the workspace root, else the same under `/tmp/envoy`); without one the test prints why it
//! skipped. Every wait is bounded by a deadline.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use peregrine_supervisor::{
    bootstrap::{BootstrapInput, BootstrapService, envoy_bootstrap},
    registry::{Address, Listener, Protocol, Registry, Worker, WorkerState, hostname_for},
    xds::{self, XdsOptions},
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(20);

fn envoy_binary() -> Result<PathBuf, String> {
    if let Ok(path) = std::env::var("ENVOY") {
        return Ok(PathBuf::from(path));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut tried = Vec::new();
    for base in [
        root.join("target/envoy/venv/lib"),
        PathBuf::from("/tmp/envoy/venv/lib"),
    ] {
        tried.push(base.display().to_string());
        let Ok(entries) = std::fs::read_dir(&base) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("python3") {
                let bin = entry.path().join("site-packages/envoy/_bin/envoy");
                if bin.is_file() {
                    return Ok(bin);
                }
            }
        }
    }
    Err(format!(
        "no Envoy binary: ENVOY is not set and none under {}",
        tried.join(", ")
    ))
}

/// A running Envoy, killed on drop.
struct Envoy {
    child: Child,
    admin: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Envoy {
    async fn start(binary: &Path, bootstrap: &str) -> Envoy {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("envoy.yaml");
        let admin_path = dir.path().join("admin");
        std::fs::write(&config, bootstrap).unwrap();
        let log = std::fs::File::create(dir.path().join("envoy.log")).unwrap();
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let base_id =
            u32::from(std::process::id() as u16) * 8 + STARTED.fetch_add(1, Ordering::Relaxed);
        let child = Command::new(binary)
            .arg("-c")
            .arg(&config)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args(["--base-id", &base_id.to_string()])
            .args(["--disable-hot-restart", "--concurrency", "1"])
            .args(["--log-level", "info"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut envoy = Envoy {
            child,
            admin: "127.0.0.1:0".parse().unwrap(),
            _dir: dir,
        };
        let admin = eventually("Envoy's admin address", || {
            let text = std::fs::read_to_string(&admin_path).ok()?;
            text.trim().parse::<SocketAddr>().ok()
        })
        .await;
        envoy.admin = admin;
        envoy
    }

    /// The last lines of Envoy's log.
    fn log(&self) -> String {
        let log = std::fs::read_to_string(self._dir.path().join("envoy.log")).unwrap_or_default();
        let lines = log.lines().collect::<Vec<_>>();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    async fn get(&self, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(self.admin).await.unwrap();
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .unwrap();
        let mut body = String::new();
        stream.read_to_string(&mut body).await.unwrap();
        body
    }

    /// Polls `path` until `check` holds; panics with the last body and Envoy's log at the deadline.
    async fn until(&self, what: &str, path: &str, check: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let body = self.get(path).await;
            if check(&body) {
                return body;
            }
            if start.elapsed() > DEADLINE {
                panic!(
                    "Envoy never showed {what}; last {path}:\n{body}\nEnvoy log:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Retries `f` until it returns something or the deadline passes.
async fn eventually<T>(what: &str, f: impl Fn() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = f() {
            return value;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn worker(index: u32, pid: u32, addr: SocketAddr, protocols: &[Protocol]) -> Worker {
    Worker {
        service: "web".into(),
        index,
        pid,
        hostname: hostname_for("web", index, pid),
        listener: Listener {
            name: "web".into(),
            scheme: "http".into(),
            protocols: protocols.to_vec(),
            addresses: vec![Address::Tcp(addr)],
        },
        state: WorkerState::Ready,
    }
}

/// The `web` hosts in admin `/clusters` as `(address, hostname)`.
fn hosts(clusters: &str) -> Vec<(String, String)> {
    clusters
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("web::")?;
            let (addr, rest) = rest.split_once("::hostname::")?;
            Some((addr.to_string(), rest.to_string()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_follows_the_registry_over_dedicated_streams() {
    follows_the_registry(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_follows_the_registry_over_ads() {
    follows_the_registry(true).await;
}

async fn follows_the_registry(ads: bool) {
    // `RUST_LOG=peregrine_supervisor=debug` shows the server's side of the conversation.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let binary = match envoy_binary() {
        Ok(binary) => binary,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let registry = Arc::new(Registry::new(["web".to_string()]));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let xds_addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(xds::serve(
        listener,
        registry.subscribe(),
        XdsOptions::default(),
        async {
            let _ = stop_rx.await;
        },
    ));

    // Fake workers: listeners nobody serves on; Envoy only needs their addresses.
    let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let second = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let first_addr = first.local_addr().unwrap();
    let second_addr = second.local_addr().unwrap();
    registry
        .register(worker(0, 4242, first_addr, &[Protocol::Http1]))
        .unwrap();

    let bootstrap = envoy_bootstrap(&BootstrapInput {
        xds_address: xds_addr,
        listener_address: "127.0.0.1:0".parse().unwrap(),
        admin_address: "127.0.0.1:0".parse().unwrap(),
        services: vec![BootstrapService::new("web")],
        ads,
        ..Default::default()
    });
    let envoy = Envoy::start(&binary, &bootstrap).await;

    let clusters = envoy
        .until("the first worker", "/clusters", |body| {
            hosts(body).contains(&(first_addr.to_string(), "web-0-4242".into()))
        })
        .await;
    println!(
        "first worker seen:\n{}",
        clusters
            .lines()
            .filter(|l| l.contains("::hostname::") || l.contains("::health_flags::"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // A new worker is pushed on the open EDS stream.
    registry
        .register(worker(1, 4343, second_addr, &[Protocol::Http1]))
        .unwrap();
    envoy
        .until("both workers", "/clusters", |body| {
            let hosts = hosts(body);
            hosts.contains(&(first_addr.to_string(), "web-0-4242".into()))
                && hosts.contains(&(second_addr.to_string(), "web-1-4343".into()))
        })
        .await;

    // A removed worker disappears.
    assert!(registry.deregister("web", 0, 4242));
    envoy
        .until("only the second worker", "/clusters", |body| {
            hosts(body) == [(second_addr.to_string(), "web-1-4343".into())]
        })
        .await;

    // A cluster change (HTTP/2 upstream) must finish warming with the endpoints intact.
    registry
        .register(worker(1, 4444, second_addr, &[Protocol::Http2]))
        .unwrap();
    envoy
        .until("the HTTP/2 worker in a warm cluster", "/clusters", |body| {
            hosts(body) == [(second_addr.to_string(), "web-1-4444".into())]
        })
        .await;
    envoy
        .until(
            "no warming cluster",
            "/stats?filter=cluster_manager",
            |body| {
                body.contains("cluster_manager.warming_clusters: 0")
                    && body.contains("cluster_manager.cds.update_success: 2")
            },
        )
        .await;
    let dump = envoy
        .get("/config_dump?resource=dynamic_active_clusters")
        .await;
    assert!(
        dump.contains("http2_protocol_options"),
        "the active cluster has HTTP/2 upstream options:\n{dump}"
    );
    let source = if ads {
        "\"ads\": {}"
    } else {
        "\"api_config_source\""
    };
    assert!(
        dump.contains(source),
        "the cluster's EDS source is {source}:\n{dump}"
    );
    let stats = envoy.get("/stats?filter=(cds|eds)").await;
    assert!(
        !stats.contains("update_rejected: 1"),
        "Envoy rejected an update:\n{stats}\n{}",
        envoy.log()
    );

    drop(envoy);
    stop_tx.send(()).unwrap();
    tokio::time::timeout(DEADLINE, server)
        .await
        .expect("the server stops in time")
        .unwrap()
        .unwrap();
}
