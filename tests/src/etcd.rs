//! Real etcd members for the fleet tests and benchmark: each on free loopback ports with its data in a
//! temporary directory, killed (process group) and removed when dropped, also when a test panics.
//!
//! etcd is Debian's `etcd-server` (3.4); a test that needs it calls [`etcd_or_skip`], which fails
//! instead of skipping when `PEREGRINE_REQUIRE_ETCD` is set (as `cargo xtask test` does).

use std::{
    net::TcpStream,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::Context;

use crate::{ChildGuard, TempDir, free_port, try_wait_until};

/// The etcd binary: `ETCD`, else `etcd` on `PATH`.
pub fn etcd_path() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ETCD") {
        return Some(path.into());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("etcd"))
            .find(|path| path.is_file())
    })
}

/// Whether etcd is here; if not, the test says why it skips, or fails when
/// `PEREGRINE_REQUIRE_ETCD=1`.
pub fn etcd_or_skip(test: &str) -> bool {
    if etcd_path().is_some() {
        return true;
    }
    assert!(
        std::env::var("PEREGRINE_REQUIRE_ETCD").map_or(true, |v| v != "1"),
        "{test}: PEREGRINE_REQUIRE_ETCD=1 but there is no etcd (apt install etcd-server)"
    );
    eprintln!("skipping {test}: no etcd binary (apt install etcd-server, or set ETCD)");
    false
}

/// One etcd member (of a cluster of one, or of [`Etcd::start_cluster`]'s).
#[derive(Debug)]
pub struct Etcd {
    client_port: u16,
    process: ChildGuard,
    _data: TempDir,
}

impl Etcd {
    /// Starts a single-member cluster and waits until it answers.
    pub fn start() -> anyhow::Result<Etcd> {
        let mut members = Etcd::start_cluster(1)?;
        Ok(members.remove(0))
    }

    /// Starts a cluster of `members` members (`m0`, `m1`, ...), each with its own ports and data
    /// directory, and waits until every one answers (which needs a quorum, so all start first).
    pub fn start_cluster(members: usize) -> anyhow::Result<Vec<Etcd>> {
        anyhow::ensure!(members >= 1, "an etcd cluster has at least one member");
        let binary = etcd_path().context("no etcd binary")?;
        let ports: Vec<(u16, u16)> = (0..members).map(|_| (free_port(), free_port())).collect();
        let peer = |port: u16| format!("http://127.0.0.1:{port}");
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer_port))| format!("m{i}={}", peer(*peer_port)))
            .collect::<Vec<_>>()
            .join(",");
        let mut started = Vec::with_capacity(members);
        for (i, &(client_port, peer_port)) in ports.iter().enumerate() {
            let data = tempfile::tempdir()?;
            let client = format!("http://127.0.0.1:{client_port}");
            let name = format!("m{i}");
            let mut command = Command::new(&binary);
            command
                .arg("--name")
                .arg(&name)
                .arg("--data-dir")
                .arg(data.path().join(&name))
                .args(["--listen-client-urls", &client])
                .args(["--advertise-client-urls", &client])
                .args(["--listen-peer-urls", &peer(peer_port)])
                .args(["--initial-advertise-peer-urls", &peer(peer_port)])
                .args(["--initial-cluster", &initial])
                .args(["--initial-cluster-state", "new"])
                .args(["--log-level", "warn"]);
            let process = ChildGuard::spawn("etcd", &mut command, data.path())?;
            started.push(Etcd {
                client_port,
                process,
                _data: data,
            });
        }
        for etcd in &mut started {
            etcd.wait_ready()?;
        }
        Ok(started)
    }

    /// The endpoint clients dial: `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Its client address (`127.0.0.1:PORT`).
    pub fn client_addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.client_port))
    }

    /// Its Prometheus metrics (`GET /metrics` on the client port), as text.
    pub fn metrics(&self) -> anyhow::Result<String> {
        let (status, body) = crate::http_get(self.client_addr(), "/metrics")?;
        anyhow::ensure!(status == 200, "etcd /metrics answered {status}");
        Ok(body)
    }

    /// Its data directory.
    pub fn data_dir(&self) -> &Path {
        self._data.path()
    }

    /// The member's process.
    pub fn process(&mut self) -> &mut ChildGuard {
        &mut self.process
    }

    /// Its logs.
    pub fn logs(&self) -> String {
        self.process.logs()
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let port = self.client_port;
        let process = &mut self.process;
        try_wait_until(Duration::from_secs(20), "etcd to answer", || {
            if process.try_wait().is_some() {
                return Some(Err(anyhow::anyhow!("etcd exited\n{}", process.logs())));
            }
            let up = TcpStream::connect(("127.0.0.1", port)).is_ok()
                && crate::http_get(
                    format!("127.0.0.1:{port}")
                        .parse::<std::net::SocketAddr>()
                        .expect("an address"),
                    "/health",
                )
                .is_ok_and(|(status, body)| status == 200 && body.contains("true"));
            up.then_some(Ok(()))
        })?
    }
}
