//! The process manager: runs `count` workers per service, restarts those that exit, and replaces,
//! adds and removes them without dropping a request.
//!
//! Each worker slot (service, index) has one task (`SlotTask`). It spawns the worker with its
//! settings in the environment, watches the process through a pidfd (readable when the process exits:
//! no polling, no SIGCHLD races, and it works for a worker adopted from an earlier supervisor), reaps
//! it with `waitid(P_PIDFD)`, removes it from the registry, and restarts it after an exponential
//! backoff that resets once a worker has stayed up for `healthy_after`. A worker that crashes at
//! start-up is therefore restarted at most once per backoff delay, never in a tight loop.
//!
//! Every stop is a drain (`SlotTask::retire`): the worker is marked draining in the registry (EDS
//! publishes `health_status: DRAINING`), the task waits until every Envoy endpoint stream has ACKed
//! that revision ([`Acks::wait_synced`], bounded by `drain_timeout`), then SIGTERM, and SIGKILL after
//! `stop_timeout`. A replacement starts first and registers (its predecessor turns draining in the
//! same snapshot) before the predecessor is retired, unless both would need the same fixed address.
//! The [`Manager`] sends slot tasks their commands: rolling restarts in batches, and reloads.
//!
//! [`Children`] is the map of live worker pids to their slot, lane and request counter; the
//! registration server asks it whether a connecting process is one of ours, the sampler where each
//! worker counts. [`Lanes`] hands out lanes (a counter line, zeroed before each spawn, and a slot of the
//! scheduler source), one per live worker, so a slot being replaced never shares one.
//!
//! Invariant: the manager writes to the registry only to mark a stopping worker draining and to
//! remove a worker whose process has exited; endpoints enter it by registration alone.

use std::{
    collections::{BTreeSet, HashMap},
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Command, Stdio},
    sync::{Arc, Mutex, atomic::Ordering},
    time::{Duration, Instant},
};

use peregrine_worker::{
    settings::{CounterSlot, ENV_LINEAGE, Settings},
    url::BindUrl,
};
use rustix::{
    io::FdFlags,
    process::{Pid, PidfdFlags, Signal, WaitId, WaitIdOptions},
};
use tokio::{
    io::unix::AsyncFd,
    sync::{mpsc, oneshot, watch},
    task::JoinSet,
};
use tracing::Instrument;

use crate::{
    config::{
        Config, INDEX_PLACEHOLDER, Lifecycle, Program, RestartPolicy, ServiceConfig,
        SupervisorConfig,
    },
    instance::Lineage,
    registry::Registry,
    sampler::Counters,
    xds::acks::Acks,
};

/// A worker slot: a service and an index in `0..count`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Slot {
    /// The service.
    pub service: String,
    /// The index.
    pub index: u32,
}

impl std::fmt::Display for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{}]", self.service, self.index)
    }
}

/// A line of a request counter region: where one worker instance counts its requests.
#[derive(Clone, Debug)]
pub struct CounterRef {
    region: Arc<Counters>,
    index: usize,
}

impl CounterRef {
    /// Line `index` of `region`.
    pub fn new(region: Arc<Counters>, index: usize) -> Self {
        CounterRef { region, index }
    }

    /// The requests counted so far.
    pub fn load(&self) -> u64 {
        self.region
            .region()
            .slot(self.index)
            .load(Ordering::Relaxed)
    }
}

/// A live worker process of this supervisor.
#[derive(Clone, Debug)]
pub struct Child {
    /// Its slot.
    pub slot: Slot,
    /// Its lane: its own line in the request counter region (unless adopted) and its slot in the
    /// scheduler source; no two live workers share one.
    pub lane: usize,
    /// Where it counts its requests.
    pub counter: CounterRef,
}

/// Live worker processes by pid.
#[derive(Debug, Default)]
pub struct Children {
    by_pid: Mutex<HashMap<u32, Child>>,
}

impl Children {
    /// The slot of the live worker with process id `pid`, if it is one of ours.
    pub fn slot_of(&self, pid: u32) -> Option<Slot> {
        self.lock().get(&pid).map(|c| c.slot.clone())
    }

    /// The live worker with process id `pid`, if it is one of ours.
    pub fn child(&self, pid: u32) -> Option<Child> {
        self.lock().get(&pid).cloned()
    }

    #[cfg(test)]
    pub(crate) fn insert_for_test(&self, pid: u32, service: &str, index: u32) {
        let counters = Arc::new(Counters::memfd(1).expect("a memfd"));
        self.insert_with_lane_for_test(pid, service, index, 0, &counters);
    }

    #[cfg(test)]
    pub(crate) fn insert_with_lane_for_test(
        &self,
        pid: u32,
        service: &str,
        index: u32,
        lane: usize,
        counters: &Arc<Counters>,
    ) {
        let child = Child {
            slot: Slot {
                service: service.into(),
                index,
            },
            lane,
            counter: CounterRef::new(counters.clone(), lane),
        };
        self.lock().insert(pid, child);
    }

    #[cfg(test)]
    pub(crate) fn remove_for_test(&self, pid: u32) {
        self.lock().remove(&pid);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Child>> {
        self.by_pid.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The lanes of the request counter region and of the scheduler source: one per live worker instance.
///
/// A slot being replaced holds two instances for a while (the new one registering, the old one
/// draining), so there are more lanes than slots; a worker's lane goes back to the pool when it has
/// exited.
#[derive(Debug)]
pub struct Lanes {
    free: Mutex<BTreeSet<usize>>,
    capacity: usize,
}

/// A lane taken from [`Lanes`]; it returns when dropped.
#[derive(Debug)]
pub struct Lane {
    lanes: Arc<Lanes>,
    index: usize,
}

impl Lanes {
    /// `capacity` lanes, all free.
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Lanes {
            free: Mutex::new((0..capacity).collect()),
            capacity,
        })
    }

    /// How many lanes there are.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The lowest free lane.
    pub fn take(self: &Arc<Self>) -> Option<Lane> {
        let index = self.lock().pop_first()?;
        Some(Lane {
            lanes: self.clone(),
            index,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<usize>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Lane {
    /// Its number.
    pub fn index(&self) -> usize {
        self.index
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.lanes.lock().insert(self.index);
    }
}

/// The number of lanes a supervisor starts with for `config`: room for every worker twice over (each
/// slot replaced at once, or the config scaled up), and at least [`MIN_LANES`].
pub fn lane_capacity(config: &Config) -> usize {
    (slot_count(config) * 2).max(MIN_LANES)
}

/// The fewest lanes a supervisor has, so that a small config can grow by reload.
pub const MIN_LANES: usize = 64;

/// How a worker process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// It exited with a status code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
    /// It exited, but it was adopted from an earlier supervisor, so its status went to its parent.
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
    /// The service's own environment.
    env: Vec<(String, String)>,
    /// The worker's settings; the counter slot is filled in with the lane at each start.
    settings: Settings,
    /// The request counter region, inherited by the worker.
    counters: Arc<Counters>,
}

/// What, in a service's config, its workers are started with: a change replaces them.
#[derive(Clone, Debug, PartialEq, Eq)]
struct LaunchKey {
    command: crate::config::WorkerCommand,
    url: String,
    env: std::collections::BTreeMap<String, String>,
}

impl LaunchKey {
    fn of(service: &ServiceConfig) -> Self {
        LaunchKey {
            command: service.command.clone(),
            url: service.url.clone(),
            env: service.env.clone(),
        }
    }
}

impl Launch {
    fn new(
        service: &ServiceConfig,
        index: u32,
        supervisor: &SupervisorConfig,
        context: &Context,
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
            control: supervisor.control.clone(),
            counters: None,
            orphan_timeout: supervisor.lifecycle.orphan_timeout,
        };
        Ok(Launch {
            program,
            args,
            env: service
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .chain([(ENV_LINEAGE.to_owned(), context.lineage.as_str().to_owned())])
                .collect(),
            settings,
            counters: context.counters.clone(),
        })
    }

    /// Starts a worker that counts its requests in line `lane`, zeroed first.
    fn spawn(&self, lane: usize) -> io::Result<u32> {
        // No worker counts in this lane now, so nothing counts in it until the new one starts.
        self.counters
            .region()
            .slot(lane)
            .store(0, Ordering::Relaxed);
        let counters = self.counters.fd().as_raw_fd();
        let settings = Settings {
            counters: Some(CounterSlot {
                fd: counters,
                slot: u32::try_from(lane).map_err(io::Error::other)?,
            }),
            ..self.settings.clone()
        };
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(settings.to_env())
            .stdin(Stdio::null())
            // A terminal's Ctrl-C reaches the supervisor only; it stops the workers in order. Workers
            // outlive a supervisor that dies, and re-register with the next one.
            .process_group(0);
        // SAFETY: the closure runs in the child between fork and exec and calls only fcntl(2), which is
        // async-signal-safe; it touches no memory shared with the parent. The counter descriptor is
        // owned by `self.counters`, open while `self` lives, so it is valid in the child.
        unsafe {
            command.pre_exec(move || {
                // The counter region is the one descriptor the worker inherits.
                rustix::io::fcntl_setfd(BorrowedFd::borrow_raw(counters), FdFlags::empty())?;
                Ok(())
            });
        }
        let child = command.spawn()?;
        // The pid is reaped through its pidfd, not through `Child`.
        Ok(child.id())
    }
}

/// How many worker slots `config` has.
pub fn slot_count(config: &Config) -> usize {
    config.services.values().map(|s| s.count as usize).sum()
}

/// What every slot task shares.
#[derive(Debug)]
pub struct Context {
    /// The registry: the manager deregisters exited workers and marks stopping ones draining.
    pub registry: Arc<Registry>,
    /// The live workers.
    pub children: Arc<Children>,
    /// The lanes of the counter region and the scheduler source.
    pub lanes: Arc<Lanes>,
    /// Which Envoy streams have ACKed which revision: a drain waits on it.
    pub acks: Arc<Acks>,
    /// The request counter region handed to new workers.
    pub counters: Arc<Counters>,
    /// The control socket's lineage, which every worker carries (see [`crate::instance`]).
    pub lineage: Lineage,
}

/// A command to a slot task.
#[derive(Debug)]
enum SlotCommand {
    /// Start a new worker (with a new launch, if given); once it has registered, drain and stop the
    /// current one. Answers what happened.
    Replace {
        launch: Option<Box<Launch>>,
        done: oneshot::Sender<Result<Replaced, String>>,
    },
    /// Drain and stop the worker; the task ends.
    Remove { done: oneshot::Sender<()> },
}

/// A replacement that went through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replaced {
    /// The slot.
    pub slot: Slot,
    /// The worker replaced, if one was running.
    pub old: Option<u32>,
    /// The new worker.
    pub new: u32,
}

/// A running slot task, as the manager sees it.
#[derive(Debug)]
struct SlotHandle {
    commands: mpsc::Sender<SlotCommand>,
    launch: LaunchKey,
}

/// The outcome of a rolling restart or reload: what was replaced, added, removed, and what failed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Workers replaced.
    pub replaced: Vec<Replaced>,
    /// Slots started.
    pub added: Vec<Slot>,
    /// Slots drained and stopped.
    pub removed: Vec<Slot>,
    /// What went wrong, one line each; the workers concerned keep running as they were.
    pub failures: Vec<String>,
}

impl Report {
    /// Adds what `other` did to this report.
    pub fn merge(&mut self, other: Report) {
        self.replaced.extend(other.replaced);
        self.added.extend(other.added);
        self.removed.extend(other.removed);
        self.failures.extend(other.failures);
    }
}

impl Report {
    /// One line: `3 replaced, 0 added, 0 removed, 0 failed`.
    pub fn summary(&self) -> String {
        format!(
            "{} replaced, {} added, {} removed, {} failed",
            self.replaced.len(),
            self.added.len(),
            self.removed.len(),
            self.failures.len()
        )
    }
}

impl std::fmt::Display for Report {
    /// The summary, then each failure on a line of its own.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.summary())?;
        for failure in &self.failures {
            write!(f, "\n  {failure}")?;
        }
        Ok(())
    }
}

/// Why a new config cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The new config needs more lanes than the supervisor has.
    #[error(
        "the new config runs {workers} workers, and a rolling restart needs {needed} lanes, but this \
         supervisor started with {capacity}: restart the supervisor to grow that far"
    )]
    Lanes {
        /// Workers in the new config.
        workers: usize,
        /// Lanes needed.
        needed: usize,
        /// Lanes there are.
        capacity: usize,
    },
    /// A worker could not be prepared.
    #[error("cannot prepare the workers of {service}")]
    Launch {
        /// The service.
        service: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// The process manager: one task per worker slot, and the operations over all of them (rolling
/// restart, reload, stop).
#[derive(Debug)]
pub struct Manager {
    context: Arc<Context>,
    supervisor: SupervisorConfig,
    services: std::collections::BTreeMap<String, ServiceConfig>,
    slots: std::collections::BTreeMap<Slot, SlotHandle>,
    tasks: JoinSet<()>,
    shutdown: watch::Receiver<bool>,
}

impl Manager {
    /// Starts a task per worker slot of `config`. Each starts its worker (or takes over the one in
    /// `adopted` for its slot), restarts it when it exits, and drains and stops it once `shutdown`
    /// turns true.
    pub fn start(
        config: &Config,
        context: Arc<Context>,
        mut adopted: std::collections::HashMap<Slot, Adopted>,
        shutdown: watch::Receiver<bool>,
    ) -> io::Result<Self> {
        let mut manager = Manager {
            context,
            supervisor: config.supervisor.clone(),
            services: config.services.clone(),
            slots: Default::default(),
            tasks: JoinSet::new(),
            shutdown,
        };
        for service in config.services.values() {
            for index in 0..service.count {
                let slot = Slot {
                    service: service.name.clone(),
                    index,
                };
                let adopted = adopted.remove(&slot);
                manager.spawn_slot(service, slot, adopted)?;
            }
        }
        for (slot, left) in adopted {
            tracing::warn!(%slot, pid = left.pid, "A worker of an earlier supervisor has no slot in this config: stopping it");
            signal(&left.pidfd, Signal::TERM);
        }
        Ok(manager)
    }

    fn spawn_slot(
        &mut self,
        service: &ServiceConfig,
        slot: Slot,
        adopted: Option<Adopted>,
    ) -> io::Result<()> {
        let launch = Launch::new(service, slot.index, &self.supervisor, &self.context)?;
        let (tx, rx) = mpsc::channel(4);
        let task = SlotTask {
            slot: slot.clone(),
            launch,
            backoff: Backoff::new(self.supervisor.restart),
            lifecycle: self.supervisor.lifecycle,
            context: self.context.clone(),
            shutdown: self.shutdown.clone(),
            commands: Some(rx),
            restarts: 0,
        };
        let span = tracing::info_span!("slot", service = %slot.service, index = slot.index);
        let current = adopted
            .map(|a| a.into_instance(&slot, &self.context))
            .transpose()?;
        self.tasks.spawn(task.run(current).instrument(span));
        self.slots.insert(
            slot,
            SlotHandle {
                commands: tx,
                launch: LaunchKey::of(service),
            },
        );
        Ok(())
    }

    /// Replaces the workers of `service` (every service if `None`) but those in `skip`, `restart_batch`
    /// slots at a time: each new worker registers before its predecessor drains and stops.
    pub async fn restart(&mut self, service: Option<&str>, skip: &BTreeSet<Slot>) -> Report {
        let mut report = Report::default();
        for config in self.services.values() {
            if service.is_some_and(|name| name != config.name) {
                continue;
            }
            let slots: Vec<Slot> = self
                .slots
                .keys()
                .filter(|slot| slot.service == config.name && !skip.contains(slot))
                .cloned()
                .collect();
            report.merge(self.replace_in_batches(&slots, config, false).await);
        }
        report
    }

    /// Replaces `slots` (all of `service`), `restart_batch` at a time, with a new launch if `relaunch`.
    async fn replace_in_batches(
        &self,
        slots: &[Slot],
        service: &ServiceConfig,
        relaunch: bool,
    ) -> Report {
        let mut report = Report::default();
        for batch in slots.chunks(service.restart_batch.max(1) as usize) {
            let mut answers = Vec::new();
            for slot in batch {
                let Some(handle) = self.slots.get(slot) else {
                    continue;
                };
                let launch = if relaunch {
                    match Launch::new(service, slot.index, &self.supervisor, &self.context) {
                        Ok(launch) => Some(Box::new(launch)),
                        Err(error) => {
                            report
                                .failures
                                .push(format!("{slot}: cannot prepare: {error}"));
                            continue;
                        }
                    }
                } else {
                    None
                };
                let (done, answer) = oneshot::channel();
                if handle
                    .commands
                    .send(SlotCommand::Replace { launch, done })
                    .await
                    .is_err()
                {
                    report
                        .failures
                        .push(format!("{slot}: its task has stopped"));
                    continue;
                }
                answers.push((slot.clone(), answer));
            }
            for (slot, answer) in answers {
                match answer.await {
                    Ok(Ok(replaced)) => report.replaced.push(replaced),
                    Ok(Err(why)) => report.failures.push(format!("{slot}: {why}")),
                    Err(_) => report
                        .failures
                        .push(format!("{slot}: the supervisor is stopping")),
                }
            }
            if !report.failures.is_empty() {
                // A batch that failed stops the rolling restart: the next batch would likely fail the
                // same way, and the workers not yet replaced keep serving.
                break;
            }
        }
        report
    }

    /// Whether `config` can be applied: a reload must leave room for a rolling restart.
    pub fn check(&self, config: &Config) -> Result<(), ReloadError> {
        let workers = slot_count(config);
        let batch = config
            .services
            .values()
            .map(|s| s.restart_batch as usize)
            .max()
            .unwrap_or(1);
        let needed = workers + batch;
        if needed > self.context.lanes.capacity() {
            return Err(ReloadError::Lanes {
                workers,
                needed,
                capacity: self.context.lanes.capacity(),
            });
        }
        Ok(())
    }

    /// Applies a new config: removed slots drain and stop, new slots start, and slots whose command,
    /// url or environment changed are replaced (rolling, `restart_batch` at a time). Supervisor-wide
    /// settings other than the restart and lifecycle ones apply at the next start (logged).
    pub async fn reload(&mut self, config: &Config) -> Result<Report, ReloadError> {
        self.check(config)?;
        for (key, old, new) in [
            (
                "bind",
                self.supervisor.bind.to_string(),
                config.supervisor.bind.to_string(),
            ),
            (
                "control",
                self.supervisor.control.display().to_string(),
                config.supervisor.control.display().to_string(),
            ),
            (
                "sampler",
                self.supervisor.sampler.to_string(),
                config.supervisor.sampler.to_string(),
            ),
            (
                "sample_interval_ms",
                self.supervisor.sample_interval.as_millis().to_string(),
                config.supervisor.sample_interval.as_millis().to_string(),
            ),
        ] {
            if old != new {
                tracing::warn!(key = %format!("supervisor.{key}"), %old, %new, "Changed, but takes effect only when the supervisor starts again");
            }
        }
        let keep_control = self.supervisor.control.clone();
        self.supervisor = config.supervisor.clone();
        // Workers must find this supervisor, wherever the new config would put it.
        self.supervisor.control = keep_control;
        let mut report = Report::default();
        // New services exist in the registry before their workers register.
        self.context.registry.set_services(
            self.services
                .keys()
                .chain(config.services.keys())
                .cloned()
                .collect::<BTreeSet<_>>(),
        );
        // Gone: whole services, and indexes past the new count.
        let gone: Vec<Slot> = self
            .slots
            .keys()
            .filter(|slot| {
                config
                    .services
                    .get(&slot.service)
                    .is_none_or(|s| slot.index >= s.count)
            })
            .cloned()
            .collect();
        let mut removals = Vec::new();
        for slot in gone {
            if let Some(handle) = self.slots.remove(&slot) {
                let (done, answer) = oneshot::channel();
                if handle
                    .commands
                    .send(SlotCommand::Remove { done })
                    .await
                    .is_ok()
                {
                    removals.push((slot, answer));
                }
            }
        }
        // New slots start while the removed ones drain.
        for service in config.services.values() {
            for index in 0..service.count {
                let slot = Slot {
                    service: service.name.clone(),
                    index,
                };
                if !self.slots.contains_key(&slot) {
                    self.spawn_slot(service, slot.clone(), None)
                        .map_err(|source| ReloadError::Launch {
                            service: service.name.clone(),
                            source,
                        })?;
                    report.added.push(slot);
                }
            }
        }
        for (slot, answer) in removals {
            let _ = answer.await;
            report.removed.push(slot);
        }
        for service in config.services.values() {
            let changed: Vec<Slot> = self
                .slots
                .iter()
                .filter(|(slot, handle)| {
                    slot.service == service.name
                        && handle.launch != LaunchKey::of(service)
                        && !report.added.contains(slot)
                })
                .map(|(slot, _)| slot.clone())
                .collect();
            if changed.is_empty() {
                continue;
            }
            tracing::info!(service = %service.name, workers = changed.len(), "Command, url or environment changed: replacing workers");
            let result = self.replace_in_batches(&changed, service, true).await;
            for replaced in &result.replaced {
                if let Some(handle) = self.slots.get_mut(&replaced.slot) {
                    handle.launch = LaunchKey::of(service);
                }
            }
            report.merge(result);
        }
        self.services = config.services.clone();
        self.context
            .registry
            .set_services(self.services.keys().cloned());
        Ok(report)
    }

    /// Waits for every slot task to end (they drain and stop their workers once `shutdown` is true).
    pub async fn stopped(mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}

/// A worker of an earlier supervisor that this one takes over.
#[derive(Debug)]
pub struct Adopted {
    /// Its process id.
    pub pid: u32,
    /// A pidfd of it.
    pub pidfd: OwnedFd,
    /// Where it counts its requests (the earlier supervisor's region, taken from the worker).
    pub counter: Option<CounterRef>,
}

impl Adopted {
    fn into_instance(self, slot: &Slot, context: &Context) -> io::Result<Instance> {
        let lane = context
            .lanes
            .take()
            .ok_or_else(|| io::Error::other("every counter lane is in use"))?;
        let counter = self
            .counter
            .unwrap_or_else(|| CounterRef::new(context.counters.clone(), lane.index()));
        // SAFETY: the pidfd is an `OwnedFd` moved into the `AsyncFd`, which owns it until it is
        // dropped; it is never closed or replaced while registered.
        let pidfd = unsafe { AsyncFd::register(self.pidfd) }.map_err(io::Error::from)?;
        context.children.lock().insert(
            self.pid,
            Child {
                slot: slot.clone(),
                lane: lane.index(),
                counter,
            },
        );
        Ok(Instance {
            pid: self.pid,
            pidfd,
            lane,
            started: Instant::now(),
        })
    }
}

/// One running worker process of a slot.
#[derive(Debug)]
struct Instance {
    pid: u32,
    pidfd: AsyncFd<OwnedFd>,
    /// Held while the process lives; freed when it has exited.
    #[allow(dead_code, reason = "held for its Drop")]
    lane: Lane,
    started: Instant,
}

/// One slot's task: starts its worker, restarts it after it exits (with backoff), replaces and
/// removes it on command, and drains and stops it on shutdown.
struct SlotTask {
    slot: Slot,
    launch: Launch,
    backoff: Backoff,
    lifecycle: Lifecycle,
    context: Arc<Context>,
    shutdown: watch::Receiver<bool>,
    /// `None` once the manager has dropped its end.
    commands: Option<mpsc::Receiver<SlotCommand>>,
    restarts: u64,
}

/// What woke a slot task.
enum Event {
    Exited(io::Result<Exit>),
    Healthy,
    /// An adopted worker had its time to register again.
    AdoptionDue,
    Command(Option<SlotCommand>),
    Shutdown,
}

/// How waiting for a new worker's registration ended.
enum Registration {
    Registered,
    Exited(io::Result<Exit>),
    TimedOut,
    Shutdown,
}

impl SlotTask {
    /// Whether the supervisor is stopping (the flag is set, or its sender is gone).
    fn stopping(&self) -> bool {
        *self.shutdown.borrow() || self.shutdown.has_changed().is_err()
    }

    async fn run(mut self, mut current: Option<Instance>) {
        self.context
            .registry
            .set_restarts(&self.slot.service, self.slot.index, 0);
        let healthy_after = self.backoff.policy().healthy_after;
        let mut healthy_at = current.as_ref().map(|i| i.started + healthy_after);
        // A worker adopted from an earlier supervisor must register again; one that does not (hung,
        // or not a worker after all) is replaced.
        let mut adoption_due = current
            .as_ref()
            .map(|i| i.started + self.lifecycle.register_timeout);
        loop {
            if self.stopping() {
                if let Some(instance) = current.take() {
                    self.retire(instance, "the supervisor is stopping").await;
                }
                return;
            }
            let Some(instance) = current.as_ref() else {
                match self.start().await {
                    Ok(instance) => {
                        healthy_at = Some(instance.started + healthy_after);
                        current = Some(instance);
                    }
                    Err(error) => {
                        tracing::error!(%error, program = %self.launch.program.display(), "Cannot start worker");
                        let command = self
                            .pause_after_exit(Duration::ZERO, format!("cannot start: {error}"))
                            .await;
                        if self.handle_idle(command, &mut current).await {
                            return;
                        }
                        // A replacement that came meanwhile is a new start, watched like one.
                        if let Some(instance) = &current {
                            healthy_at = Some(instance.started + healthy_after);
                        }
                    }
                }
                continue;
            };
            let event = tokio::select! {
                exit = exited(&instance.pidfd) => Event::Exited(exit),
                () = sleep_until_some(healthy_at) => Event::Healthy,
                () = sleep_until_some(adoption_due) => Event::AdoptionDue,
                command = recv(&mut self.commands) => Event::Command(command),
                () = stopped(&mut self.shutdown) => Event::Shutdown,
            };
            match event {
                Event::Shutdown => {}
                Event::AdoptionDue => {
                    adoption_due = None;
                    let pid = instance.pid;
                    let registered = self
                        .context
                        .registry
                        .snapshot()
                        .instance(&self.slot.service, self.slot.index, pid)
                        .is_some();
                    if !registered {
                        tracing::warn!(pid, timeout = ?self.lifecycle.register_timeout, "The adopted worker did not register again in time; replacing it");
                        match self.replace_with(None, &mut current).await {
                            Ok(replaced) => {
                                healthy_at = Some(Instant::now() + healthy_after);
                                tracing::info!(new = replaced.new, "Adopted worker replaced");
                            }
                            Err(why) => tracing::warn!(why, "Cannot replace the adopted worker"),
                        }
                    }
                }
                Event::Healthy => {
                    healthy_at = None;
                    self.context
                        .registry
                        .update_slot(&self.slot.service, self.slot.index, |s| {
                            s.crash_looping = false
                        });
                }
                Event::Exited(exit) => {
                    let instance = current.take().expect("an instance is running");
                    let uptime = instance.started.elapsed();
                    let exit = self.reap(instance, exit);
                    healthy_at = None;
                    if self.stopping() {
                        return;
                    }
                    let command = self.pause_after_exit(uptime, exit).await;
                    if self.handle_idle(command, &mut current).await {
                        return;
                    }
                    if let Some(instance) = &current {
                        healthy_at = Some(instance.started + healthy_after);
                    }
                }
                Event::Command(None) => self.commands = None,
                Event::Command(Some(SlotCommand::Replace { launch, done })) => {
                    let result = self.replace_with(launch, &mut current).await;
                    if result.is_ok() {
                        healthy_at = Some(Instant::now() + healthy_after);
                    }
                    let _ = done.send(result);
                }
                Event::Command(Some(SlotCommand::Remove { done })) => {
                    self.remove(&mut current).await;
                    let _ = done.send(());
                    return;
                }
            }
        }
    }

    /// Handles a command that arrived while no worker ran (during a backoff pause); returns whether
    /// the task must end.
    async fn handle_idle(
        &mut self,
        command: Option<SlotCommand>,
        current: &mut Option<Instance>,
    ) -> bool {
        match command {
            None => false,
            Some(SlotCommand::Replace { launch, done }) => {
                self.backoff = Backoff::new(self.backoff.policy());
                let _ = done.send(self.replace_with(launch, current).await);
                false
            }
            Some(SlotCommand::Remove { done }) => {
                self.remove(current).await;
                let _ = done.send(());
                true
            }
        }
    }

    /// Replaces the worker, with `launch` if given; if the replacement fails, the slot keeps its
    /// previous launch (a later reload tries the new one again).
    async fn replace_with(
        &mut self,
        launch: Option<Box<Launch>>,
        current: &mut Option<Instance>,
    ) -> Result<Replaced, String> {
        let previous = launch.map(|launch| std::mem::replace(&mut self.launch, *launch));
        let old = current.as_ref().map(|i| i.pid);
        let old_url = previous
            .as_ref()
            .unwrap_or(&self.launch)
            .settings
            .url
            .clone();
        let exclusive = current.is_some()
            && old_url == self.launch.settings.url
            && fixed_address(&self.launch.settings.url);
        match self.replace(current, exclusive).await {
            Ok(new) => Ok(Replaced {
                slot: self.slot.clone(),
                old,
                new,
            }),
            Err(why) => {
                if let Some(previous) = previous {
                    self.launch = previous;
                }
                Err(why)
            }
        }
    }

    /// Drains and stops the worker and forgets the slot: it was removed from the config.
    async fn remove(&mut self, current: &mut Option<Instance>) {
        if let Some(instance) = current.take() {
            self.retire(instance, "its slot was removed from the config")
                .await;
        }
        self.context
            .registry
            .remove_slot(&self.slot.service, self.slot.index);
    }

    /// Records an unexpected exit and waits out the backoff delay; returns early with a command that
    /// arrived meanwhile.
    async fn pause_after_exit(&mut self, uptime: Duration, exit: String) -> Option<SlotCommand> {
        let healthy_after = self.backoff.policy().healthy_after;
        let delay = self.backoff.after_exit(uptime);
        self.restarts += 1;
        let crash_looping = uptime < healthy_after;
        let restarts = self.restarts;
        self.context
            .registry
            .update_slot(&self.slot.service, self.slot.index, |s| {
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
        let commands = &mut self.commands;
        tokio::select! {
            _ = tokio::time::sleep(delay) => None,
            () = stopped(&mut self.shutdown) => None,
            command = recv(commands) => {
                if command.is_none() {
                    *commands = None;
                }
                command
            }
        }
    }

    /// Starts a worker in a free lane.
    async fn start(&self) -> io::Result<Instance> {
        let lane = self
            .context
            .lanes
            .take()
            .ok_or_else(|| io::Error::other("every counter lane is in use"))?;
        // The lock is held across the spawn so that a registration from the new pid waits for the map
        // entry instead of racing it.
        let (pid, pidfd) = {
            let mut map = self.context.children.lock();
            let pid = self.launch.spawn(lane.index())?;
            let pidfd = rustix::process::pidfd_open(pid_of(pid), PidfdFlags::empty())?;
            map.insert(
                pid,
                Child {
                    slot: self.slot.clone(),
                    lane: lane.index(),
                    counter: CounterRef::new(self.context.counters.clone(), lane.index()),
                },
            );
            (pid, pidfd)
        };
        tracing::info!(pid, lane = lane.index(), restarts = self.restarts, program = %self.launch.program.display(), "Worker started");
        Ok(Instance {
            pid,
            // SAFETY: the pidfd is an `OwnedFd` moved into the `AsyncFd`, which owns it until it is
            // dropped; it is never closed or replaced while registered.
            pidfd: unsafe { AsyncFd::register(pidfd) }.map_err(io::Error::from)?,
            lane,
            started: Instant::now(),
        })
    }

    /// Starts a new worker and, once it has registered, drains and stops `current`; returns the new
    /// worker's pid. If the new worker fails, `current` keeps serving.
    ///
    /// A worker with a fixed address (a given TCP port, a Unix path) cannot run beside a successor at
    /// the same address (no SO_REUSEPORT, and a live Unix socket is not taken over): then `current` is
    /// drained and stopped first, and the slot is empty until the new worker registers (the service's
    /// other workers carry its traffic).
    async fn replace(
        &mut self,
        current: &mut Option<Instance>,
        exclusive: bool,
    ) -> Result<u32, String> {
        let keeps_serving = if exclusive {
            if let Some(old) = current.take() {
                self.retire(old, "its successor needs its address").await;
            }
            "the slot is restarted with backoff"
        } else {
            "the old one keeps serving"
        };
        let new = self
            .start()
            .await
            .map_err(|e| format!("cannot start: {e}"))?;
        match self.await_registration(&new, current).await {
            Registration::Registered => {}
            Registration::Exited(exit) => {
                let exit = self.reap(new, exit);
                return Err(format!(
                    "the new worker ended before registering ({exit}); {keeps_serving}"
                ));
            }
            Registration::TimedOut => {
                let timeout = self.lifecycle.register_timeout;
                self.retire(new, "it did not register in time").await;
                return Err(format!(
                    "the new worker did not register within {timeout:?}; {keeps_serving}"
                ));
            }
            Registration::Shutdown => {
                self.retire(new, "the supervisor is stopping").await;
                return Err("the supervisor is stopping".into());
            }
        }
        let pid = new.pid;
        tracing::info!(pid, "Replacement registered");
        if let Some(old) = current.replace(new) {
            self.retire(old, "it was replaced").await;
        }
        Ok(pid)
    }

    /// Waits until `new` has registered; if `current` exits meanwhile, it is reaped.
    async fn await_registration(
        &mut self,
        new: &Instance,
        current: &mut Option<Instance>,
    ) -> Registration {
        let deadline = tokio::time::Instant::now() + self.lifecycle.register_timeout;
        let mut snapshots = self.context.registry.subscribe();
        loop {
            let registered = snapshots
                .borrow_and_update()
                .instance(&self.slot.service, self.slot.index, new.pid)
                .is_some();
            if registered {
                return Registration::Registered;
            }
            let old_exit = async {
                match current.as_ref() {
                    Some(old) => exited(&old.pidfd).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = snapshots.changed() => {
                    if changed.is_err() {
                        return Registration::Shutdown;
                    }
                }
                exit = exited(&new.pidfd) => return Registration::Exited(exit),
                exit = old_exit => {
                    let old = current.take().expect("the old worker was running");
                    let uptime = old.started.elapsed();
                    self.reap(old, exit);
                    tracing::warn!(?uptime, "The worker being replaced exited before its successor registered");
                }
                () = tokio::time::sleep_until(deadline) => return Registration::TimedOut,
                () = stopped(&mut self.shutdown) => return Registration::Shutdown,
            }
        }
    }

    /// Drains and stops `instance`: marks it draining, waits until every connected Envoy has ACKed that
    /// (at most `drain_timeout`), then SIGTERM, and SIGKILL after `stop_timeout`.
    async fn retire(&self, instance: Instance, why: &str) -> String {
        let Slot { service, index } = &self.slot;
        let pid = instance.pid;
        let begun = Instant::now();
        if let Some(revision) = self.context.registry.drain(service, *index, pid) {
            tracing::info!(pid, why, revision, "Draining worker");
            let synced = self
                .context
                .acks
                .wait_synced(revision, self.lifecycle.drain_timeout);
            tokio::select! {
                outcome = synced => {
                    let silent: Vec<&str> = outcome.silent.iter().map(|s| s.node.as_str()).collect();
                    if outcome.is_synced() {
                        tracing::info!(pid, streams = outcome.synced, ?silent, waited = ?begun.elapsed(), "Every Envoy has the worker as draining");
                    } else {
                        tracing::warn!(pid, lagging = ?outcome.lagging, ?silent, timeout = ?self.lifecycle.drain_timeout, "Not every Envoy ACKed the drain in time; stopping the worker anyway");
                    }
                }
                exit = exited(&instance.pidfd) => return self.reap(instance, exit),
            }
        }
        tracing::debug!(pid, why, "Stopping worker");
        signal(&instance.pidfd, Signal::TERM);
        let exit = match tokio::time::timeout(self.lifecycle.stop_timeout, exited(&instance.pidfd))
            .await
        {
            Ok(exit) => exit,
            Err(_) => {
                tracing::warn!(pid, timeout = ?self.lifecycle.stop_timeout, "Worker did not stop in time; killing it");
                signal(&instance.pidfd, Signal::KILL);
                exited(&instance.pidfd).await
            }
        };
        self.reap(instance, exit)
    }

    /// Forgets an exited worker: it leaves the children map and the registry; its lane is freed.
    /// Returns how it ended, for the slot's status.
    fn reap(&self, instance: Instance, exit: io::Result<Exit>) -> String {
        let pid = instance.pid;
        self.context.children.lock().remove(&pid);
        let removed = self
            .context
            .registry
            .deregister(&self.slot.service, self.slot.index, pid);
        let uptime = instance.started.elapsed();
        match exit {
            Ok(exit) => {
                tracing::info!(pid, %exit, ?uptime, deregistered = removed, "Worker exited");
                exit.to_string()
            }
            Err(error) => {
                tracing::error!(pid, %error, "Lost track of worker");
                format!("lost track of it: {error}")
            }
        }
    }
}

/// Whether two workers cannot listen on `url` at once: a given TCP port, or a Unix socket path.
fn fixed_address(url: &BindUrl) -> bool {
    match url {
        BindUrl::Tcp { port, .. } => *port != 0,
        BindUrl::Unix { .. } => true,
    }
}

/// Resolves once the supervisor is stopping: the flag is set, or its sender is gone.
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// The next command, or never once the channel is gone.
async fn recv(commands: &mut Option<mpsc::Receiver<SlotCommand>>) -> Option<SlotCommand> {
    match commands {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`, or for ever if `None`.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

fn pid_of(pid: u32) -> Pid {
    Pid::from_raw(pid as i32).expect("a spawned child has a positive pid")
}

fn signal(pidfd: &impl AsFd, signal: Signal) {
    if let Err(error) = rustix::process::pidfd_send_signal(pidfd.as_fd(), signal) {
        tracing::debug!(%error, ?signal, "Cannot signal worker (it may have exited)");
    }
}

/// Resolves when the process behind `pidfd` has exited, and reaps it (a process adopted from an
/// earlier supervisor is not ours to reap: [`Exit::Unknown`]).
async fn exited(pidfd: &AsyncFd<OwnedFd>) -> io::Result<Exit> {
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

    fn watched(pid: u32) -> AsyncFd<OwnedFd> {
        let pidfd = rustix::process::pidfd_open(pid_of(pid), PidfdFlags::empty()).unwrap();
        // SAFETY: the pidfd is an `OwnedFd` moved into the `AsyncFd`, which owns it until dropped.
        unsafe { AsyncFd::register(pidfd) }.unwrap()
    }

    /// A slot task for `web[0]` that starts nothing, with `lifecycle`.
    fn task(lifecycle: Lifecycle) -> SlotTask {
        let counters = Arc::new(Counters::memfd(4).unwrap());
        let context = Arc::new(Context {
            registry: Arc::new(Registry::new(["web".to_string()])),
            children: Arc::default(),
            lanes: Lanes::new(4),
            acks: Arc::default(),
            counters,
            lineage: crate::instance::Lineage::random().unwrap(),
        });
        let slot = Slot {
            service: "web".into(),
            index: 0,
        };
        let config = Config::parse(
            "[service.web]\n",
            std::path::Path::new("/tmp"),
            &HashMap::new(),
        )
        .unwrap();
        SlotTask {
            slot,
            launch: Launch::new(&config.services["web"], 0, &config.supervisor, &context).unwrap(),
            backoff: Backoff::new(RestartPolicy::default()),
            lifecycle,
            context,
            shutdown: watch::channel(false).1,
            commands: None,
            restarts: 0,
        }
    }

    #[allow(
        clippy::zombie_processes,
        reason = "reaped through its pidfd by exited"
    )]
    #[tokio::test]
    async fn notices_an_exit_through_the_pidfd_and_reaps_it() {
        let child = Command::new("sh").args(["-c", "exit 7"]).spawn().unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(10), exited(&watched(child.id())))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(exit, Exit::Code(7));
    }

    #[tokio::test]
    async fn an_adopted_process_that_exits_has_an_unknown_status() {
        // The shell's background child is not ours once the shell has exited: like a worker of an
        // earlier supervisor, it can be watched but not reaped.
        let output = Command::new("sh")
            .args(["-c", "sleep 0.3 >/dev/null 2>&1 & echo $!"])
            .output()
            .unwrap();
        let pid: u32 = String::from_utf8(output.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(10), exited(&watched(pid)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(exit, Exit::Unknown);
    }

    #[allow(
        clippy::zombie_processes,
        reason = "reaped through its pidfd by retire"
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
        let task = task(Lifecycle {
            stop_timeout: Duration::from_millis(200),
            ..Lifecycle::default()
        });
        let instance = Instance {
            pid: child.id(),
            pidfd: watched(child.id()),
            lane: task.context.lanes.take().unwrap(),
            started: Instant::now(),
        };
        let exit = tokio::time::timeout(Duration::from_secs(10), task.retire(instance, "a test"))
            .await
            .unwrap();
        assert_eq!(exit, "signal 9");
        assert_eq!(task.context.lanes.lock().len(), 4, "the lane is free again");
    }
}
