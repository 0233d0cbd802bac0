//! A worker process's end: watching it through its pidfd, signalling it, and how it ended.
//!
//! A pidfd turns readable when its process exits: no polling, no SIGCHLD races, and it works as well
//! for a worker adopted from an earlier supervisor (whose exit status goes to its parent, not to us).
//!
//! Invariant: a process is only ever signalled through a pidfd opened while it was known to be ours,
//! so a reused pid is never signalled.

use std::{
    io,
    os::fd::{AsFd, OwnedFd},
};

use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};
use tokio::io::unix::AsyncFd;

/// How a worker process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// It exited with a status code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
    /// It exited, but it was adopted from an earlier supervisor that died, so its status went to
    /// its parent.
    Unknown,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(code) => write!(f, "exit code {code}"),
            Exit::Signal(signal) => write!(f, "signal {signal}"),
            Exit::Unknown => f.write_str("exited (adopted: status unknown)"),
        }
    }
}

/// How a worker's process ended, as far as the supervisor could tell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// It exited, and this is how.
    Exit(Exit),
    /// It exited this way, and left `left` processes of its tree running, which the supervisor
    /// stopped.
    LeftRunning {
        /// How the process the supervisor started ended.
        exit: Exit,
        /// How many processes it left.
        left: usize,
    },
    /// Its pidfd failed: the supervisor lost track of it.
    Lost(String),
}

/// Why a worker that exits on its own and leaves its children running fails.
pub(super) const DAEMONIZES: &str =
    "the command exited and left children running: it daemonizes; run it in the foreground";

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ending::Exit(exit) => exit.fmt(f),
            Ending::LeftRunning { exit, left } => {
                let processes = if *left == 1 { "process" } else { "processes" };
                match exit {
                    // It exited by itself: the parent of a server that forked and let it go.
                    Exit::Code(_) => write!(
                        f,
                        "{exit}, {left} {processes} left running and stopped: {DAEMONIZES}"
                    ),
                    // Killed, or adopted: its children were orphaned, not let go.
                    Exit::Signal(_) | Exit::Unknown => {
                        write!(
                            f,
                            "{exit}, {left} {processes} of its tree left running and stopped"
                        )
                    }
                }
            }
            Ending::Lost(error) => write!(f, "lost track of it: {error}"),
        }
    }
}

pub(super) fn pid_of(pid: u32) -> Pid {
    Pid::from_raw(pid as i32).expect("a spawned child has a positive pid")
}

pub(super) fn signal(pidfd: &impl AsFd, signal: Signal) {
    if let Err(error) = rustix::process::pidfd_send_signal(pidfd.as_fd(), signal) {
        tracing::debug!(%error, ?signal, "Cannot signal worker (it may have exited)");
    }
}

/// Resolves when the process behind `pidfd` has exited, and reaps it if it is this process's child:
/// one it started, or one adopted by this image after an upgrade in place (the image before it
/// started it). A process adopted after a crash is not ours to reap: [`Exit::Unknown`].
pub(super) async fn exited(pidfd: &AsyncFd<OwnedFd>) -> io::Result<Exit> {
    loop {
        let mut guard = pidfd.readable().await?;
        let status = match rustix::process::waitid(
            WaitId::PidFd(pidfd.get_ref().as_fd()),
            WaitIdOptions::EXITED | WaitIdOptions::NOHANG,
        ) {
            Err(rustix::io::Errno::CHILD) => return Ok(Exit::Unknown),
            other => other?,
        };
        match status {
            Some(status) if status.exited() || status.killed() || status.dumped() => {
                return Ok(match (status.exit_status(), status.terminating_signal()) {
                    (Some(code), _) => Exit::Code(code),
                    (None, Some(signal)) => Exit::Signal(signal),
                    (None, None) => Exit::Code(-1),
                });
            }
            _ => guard.clear_ready(),
        }
    }
}
