//! The process manager: runs `count` workers per service, restarts those that exit, and replaces,
//! adds and removes them without dropping a request.
//!
//! Each worker slot (service, index) has one task ([`slot_task`]). It spawns the worker with its
//! settings in the environment ([`launch`]), watches the process through a pidfd ([`process`]), reaps
//! it, removes it from the registry, and restarts it after an exponential [`backoff`]. The
//! [`Manager`] sends slot tasks their commands: rolling restarts in batches, and reloads. The live
//! processes themselves are in the process table ([`crate::children`]).
//!
//! Invariant: of endpoints the manager adds only a passed-socket server's, once its ready path
//! answers ([`passed`]: such a server cannot register); a built-in worker enters by registration
//! alone. Of the registry it also writes the services' and slots' status (`set_services`,
//! `set_restarts`, `update_slot`, `remove_slot`) and a worker's end of life (`drain` before it
//! stops, `deregister` once it has exited).

mod backoff;
mod context;
mod error;
mod launch;
mod leftovers;
mod locked_memory;
mod orphan_watch;
mod passed;
mod privileges;
mod process;
mod slot_task;

use std::{
    collections::{BTreeSet, HashMap},
    io,
    os::fd::AsFd,
    sync::Arc,
};

use peregrine_contract::ErrorChain;
use rustix::process::Signal;
use tokio::{
    sync::{mpsc, oneshot, watch},
    task::JoinSet,
};
use tracing::Instrument;

use self::{
    backoff::Backoff,
    context::SlotCommand,
    launch::{Launch, LaunchKey, PassedListener},
    process::signal,
    slot_task::SlotTask,
};
pub use self::{
    context::{Context, Replaced, starting_gate},
    error::{Fallback, ReplaceError, StartError},
    launch::{EXEC_PASSED, exec_passed},
    leftovers::{become_subreaper, reap_orphans},
    orphan_watch::{ORPHAN_WATCH, WatchOrders, watch_orphans},
    process::{Ending, Exit},
    slot_task::Adopted,
};
use crate::{
    children::{Slot, slot_count},
    config::{Config, ServiceConfig, SupervisorConfig, Warning, concurrency::ListenerMode},
};

/// This host's plan for the locked memory of `services`' workers (under the supervisor's own limit,
/// and whether it may raise it), and a warning for each user whose workers' rings cannot fit.
fn locked_memory_plan(
    services: &std::collections::BTreeMap<String, ServiceConfig>,
) -> (locked_memory::Plan, Vec<Warning>) {
    let own_uid = rustix::process::getuid().as_raw();
    let plan = locked_memory::plan(
        services.values(),
        own_uid,
        locked_memory::Limit::own(),
        locked_memory::may_raise(),
        rustix::param::page_size(),
    );
    let warnings = locked_memory::shortfalls(&plan, services, own_uid);
    (plan, warnings)
}

/// The warnings [`locked_memory_plan`] gives for `services` on this host: what a start would say.
pub fn locked_memory_warnings(
    services: &std::collections::BTreeMap<String, ServiceConfig>,
) -> Vec<Warning> {
    locked_memory_plan(services).1
}

/// A running slot task, as the manager sees it.
#[derive(Debug)]
struct SlotHandle {
    commands: mpsc::Sender<SlotCommand>,
    launch: LaunchKey,
}

/// A slot that a rolling restart or reload could not replace, and why.
#[derive(Debug, thiserror::Error)]
#[error("{slot}: {}", ErrorChain(error))]
pub struct Failure {
    /// The slot.
    pub slot: Slot,
    /// Why.
    pub error: ReplaceError,
}

/// The outcome of a rolling restart or reload: what was replaced, added, removed, and what failed.
#[derive(Debug, Default)]
pub struct Report {
    /// Workers replaced.
    pub replaced: Vec<Replaced>,
    /// Slots started.
    pub added: Vec<Slot>,
    /// Slots drained and stopped.
    pub removed: Vec<Slot>,
    /// What went wrong; the workers concerned keep running as they were.
    pub failures: Vec<Failure>,
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
    /// Stops the servers on passed listeners if this supervisor dies and none takes them over
    /// within `orphan_timeout_ms` ([`orphan_watch`]); only while a service has `pass_socket`.
    watcher: Option<orphan_watch::Watcher>,
    /// The locked memory each user's workers are given for their rings ([`locked_memory`]).
    locked_memory: locked_memory::Plan,
    /// Each shared listener (`listener = "shared"`) by service, with the url it was bound for: one
    /// per service, kept for as long as the service and its url are.
    shared: std::sync::Mutex<std::collections::BTreeMap<String, (String, Arc<PassedListener>)>>,
}

impl Manager {
    /// Starts a task per worker slot of `config`. Each starts its worker (or takes over the one in
    /// `adopted` for its slot), restarts it when it exits, and drains and stops it once `shutdown`
    /// turns true.
    pub fn start(
        config: &Config,
        context: Arc<Context>,
        mut adopted: HashMap<Slot, Adopted>,
        shutdown: watch::Receiver<bool>,
    ) -> io::Result<Self> {
        let mut manager = Manager {
            context,
            supervisor: config.supervisor.clone(),
            services: config.services.clone(),
            slots: Default::default(),
            tasks: JoinSet::new(),
            shutdown,
            watcher: None,
            locked_memory: locked_memory::Plan::default(),
            shared: Default::default(),
        };
        // At start, `run` logs what the plan lacks with the other start-up warnings.
        let _ = manager.plan_locked_memory(&config.services);
        manager.take_back_shared(config, &adopted);
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
        manager.watch_orphans();
        Ok(manager)
    }

    /// Starts the orphan watcher if a service has `pass_socket` and `orphan_timeout_ms` is not 0
    /// (for ever), again if those timeouts changed; stops it when none is needed.
    fn watch_orphans(&mut self) {
        let needed = !self.supervisor.lifecycle.orphan_timeout.is_zero()
            && self.services.values().any(|s| s.pass_socket);
        if !needed {
            self.watcher = None;
            return;
        }
        if self
            .watcher
            .as_ref()
            .is_some_and(|w| w.watches_for(&self.supervisor))
        {
            return;
        }
        self.watcher = None;
        match orphan_watch::Watcher::spawn(
            &self.supervisor,
            &self.context.lineage,
            &self.context.children,
        ) {
            Ok(watcher) => self.watcher = Some(watcher),
            Err(error) => {
                tracing::warn!(%error, "Cannot start the orphan watcher: servers on passed listeners outlive a supervisor that dies, until one adopts them")
            }
        }
    }

    /// Plans the locked memory of `services`' workers; returns a warning for each user whose
    /// workers' rings cannot fit.
    fn plan_locked_memory(
        &mut self,
        services: &std::collections::BTreeMap<String, ServiceConfig>,
    ) -> Vec<Warning> {
        let (plan, warnings) = locked_memory_plan(services);
        self.locked_memory = plan;
        warnings
    }

    /// Before this process execs a new image of itself ([`crate::upgrade`]): stops the orphan
    /// watcher, which would otherwise wait on for a supervisor whose pid never exits, beside the
    /// one the new image starts. Its zombie is the new image's to reap.
    pub fn release_for_exec(&mut self) {
        self.watcher = None;
    }

    /// The process table, for children the supervisor starts beside its workers.
    pub fn children(&self) -> Arc<crate::children::Children> {
        self.context.children.clone()
    }

    /// Whether the supervisor has begun to stop (its workers are draining): an upgrade must not
    /// exec then.
    pub fn is_stopping(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// After an exec that failed: the orphan watcher again, if one is needed.
    pub fn resume_after_failed_exec(&mut self) {
        self.watch_orphans();
    }

    /// Takes back the shared listeners the `adopted` workers hold, for the services of `config`
    /// whose url is still where they listen: new workers join the queue the adopted ones accept
    /// from. A service whose adopted workers hold none (or that has none) binds its listener anew.
    fn take_back_shared(&self, config: &Config, adopted: &HashMap<Slot, Adopted>) {
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        for (slot, worker) in adopted {
            let Some(service) = config.services.get(&slot.service) else {
                continue;
            };
            if service.listener != ListenerMode::Shared || shared.contains_key(&service.name) {
                continue;
            }
            let Some(address) = &worker.passed else {
                continue;
            };
            let url = service.url_for(0);
            if !passed::bound_for(address, &url) {
                continue;
            }
            match PassedListener::take_back(worker.pidfd.as_fd(), worker.pid, address) {
                Ok(Some(listener)) => {
                    tracing::info!(service = %service.name, %address, pid = worker.pid, "Took the shared listener back from an adopted worker");
                    shared.insert(
                        service.name.clone(),
                        (service.url.clone(), Arc::new(listener)),
                    );
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(service = %service.name, pid = worker.pid, error = %ErrorChain(&error), "Cannot take the shared listener back from an adopted worker")
                }
            }
        }
    }

    /// The shared listener of `service`, if its workers share one: the one bound for its url, or
    /// one bound now.
    fn shared_listener(&self, service: &ServiceConfig) -> io::Result<Option<Arc<PassedListener>>> {
        if service.listener != ListenerMode::Shared {
            return Ok(None);
        }
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((url, listener)) = shared.get(&service.name)
            && *url == service.url
        {
            return Ok(Some(listener.clone()));
        }
        let listener = Arc::new(PassedListener::bind(&service.url_for(0))?);
        tracing::info!(service = %service.name, address = %listener.address, "Bound the listener the service's workers share");
        shared.insert(
            service.name.clone(),
            (service.url.clone(), listener.clone()),
        );
        Ok(Some(listener))
    }

    /// Forgets the shared listeners of services that are gone or no longer share one (a worker
    /// still passed one keeps its own duplicate, and its slot's launch the listener itself).
    fn forget_shared(&self) {
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        shared.retain(|name, (url, _)| {
            self.services
                .get(name)
                .is_some_and(|s| s.listener == ListenerMode::Shared && s.url == *url)
        });
    }

    /// What the worker in slot `index` of `service` is started with.
    fn launch(&self, service: &ServiceConfig, index: u32) -> io::Result<Launch> {
        let uid = service
            .account
            .as_ref()
            .map_or_else(|| rustix::process::getuid().as_raw(), |a| a.uid);
        let locked_memory = if service.pass_socket {
            locked_memory::for_app(locked_memory::Limit::own())
        } else {
            self.locked_memory.limits.get(&uid).copied()
        };
        Launch::new(
            service,
            index,
            &self.supervisor,
            &self.context.lineage,
            &self.context.counters,
            (locked_memory, self.shared_listener(service)?),
        )
    }

    fn spawn_slot(
        &mut self,
        service: &ServiceConfig,
        slot: Slot,
        adopted: Option<Adopted>,
    ) -> io::Result<()> {
        let launch = self.launch(service, slot.index)?;
        let current = adopted
            .map(|a| a.into_instance(&slot, &self.context, &launch))
            .transpose()
            .map_err(|error| match error {
                StartError::Spawn(error) => error,
                StartError::NoLane => io::Error::other(error),
            })?;
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
                    match self.launch(service, slot.index) {
                        Ok(launch) => Some(Box::new(launch)),
                        Err(error) => {
                            report.failures.push(Failure {
                                slot: slot.clone(),
                                error: ReplaceError::Prepare(error),
                            });
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
                    report.failures.push(Failure {
                        slot: slot.clone(),
                        error: ReplaceError::TaskStopped,
                    });
                    continue;
                }
                answers.push((slot.clone(), answer));
            }
            for (slot, answer) in answers {
                match answer.await {
                    Ok(Ok(replaced)) => report.replaced.push(replaced),
                    Ok(Err(error)) => report.failures.push(Failure { slot, error }),
                    Err(_) => report.failures.push(Failure {
                        slot,
                        error: ReplaceError::Stopping,
                    }),
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
        for warning in self.plan_locked_memory(&config.services) {
            warning.log();
        }
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
        self.forget_shared();
        self.context
            .registry
            .set_services(self.services.keys().cloned());
        self.watch_orphans();
        Ok(report)
    }

    /// Waits for every slot task to end (they drain and stop their workers once `shutdown` is true),
    /// then stops whatever any worker left running (a task stops what its worker leaves, but a
    /// process may have been orphaned since, or by a worker of an earlier supervisor).
    pub async fn stopped(mut self) {
        // This supervisor stops its workers itself.
        self.watcher = None;
        while self.tasks.join_next().await.is_some() {}
        let lineage = self.context.lineage.clone();
        let children = self.context.children.clone();
        let sweep = move || leftovers::sweep(&lineage, &children);
        let left = tokio::task::spawn_blocking(sweep.clone())
            .await
            .unwrap_or_default();
        if !left.is_empty() {
            let pids: Vec<u32> = left.iter().map(|l| l.pid()).collect();
            tracing::warn!(?pids, "Workers left processes running; stopping them");
            leftovers::stop(left, self.supervisor.lifecycle.stop_timeout, sweep).await;
        }
    }
}
