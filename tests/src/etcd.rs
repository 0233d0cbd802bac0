//! Real etcd for the fleet tests and benchmark: [`EtcdCluster`], one or more members on one address
//! of the caller's choosing (loopback, a network's bridge, or a host of a
//! [`Network`](crate::Network) of its own, so that hosts in network namespaces reach it), whose
//! members can be killed and started again on the data they had, and [`Etcd`], a cluster of one on
//! loopback for the tests that need nothing more. Each member is on free ports with its data in the
//! cluster's temporary directory, killed (process group) and removed when dropped, also when a test
//! panics.
//!
//! etcd is Debian's `etcd-server` (3.4); a test that needs it calls [`etcd_or_skip`], which fails
//! instead of skipping when `PEREGRINE_REQUIRE_ETCD` is set (as `cargo xtask test` does).
//!
//! With [`EtcdTls`] the members serve clients over TLS and require client certificates
//! (`--client-cert-auth`), as a fleet's etcd should; `/health` and `/metrics`, which the harness
//! reads, are then served in cleartext on a port of their own (`--listen-metrics-urls`). Members
//! speak TLS among themselves too, each presenting `etcd-peer.pem` and requiring the other's
//! (`--peer-client-cert-auth`), as docs/fleet.md sets a fleet's etcd up.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, bail};

use crate::{ChildGuard, TempDir, free_port, try_wait_until};

/// The certificates of an etcd over TLS, as `peregrine tls init` writes them into one directory:
/// `etcd-ca.pem`, `etcd-server.pem`/`.key` and `etcd-peer.pem`/`.key` (which must name the members'
/// address) and `etcd-client.pem`/`.key` (the supervisors').
#[derive(Clone, Debug)]
pub struct EtcdTls {
    /// The directory.
    pub dir: PathBuf,
}

impl EtcdTls {
    /// The certificates in `dir`.
    pub fn in_dir(dir: &Path) -> EtcdTls {
        EtcdTls {
            dir: dir.to_owned(),
        }
    }

    /// A file of the set.
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// `[cluster.tls]` for a supervisor.
    pub fn cluster_tls(&self) -> crate::config::ClusterTls {
        crate::config::ClusterTls {
            ca: Some(self.file("etcd-ca.pem")),
            cert: Some(self.file("etcd-client.pem")),
            key: Some(self.file("etcd-client.key")),
        }
    }
}

/// How long a member may take to answer, or a cluster to elect a leader.
const READY_DEADLINE: Duration = Duration::from_secs(30);

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
    crate::skip(
        test,
        "no etcd binary (apt install etcd-server, or set ETCD)",
    );
    false
}

/// A single etcd member on loopback, for tests that need an etcd and nothing more of it: an
/// [`EtcdCluster`] of one.
#[derive(Debug)]
pub struct Etcd {
    cluster: EtcdCluster,
}

impl Etcd {
    /// Starts a single-member cluster on `127.0.0.1` and waits until it answers healthy.
    pub fn start() -> anyhow::Result<Etcd> {
        Self::start_with_args(&[])
    }

    /// Like [`Etcd::start`], with more command-line arguments for the member (e.g.
    /// `--max-request-bytes`).
    pub fn start_with_args(args: &[&str]) -> anyhow::Result<Etcd> {
        let mut cluster = EtcdCluster::unstarted(&[], Ipv4Addr::LOCALHOST.into(), 1, None)?;
        cluster.args = args.iter().map(|s| (*s).to_owned()).collect();
        cluster.start_members()?;
        Ok(Etcd { cluster })
    }

    /// The endpoint clients dial: `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        self.cluster.endpoint(0)
    }

    /// SIGKILLs the member (its data stays until it is dropped).
    pub fn kill(&mut self) {
        self.cluster.kill(0);
    }
}

/// A cluster of etcd members on one address, each with its own ports and data directory; members
/// can be killed and started again on their data. Killed (every member's process group) and removed
/// when dropped.
#[derive(Debug)]
pub struct EtcdCluster {
    ip: IpAddr,
    /// The program and arguments every member is started through (empty: none).
    wrapper: Vec<String>,
    /// More arguments for every member.
    args: Vec<String>,
    members: Vec<Member>,
    /// `name=peer-url,...`: every member's peer URL.
    initial_cluster: String,
    /// Clients over TLS with client certificates, when set.
    tls: Option<EtcdTls>,
    // Last: the processes die before their data is removed.
    dir: TempDir,
}

/// One member of an [`EtcdCluster`].
#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    /// `/health` and `/metrics` in cleartext, with TLS.
    metrics_port: u16,
    /// `None` while killed.
    process: Option<ChildGuard>,
    /// Processes of this member killed earlier (for their logs).
    previous: Vec<ChildGuard>,
}

// === impl EtcdCluster ===

impl EtcdCluster {
    /// Starts `size` members listening on `ip` (e.g. a [`Network`](crate::Network)'s bridge address)
    /// and waits until every one of them answers healthy (the cluster has elected a leader).
    pub fn start(ip: IpAddr, size: usize) -> anyhow::Result<EtcdCluster> {
        Self::start_wrapped(&[], ip, size)
    }

    /// Like [`EtcdCluster::start`], with every member started (and started again) through
    /// `wrapper`, a program and its arguments that exec the rest: e.g. a
    /// [`NetHost::wrapper`](crate::NetHost::wrapper), with `ip` that host's address, so that the
    /// members live in the host's namespace and go with it.
    pub fn start_wrapped(wrapper: &[&str], ip: IpAddr, size: usize) -> anyhow::Result<EtcdCluster> {
        Self::start_with(wrapper, ip, size, None)
    }

    /// Like [`EtcdCluster::start_wrapped`], with clients over TLS when `tls` is given.
    pub fn start_with(
        wrapper: &[&str],
        ip: IpAddr,
        size: usize,
        tls: Option<EtcdTls>,
    ) -> anyhow::Result<EtcdCluster> {
        let mut cluster = Self::unstarted(wrapper, ip, size, tls)?;
        cluster.start_members()?;
        Ok(cluster)
    }

    /// Every member started, and healthy.
    fn start_members(&mut self) -> anyhow::Result<()> {
        for index in 0..self.size() {
            self.spawn(index)?;
        }
        self.wait_healthy()
    }

    /// The cluster, its members not started yet.
    fn unstarted(
        wrapper: &[&str],
        ip: IpAddr,
        size: usize,
        tls: Option<EtcdTls>,
    ) -> anyhow::Result<EtcdCluster> {
        anyhow::ensure!(size > 0, "a cluster has members");
        let dir = tempfile::Builder::new()
            .prefix("peregrine-etcd-")
            .tempdir()?;
        let members: Vec<Member> = (0..size)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: free_port(),
                peer_port: free_port(),
                metrics_port: free_port(),
                process: None,
                previous: Vec::new(),
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, peer_url(ip, m.peer_port, tls.is_some())))
            .collect::<Vec<_>>()
            .join(",");
        Ok(EtcdCluster {
            ip,
            wrapper: wrapper.iter().map(|s| (*s).to_owned()).collect(),
            args: Vec::new(),
            members,
            initial_cluster,
            tls,
            dir,
        })
    }

    /// The number of members, running or not.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Every member's client endpoint, `http://IP:PORT` (`https://` with TLS), running or not: the
    /// `[cluster] etcd` list.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.size()).map(|i| self.endpoint(i)).collect()
    }

    /// Member `index`'s client endpoint.
    pub fn endpoint(&self, index: usize) -> String {
        let url = url(self.ip, self.members[index].client_port);
        match self.tls {
            Some(_) => url.replacen("http://", "https://", 1),
            None => url,
        }
    }

    /// The TLS certificates, when clients speak TLS.
    pub fn tls(&self) -> Option<&EtcdTls> {
        self.tls.as_ref()
    }

    /// Where member `index` serves `/health` and `/metrics` in cleartext.
    fn plain_addr(&self, index: usize) -> SocketAddr {
        let member = &self.members[index];
        let port = match self.tls {
            Some(_) => member.metrics_port,
            None => member.client_port,
        };
        SocketAddr::new(self.ip, port)
    }

    /// Member `index`'s client address (`IP:PORT`).
    pub fn client_addr(&self, index: usize) -> SocketAddr {
        SocketAddr::new(self.ip, self.members[index].client_port)
    }

    /// Member `index`'s Prometheus metrics (`GET /metrics`), as text.
    pub fn metrics(&self, index: usize) -> anyhow::Result<String> {
        let (status, body) = crate::http_get(self.plain_addr(index), "/metrics")?;
        anyhow::ensure!(
            status == 200,
            "etcd member {index}'s /metrics answered {status}"
        );
        Ok(body)
    }

    /// Member `index`'s pid (its process group), `None` while it is killed.
    pub fn pid(&self, index: usize) -> Option<u32> {
        self.members[index].process.as_ref().map(ChildGuard::id)
    }

    /// Whether member `index` runs (was not killed, or was started again).
    pub fn is_running(&mut self, index: usize) -> bool {
        self.members[index]
            .process
            .as_mut()
            .is_some_and(|p| p.try_wait().is_none())
    }

    /// The index of the member that leads, as the running members report it
    /// (`etcd_server_is_leader` in their metrics).
    pub fn leader(&mut self) -> anyhow::Result<usize> {
        let mut leaders = Vec::new();
        for index in 0..self.size() {
            if !self.is_running(index) {
                continue;
            }
            let metrics = self.metrics(index)?;
            if metrics
                .lines()
                .any(|line| line.trim() == "etcd_server_is_leader 1")
            {
                leaders.push(index);
            }
        }
        match leaders[..] {
            [leader] => Ok(leader),
            [] => bail!("no running member leads"),
            _ => bail!("members {leaders:?} all say they lead"),
        }
    }

    /// SIGKILLs member `index` (its data stays).
    pub fn kill(&mut self, index: usize) {
        let member = &mut self.members[index];
        if let Some(mut process) = member.process.take() {
            process.kill();
            member.previous.push(process);
        }
    }

    /// Starts killed member `index` again, on the data it had; does not wait (see
    /// [`EtcdCluster::wait_healthy`]: a member alone cannot be healthy without a quorum).
    pub fn restart(&mut self, index: usize) -> anyhow::Result<()> {
        if self.is_running(index) {
            bail!("member {index} runs");
        }
        self.spawn(index)
    }

    /// Waits until every running member answers `/health` with `true`: it is part of a quorum that
    /// has a leader.
    pub fn wait_healthy(&mut self) -> anyhow::Result<()> {
        let running: Vec<usize> = (0..self.size()).filter(|i| self.is_running(*i)).collect();
        try_wait_until(
            READY_DEADLINE,
            "every running etcd member to be healthy",
            || {
                for index in &running {
                    let member = &mut self.members[*index];
                    if let Some(process) = member.process.as_mut()
                        && process.try_wait().is_some()
                    {
                        return Some(Err(anyhow::anyhow!(
                            "etcd {} exited\n{}",
                            member.name,
                            process.logs()
                        )));
                    }
                    let port = match self.tls {
                        Some(_) => member.metrics_port,
                        None => member.client_port,
                    };
                    if !healthy(SocketAddr::new(self.ip, port)) {
                        return None;
                    }
                }
                Some(Ok(()))
            },
        )?
    }

    /// Whether member `index` answers `/health` with `true` right now.
    pub fn is_healthy(&self, index: usize) -> bool {
        healthy(self.plain_addr(index))
    }

    /// Every member's logs, earlier processes of it included.
    pub fn logs(&self) -> String {
        self.members
            .iter()
            .flat_map(|m| m.previous.iter().chain(m.process.as_ref()))
            .map(ChildGuard::logs)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Starts member `index` on its data directory (made on the first start).
    fn spawn(&mut self, index: usize) -> anyhow::Result<()> {
        let binary = etcd_path().context("no etcd binary")?;
        let ip = self.ip;
        let member = &mut self.members[index];
        let client = match &self.tls {
            Some(_) => url(ip, member.client_port).replacen("http://", "https://", 1),
            None => url(ip, member.client_port),
        };
        let peer = peer_url(ip, member.peer_port, self.tls.is_some());
        let mut command = crate::process::wrapped(&self.wrapper, binary);
        command
            .arg("--name")
            .arg(&member.name)
            .arg("--data-dir")
            .arg(self.dir.path().join(&member.name))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial_cluster])
            // Read on the first start only: a member started again goes by its data directory.
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "peregrine-e2e"])
            .args(["--log-level", "warn"])
            .args(&self.args);
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(tls.file("etcd-server.pem"))
                .arg("--key-file")
                .arg(tls.file("etcd-server.key"))
                .arg("--trusted-ca-file")
                .arg(tls.file("etcd-ca.pem"))
                .arg("--client-cert-auth")
                .arg("--peer-cert-file")
                .arg(tls.file("etcd-peer.pem"))
                .arg("--peer-key-file")
                .arg(tls.file("etcd-peer.key"))
                .arg("--peer-trusted-ca-file")
                .arg(tls.file("etcd-ca.pem"))
                .arg("--peer-client-cert-auth")
                .args(["--listen-metrics-urls", &url(ip, member.metrics_port)]);
        }
        let starts = member.previous.len() + 1;
        let name = match starts {
            1 => format!("etcd-{}", member.name),
            n => format!("etcd-{}-{n}", member.name),
        };
        member.process = Some(ChildGuard::spawn(&name, &mut command, self.dir.path())?);
        Ok(())
    }
}

/// A member's peer URL: `https://` when the members speak TLS among themselves.
fn peer_url(ip: IpAddr, port: u16, tls: bool) -> String {
    let url = url(ip, port);
    if tls {
        url.replacen("http://", "https://", 1)
    } else {
        url
    }
}

/// `http://IP:PORT`.
fn url(ip: IpAddr, port: u16) -> String {
    format!("http://{}", SocketAddr::new(ip, port))
}

/// Whether the member at `addr` answers `/health` with `true`.
fn healthy(addr: SocketAddr) -> bool {
    crate::http_get(addr, "/health")
        .is_ok_and(|(status, body)| status == 200 && body.contains("\"true\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_survives_one_member_and_comes_back_from_two() {
        if !etcd_or_skip("a_cluster_survives_one_member_and_comes_back_from_two") {
            return;
        }
        let mut cluster = EtcdCluster::start([127, 0, 0, 1].into(), 3).unwrap();
        assert_eq!(cluster.endpoints().len(), 3);
        assert!((0..3).all(|i| cluster.pid(i).is_some()));
        let metrics = cluster.metrics(0).unwrap();
        assert!(metrics.contains("etcd_server_has_leader 1"), "{metrics}");
        let leader = cluster.leader().unwrap();
        cluster.kill(leader);
        assert!(!cluster.is_running(leader));
        assert_eq!(cluster.pid(leader), None);
        // The two left elect a leader among themselves.
        cluster.wait_healthy().unwrap();
        let next = cluster.leader().unwrap();
        assert_ne!(next, leader);
        // One left: no quorum, no leader, not healthy.
        cluster.kill(next);
        let last = (0..3).find(|i| *i != leader && *i != next).unwrap();
        try_wait_until(
            Duration::from_secs(10),
            "the last member to lose its quorum",
            || (!cluster.is_healthy(last)).then_some(()),
        )
        .unwrap();
        // Both back on their data: healthy again.
        cluster.restart(leader).unwrap();
        cluster.restart(next).unwrap();
        cluster.wait_healthy().unwrap();
        assert!((0..3).all(|i| cluster.is_healthy(i)));
        assert!(cluster.logs().contains("etcd-m"), "{}", cluster.logs());
    }
}
