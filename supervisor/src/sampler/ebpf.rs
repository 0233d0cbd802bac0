//! The eBPF scheduler source: [`peregrine_ebpf::Probe`] counts each tracked worker's on-CPU and
//! run-queue time in the kernel, from scheduler events, per CPU; a read sums the CPUs' cells from
//! shared memory without a syscall. Its mmapable `counters` map is the request counter region.

use std::{os::fd::AsFd, sync::Arc};

use peregrine_contract::{counters::CounterRegion, shm::ShmError};
use peregrine_ebpf::Probe;

use super::{SampleError, SamplerKind, SchedSource, SchedTotals};
use crate::children::Counters;

/// The loaded probe, as a [`SchedSource`].
#[derive(Debug)]
pub struct EbpfSource {
    probe: Probe,
}

impl EbpfSource {
    /// Loads and attaches the kernel program for `slots` worker slots; returns the source and the
    /// request counters (the probe's map, which the workers inherit and count in).
    pub fn load(slots: usize) -> Result<(EbpfSource, Arc<Counters>), peregrine_ebpf::Error> {
        let slots_u32 = u32::try_from(slots.max(1)).unwrap_or(u32::MAX);
        let probe = Probe::load(slots_u32)?;
        let counters =
            counters_of(&probe, slots.max(1)).map_err(|source| peregrine_ebpf::Error::Mmap {
                name: "counters",
                source,
            })?;
        Ok((EbpfSource { probe }, Arc::new(counters)))
    }
}

fn counters_of(probe: &Probe, slots: usize) -> Result<Counters, ShmError> {
    // Its own descriptor of the map: the workers inherit it, and it keeps the map alive.
    let fd = probe.counters().try_clone_to_owned()?;
    let region = CounterRegion::map(fd.as_fd(), slots)?;
    Ok(Counters::new(fd, region))
}

fn backend(what: &'static str, source: peregrine_ebpf::Error) -> SampleError {
    SampleError::Ebpf {
        what,
        source: Box::new(source),
    }
}

impl SchedSource for EbpfSource {
    fn kind(&self) -> SamplerKind {
        SamplerKind::Ebpf
    }

    fn track(&mut self, slot: usize, pid: u32) -> Result<(), SampleError> {
        let slot = u32::try_from(slot).map_err(|_| SampleError::NotTracked { slot, pid })?;
        self.probe
            .track(slot, pid)
            .map_err(|e| backend("cannot track the worker in the eBPF map", e))
    }

    fn untrack(&mut self, _slot: usize, pid: u32) {
        if let Err(error) = self.probe.untrack(pid) {
            tracing::warn!(pid, error = %error, "Cannot untrack a worker in the eBPF map");
        }
    }

    fn read(&mut self, slot: usize, pid: u32) -> Result<SchedTotals, SampleError> {
        // The cells keep a process's totals after it exits; `kill(pid, 0)` (no signal is sent) says
        // whether it still exists, so a worker the manager has reaped (and whose slot counter it may
        // have zeroed for a successor) reads as gone.
        let alive = rustix::process::Pid::from_raw(pid as i32)
            .is_some_and(|p| rustix::process::test_kill_process(p).is_ok());
        if !alive {
            return Err(SampleError::Gone { pid });
        }
        let slot = u32::try_from(slot).map_err(|_| SampleError::NotTracked { slot, pid })?;
        let totals = self.probe.read(slot, pid);
        Ok(SchedTotals {
            on_cpu_ns: totals.on_cpu_ns,
            runq_wait_ns: totals.runq_wait_ns,
        })
    }
}
