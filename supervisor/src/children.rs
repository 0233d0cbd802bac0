//! The process table: which live processes are this supervisor's workers, in which slot and lane, and
//! where each counts its requests.
//!
//! - [`Slot`]: a service and an index in `0..count`; the unit the manager runs one task for.
//! - [`Lanes`]: the lanes of the request counter region and of the scheduler source, one per live
//!   worker *instance* (a slot being replaced holds two for a while), handed out and returned on drop.
//! - [`Counters`]: the shared request counter region (its descriptor, which workers inherit, and the
//!   supervisor's mapping); [`CounterRef`] is one worker's line of it.
//! - [`Children`]: live worker pids to their [`Child`] entry (slot, lane, counter).
//!
//! The manager writes the table (a spawn, an adoption, a reap); registration asks it whether a
//! connecting process is one of ours and for which slot; the sampler asks where each worker counts.
//!
//! Invariant: this module knows processes, not state: whether a worker is registered, serving or
//! draining is the registry's alone. An entry exists from just before a worker can register (the
//! table is locked across the spawn) until its process has been reaped.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    sync::{Arc, Mutex, atomic::Ordering},
};

use peregrine_contract::{
    counters::{CounterRegion, FEATURE_IN_FLIGHT, InFlight},
    shm::ShmError,
};

use crate::config::Config;

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

    /// The descriptor of the region its line is in.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.region.fd()
    }

    /// Its line in that region.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The requests counted so far.
    pub fn load(&self) -> u64 {
        self.region
            .region()
            .lane(self.index)
            .load(Ordering::Relaxed)
    }

    /// Its requests in flight, if the worker keeps them (a built-in worker of this version; not a
    /// server on a passed listener, nor a worker of an older version).
    pub fn in_flight(&self) -> Option<InFlight> {
        let region = self.region.region();
        let kept = region.features(self.index).load(Ordering::Relaxed) & FEATURE_IN_FLIGHT != 0;
        kept.then(|| InFlight(region.in_flight(self.index).load(Ordering::Relaxed)))
    }
}

/// A live worker process of this supervisor.
#[derive(Clone, Debug)]
pub struct Child {
    /// Its slot.
    pub slot: Slot,
    /// Its lane: its slot in the scheduler source and, for a passed-socket server, its line in the
    /// shared request counter region; no two live workers share one.
    pub lane: usize,
    /// Where it counts its requests: a region of its own, or its lane of the shared one.
    pub counter: CounterRef,
    /// Whether it counts its requests there itself: a server on a passed listener (`pass_socket`)
    /// does not.
    pub counts_requests: bool,
    /// For a server on a passed TCP listener, the listener's port: the eBPF sampler counts the
    /// responses sent on the connections it accepted, in the lane's counter. Without it (procfs, or a
    /// Unix listener) such a server has no request rate, and no stall is judged from one.
    pub listen_port: Option<u16>,
    /// Whether that listener is IPv6 (its connections are then the kernel's IPv6 sockets, IPv4 ones
    /// mapped into it included).
    pub listen_ipv6: bool,
    /// Whether that listener is the service's shared one (`listener = "shared"`): its connections
    /// are every worker's, so none of them is this worker's own requests in flight.
    pub listen_shared: bool,
    /// The uid it was started with (its service's `user`, or the supervisor's): the only uid it may
    /// register as.
    pub uid: u32,
    /// How many requests it serves at once (its service's `concurrency`); `None`: many. The sampler
    /// scales its requests in flight by it into a utilization.
    pub concurrency: Option<u32>,
}

impl Child {
    /// Whether it serves on a listener the supervisor bound and passed it (`pass_socket`), which
    /// the supervisor registers: such a server is the one that does not count its own requests.
    pub fn is_passed(&self) -> bool {
        !self.counts_requests
    }
}

/// Live worker processes by pid.
#[derive(Debug, Default)]
pub struct Children {
    by_pid: Mutex<HashMap<u32, Child>>,
    /// Children that are no workers and that whoever started them waits for (an upgrade's checks
    /// of the new program): the orphan reaper leaves them alone. Locked after `by_pid`.
    waited: Mutex<HashSet<u32>>,
    /// The supervisor's orphan watcher, while it runs: the one process with this lineage and no
    /// slot that is never a worker's leftover (`manager::orphan_watch`).
    helper: Mutex<Option<u32>>,
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

    /// Whether `pid` is a live worker of ours (or one that exited and is not yet reaped).
    pub fn is_worker(&self, pid: u32) -> bool {
        self.lock().contains_key(&pid)
    }

    /// The pids of every live worker.
    pub fn pids(&self) -> HashSet<u32> {
        self.lock().keys().copied().collect()
    }

    /// Runs `f` unless `pid` is a worker, with the table locked throughout: no worker with that pid
    /// can be added meanwhile (a spawn holds the lock), so `f` may reap a child that is no worker.
    pub fn unless_worker<T>(&self, pid: u32, f: impl FnOnce() -> T) -> Option<T> {
        let map = self.lock();
        let waited = self.waited.lock().unwrap_or_else(|e| e.into_inner());
        let result = (!map.contains_key(&pid) && !waited.contains(&pid)).then(f);
        drop(waited);
        drop(map);
        result
    }

    /// Starts a child that is no worker and that the caller waits for itself, with `spawn` (which
    /// returns its pid and the rest): [`Children::unless_worker`] passes it over, so the orphan
    /// reaper never takes its exit status from its waiter. The table is locked across the spawn.
    /// Call [`Children::done_waiting`] once it has been waited for.
    pub fn spawn_waited<T>(
        &self,
        spawn: impl FnOnce() -> std::io::Result<(u32, T)>,
    ) -> std::io::Result<(u32, T)> {
        let _map = self.lock();
        let (pid, more) = spawn()?;
        self.waited
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pid);
        Ok((pid, more))
    }

    /// Forgets a child of [`Children::spawn_waited`] that has been waited for.
    pub fn done_waiting(&self, pid: u32) {
        self.waited
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&pid);
    }

    /// Marks `pid` as the supervisor's own helper (its orphan watcher), or none.
    pub fn set_helper(&self, pid: Option<u32>) {
        *self.helper.lock().unwrap_or_else(|e| e.into_inner()) = pid;
    }

    /// Whether `pid` is the supervisor's own helper, marked by [`Children::set_helper`].
    pub fn is_helper(&self, pid: u32) -> bool {
        *self.helper.lock().unwrap_or_else(|e| e.into_inner()) == Some(pid)
    }

    /// Adds a live worker: one this supervisor adopted.
    pub fn insert(&self, pid: u32, child: Child) {
        self.lock().insert(pid, child);
    }

    /// Starts a worker with `spawn` (which returns its pid and anything else the caller needs) and
    /// adds it as `child`. The table is locked across the spawn, so a registration from the new pid
    /// waits for its entry instead of racing it.
    pub fn spawn<T>(
        &self,
        child: Child,
        spawn: impl FnOnce() -> std::io::Result<(u32, T)>,
    ) -> std::io::Result<(u32, T)> {
        let mut map = self.lock();
        let (pid, more) = spawn()?;
        map.insert(pid, child);
        Ok((pid, more))
    }

    /// Forgets a worker whose process has exited.
    pub fn remove(&self, pid: u32) -> Option<Child> {
        self.lock().remove(&pid)
    }

    #[cfg(test)]
    pub(crate) fn insert_for_test(&self, pid: u32, service: &str, index: u32) {
        let counters = Arc::new(Counters::memfd(1).expect("a memfd"));
        self.insert_with_lane_for_test(pid, service, index, 0, &counters);
    }

    #[cfg(test)]
    pub(crate) fn insert_as_for_test(&self, pid: u32, service: &str, index: u32, uid: u32) {
        self.insert_for_test(pid, service, index);
        if let Some(child) = self.lock().get_mut(&pid) {
            child.uid = uid;
        }
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
        self.insert_counted_for_test(pid, (service, index), lane, counters, true);
    }

    #[cfg(test)]
    pub(crate) fn insert_counted_for_test(
        &self,
        pid: u32,
        (service, index): (&str, u32),
        lane: usize,
        counters: &Arc<Counters>,
        counts_requests: bool,
    ) {
        let child = Child {
            slot: Slot {
                service: service.into(),
                index,
            },
            lane,
            counter: CounterRef::new(counters.clone(), lane),
            counts_requests,
            listen_port: None,
            listen_ipv6: false,
            listen_shared: false,
            uid: rustix::process::geteuid().as_raw(),
            concurrency: None,
        };
        self.lock().insert(pid, child);
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

    /// How many lanes are free.
    pub fn free(&self) -> usize {
        self.lock().len()
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

/// How many worker slots `config` has.
pub fn slot_count(config: &Config) -> usize {
    config.services.values().map(|s| s.count as usize).sum()
}

/// A request counter region: its descriptor, and the supervisor's mapping of it.
///
/// The shared one, with a lane per worker instance, is the eBPF sampler's `BPF_F_MMAPABLE` `counters`
/// map ([`crate::sampler::ebpf::EbpfSource::load`]), where the kernel counts passed-socket servers'
/// responses, or a memfd of the same layout ([`Counters::memfd`]). A worker that counts its own
/// requests gets a one-line memfd of its own, the one descriptor it inherits: it cannot reach
/// another's count.
#[derive(Debug)]
pub struct Counters {
    fd: OwnedFd,
    region: CounterRegion,
}

impl Counters {
    /// A region behind `fd`, mapped as `region`.
    pub fn new(fd: OwnedFd, region: CounterRegion) -> Self {
        Counters { fd, region }
    }

    /// A fresh zeroed memfd region of `lanes` counters.
    pub fn memfd(lanes: usize) -> Result<Self, ShmError> {
        let (fd, region) = CounterRegion::create(lanes)?;
        Ok(Counters { fd, region })
    }

    /// The descriptor (a worker inherits its own region's).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The supervisor's mapping.
    pub fn region(&self) -> &CounterRegion {
        &self.region
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_that_does_not_keep_its_requests_in_flight_has_none_rather_than_zero() {
        use peregrine_contract::counters::FEATURE_IN_FLIGHT;
        let counters = Arc::new(Counters::memfd(2).unwrap());
        let (new, old) = (
            CounterRef::new(counters.clone(), 0),
            CounterRef::new(counters.clone(), 1),
        );
        // A worker of this version says it keeps the word; one of an older version leaves it all zero.
        let region = counters.region();
        region
            .features(0)
            .store(FEATURE_IN_FLIGHT, Ordering::Relaxed);
        region
            .in_flight(0)
            .store(InFlight::start_delta(5), Ordering::Relaxed);
        assert_eq!(new.in_flight().map(InFlight::open), Some(1));
        assert_eq!(old.in_flight(), None);
    }

    #[test]
    fn a_child_its_starter_waits_for_is_passed_over_by_the_orphan_reaper_until_waited_for() {
        let children = Children::default();
        let (pid, ()) = children.spawn_waited(|| Ok((4242, ()))).unwrap();
        assert_eq!(children.unless_worker(pid, || "reaped"), None);
        assert!(!children.is_worker(pid), "it is no worker");
        children.done_waiting(pid);
        assert_eq!(children.unless_worker(pid, || "reaped"), Some("reaped"));
    }
}
