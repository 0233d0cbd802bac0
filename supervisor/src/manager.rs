//! The process manager: runs `count` workers per service and restarts those that exit.
//!
//! Each worker slot (service, index) has one task. It spawns the worker with its settings in the
//! environment, watches the process through a pidfd (readable when the process exits: no polling, no
//! SIGCHLD races), reaps it with `waitid(P_PIDFD)`, removes it from the registry, and restarts it after
//! an exponential backoff that resets once a worker has stayed up for `healthy_after`. A worker that
//! crashes at start-up is therefore restarted at most once per backoff delay, never in a tight loop.
//!
//! [`Children`] is the map of live worker pids to their slots; the registration server asks it whether
//! a connecting process is one of ours.
//!
//! Right before it starts a worker, a slot task zeroes the slot's request counter, so a counter always
//! holds exactly the requests of the worker now in its slot; it records its restart count in the
//! registry's slot statuses.
//!
//! Invariant: the manager never writes endpoints; it only removes a worker from the registry when the
//! worker's process has exited.

use std::{
    collections::HashMap,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Mutex, atomic::Ordering},
    time::{Duration, Instant},
};

use peregrine_worker::settings::{CounterSlot, Settings};
use rustix::{
    io::FdFlags,
    process::{Pid, PidfdFlags, Signal, WaitId, WaitIdOptions},
};
use tokio::{io::unix::AsyncFd, sync::watch};
use tracing::Instrument;

use crate::{
    config::{Config, INDEX_PLACEHOLDER, Program, RestartPolicy, ServiceConfig},
    registry::Registry,
    sampler::Counters,
};

/// A worker slot: a service and an index in `0..count`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    /// The service.
    pub service: String,
    /// The index.
    pub index: u32,
}

/// Live worker processes by pid.
#[derive(Debug, Default)]
pub struct Children {
    by_pid: Mutex<HashMap<u32, Slot>>,
}

impl Children {
    /// The slot of the live worker with process id `pid`, if it is one of ours.
    pub fn slot_of(&self, pid: u32) -> Option<Slot> {
        self.lock().get(&pid).cloned()
    }

    #[cfg(test)]
    pub(crate) fn insert_for_test(&self, pid: u32, service: &str, index: u32) {
        let slot = Slot {
            service: service.into(),
            index,
        };
        self.lock().insert(pid, slot);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Slot>> {
        self.by_pid.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How a worker process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// It exited with a status code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(code) => write!(f, "exit code {code}"),
            Exit::Signal(signal) => write!(f, "signal {signal}"),
        }
    }
}

/// The exponential backoff of one slot.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    policy: RestartPolicy,
    next: Duration,
}

impl Backoff {
    /// The policy it follows.
    pub fn policy(&self) -> RestartPolicy {
        self.policy
    }

    /// A fresh backoff at the policy's initial delay.
    pub fn new(policy: RestartPolicy) -> Self {
        Backoff {
            policy,
            next: policy.initial,
        }
    }

    /// The delay before restarting a worker that ran for `uptime`: the initial delay after a healthy
    /// run, else twice the previous delay, capped.
    pub fn after_exit(&mut self, uptime: Duration) -> Duration {
        if uptime >= self.policy.healthy_after {
            self.next = self.policy.initial;
        }
        let delay = self.next;
        self.next = (self.next * 2).min(self.policy.max);
        delay
    }
}

/// What a slot task needs to start its worker.
#[derive(Clone, Debug)]
struct Launch {
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// The request counter region, inherited by the worker.
    counters: Arc<Counters>,
    /// The worker's counter in it.
    counter: usize,
}

impl Launch {
    fn new(
        service: &ServiceConfig,
        index: u32,
        control: &Path,
        counters: Arc<Counters>,
        counter: usize,
    ) -> io::Result<Self> {
        let program = match &service.command.program {
            Program::Peregrine => std::env::current_exe()?,
            Program::Path(path) => path.clone(),
        };
        // `{index}` in an argument is the worker's index (e.g. `taskset -c {index}` pins each worker to
        // its own CPU).
        let args = service
            .command
            .args
            .iter()
            .map(|arg| arg.replace(INDEX_PLACEHOLDER, &index.to_string()))
            .collect();
        let settings = Settings {
            service: service.name.clone(),
            index,
            url: service.url_for(index),
            control: control.to_owned(),
            counters: Some(CounterSlot {
                fd: counters.fd().as_raw_fd(),
                slot: u32::try_from(counter).map_err(io::Error::other)?,
            }),
            orphan_timeout: peregrine_worker::settings::DEFAULT_ORPHAN_TIMEOUT,
        };
        let mut env: Vec<(String, String)> = service
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        env.extend(
            settings
                .to_env()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v)),
        );
        Ok(Launch {
            program,
            args,
            env,
            counters,
            counter,
        })
    }

    /// Starts a worker, its request counter zeroed first.
    fn spawn(&self) -> io::Result<u32> {
        // No worker runs in this slot now, so nothing counts in it until the new one starts.
        self.counters
            .region()
            .slot(self.counter)
            .store(0, Ordering::Relaxed);
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            // A terminal's Ctrl-C reaches the supervisor only; it stops the workers in order.
            .process_group(0);
        let counters = self.counters.fd().as_raw_fd();
        // SAFETY: the closure runs in the child between fork and exec and calls only prctl(2) and
        // fcntl(2), which are async-signal-safe; it touches no memory shared with the parent. The
        // counter descriptor is owned by `self.counters`, open while `self` lives, so it is valid in the
        // child.
        unsafe {
            command.pre_exec(move || {
                // Until workers can outlive their supervisor, a worker must not outlive it.
                rustix::process::set_parent_process_death_signal(Some(Signal::TERM))?;
                // The counter region is the one descriptor the worker inherits.
                rustix::io::fcntl_setfd(BorrowedFd::borrow_raw(counters), FdFlags::empty())?;
                Ok(())
            });
        }
        let child = command.spawn()?;
        // The pid is reaped through its pidfd below, not through `Child`.
        Ok(child.id())
    }
}

/// How many worker slots `config` has: the size of the request counter region.
pub fn slot_count(config: &Config) -> usize {
    config.services.values().map(|s| s.count as usize).sum()
}

/// Every worker slot of `config` with its global number `k` (services in name order, then index): the
/// slot's counter in the request counter region.
pub fn slot_numbers(config: &Config) -> Vec<(Slot, usize)> {
    config
        .services
        .values()
        .flat_map(|service| {
            (0..service.count).map(|index| Slot {
                service: service.name.clone(),
                index,
            })
        })
        .enumerate()
        .map(|(k, slot)| (slot, k))
        .collect()
}

/// Starts one task per worker slot; they run until `shutdown` turns true, then stop their workers
/// (SIGTERM, then SIGKILL after `stop_timeout`) and return.
///
/// Slot `k` of [`slot_numbers`] counts its requests in counter `k` of `counters`, which must hold
/// [`slot_count`] counters.
pub fn start(
    config: &Config,
    registry: Arc<Registry>,
    children: Arc<Children>,
    counters: Arc<Counters>,
    shutdown: watch::Receiver<bool>,
    stop_timeout: Duration,
) -> io::Result<tokio::task::JoinSet<()>> {
    let mut tasks = tokio::task::JoinSet::new();
    for (slot, counter) in slot_numbers(config) {
        let service = &config.services[&slot.service];
        let launch = Launch::new(
            service,
            slot.index,
            &config.supervisor.control,
            counters.clone(),
            counter,
        )?;
        let span = tracing::info_span!("slot", service = %slot.service, index = slot.index);
        tasks.spawn(
            run_slot(
                slot,
                launch,
                Backoff::new(config.supervisor.restart),
                registry.clone(),
                children.clone(),
                shutdown.clone(),
                stop_timeout,
            )
            .instrument(span),
        );
    }
    Ok(tasks)
}

async fn run_slot(
    slot: Slot,
    launch: Launch,
    mut backoff: Backoff,
    registry: Arc<Registry>,
    children: Arc<Children>,
    mut shutdown: watch::Receiver<bool>,
    stop_timeout: Duration,
) {
    let mut restarts = 0u64;
    registry.set_restarts(&slot.service, slot.index, restarts);
    while !*shutdown.borrow() {
        let started = Instant::now();
        // The lock is held across the spawn so that a registration from the new pid waits for the
        // map entry instead of racing it.
        let spawned = {
            let mut map = children.lock();
            launch.spawn().and_then(|pid| {
                let pidfd = rustix::process::pidfd_open(pid_of(pid), PidfdFlags::empty())?;
                map.insert(pid, slot.clone());
                Ok((pid, pidfd))
            })
        };
        let healthy_after = backoff.policy().healthy_after;
        let exit = match spawned {
            Ok((pid, pidfd)) => {
                tracing::info!(pid, restarts, program = %launch.program.display(), "Worker started");
                let watch = watch_worker(pid, pidfd, &mut shutdown, stop_timeout);
                tokio::pin!(watch);
                // A worker that stays up `healthy_after` ends a crash loop.
                let exit = tokio::select! {
                    exit = &mut watch => exit,
                    () = tokio::time::sleep(healthy_after) => {
                        registry.update_slot(&slot.service, slot.index, |s| s.crash_looping = false);
                        watch.await
                    }
                };
                children.lock().remove(&pid);
                let removed = registry.deregister(&slot.service, slot.index, pid);
                match exit {
                    Ok(exit) => {
                        tracing::info!(pid, %exit, uptime = ?started.elapsed(), deregistered = removed, "Worker exited")
                    }
                    Err(ref error) => tracing::error!(pid, %error, "Lost track of worker"),
                }
                match exit {
                    Ok(exit) => exit.to_string(),
                    Err(error) => format!("lost track of it: {error}"),
                }
            }
            Err(error) => {
                tracing::error!(%error, program = %launch.program.display(), "Cannot start worker");
                format!("cannot start: {error}")
            }
        };
        if *shutdown.borrow() {
            break;
        }
        let uptime = started.elapsed();
        let delay = backoff.after_exit(uptime);
        restarts += 1;
        let crash_looping = uptime < healthy_after;
        registry.update_slot(&slot.service, slot.index, |s| {
            s.restarts = restarts;
            s.last_exit = Some(exit.clone());
            s.restart_delay = Some(delay);
            s.crash_looping = crash_looping;
        });
        tracing::warn!(
            exit,
            ?delay,
            restarts,
            crash_looping,
            "Restarting worker after backoff"
        );
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.changed() => {}
        }
    }
}

fn pid_of(pid: u32) -> Pid {
    Pid::from_raw(pid as i32).expect("a spawned child has a positive pid")
}

/// Waits for the worker to exit; on shutdown, stops it first. Returns how it ended.
async fn watch_worker(
    pid: u32,
    pidfd: OwnedFd,
    shutdown: &mut watch::Receiver<bool>,
    stop_timeout: Duration,
) -> io::Result<Exit> {
    // SAFETY: `pidfd` is an `OwnedFd` moved into the `AsyncFd`, which owns it until it is dropped; it is
    // never closed or replaced while registered.
    let pidfd = unsafe { AsyncFd::register(pidfd) }.map_err(io::Error::from)?;
    let stopping = async {
        while !*shutdown.borrow() {
            if shutdown.changed().await.is_err() {
                break;
            }
        }
    };
    tokio::select! {
        exit = exited(&pidfd) => return exit,
        () = stopping => {}
    }
    tracing::debug!(pid, "Stopping worker");
    signal(&pidfd, Signal::TERM);
    match tokio::time::timeout(stop_timeout, exited(&pidfd)).await {
        Ok(exit) => exit,
        Err(_) => {
            tracing::warn!(
                pid,
                ?stop_timeout,
                "Worker did not stop in time; killing it"
            );
            signal(&pidfd, Signal::KILL);
            exited(&pidfd).await
        }
    }
}

fn signal(pidfd: &AsyncFd<OwnedFd>, signal: Signal) {
    if let Err(error) = rustix::process::pidfd_send_signal(pidfd.get_ref(), signal) {
        tracing::debug!(%error, ?signal, "Cannot signal worker (it may have exited)");
    }
}

/// Resolves when the process behind `pidfd` has exited, and reaps it.
async fn exited(pidfd: &AsyncFd<OwnedFd>) -> io::Result<Exit> {
    loop {
        let mut guard = pidfd.readable().await?;
        let status = rustix::process::waitid(
            WaitId::PidFd(pidfd.get_ref().as_fd()),
            WaitIdOptions::EXITED | WaitIdOptions::NOHANG,
        )?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_caps_and_resets_after_a_healthy_run() {
        let policy = RestartPolicy {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(500),
            healthy_after: Duration::from_secs(10),
        };
        let mut backoff = Backoff::new(policy);
        let quick = Duration::from_millis(5);
        let delays: Vec<u128> = (0..5)
            .map(|_| backoff.after_exit(quick).as_millis())
            .collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
        assert_eq!(backoff.after_exit(Duration::from_secs(11)).as_millis(), 100);
        assert_eq!(backoff.after_exit(quick).as_millis(), 200);
    }

    #[allow(
        clippy::zombie_processes,
        reason = "reaped through its pidfd by watch_worker"
    )]
    #[tokio::test]
    async fn notices_an_exit_through_the_pidfd_and_reaps_it() {
        let child = Command::new("sh").args(["-c", "exit 7"]).spawn().unwrap();
        let pidfd = rustix::process::pidfd_open(pid_of(child.id()), PidfdFlags::empty()).unwrap();
        let (_tx, mut rx) = watch::channel(false);
        let exit = tokio::time::timeout(
            Duration::from_secs(10),
            watch_worker(child.id(), pidfd, &mut rx, Duration::from_secs(1)),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(exit, Exit::Code(7));
    }

    #[allow(
        clippy::zombie_processes,
        reason = "reaped through its pidfd by watch_worker"
    )]
    #[tokio::test]
    async fn stops_a_worker_with_sigterm_then_sigkill() {
        // This child ignores SIGTERM, so the stop escalates to SIGKILL after the timeout. It says when
        // the trap is set, so the SIGTERM cannot arrive before it.
        let mut child = Command::new("sh")
            .args([
                "-c",
                "trap '' TERM; echo trapped; while :; do sleep 1; done",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line, "trapped\n");
        let pidfd = rustix::process::pidfd_open(pid_of(child.id()), PidfdFlags::empty()).unwrap();
        let (tx, mut rx) = watch::channel(false);
        tx.send(true).unwrap();
        let exit = tokio::time::timeout(
            Duration::from_secs(10),
            watch_worker(child.id(), pidfd, &mut rx, Duration::from_millis(200)),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(exit, Exit::Signal(9));
    }
}
