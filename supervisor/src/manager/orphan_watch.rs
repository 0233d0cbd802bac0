//! `orphan_timeout_ms` for servers on passed listeners, which never dial the supervisor and so
//! cannot tell that it is gone.
//!
//! A built-in worker stops by itself once no supervisor has taken its registration for
//! `orphan_timeout_ms`. A server on a passed listener (`pass_socket`) has no such connection. So a
//! supervisor that runs such servers starts a watcher, `peregrine orphan-watch` ([`Watcher`]): a
//! small process of its own that waits for the supervisor to die. When it does, the watcher waits
//! `orphan_timeout_ms`. If a supervisor then answers on the control socket again, it has adopted
//! the servers (or will), and the watcher exits. If none does, the watcher stops every process of
//! the socket's lineage that carries a slot (the servers, what they forked, and any built-in
//! worker still there) as a worker is stopped: SIGTERM, SIGKILL after `stop_timeout_ms`
//! ([`leftovers::stop`]). A supervisor that stops normally stops its watcher first.
//!
//! The watcher runs as the supervisor does (it must signal workers of every service's user), in
//! the supervisor's process group, with this lineage but no slot in its environment: it is never
//! taken for a worker or adopted. Its environment alone does not spare it from being stopped as a
//! worker's leftover (a worker's child can keep the lineage and drop the rest): the supervisor
//! knows its pid ([`Children::set_helper`]) while it runs. A watcher of an earlier supervisor is
//! never the supervisor's child (its parent died, and it went to init, or to a subreaper above the
//! dead supervisor, which no later supervisor is), so nothing takes it for a leftover either: those
//! are found among the supervisor's children, or, anywhere on the host, only by a slot in their
//! environment. It exits by itself once the new supervisor answers on the control socket.
//!
//! Invariant: the watcher signals nothing before the supervisor that started it has exited and
//! `orphan_timeout_ms` has passed without an answer on the control socket.

use std::{
    io,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Arc,
    time::Duration,
};

use peregrine_contract::settings::ENV_LINEAGE;
use rustix::{
    event::{PollFd, PollFlags, Timespec},
    process::{Pid, PidfdFlags, Signal},
};

use super::leftovers;
use crate::{children::Children, config::SupervisorConfig, instance::Lineage};

/// The hidden subcommand that runs the watcher: `peregrine orphan-watch SUPERVISOR_PID CONTROL
/// ORPHAN_TIMEOUT_MS STOP_TIMEOUT_MS`, with the lineage in `PEREGRINE_LINEAGE`.
pub const ORPHAN_WATCH: &str = "orphan-watch";

/// How long a watcher sent SIGKILL is waited for to exit.
const EXIT_WAIT: Timespec = Timespec {
    tv_sec: 1,
    tv_nsec: 0,
};

/// What a watcher is told when it starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchOrders {
    /// The supervisor to watch: the watcher's parent.
    pub supervisor: u32,
    /// Its control socket: a supervisor that answers there has taken over.
    pub control: PathBuf,
    /// How long the servers may serve on without a supervisor.
    pub orphan_timeout: Duration,
    /// How long they have to stop after SIGTERM.
    pub stop_timeout: Duration,
}

/// A running watcher, killed when dropped.
#[derive(Debug)]
pub(super) struct Watcher {
    pidfd: OwnedFd,
    orders: WatchOrders,
    children: Arc<Children>,
}

impl Watcher {
    /// Starts a watcher for this supervisor, with `supervisor`'s control socket and timeouts.
    pub(super) fn spawn(
        supervisor: &SupervisorConfig,
        lineage: &Lineage,
        children: &Arc<Children>,
    ) -> io::Result<Watcher> {
        let orders = WatchOrders {
            supervisor: std::process::id(),
            control: supervisor.control.clone(),
            orphan_timeout: supervisor.lifecycle.orphan_timeout,
            stop_timeout: supervisor.lifecycle.stop_timeout,
        };
        let mut command = Command::new(std::env::current_exe()?);
        command
            .arg(ORPHAN_WATCH)
            .args(orders.to_args())
            .env(ENV_LINEAGE, lineage.as_str())
            .stdin(Stdio::null());
        // Only the supervisor speaks for its unit to the service manager.
        for name in crate::service_manager::INHERITED {
            command.env_remove(name);
        }
        // Marked before a worker's exit can look for leftovers (the reaper takes no child of
        // `spawn_waited` meanwhile, so the pid names the watcher until it is marked).
        let (pid, ()) = children.spawn_waited(|| Ok((command.spawn()?.id(), ())))?;
        children.set_helper(Some(pid));
        children.done_waiting(pid);
        let raw = Pid::from_raw(pid as i32).ok_or_else(|| io::Error::other("pid 0"))?;
        // Our child: its pid cannot name another process before it is reaped.
        let pidfd = rustix::process::pidfd_open(raw, PidfdFlags::empty())?;
        tracing::debug!(pid, timeout = ?orders.orphan_timeout, "Orphan watcher started");
        Ok(Watcher {
            pidfd,
            orders,
            children: children.clone(),
        })
    }

    /// Whether this watcher was started with what `supervisor` says now.
    pub(super) fn watches_for(&self, supervisor: &SupervisorConfig) -> bool {
        self.orders.orphan_timeout == supervisor.lifecycle.orphan_timeout
            && self.orders.stop_timeout == supervisor.lifecycle.stop_timeout
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // The supervisor reaps it (it is no worker: `leftovers::reap_orphans`). It stays marked
        // until it has exited (a zombie is never a leftover), so it is not taken for one meanwhile,
        // and never longer: its pid may name another process once it is reaped.
        let _ = rustix::process::pidfd_send_signal(&self.pidfd, Signal::KILL);
        let mut fds = [PollFd::new(&self.pidfd, PollFlags::IN)];
        let _ = rustix::event::poll(&mut fds, Some(&EXIT_WAIT));
        self.children.set_helper(None);
    }
}

// === impl WatchOrders ===

impl WatchOrders {
    /// The subcommand's arguments, after its name.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            self.supervisor.to_string(),
            self.control.display().to_string(),
            self.orphan_timeout.as_millis().to_string(),
            self.stop_timeout.as_millis().to_string(),
        ]
    }
}

/// The watcher's body (`peregrine orphan-watch`): waits for the supervisor to exit, then for
/// `orphan_timeout`; stops the lineage's servers unless a supervisor answers on the control socket.
pub fn watch_orphans(orders: &WatchOrders) -> io::Result<()> {
    let lineage = std::env::var(ENV_LINEAGE)
        .ok()
        .and_then(|text| Lineage::parse(&text))
        .ok_or_else(|| io::Error::other(format!("no lineage in {ENV_LINEAGE}")))?;
    wait_for_exit(orders.supervisor)?;
    std::thread::sleep(orders.orphan_timeout);
    if answers(&orders.control) {
        tracing::info!(control = %orders.control.display(), "A supervisor answers on the control socket again: its servers are its own");
        return Ok(());
    }
    let children = std::sync::Arc::new(Children::default());
    let sweep = move || leftovers::sweep(&lineage, &children);
    let left = sweep();
    if left.is_empty() {
        return Ok(());
    }
    let pids: Vec<u32> = left.iter().map(|l| l.pid()).collect();
    tracing::warn!(?pids, timeout = ?orders.orphan_timeout, control = %orders.control.display(), "No supervisor has come back within orphan_timeout_ms: stopping its workers");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let stopped = runtime.block_on(leftovers::stop(left, orders.stop_timeout, sweep));
    tracing::info!(
        stopped,
        "Stopped the workers of a supervisor that did not come back"
    );
    Ok(())
}

/// Returns once process `pid`, this process's parent, has exited (at once if it has already: the
/// parent is then another process).
fn wait_for_exit(pid: u32) -> io::Result<()> {
    let Some(raw) = Pid::from_raw(pid as i32) else {
        return Ok(());
    };
    let Ok(pidfd) = rustix::process::pidfd_open(raw, PidfdFlags::empty()) else {
        return Ok(());
    };
    // Opened while it was still our parent: the pidfd is of the supervisor, not of a reused pid.
    if rustix::process::getppid() != Some(raw) {
        return Ok(());
    }
    loop {
        let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
        match rustix::event::poll(&mut fds, None) {
            Ok(_) if fds[0].revents().contains(PollFlags::IN) => return Ok(()),
            Ok(_) | Err(rustix::io::Errno::INTR) => continue,
            Err(error) => return Err(error.into()),
        }
    }
}

/// Whether something accepts connections on the Unix socket `control`: a supervisor runs there.
fn answers(control: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(control).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_listening_socket_answers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        assert!(!answers(&path), "no file");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert!(answers(&path));
        drop(listener);
        assert!(!answers(&path), "a file nothing listens on");
    }
}
