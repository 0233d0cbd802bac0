//! What the manager and its slot tasks share: the [`Context`] every task holds, and the commands the
//! manager sends a task with their answers.

use std::sync::Arc;

use tokio::sync::{Semaphore, oneshot};

use super::{error::ReplaceError, launch::Launch};
use crate::{
    children::{Children, Counters, Lanes, Slot},
    fleet::FleetDrains,
    instance::Lineage,
    registry::Registry,
    timings::Timings,
    xds::acks::Acks,
};

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
    /// In a fleet, how far the other hosts' Envoys have ACKed: a drain waits on it too.
    pub fleet: Option<Arc<FleetDrains>>,
    /// The request counter region handed to new workers.
    pub counters: Arc<Counters>,
    /// The control socket's lineage, which every worker carries (see [`crate::instance`]).
    pub lineage: Lineage,
    /// Where drains are timed, for the metrics.
    pub timings: Timings,
    /// The workers that may be starting at once ([`STARTING_AT_ONCE`]), over every service: a
    /// slot task takes a permit before it spawns a worker and gives it back once the worker has
    /// registered, exited or run out of time.
    pub starting: Arc<Semaphore>,
}

/// How many workers may be starting (spawned, not registered yet) at once. A burst of starts (a
/// service of hundreds of workers, a supervisor started again) otherwise queues more registrations
/// than a slow machine answers within a worker's registration timeout; the workers that give up are
/// started again, which queues more, and the service never comes up. Measured: 256 workers started
/// at once on 2 emulated CPUs (QEMU's TCG) never got past 2 registered in 2 minutes.
pub(super) const STARTING_AT_ONCE: usize = 32;

/// The semaphore of [`Context::starting`].
pub fn starting_gate() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(STARTING_AT_ONCE))
}

/// A command to a slot task.
#[derive(Debug)]
pub(super) enum SlotCommand {
    /// Start a new worker (with a new launch, if given); once it has registered, drain and stop the
    /// current one. Answers what happened.
    Replace {
        launch: Option<Box<Launch>>,
        done: oneshot::Sender<Result<Replaced, ReplaceError>>,
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
