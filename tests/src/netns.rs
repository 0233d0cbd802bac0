//! Hosts as network namespaces on one machine, for the multi-host fleet tests.
//!
//! A [`Network`] is a bridge in the root namespace (`10.77.<n>.1/24`) and one `ip netns` per host,
//! each joined to the bridge by a veth pair (`eth0` inside, `10.77.<n>.<11 + i>/24`), with its
//! loopback up. Processes reach another host, and the bridge's own address in the root namespace (the
//! etcd members listen there), but not the root namespace's loopback.
//!
//! `<n>` is claimed with a lock file (`/run/peregrine-e2e/net-<n>.lock`, `flock`ed for the network's
//! life and freed by the kernel the moment its holder dies), so parallel tests, and parallel test
//! binaries, never share a name or a subnet. Whoever holds `<n>`'s lock owns everything named after
//! `<n>`: a new network first removes what a killed earlier run left under its own `<n>`, and under
//! every `<n>` whose lock nobody holds. `Drop` removes the network (processes still inside are killed,
//! then the veths, the namespaces and the bridge), also when a test panics.
//!
//! A process runs on a host through [`NetHost::wrapper`] (`ip netns exec NAME`, which execs: the
//! process keeps its pid and process group), and the test's own code through [`NetHost::run`] or
//! [`NetHost::enter`] (the calling thread moves into the namespace). [`NetHost::cut`] takes the
//! host's link down and [`NetHost::restore`] brings it back: while cut, the host reaches only itself.
//!
//! Needs root and `ip` (iproute2); a test calls [`netns_or_skip`] first.

use std::{
    fs::File,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use anyhow::{Context, bail};
use rustix::{
    process::{Pid, Signal, kill_process},
    thread::{LinkNameSpaceType, move_into_link_name_space},
};

use crate::try_wait_until;

/// Where the lock files that claim a network index live.
const LOCK_DIR: &str = "/run/peregrine-e2e";
/// The prefix of every bridge, veth and namespace name a [`Network`] creates.
const PREFIX: &str = "pge2e";
/// The network indexes: `10.77.<n>.0/24` for `n` in this range.
const INDEXES: std::ops::RangeInclusive<u32> = 1..=254;
/// The interface name of a host's end of its veth pair, inside its namespace.
const HOST_IFACE: &str = "eth0";
/// At most this many hosts per network (their addresses are `.11` to `.11 + MAX_HOSTS - 1`).
const MAX_HOSTS: usize = 100;

/// Whether this test can make network namespaces (root, and `ip` runs). If not, the test says why it
/// skips, or fails when `PEREGRINE_REQUIRE_ETCD=1` (set by `cargo xtask test`, whose fleet tests must
/// not skip).
pub fn netns_or_skip(test: &str) -> bool {
    let why = if !rustix::process::geteuid().is_root() {
        "network namespaces need root".to_owned()
    } else {
        match Command::new("ip").arg("-V").output() {
            Ok(output) if output.status.success() => return true,
            Ok(output) => format!("`ip -V` failed: {}", output.status),
            Err(error) => format!("no `ip` (apt install iproute2): {error}"),
        }
    };
    assert!(
        std::env::var("PEREGRINE_REQUIRE_ETCD").map_or(true, |v| v != "1"),
        "{test}: PEREGRINE_REQUIRE_ETCD=1 but {why}"
    );
    crate::skip(test, why);
    false
}

/// A bridge and one network namespace per host; removed on drop.
#[derive(Debug)]
pub struct Network {
    index: u32,
    bridge: String,
    hosts: Vec<NetHost>,
    /// Held for the network's life: the claim on `index`.
    _lock: File,
}

/// One host of a [`Network`]: a network namespace with one address on the bridge's subnet.
#[derive(Clone, Debug)]
pub struct NetHost {
    name: String,
    netns: String,
    veth: String,
    address: Ipv4Addr,
}

// === impl Network ===

impl Network {
    /// A bridge and one namespace per name in `hosts` (each with loopback and its link up), on a
    /// subnet no other live network uses.
    pub fn create(hosts: &[&str]) -> anyhow::Result<Network> {
        anyhow::ensure!(hosts.len() <= MAX_HOSTS, "at most {MAX_HOSTS} hosts");
        std::fs::create_dir_all(LOCK_DIR).with_context(|| format!("creating {LOCK_DIR}"))?;
        remove_abandoned();
        let (index, lock) = claim_index()?;
        // Whatever still carries our index was left by a killed run: ours to remove.
        remove_index(index);
        let bridge = format!("{PREFIX}{index}");
        let mut network = Network {
            index,
            bridge: bridge.clone(),
            hosts: Vec::new(),
            _lock: lock,
        };
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", network.bridge_address()),
            "dev",
            &bridge,
        ])?;
        ip(&["link", "set", &bridge, "up"])?;
        for (i, name) in hosts.iter().enumerate() {
            let host = NetHost {
                name: (*name).to_owned(),
                netns: format!("{PREFIX}{index}-{name}"),
                veth: format!("{PREFIX}{index}h{i}"),
                address: Ipv4Addr::new(10, 77, index as u8, 11 + i as u8),
            };
            // Pushed first, so that a failure below still removes what was made.
            network.hosts.push(host.clone());
            host.create(&bridge)?;
        }
        Ok(network)
    }

    /// The bridge's address in the root namespace (`10.77.<n>.1`): reachable from every host that
    /// is not cut off.
    pub fn bridge_address(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.index as u8, 1)
    }

    /// The hosts, in the order they were named.
    pub fn hosts(&self) -> &[NetHost] {
        &self.hosts
    }

    /// The host called `name`.
    ///
    /// # Panics
    ///
    /// When there is none.
    #[track_caller]
    pub fn host(&self, name: &str) -> &NetHost {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name:?} in {:?}", self.hosts))
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for host in &self.hosts {
            host.remove();
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

// === impl NetHost ===

impl NetHost {
    /// The host's name, as the test gave it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's name (for `ip netns exec`).
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// The host's address on the bridge's subnet.
    pub fn address(&self) -> Ipv4Addr {
        self.address
    }

    /// The program and arguments that run a command on this host: `ip netns exec NAME` (it execs the
    /// command, so the command keeps its pid). For [`Supervisor::start_wrapped_in`] and
    /// [`Envoy::start_wrapped`].
    ///
    /// [`Supervisor::start_wrapped_in`]: crate::Supervisor::start_wrapped_in
    /// [`Envoy::start_wrapped`]: crate::Envoy::start_wrapped
    pub fn wrapper(&self) -> [&str; 4] {
        ["ip", "netns", "exec", &self.netns]
    }

    /// `program` to be run on this host.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.netns]).arg(program);
        command
    }

    /// Moves the calling thread into the host's namespace: every socket it opens from now on is the
    /// host's. For a thread of its own (see [`NetHost::run`]); the test's main thread stays put.
    pub fn enter(&self) -> anyhow::Result<()> {
        enter_netns(&self.netns_path())
    }

    /// A closure that moves the thread calling it into the host's namespace (for a thread started
    /// elsewhere, such as a [`Load`](crate::Load)'s).
    pub fn entry(&self) -> impl FnOnce() -> anyhow::Result<()> + Send + 'static {
        let path = self.netns_path();
        move || enter_netns(&path)
    }

    /// Runs `f` on a thread inside the host's namespace and returns what it returns (a panic in `f`
    /// goes on in the caller). For talking to a process that listens on the host's loopback.
    ///
    /// # Panics
    ///
    /// When the thread cannot enter the namespace.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|scope| {
            let thread = scope.spawn(|| {
                self.enter()
                    .unwrap_or_else(|error| panic!("entering {}: {error:#}", self.netns));
                f()
            });
            thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// Cuts the host off: its link goes down, so it reaches neither the other hosts nor the bridge
    /// (connections out fail at once: no route), and nothing reaches it (packets to it are lost).
    /// Its own address and loopback still work inside it.
    pub fn cut(&self) -> anyhow::Result<()> {
        ip(&["-n", &self.netns, "link", "set", HOST_IFACE, "down"])
    }

    /// Brings a [`cut`](NetHost::cut) host back, and waits until both ends of its link are up.
    pub fn restore(&self) -> anyhow::Result<()> {
        ip(&["-n", &self.netns, "link", "set", HOST_IFACE, "up"])?;
        try_wait_until(
            Duration::from_secs(10),
            &format!("{}'s link to come up", self.name),
            || {
                let inside = ip_output(&["-n", &self.netns, "-o", "link", "show", HOST_IFACE]);
                let outside = ip_output(&["-o", "link", "show", &self.veth]);
                let up = |out: anyhow::Result<String>| {
                    out.is_ok_and(|text| text.contains("state UP") && text.contains("LOWER_UP"))
                };
                (up(inside) && up(outside)).then_some(())
            },
        )
    }

    /// The pids of the processes inside the namespace.
    pub fn pids(&self) -> Vec<u32> {
        netns_pids(&self.netns)
    }

    fn netns_path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.netns)
    }

    /// The namespace, its veth pair into `bridge`, its address, loopback and link up.
    fn create(&self, bridge: &str) -> anyhow::Result<()> {
        let ns = self.netns.as_str();
        ip(&["netns", "add", ns])?;
        ip(&[
            "link", "add", &self.veth, "type", "veth", "peer", "name", HOST_IFACE, "netns", ns,
        ])?;
        ip(&["link", "set", &self.veth, "master", bridge, "up"])?;
        ip(&[
            "-n",
            ns,
            "addr",
            "add",
            &format!("{}/24", self.address),
            "dev",
            HOST_IFACE,
        ])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        ip(&["-n", ns, "link", "set", HOST_IFACE, "up"])
    }

    /// Kills what still runs inside, then removes the veth pair and the namespace.
    fn remove(&self) {
        remove_netns(&self.netns, Some(&self.veth));
    }
}

/// The index of a fresh network and the lock that claims it: the first free one from a place that
/// differs between processes and between calls.
fn claim_index() -> anyhow::Result<(u32, File)> {
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let span = INDEXES.end() - INDEXES.start() + 1;
    let start = std::process::id()
        .wrapping_mul(7919)
        .wrapping_add(CALLS.fetch_add(1, Ordering::Relaxed).wrapping_mul(31));
    for step in 0..span {
        let index = INDEXES.start() + (start.wrapping_add(step)) % span;
        if let Some(lock) = try_lock(index)? {
            return Ok((index, lock));
        }
    }
    bail!("every network index is taken (see {LOCK_DIR})")
}

/// The lock of `index`, if nobody holds it.
fn try_lock(index: u32) -> anyhow::Result<Option<File>> {
    let path = Path::new(LOCK_DIR).join(format!("net-{index}.lock"));
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(error)) => {
            Err(error).with_context(|| format!("locking {}", path.display()))
        }
    }
}

/// Removes what earlier runs left under an index whose lock nobody holds any more.
fn remove_abandoned() {
    let mut indexes: Vec<u32> = ip_output(&["-o", "link", "show"])
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.split(": ").nth(1))
        .filter_map(|name| index_of(name.split('@').next().unwrap_or(name)))
        .chain(list_netns().iter().filter_map(|ns| index_of(ns)))
        .collect();
    indexes.sort_unstable();
    indexes.dedup();
    for index in indexes {
        // Held only for the sweep: a network claiming the index meanwhile waits for nothing, it just
        // picks another.
        if let Ok(Some(_lock)) = try_lock(index) {
            remove_index(index);
        }
    }
}

/// Removes every namespace, veth and bridge named after `index` (whose lock the caller holds).
fn remove_index(index: u32) {
    let ours = |name: &str| index_of(name) == Some(index);
    for ns in list_netns().into_iter().filter(|ns| ours(ns)) {
        remove_netns(&ns, None);
    }
    for link in ip_output(&["-o", "link", "show"])
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_owned())
        .filter(|name| ours(name))
    {
        let _ = ip(&["link", "del", &link]);
    }
}

/// The index in a name this module made: `pge2e<n>`, `pge2e<n>h<i>` or `pge2e<n>-<host>`.
fn index_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX)?;
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let (number, tail) = rest.split_at(digits);
    if !(tail.is_empty() || tail.starts_with('h') || tail.starts_with('-')) {
        return None;
    }
    number.parse().ok().filter(|n| INDEXES.contains(n))
}

/// SIGKILLs what runs in namespace `ns`, deletes `veth` (its peer goes with it) and the namespace.
fn remove_netns(ns: &str, veth: Option<&str>) {
    for pid in netns_pids(ns) {
        if let Some(pid) = Pid::from_raw(pid as i32) {
            let _ = kill_process(pid, Signal::KILL);
        }
    }
    if let Some(veth) = veth {
        let _ = ip(&["link", "del", veth]);
    }
    let _ = ip(&["netns", "del", ns]);
}

/// The pids of the processes in namespace `ns` (`ip netns pids`).
fn netns_pids(ns: &str) -> Vec<u32> {
    ip_output(&["netns", "pids", ns])
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|pid| pid.parse().ok())
        .collect()
}

/// The names of the namespaces `ip netns` knows.
fn list_netns() -> Vec<String> {
    // No directory: no namespace yet.
    std::fs::read_dir("/run/netns")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|entry| entry.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Moves the calling thread into the network namespace at `path`.
fn enter_netns(path: &Path) -> anyhow::Result<()> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    move_into_link_name_space(
        std::os::fd::AsFd::as_fd(&file),
        Some(LinkNameSpaceType::Network),
    )
    .with_context(|| format!("entering {}", path.display()))
}

/// Runs `ip ARGS`; an error with its stderr if it fails.
fn ip(args: &[&str]) -> anyhow::Result<()> {
    ip_output(args).map(drop)
}

/// Runs `ip ARGS` and returns its stdout; an error with its stderr if it fails.
fn ip_output(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .context("running ip")?;
    if !output.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;

    use super::*;

    #[test]
    fn reads_indexes_from_its_own_names_only() {
        assert_eq!(index_of("pge2e17"), Some(17));
        assert_eq!(index_of("pge2e17h3"), Some(17));
        assert_eq!(index_of("pge2e17-host-a"), Some(17));
        assert_eq!(index_of("pge2e0"), None);
        assert_eq!(index_of("pge2e255"), None);
        assert_eq!(index_of("pge2e17x"), None);
        assert_eq!(index_of("pge2e"), None);
        assert_eq!(index_of("eth0"), None);
    }

    #[test]
    fn a_network_is_made_and_removed() {
        if !netns_or_skip("a_network_is_made_and_removed") {
            return;
        }
        let network = Network::create(&["a", "b"]).unwrap();
        let (a, b) = (network.host("a").clone(), network.host("b").clone());
        let bridge = network.bridge_address();
        // A listener on b is reachable from a and from the root namespace, through the bridge.
        let listener = b.run(|| std::net::TcpListener::bind((b.address(), 0)).unwrap());
        let port = listener.local_addr().unwrap().port();
        a.run(|| std::net::TcpStream::connect((b.address(), port)).unwrap());
        std::net::TcpStream::connect((b.address(), port)).unwrap();
        let root = std::net::TcpListener::bind((bridge, 0)).unwrap();
        let root_port = root.local_addr().unwrap().port();
        a.run(|| std::net::TcpStream::connect((bridge, root_port)).unwrap());
        // Cut off, a reaches only itself.
        a.cut().unwrap();
        let error = a
            .run(|| std::net::TcpStream::connect((b.address(), port)))
            .unwrap_err();
        assert_eq!(error.kind(), ErrorKind::NetworkUnreachable, "{error}");
        let own = a.run(|| std::net::TcpListener::bind((a.address(), 0)).unwrap());
        let own_port = own.local_addr().unwrap().port();
        a.run(|| std::net::TcpStream::connect((a.address(), own_port)).unwrap());
        a.restore().unwrap();
        try_wait_until(Duration::from_secs(10), "a to reach b again", || {
            a.run(|| std::net::TcpStream::connect((b.address(), port)).ok())
        })
        .unwrap();
        let names = (network.bridge.clone(), a.netns().to_owned(), a.veth.clone());
        drop((listener, own, root));
        drop(network);
        assert!(!list_netns().contains(&names.1), "{names:?}");
        let links = ip_output(&["-o", "link", "show"]).unwrap();
        assert!(
            !links.contains(&format!(": {}:", names.0)) && !links.contains(&names.2),
            "{links}"
        );
    }
}
