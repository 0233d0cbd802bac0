//! What the manager and its slot tasks share: the [`Context`] every task holds, and the commands the
//! manager sends a task with their answers.

use std::sync::Arc;

use tokio::sync::oneshot;

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
