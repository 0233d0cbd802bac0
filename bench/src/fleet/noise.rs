//! How busy the machine was during a phase, and how much of that was other work than the
//! benchmark's (this process and everything it started: etcd, Envoys, supervisors, workers): the
//! machine is shared with other jobs, so every figure says how noisy its phase was.

use super::super::machine::{Busy, load_average};

/// A phase being measured.
#[derive(Clone, Copy, Debug)]
pub(super) struct Noise {
    start: Busy,
}

/// What a phase measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Load {
    /// Cores busy, all work together.
    pub(super) machine: f64,
    /// Cores busy with work other than the benchmark's.
    pub(super) others: f64,
    /// The 1-minute load average at the end.
    pub(super) load1: f64,
}

impl Noise {
    /// From now.
    pub(super) fn start() -> anyhow::Result<Noise> {
        Ok(Noise {
            start: Busy::now(std::process::id())?,
        })
    }

    /// Until now.
    pub(super) fn stop(self) -> anyhow::Result<Load> {
        let (machine, others) = Busy::now(std::process::id())?.since(self.start);
        Ok(Load {
            machine,
            others,
            load1: load_average()?[0],
        })
    }
}
