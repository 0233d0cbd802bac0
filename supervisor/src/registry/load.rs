//! What the registry holds beside endpoints: each worker's sampled load, and each slot's restarts.
//!
//! Both change far more often than endpoints (loads every sample interval), so each has a watch
//! channel of its own and never moves the endpoint [`Snapshot`](super::Snapshot)'s revision: xDS
//! rebuilds its cache on every snapshot and must not see a load change.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    time::{Duration, SystemTime},
};

/// Which kind of scheduler source runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SamplerKind {
    /// Scheduler events counted in the kernel by eBPF programs.
    Ebpf,
    /// `/proc/<pid>/task/*/schedstat`.
    Procfs,
}

impl SamplerKind {
    /// `"ebpf"` or `"procfs"`, as in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            SamplerKind::Ebpf => "ebpf",
            SamplerKind::Procfs => "procfs",
        }
    }
}

impl fmt::Display for SamplerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One worker instance's sampled load.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerLoad {
    /// Its service.
    pub service: String,
    /// Its slot in the service.
    pub index: u32,
    /// Its process id: a load belongs to one worker instance.
    pub pid: u32,
    /// CPU use between the last two samples, in cores (1.0 = one CPU busy all the time). `None` after
    /// the first sample, which is a baseline.
    pub cpu_cores: Option<f64>,
    /// Run-queue wait between the last two samples, in cores: the share of wall time the worker's
    /// threads were runnable but waiting for a CPU (1.0 = one thread waiting all the time).
    pub runq_wait_cores: Option<f64>,
    /// Requests per second between the last two samples.
    pub requests_per_second: Option<f64>,
    /// On-CPU time since the scheduler source's baseline (for procfs, the worker's start).
    pub cpu_seconds_total: f64,
    /// Run-queue wait since the scheduler source's baseline.
    pub runq_wait_seconds_total: f64,
    /// Requests this worker instance served (its counter starts at zero).
    pub requests_total: u64,
    /// Mean requests in flight between the last two samples: kept by a built-in worker (exact), or
    /// seen in the kernel's socket tables for a server on a passed listener (the mean of the counts
    /// at the two samples). `None` where neither is known.
    pub in_flight: Option<f64>,
    /// Requests in flight at the last sample.
    pub in_flight_now: Option<u64>,
    /// The utilization that requests in flight make: [`in_flight`](Self::in_flight) over the
    /// service's concurrency (unscaled for a server of many at once).
    pub in_flight_utilization: Option<f64>,
    /// For a worker of a service that serves a known number of requests at once (`concurrency`),
    /// with its requests in flight known: its rate and utilization as ORCA reports them, each an
    /// exponential mean over a few seconds of samples (from its first rates on: see
    /// [`SmoothedLoad::settled`]). `None` otherwise.
    pub smoothed: Option<SmoothedLoad>,
    /// When the sample was taken.
    pub sampled_at: SystemTime,
}

/// A worker's rate and utilization, each an exponential mean over a few seconds of samples.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SmoothedLoad {
    /// Requests per second.
    pub requests_per_second: f64,
    /// The higher of (on-CPU + run-queue wait) in cores and the mean requests in flight over the
    /// service's concurrency.
    pub utilization: f64,
    /// Whether the means cover their time constant. Until then they lean on the first samples (one
    /// that saw nothing in flight would weigh a busy worker by its CPU alone, a hundred times its
    /// peers), and ORCA reports nothing for the worker.
    pub settled: bool,
}

/// What the kernel shows on a service's shared listener at a sample: the connections waiting in its
/// accept queue, and the accepted ones that hold a request (see the sampler's `sock_diag`). The
/// service's requests in flight, whichever worker holds them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ListenerLoad {
    /// Connections not accepted yet.
    pub queued: u64,
    /// Accepted connections that hold a request.
    pub serving: u64,
    /// The load of the one endpoint the listener is to Envoy, as its ORCA reports carry it: its
    /// workers' summed rate, and their utilization (the listener's requests in flight per worker
    /// over the concurrency, or their CPU and run-queue wait if higher), exponential means over a
    /// few seconds. `None` until the sampler has its first means.
    pub smoothed: Option<SmoothedLoad>,
}

/// The sampler that produces the loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplerInfo {
    /// Its scheduler source.
    pub kind: SamplerKind,
    /// Its sample interval.
    pub interval: Duration,
}

/// The loads of every sampled worker at one sample, immutable once published.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Loads {
    /// The running sampler; `None` while none runs.
    pub sampler: Option<SamplerInfo>,
    /// By service, slot index and pid (a slot being replaced has two instances).
    by_instance: BTreeMap<(String, u32, u32), WorkerLoad>,
    by_pid: HashMap<u32, (String, u32, u32)>,
    /// The shared listeners' loads, by service.
    listeners: BTreeMap<String, ListenerLoad>,
}

impl Loads {
    /// The loads of `workers`, as sampled by `sampler`. A later load of the same instance replaces an
    /// earlier one.
    pub fn new(
        sampler: Option<SamplerInfo>,
        workers: impl IntoIterator<Item = WorkerLoad>,
    ) -> Self {
        let mut loads = Loads {
            sampler,
            ..Loads::default()
        };
        for load in workers {
            let key = (load.service.clone(), load.index, load.pid);
            loads.by_pid.insert(load.pid, key.clone());
            loads.by_instance.insert(key, load);
        }
        loads
    }

    /// The load of the worker process `pid` in `service`'s slot `index`.
    pub fn get(&self, service: &str, index: u32, pid: u32) -> Option<&WorkerLoad> {
        self.by_instance.get(&(service.to_owned(), index, pid))
    }

    /// The load of the worker process `pid`.
    pub fn by_pid(&self, pid: u32) -> Option<&WorkerLoad> {
        self.by_instance.get(self.by_pid.get(&pid)?)
    }

    /// Every load, by service name, slot index and pid.
    pub fn iter(&self) -> impl Iterator<Item = &WorkerLoad> {
        self.by_instance.values()
    }

    /// These loads with the shared listeners' `listeners`, by service.
    pub fn with_listeners(
        mut self,
        listeners: impl IntoIterator<Item = (String, ListenerLoad)>,
    ) -> Self {
        self.listeners.extend(listeners);
        self
    }

    /// The load of `service`'s shared listener, where it has one and its tables could be read.
    pub fn listener(&self, service: &str) -> Option<ListenerLoad> {
        self.listeners.get(service).copied()
    }

    /// Every shared listener's load, by service name.
    pub fn listeners(&self) -> impl Iterator<Item = (&str, ListenerLoad)> {
        self.listeners
            .iter()
            .map(|(service, load)| (service.as_str(), *load))
    }

    /// How many workers have a load.
    pub fn len(&self) -> usize {
        self.by_pid.len()
    }

    /// Whether no worker has a load.
    pub fn is_empty(&self) -> bool {
        self.by_pid.is_empty()
    }
}

/// The state of one worker slot, whether or not a worker is registered in it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotStatus {
    /// How often the manager restarted the slot's worker (after an exit or a failed start).
    pub restarts: u64,
    /// How the last worker ended (`exit code 3`, `signal 9`, or why it could not start).
    pub last_exit: Option<String>,
    /// The delay before the restart that follows the last exit.
    pub restart_delay: Option<std::time::Duration>,
    /// The slot's workers keep exiting before they have run `healthy_after`: its restart delay grows.
    /// Cleared once a worker stays up that long.
    pub crash_looping: bool,
    /// For a server on a passed listener that is not ready yet, what the last probe of its ready
    /// path found.
    pub last_probe: Option<String>,
}

/// Every worker slot the manager runs, by service and index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slots {
    by_service: BTreeMap<String, BTreeMap<u32, SlotStatus>>,
}

impl Slots {
    /// The status of `service`'s slot `index`.
    pub fn get(&self, service: &str, index: u32) -> Option<SlotStatus> {
        self.by_service.get(service)?.get(&index).cloned()
    }

    /// Every slot as (service, index, status), by service name and then index.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u32, &SlotStatus)> {
        self.by_service.iter().flat_map(|(service, slots)| {
            slots
                .iter()
                .map(move |(index, status)| (service.as_str(), *index, status))
        })
    }

    /// Forgets `service`'s slot `index` (removed from the config); returns whether it was there.
    pub(super) fn remove(&mut self, service: &str, index: u32) -> bool {
        let Some(slots) = self.by_service.get_mut(service) else {
            return false;
        };
        let removed = slots.remove(&index).is_some();
        if slots.is_empty() {
            self.by_service.remove(service);
        }
        removed
    }

    /// Applies `change` to the status of `service`'s slot `index`; returns whether it changed.
    pub(super) fn update(
        &mut self,
        service: &str,
        index: u32,
        change: impl FnOnce(&mut SlotStatus),
    ) -> bool {
        let status = self
            .by_service
            .entry(service.to_owned())
            .or_default()
            .entry(index)
            .or_default();
        let before = status.clone();
        change(status);
        *status != before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(service: &str, index: u32, pid: u32) -> WorkerLoad {
        WorkerLoad {
            service: service.into(),
            index,
            pid,
            cpu_cores: None,
            runq_wait_cores: None,
            requests_per_second: None,
            cpu_seconds_total: 0.0,
            runq_wait_seconds_total: 0.0,
            requests_total: 0,
            in_flight: None,
            in_flight_now: None,
            in_flight_utilization: None,
            smoothed: None,
            sampled_at: SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn finds_loads_by_slot_and_by_pid() {
        let loads = Loads::new(None, [load("b", 0, 30), load("a", 1, 20), load("a", 0, 10)]);
        assert_eq!(loads.get("a", 1, 20).map(|l| l.pid), Some(20));
        assert_eq!(
            loads.by_pid(30).map(|l| (l.service.as_str(), l.index)),
            Some(("b", 0))
        );
        assert!(loads.get("a", 1, 21).is_none() && loads.by_pid(40).is_none());
        let order: Vec<u32> = loads.iter().map(|l| l.pid).collect();
        assert_eq!(order, [10, 20, 30]);
        // A slot being replaced has a load per instance.
        let loads = Loads::new(None, [load("a", 0, 11), load("a", 0, 10)]);
        assert_eq!(loads.len(), 2);
        assert_eq!(loads.by_pid(10).map(|l| l.pid), Some(10));
        assert_eq!(loads.by_pid(11).map(|l| l.pid), Some(11));
    }
}
