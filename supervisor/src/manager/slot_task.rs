//! One slot's task: starts its worker, restarts it after it exits (with backoff), replaces and
//! removes it on command, and drains and stops it on shutdown.
//!
//! Every stop is a drain ([`SlotTask::retire`]): the worker is marked draining in the registry (EDS
//! publishes `health_status: DRAINING`), the task waits until every Envoy endpoint stream has ACKed
//! that revision ([`Acks::wait_synced`], bounded by `drain_timeout`), in a fleet also until every other
//! host's supervisor says its Envoys have ([`FleetDrains::wait`], within the same bound), then the
//! service's `stop_signal` (SIGTERM by default), and SIGKILL after `stop_timeout`. A replacement
//! starts first and registers (its predecessor turns draining in the same snapshot) before the
//! predecessor is retired, unless both would need the same fixed address.
//!
//! A passed-socket worker (`pass_socket`) never registers itself: the task starts its probe
//! ([`register_when_ready`]) with it, and the probe registers it once its listener answers.
//!
//! Invariant: the task is the only writer of its slot's entries, in the process table and in the
//! registry's slot status; a worker's endpoint is only ever drained or removed here, and added only
//! by the probe of a passed-socket worker the task started.

use std::{
    io,
    os::fd::OwnedFd,
    sync::Arc,
    time::{Duration, Instant},
};

use peregrine_contract::ErrorChain;
use rustix::process::{PidfdFlags, Signal};
use tokio::{
    io::unix::AsyncFd,
    sync::{OwnedSemaphorePermit, mpsc, watch},
};

use super::{
    backoff::Backoff,
    context::{Context, Replaced, SlotCommand},
    error::{Fallback, ReplaceError, StartError},
    launch::{Launch, fixed_address},
    leftovers::{self, Scope},
    passed::{LastProbe, register_when_ready},
    process::{DAEMONIZES, Ending, Exit, exited, pid_of, signal},
};
use crate::{
    children::{Child, CounterRef, Lane, Slot},
    config::Lifecycle,
    fleet::FleetOutcome,
    registry::Address,
};
#[cfg(doc)]
use crate::{fleet::FleetDrains, xds::acks::Acks};

/// A worker of an earlier supervisor that this one takes over.
#[derive(Debug)]
pub struct Adopted {
    /// Its process id.
    pub pid: u32,
    /// A pidfd of it.
    pub pidfd: OwnedFd,
    /// The user it runs as.
    pub uid: u32,
    /// Where it counts its requests (the earlier supervisor's region, taken from the worker).
    pub counter: Option<CounterRef>,
    /// Where it listens, when the earlier supervisor passed it its listener: it is probed there and
    /// registered on its behalf again.
    pub passed: Option<Address>,
}

impl Adopted {
    pub(super) fn into_instance(
        self,
        slot: &Slot,
        context: &Context,
        launch: &Launch,
    ) -> Result<Instance, StartError> {
        let lane = context.lanes.take().ok_or(StartError::NoLane)?;
        let counter = self
            .counter
            .unwrap_or_else(|| CounterRef::new(context.counters.clone(), lane.index()));
        // SAFETY: the pidfd is an `OwnedFd` moved into the `AsyncFd`, which owns it until it is
        // dropped; it is never closed or replaced while registered.
        let pidfd = unsafe { AsyncFd::register(self.pidfd) }.map_err(io::Error::from)?;
        context.children.insert(
            self.pid,
            Child {
                slot: slot.clone(),
                lane: lane.index(),
                counter,
                counts_requests: !launch.pass_socket,
                listen_port: self.passed.as_ref().and_then(Address::port),
                listen_ipv6: self.passed.as_ref().is_some_and(is_ipv6),
                listen_shared: launch.shared.is_some(),
                uid: self.uid,
                concurrency: launch.concurrency,
            },
        );
        Ok(Instance {
            pid: self.pid,
            pidfd,
            lane,
            started: Instant::now(),
            adopted: true,
            prober: self
                .passed
                .filter(|_| launch.pass_socket)
                .map(|address| Prober::start(context, slot, self.pid, address, launch)),
        })
    }
}

/// One running worker process of a slot.
#[derive(Debug)]
pub(super) struct Instance {
    pid: u32,
    pidfd: AsyncFd<OwnedFd>,
    /// Held while the process lives; freed when it has exited.
    #[allow(dead_code, reason = "held for its Drop")]
    lane: Lane,
    started: Instant,
    /// Whether it was adopted from an earlier supervisor: after a crash not this one's child, so
    /// what it leaves when it exits goes to init, not to this supervisor, and is looked for on the
    /// whole host ([`leftovers`]; after an upgrade in place it is a child, and the host holds it
    /// too).
    adopted: bool,
    /// For a passed-socket worker, the probe that registers it once it answers.
    prober: Option<Prober>,
}

/// The task that registers a passed-socket worker once it is ready; it ends with its instance.
#[derive(Debug)]
struct Prober {
    task: tokio::task::AbortHandle,
    /// What the last probe found, while the worker is not ready.
    last: LastProbe,
}

impl Instance {
    /// What the last probe of a passed-socket worker that is not ready found.
    fn last_probe(&self) -> Option<String> {
        let prober = self.prober.as_ref()?;
        prober
            .last
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Logs why a passed-socket worker was never ready, as its last probe found.
    fn report_not_ready(&self, ready_path: &str, timeout: Duration) {
        if self.prober.is_some() {
            let last = self.last_probe();
            tracing::warn!(
                pid = self.pid,
                ready_path,
                ?timeout,
                last_probe = last.as_deref().unwrap_or("none yet"),
                "The worker never answered its ready path"
            );
        }
    }
}

impl Prober {
    /// Probes worker `pid` of `slot` at `address` until it is ready, then registers it.
    fn start(context: &Context, slot: &Slot, pid: u32, address: Address, launch: &Launch) -> Self {
        let last = LastProbe::default();
        let task = tokio::spawn(register_when_ready(
            context.registry.clone(),
            (slot.service.clone(), slot.index, pid),
            (address, launch.shared.is_some()),
            launch.ready_path.clone(),
            last.clone(),
        ));
        Prober {
            task: task.abort_handle(),
            last,
        }
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One slot's task: starts its worker, restarts it after it exits (with backoff), replaces and
/// removes it on command, and drains and stops it on shutdown.
pub(super) struct SlotTask {
    pub(super) slot: Slot,
    pub(super) launch: Launch,
    pub(super) backoff: Backoff,
    pub(super) lifecycle: Lifecycle,
    pub(super) context: Arc<Context>,
    pub(super) shutdown: watch::Receiver<bool>,
    /// `None` once the manager has dropped its end.
    pub(super) commands: Option<mpsc::Receiver<SlotCommand>>,
    pub(super) restarts: u64,
}

/// What woke a slot task.
enum Event {
    Exited(io::Result<Exit>),
    Healthy,
    /// An adopted worker had its time to register again.
    AdoptionDue,
    /// A passed-socket worker had its time to answer its ready path.
    ReadyDue,
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

    /// Whether worker `pid` of this slot is registered.
    fn is_registered(&self, pid: u32) -> bool {
        self.context
            .registry
            .snapshot()
            .instance(&self.slot.service, self.slot.index, pid)
            .is_some()
    }

    pub(super) async fn run(mut self, mut current: Option<Instance>) {
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
        // A passed-socket worker must answer its ready path within the same time, or it is stopped
        // and started again with backoff (a replacement is bounded by `await_registration`).
        let mut ready_due = None;
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
                        ready_due = self
                            .launch
                            .pass_socket
                            .then(|| instance.started + self.lifecycle.register_timeout);
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
                () = sleep_until_some(ready_due) => Event::ReadyDue,
                command = recv(&mut self.commands) => Event::Command(command),
                () = stopped(&mut self.shutdown) => Event::Shutdown,
            };
            match event {
                Event::Shutdown => {}
                Event::AdoptionDue => {
                    adoption_due = None;
                    let pid = instance.pid;
                    if !self.is_registered(pid) {
                        tracing::warn!(pid, timeout = ?self.lifecycle.register_timeout, "The adopted worker did not register again in time; replacing it");
                        match self.replace_with(None, &mut current).await {
                            Ok(replaced) => {
                                healthy_at = Some(Instant::now() + healthy_after);
                                tracing::info!(new = replaced.new, "Adopted worker replaced");
                            }
                            Err(error) => {
                                tracing::warn!(error = %ErrorChain(&error), "Cannot replace the adopted worker")
                            }
                        }
                    }
                }
                Event::ReadyDue => {
                    ready_due = None;
                    if self.is_registered(instance.pid) {
                        continue;
                    }
                    let timeout = self.lifecycle.register_timeout;
                    instance.report_not_ready(&self.launch.ready_path, timeout);
                    let last = instance.last_probe();
                    let instance = current.take().expect("an instance is running");
                    let ending = self
                        .retire(instance, "it did not answer its ready path in time")
                        .await;
                    healthy_at = None;
                    if self.stopping() {
                        return;
                    }
                    let why = format!(
                        "not ready within {timeout:?}: the last GET {} got {}; stopped ({ending})",
                        self.launch.ready_path,
                        last.as_deref().unwrap_or("no answer yet"),
                    );
                    // A worker that never became ready failed to start, however long it ran.
                    let command = self.pause_after_exit(Duration::ZERO, why).await;
                    if self.handle_idle(command, &mut current).await {
                        return;
                    }
                    if let Some(instance) = &current {
                        healthy_at = Some(instance.started + healthy_after);
                    }
                }
                // A passed-socket worker that is not ready yet is not healthy however long it runs.
                Event::Healthy if self.launch.pass_socket && !self.is_registered(instance.pid) => {
                    healthy_at = None
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
                    let exit = self.reap(instance, exit).await;
                    healthy_at = None;
                    ready_due = None;
                    if self.stopping() {
                        return;
                    }
                    let command = self.pause_after_exit(uptime, exit.to_string()).await;
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
                        ready_due = None;
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
    ) -> Result<Replaced, ReplaceError> {
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
            && fixed_address(&self.launch.settings.url)
            // A shared listener is the supervisor's: the new worker joins it beside the old one.
            && self.launch.shared.is_none();
        match self.replace(current, exclusive).await {
            Ok(new) => Ok(Replaced {
                slot: self.slot.clone(),
                old,
                new,
            }),
            Err(error) => {
                if let Some(previous) = previous {
                    self.launch = previous;
                }
                Err(error)
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

    /// Starts a worker in a free lane, once fewer than
    /// [`STARTING_AT_ONCE`](super::context::STARTING_AT_ONCE) workers are starting.
    async fn start(&self) -> Result<Instance, StartError> {
        // The semaphore is never closed; were it, the start would go ungated rather than fail.
        let permit = self.context.starting.clone().acquire_owned().await.ok();
        let lane = self.context.lanes.take().ok_or(StartError::NoLane)?;
        let listener = self.launch.bind_passed()?;
        let passed = listener.as_ref().map(|listener| listener.address.clone());
        let counter = self.launch.counter(lane.index())?;
        let child = Child {
            slot: self.slot.clone(),
            lane: lane.index(),
            counter: counter.clone(),
            counts_requests: !self.launch.pass_socket,
            listen_port: passed.as_ref().and_then(Address::port),
            listen_ipv6: passed.as_ref().is_some_and(is_ipv6),
            listen_shared: self.launch.shared.is_some(),
            uid: self.launch.uid(),
            concurrency: self.launch.concurrency,
        };
        let (pid, pidfd) = self.context.children.spawn(child, || {
            let pid = self.launch.spawn(&counter, listener)?;
            let pidfd = rustix::process::pidfd_open(pid_of(pid), PidfdFlags::empty())?;
            Ok((pid, pidfd))
        })?;
        tracing::info!(pid, lane = lane.index(), restarts = self.restarts, program = %self.launch.program.display(), "Worker started");
        if let Some(permit) = permit {
            self.hold_until_registered(permit, pid);
        }
        let prober = passed
            .map(|address| Prober::start(&self.context, &self.slot, pid, address, &self.launch));
        Ok(Instance {
            pid,
            // SAFETY: the pidfd is an `OwnedFd` moved into the `AsyncFd`, which owns it until it is
            // dropped; it is never closed or replaced while registered.
            pidfd: unsafe { AsyncFd::register(pidfd) }.map_err(io::Error::from)?,
            lane,
            started: Instant::now(),
            adopted: false,
            prober,
        })
    }

    /// Holds `permit` (a place among the workers starting at once) until worker `pid` has
    /// registered, has exited, or has had its registration timeout, whichever is first.
    fn hold_until_registered(&self, permit: OwnedSemaphorePermit, pid: u32) {
        let registry = self.context.registry.clone();
        let Slot { service, index } = self.slot.clone();
        let deadline = tokio::time::Instant::now() + self.lifecycle.register_timeout;
        // Its own pidfd: the instance's is the slot task's to wait on. Without one (the worker
        // exited already, or the kernel refused), the permit goes back at once.
        let Some(pidfd) = rustix::process::pidfd_open(pid_of(pid), PidfdFlags::empty())
            .ok()
            // SAFETY: the pidfd is an `OwnedFd` moved into the `AsyncFd`, which owns it until it
            // is dropped (with the task); it is never closed or replaced while registered.
            .and_then(|fd| unsafe { AsyncFd::register(fd) }.ok())
        else {
            return;
        };
        tokio::spawn(async move {
            let _permit = permit;
            let mut snapshots = registry.subscribe();
            loop {
                if snapshots
                    .borrow_and_update()
                    .instance(&service, index, pid)
                    .is_some()
                {
                    return;
                }
                tokio::select! {
                    changed = snapshots.changed() => if changed.is_err() { return },
                    _ = pidfd.readable() => return,
                    () = tokio::time::sleep_until(deadline) => return,
                }
            }
        });
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
    ) -> Result<u32, ReplaceError> {
        let fallback = if exclusive {
            if let Some(old) = current.take() {
                self.retire(old, "its successor needs its address").await;
            }
            Fallback::RestartWithBackoff
        } else {
            Fallback::OldKeepsServing
        };
        let new = self.start().await.map_err(ReplaceError::Start)?;
        match self.await_registration(&new, current).await {
            Registration::Registered => {}
            Registration::Exited(exit) => {
                let ending = self.reap(new, exit).await;
                return Err(ReplaceError::ExitedBeforeRegistering { ending, fallback });
            }
            Registration::TimedOut => {
                let timeout = self.lifecycle.register_timeout;
                new.report_not_ready(&self.launch.ready_path, timeout);
                self.retire(new, "it did not register in time").await;
                return Err(ReplaceError::RegisterTimeout { timeout, fallback });
            }
            Registration::Shutdown => {
                self.retire(new, "the supervisor is stopping").await;
                return Err(ReplaceError::Stopping);
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
                    self.reap(old, exit).await;
                    tracing::warn!(?uptime, "The worker being replaced exited before its successor registered");
                }
                () = tokio::time::sleep_until(deadline) => return Registration::TimedOut,
                () = stopped(&mut self.shutdown) => return Registration::Shutdown,
            }
        }
    }

    /// Drains and stops `instance`: marks it draining, waits until every connected Envoy has ACKed that
    /// (at most `drain_timeout`), then its `stop_signal`, and SIGKILL after `stop_timeout`.
    async fn retire(&self, instance: Instance, why: &str) -> Ending {
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
                    let late: Vec<&str> = outcome.late.iter().map(|s| s.node.as_str()).collect();
                    if outcome.is_synced() {
                        tracing::info!(pid, streams = outcome.synced, awaited = ?outcome.awaited, ?silent, ?late, waited = ?begun.elapsed(), "Every Envoy has the worker as draining");
                    } else {
                        tracing::warn!(pid, lagging = ?outcome.lagging, awaited = ?outcome.awaited, ?silent, ?late, timeout = ?self.lifecycle.drain_timeout, "Not every Envoy ACKed the drain in time; stopping the worker anyway");
                    }
                }
                exit = exited(&instance.pidfd) => return self.reap(instance, exit).await,
            }
            if let Some(fleet) = &self.context.fleet {
                let left = self.lifecycle.drain_timeout.saturating_sub(begun.elapsed());
                tokio::select! {
                    outcome = fleet.wait(revision, left) => match outcome {
                        FleetOutcome::Synced { hosts, revision } => {
                            tracing::info!(pid, hosts, etcd_revision = revision, waited = ?begun.elapsed(), "Every host of the fleet has the worker as draining");
                        }
                        FleetOutcome::Lagging { hosts, revision } => {
                            tracing::warn!(pid, lagging = ?hosts, etcd_revision = revision, timeout = ?self.lifecycle.drain_timeout, "Not every host of the fleet ACKed the drain in time; stopping the worker anyway");
                        }
                        FleetOutcome::Away => {
                            tracing::warn!(pid, "etcd is away: the other hosts cannot learn of the drain; stopping the worker (their Envoys retry elsewhere)");
                        }
                    },
                    exit = exited(&instance.pidfd) => return self.reap(instance, exit).await,
                }
            }
            self.context
                .timings
                .drain
                .observe(begun.elapsed().as_secs_f64());
        }
        tracing::debug!(pid, why, signal = %self.launch.stop_signal, "Stopping worker");
        signal(&instance.pidfd, self.launch.stop_signal.signal);
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
        self.reap(instance, exit).await
    }

    /// Forgets an exited worker: it leaves the process table and the registry; its lane is freed.
    /// Then stops what it left running ([`leftovers`]). Returns how it ended, for the slot's status.
    async fn reap(&self, instance: Instance, exit: io::Result<Exit>) -> Ending {
        let pid = instance.pid;
        let scope = if instance.adopted {
            Scope::Host
        } else {
            Scope::Children
        };
        self.context.children.remove(pid);
        let removed = self
            .context
            .registry
            .deregister(&self.slot.service, self.slot.index, pid);
        let uptime = instance.started.elapsed();
        let probed = instance.prober.is_some();
        // Its probe ends here: what it found last goes from the slot's status.
        drop(instance);
        if probed {
            self.context
                .registry
                .update_slot(&self.slot.service, self.slot.index, |s| s.last_probe = None);
        }
        let exit = match exit {
            Ok(exit) => {
                tracing::info!(pid, %exit, ?uptime, deregistered = removed, "Worker exited");
                exit
            }
            Err(error) => {
                tracing::error!(pid, %error, "Lost track of worker");
                return Ending::Lost(error.to_string());
            }
        };
        match self.stop_leftovers(pid, exit, scope).await {
            0 => Ending::Exit(exit),
            left => Ending::LeftRunning { exit, left },
        }
    }

    /// Stops what worker `pid`, which ended with `exit`, left running; returns how many processes
    /// that was.
    async fn stop_leftovers(&self, pid: u32, exit: Exit, scope: Scope) -> usize {
        let slot = self.slot.clone();
        let lineage = self.context.lineage.clone();
        let children = self.context.children.clone();
        let (slot_now, lineage_now, children_now) =
            (slot.clone(), lineage.clone(), children.clone());
        let find = move || leftovers::find(&slot, &lineage, &children, scope);
        let (first, foreign) = tokio::task::spawn_blocking(move || {
            leftovers::find_naming(&slot_now, &lineage_now, &children_now, scope)
        })
        .await
        .unwrap_or_default();
        if first.is_empty() {
            return 0;
        }
        let pids: Vec<u32> = first.iter().map(|l| l.pid()).collect();
        for leftover in &foreign {
            // Handed to the supervisor when this worker exited, outside the tree of the slot it
            // names: this worker's leftover, not that slot's.
            tracing::warn!(
                pid,
                left = leftover.pid,
                names = %leftover.names,
                "A process this worker left names another slot in its environment; it is this worker's, not that slot's"
            );
        }
        if let Exit::Code(_) = exit {
            tracing::warn!(pid, %exit, left = ?pids, "The worker exited and left processes running; stopping them: {DAEMONIZES}");
        } else {
            tracing::warn!(pid, %exit, left = ?pids, "The worker left processes of its tree running; stopping them");
        }
        let stopped = leftovers::stop(first, self.lifecycle.stop_timeout, find).await;
        tracing::info!(pid, stopped, "Stopped what the worker left running");
        stopped
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

/// Whether `address` is an IPv6 socket's.
fn is_ipv6(address: &Address) -> bool {
    matches!(address, Address::Tcp(socket) if socket.is_ipv6())
}

#[cfg(test)]
mod tests {
    use std::{
        collections::HashMap,
        process::{Command, Stdio},
    };

    use super::*;
    use crate::{
        children::{Counters, Lanes},
        config::{Config, RestartPolicy},
        registry::Registry,
    };

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
            fleet: None,
            counters,
            lineage: crate::instance::Lineage::random().unwrap(),
            timings: Default::default(),
            starting: crate::manager::starting_gate(),
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
            launch: Launch::new(
                &config.services["web"],
                0,
                &config.supervisor,
                &context.lineage,
                &context.counters,
                (None, None),
            )
            .unwrap(),
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

    /// A place among the workers starting at once is held until the worker registers or exits.
    #[tokio::test]
    async fn a_start_permit_comes_back_when_the_worker_registers_or_exits() {
        let task = task(Lifecycle::default());
        let gate = task.context.starting.clone();
        let all = gate.available_permits();
        let permits_back = |expected: usize| {
            let gate = gate.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(10), async {
                    while gate.available_permits() != expected {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
                .await
                .expect("the permit back within 10 s");
            }
        };
        // Registered: given back.
        let mut registers = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = registers.id();
        task.hold_until_registered(gate.clone().acquire_owned().await.unwrap(), pid);
        assert_eq!(gate.available_permits(), all - 1);
        let address = Address::Tcp(([127, 0, 0, 1], 8000).into());
        task.context
            .registry
            .register(crate::registry::Worker::ready(
                "web",
                0,
                pid,
                vec![crate::registry::Protocol::Http1],
                vec![address],
            ))
            .unwrap();
        permits_back(all).await;
        registers.kill().unwrap();
        registers.wait().unwrap();
        // Exited unregistered: given back too, long before the registration timeout.
        let mut exits = Command::new("sleep").arg("30").spawn().unwrap();
        task.hold_until_registered(gate.clone().acquire_owned().await.unwrap(), exits.id());
        assert_eq!(gate.available_permits(), all - 1);
        exits.kill().unwrap();
        exits.wait().unwrap();
        permits_back(all).await;
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
            adopted: false,
            prober: None,
        };
        let exit = tokio::time::timeout(Duration::from_secs(10), task.retire(instance, "a test"))
            .await
            .unwrap();
        assert_eq!(exit, Ending::Exit(Exit::Signal(9)));
        assert_eq!(exit.to_string(), "signal 9");
        assert_eq!(task.context.lanes.free(), 4, "the lane is free again");
    }
}
