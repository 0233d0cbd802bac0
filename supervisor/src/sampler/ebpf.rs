//! The eBPF scheduler source: [`peregrine_ebpf::Probe`] counts each tracked worker's on-CPU and
//! run-queue time (with that of the processes it forks) in the kernel, from scheduler events, per
//! CPU; a read sums the CPUs' cells from shared memory without a syscall. Its mmapable `counters` map is the request counter region.

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
    /// Loads and attaches the kernel program for `lanes` worker lanes; returns the source and the
    /// request counters (the probe's map, which the workers inherit and count in).
    pub fn load(lanes: usize) -> Result<(EbpfSource, Arc<Counters>), peregrine_ebpf::Error> {
        let lanes_u32 = u32::try_from(lanes.max(1)).unwrap_or(u32::MAX);
        let probe = Probe::load(lanes_u32)?;
        let counters =
            counters_of(&probe, lanes.max(1)).map_err(|source| peregrine_ebpf::Error::Mmap {
                name: "counters",
                source,
            })?;
        Ok((EbpfSource { probe }, Arc::new(counters)))
    }

    /// Where the kernel counts the sends of servers on passed listeners, or why it does not: for
    /// the log line that names the sampler.
    pub fn sends(&self) -> String {
        match self.probe.send_hook() {
            Ok(hook) => format!("counted at {hook}"),
            Err(why) => format!(
                "not counted ({})",
                peregrine_contract::ErrorChain(why.as_ref())
            ),
        }
    }
}

fn counters_of(probe: &Probe, lanes: usize) -> Result<Counters, ShmError> {
    // Its own descriptor of the map: the workers inherit it, and it keeps the map alive.
    let fd = probe.counters().try_clone_to_owned()?;
    let region = CounterRegion::map(fd.as_fd(), lanes)?;
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

    fn track(&mut self, lane: usize, pid: u32) -> Result<(), SampleError> {
        let lane = u32::try_from(lane).map_err(|_| SampleError::NotTracked { lane, pid })?;
        self.probe
            .track(lane, pid)
            .map_err(|e| backend("cannot track the worker in the eBPF map", e))
    }

    fn count_sends(&mut self, lane: usize, port: u16) -> bool {
        let Ok(lane) = u32::try_from(lane) else {
            return false;
        };
        match self.probe.count_sends(lane, port) {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(lane, port, error = %peregrine_contract::ErrorChain(&error), "Cannot count the server's responses in the kernel: it has no request rate");
                false
            }
        }
    }

    fn counts_sends(&self) -> bool {
        self.probe.counts_sends()
    }

    fn untrack(&mut self, _lane: usize, pid: u32) {
        if let Err(error) = self.probe.untrack(pid) {
            tracing::warn!(pid, error = %error, "Cannot untrack a worker in the eBPF map");
        }
    }

    fn read(&mut self, lane: usize, pid: u32) -> Result<SchedTotals, SampleError> {
        // The cells keep a process's totals after it exits; `kill(pid, 0)` (no signal is sent) says
        // whether it still exists, so a worker the manager has reaped (and whose lane counter it may
        // have zeroed for a successor) reads as gone.
        let alive = rustix::process::Pid::from_raw(pid as i32)
            .is_some_and(|p| rustix::process::test_kill_process(p).is_ok());
        if !alive {
            return Err(SampleError::Gone { pid });
        }
        let lane = u32::try_from(lane).map_err(|_| SampleError::NotTracked { lane, pid })?;
        let totals = self.probe.read(lane, pid);
        Ok(SchedTotals {
            on_cpu_ns: totals.on_cpu_ns,
            runq_wait_ns: totals.runq_wait_ns,
        })
    }
}
