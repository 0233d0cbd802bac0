//! The load sampler: every `sample_interval_ms`, each worker's CPU use, run-queue wait and request rate.
//!
//! Two inputs per worker. Its scheduler time (on a CPU, and runnable but waiting for one) comes from a
//! [`SchedSource`]: [`ebpf::EbpfSource`] counts it in the kernel from scheduler events (a read is a
//! look at shared memory); [`procfs::ProcfsSource`] reads `/proc/<pid>/task/*/schedstat` where eBPF
//! cannot load. Its requests come from its lane of the shared
//! [`Counters`](crate::children::Counters) region, which
//! the manager zeroes before it starts each worker, so a lane's count is exactly what its current worker
//! served.
//!
//! [`run`] is the loop: on every tick it reconciles the tracked workers with the registry's snapshot
//! (tracks new pids, untracks gone ones), reads every worker, turns two readings into rates with the pure
//! [`rates::step`], and publishes the lot as one [`Loads`] value on the registry's load channel. A
//! worker's first reading is its baseline: its rates are `None` until the second. Between ticks, a
//! change of the endpoints (a registration) makes the loop take the baseline of any new worker at
//! once, so that its first rates come one tick after it registered (at least half an interval later:
//! a first rate never rests on a sliver of time), not two.
//!
//! A worker that served nothing in an interval is also looked at for a stall ([`stall`]): stopped,
//! or leaving requests unread. A stall, and its end, is the one thing the sampler writes into the
//! endpoint snapshot ([`Registry::set_stalled`]): Envoy must stop sending to such a worker, and an
//! idle-looking load report would do the opposite.
//!
//! Invariant: the sampler reads the endpoint snapshot and writes loads, and of endpoints only a
//! worker's stall; it never changes which workers exist, and loads never cause an endpoint snapshot
//! (xDS rebuilds on each of those).

pub mod ebpf;
pub mod procfs;
pub mod rates;
pub mod sock_diag;
pub mod stall;

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use tokio::sync::watch;

pub use peregrine_contract::ErrorChain;
use peregrine_contract::procfs::ProcError;

pub use crate::registry::SamplerKind;
use crate::{
    children::{Children, CounterRef},
    registry::{ListenerLoad, Loads, Registry, SamplerInfo, Snapshot, Stall, WorkerLoad},
};

/// Cumulative scheduler time of one process (all its threads) since an arbitrary baseline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedTotals {
    /// Time on a CPU, in nanoseconds.
    pub on_cpu_ns: u64,
    /// Time runnable but waiting for a CPU (on a run queue), in nanoseconds.
    pub runq_wait_ns: u64,
}

impl SchedTotals {
    /// The field-wise sum, saturating.
    pub fn saturating_add(self, other: SchedTotals) -> SchedTotals {
        SchedTotals {
            on_cpu_ns: self.on_cpu_ns.saturating_add(other.on_cpu_ns),
            runq_wait_ns: self.runq_wait_ns.saturating_add(other.runq_wait_ns),
        }
    }
}

/// Why a worker could not be tracked or read.
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    /// The process no longer exists (the worker is gone; the manager will notice).
    #[error("process {pid} is gone")]
    Gone {
        /// The process.
        pid: u32,
    },
    /// The lane is not tracked for this process.
    #[error("lane {lane} does not track process {pid}")]
    NotTracked {
        /// The lane.
        lane: usize,
        /// The process.
        pid: u32,
    },
    /// A procfs file could not be read or parsed.
    #[error(transparent)]
    Proc(#[from] ProcError),
    /// A BPF map operation failed.
    #[error("{what}")]
    Ebpf {
        /// What failed.
        what: &'static str,
        /// The cause (boxed: the loader's error is large, and this one is rare).
        #[source]
        source: Box<peregrine_ebpf::Error>,
    },
}

/// Where the sampler reads the scheduler time of worker processes.
///
/// `lane` is the worker instance's lane ([`crate::children::Lanes`]), which also indexes the request
/// counter region. The loop calls [`track`](SchedSource::track) once per worker instance
/// before reading it, and [`untrack`](SchedSource::untrack) once it is gone or replaced.
pub trait SchedSource: Send {
    /// Which kind of source this is.
    fn kind(&self) -> SamplerKind;
    /// Starts following process `pid` in `lane` (replacing whatever the lane followed).
    fn track(&mut self, lane: usize, pid: u32) -> Result<(), SampleError>;
    /// Stops following process `pid` in `lane`.
    fn untrack(&mut self, lane: usize, pid: u32);
    /// The process's cumulative scheduler time. [`SampleError::Gone`] when it has exited.
    fn read(&mut self, lane: usize, pid: u32) -> Result<SchedTotals, SampleError>;
    /// Counts, in `lane`'s request counter, the responses the lane's processes send on connections
    /// their listener on `port` accepted: for a server that does not count its requests. `false`
    /// when this source cannot (procfs); the lane then has no request rate.
    fn count_sends(&mut self, lane: usize, port: u16) -> bool {
        let _ = (lane, port);
        false
    }
    /// Whether [`count_sends`](Self::count_sends) can count at all.
    fn counts_sends(&self) -> bool {
        false
    }
}

impl fmt::Debug for dyn SchedSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SchedSource({})", self.kind())
    }
}

/// What the loop needs besides its source.
#[derive(Debug, Clone)]
pub struct Options {
    /// Time between samples.
    pub interval: Duration,
    /// Where each pass's duration goes, for the metrics.
    pub pass_time: Option<prometheus_client::metrics::histogram::Histogram>,
}

/// Samples every registered worker each `interval` and publishes the loads, until `stop` turns true.
///
/// Reading runs on tokio's blocking pool (files under `/proc`, or BPF map look-ups), one tick at a time,
/// so a slow read delays the next tick rather than a runtime thread.
pub async fn run(
    source: Box<dyn SchedSource>,
    children: Arc<Children>,
    registry: Arc<Registry>,
    options: Options,
    mut stop: watch::Receiver<bool>,
) {
    let info = SamplerInfo {
        kind: source.kind(),
        interval: options.interval,
    };
    tracing::info!(sampler = %info.kind, interval = ?info.interval, "Sampling workers");
    registry.publish_loads(Loads::new(Some(info), []));
    let mut sampler = Sampler::new(source, children);
    sampler.min_window = options.interval / 2;
    let mut state = Some(sampler);
    let mut ticks = tokio::time::interval(options.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut snapshots = registry.subscribe();
    loop {
        let full = tokio::select! {
            _ = ticks.tick() => true,
            changed = snapshots.changed() => {
                if changed.is_err() {
                    break;
                }
                false
            }
            _ = stop.wait_for(|stop| *stop) => break,
        };
        let Some(mut sampler) = state.take() else {
            break;
        };
        let snapshot = snapshots.borrow_and_update().clone();
        if !full {
            #[cfg(test)]
            PASSES_BETWEEN_TICKS.with(|passes| passes.set(passes.get() + 1));
            // The endpoints changed (a registration, most often): a new worker's baseline now, so
            // that its first rates come at the next tick rather than the one after.
            match tokio::task::spawn_blocking(move || {
                sampler.baseline_new(&snapshot, Instant::now());
                sampler
            })
            .await
            {
                Ok(sampler) => {
                    state = Some(sampler);
                    continue;
                }
                Err(error) => {
                    tracing::error!(%error, "The sampler failed; loads are no longer published");
                    break;
                }
            }
        }
        let ticked_on = snapshot.revision;
        let tick = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let loads = sampler.tick(&snapshot, started, SystemTime::now());
            (sampler, loads, started.elapsed())
        });
        match tick.await {
            Ok((sampler, sample, took)) => {
                if let Some(pass_time) = &options.pass_time {
                    pass_time.observe(took.as_secs_f64());
                }
                registry.publish_loads(
                    Loads::new(Some(info), sample.loads).with_listeners(sample.listeners),
                );
                let mut own_writes = 0;
                for change in sample.stalls {
                    let StallChange {
                        service,
                        index,
                        pid,
                        stall,
                    } = change;
                    if registry.set_stalled(&service, index, pid, stall).is_none() {
                        continue;
                    }
                    own_writes += 1;
                    match stall {
                        Some(stall) => {
                            tracing::warn!(%service, index, pid, %stall, "Worker stalled: Envoy sends it no new request until it moves again")
                        }
                        None => {
                            tracing::info!(%service, index, pid, "Stalled worker moves again: back in rotation")
                        }
                    }
                }
                // Its own stall writes are no news to the sampler: it marks what it now sees as
                // seen, in one step with reading it (so a later write still wakes it), and marks it
                // changed again when a revision since its snapshot is someone else's.
                if own_writes > 0
                    && snapshots.borrow_and_update().revision != ticked_on + own_writes
                {
                    snapshots.mark_changed();
                }
                state = Some(sampler);
            }
            Err(error) => {
                tracing::error!(%error, "The sampler failed; loads are no longer published");
                break;
            }
        }
    }
    registry.publish_loads(Loads::default());
}

#[cfg(test)]
thread_local! {
    /// The passes [`run`] made between ticks (woken by a change of the endpoints) on this thread:
    /// a test runs the loop on its current-thread runtime and sees from this which writes wake it.
    static PASSES_BETWEEN_TICKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The loop's state between ticks: the source, and per lane the worker followed and its history.
#[derive(Debug)]
struct Sampler {
    source: Box<dyn SchedSource>,
    /// The manager's live workers: each one's lane and request counter.
    children: Arc<Children>,
    /// Followed workers by lane.
    tracked: HashMap<usize, Tracked>,
    /// A baseline taken between ticks ([`Sampler::baseline_new`]) gives rates only once it is this
    /// old: half the interval, so a first rate never rests on a sliver of time.
    min_window: Duration,
    /// The kernel's socket tables, for the requests in flight of servers on passed listeners: opened
    /// at the first tick that has one; `Err` once it could not be (logged once, not tried again).
    diag: Option<Result<sock_diag::SockDiag, ()>>,
    /// The services whose workers share one passed TCP listener: its port, and whether it is IPv6.
    /// Its requests in flight are the service's, whichever worker holds them.
    shared: BTreeMap<String, (u16, bool)>,
    /// Each shared listener's history, by service.
    listener_history: BTreeMap<String, rates::ListenerHistory>,
}

/// Who counts a worker's requests in its lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Counting {
    /// The worker, once per request.
    ByWorker,
    /// The source, from the responses sent on connections its listener on this port accepted.
    Sends(u16),
    /// Nobody (a server on a passed Unix listener).
    None,
}

/// A worker instance the source follows.
#[derive(Debug)]
struct Tracked {
    pid: u32,
    counter: CounterRef,
    /// Whether the worker counts its requests (see [`crate::children::Child::counts_requests`]).
    counted: bool,
    history: Option<rates::History>,
    /// Whether a read error other than "gone" was logged already (once per instance is enough).
    warned: bool,
    /// Whether the last sample found bytes it left unread (see [`stall::judge`]).
    suspect: bool,
    /// Its stall, as last published.
    stall: Option<Stall>,
    /// When its history is a baseline taken between ticks, when that was.
    baseline_at: Option<Instant>,
    /// For a server on a passed TCP listener of its own, the listener's port and whether it is
    /// IPv6: where its requests in flight are seen ([`sock_diag`]).
    port: Option<(u16, bool)>,
    /// Its service's concurrency ([`crate::children::Child::concurrency`]).
    concurrency: Option<u32>,
}

/// What one tick found.
#[derive(Debug, Default)]
struct Sample {
    loads: Vec<WorkerLoad>,
    /// The shared listeners' loads, by service (none where the kernel's tables could not be read).
    listeners: Vec<(String, ListenerLoad)>,
    /// Workers whose stall began or ended.
    stalls: Vec<StallChange>,
}

/// A worker whose stall began (`Some`) or ended (`None`).
#[derive(Debug, PartialEq, Eq)]
struct StallChange {
    service: String,
    index: u32,
    pid: u32,
    stall: Option<Stall>,
}

/// A worker of the snapshot the manager lists: its pid, service, index, counter, who counts its
/// requests, and where its requests in flight are seen and its service's concurrency.
type Found<'a> = (u32, &'a str, u32, CounterRef, Counting, InFlightAt);

/// Where a worker's requests in flight are seen: the port of its own passed TCP listener and whether
/// it is IPv6 (`None`: it keeps them itself, or has no listener of its own), its service's
/// concurrency, and whether it accepts from its service's shared listener (whose count is the
/// service's).
type InFlightAt = (Option<(u16, bool)>, Option<u32>, bool);

/// A tracked worker in this tick's snapshot.
#[derive(Debug)]
struct Current {
    lane: usize,
    service: String,
    index: u32,
    /// Whether it accepts from its service's shared listener.
    shared: bool,
}

impl Sampler {
    fn new(source: Box<dyn SchedSource>, children: Arc<Children>) -> Self {
        Sampler {
            source,
            children,
            tracked: HashMap::new(),
            min_window: Duration::ZERO,
            diag: None,
            shared: BTreeMap::new(),
            listener_history: BTreeMap::new(),
        }
    }

    /// A tracked worker's requests in flight, as read now: kept in its line by a worker that counts,
    /// seen in `seen` (the kernel's count by listening port; `None`: the tables could not be read)
    /// for a server on a passed listener.
    fn in_flight_of(
        tracked: &Tracked,
        seen: Option<&HashMap<u16, sock_diag::Held>>,
    ) -> Option<rates::InFlightReading> {
        match tracked.port {
            Some((port, _)) => Some(rates::InFlightReading::Seen(
                seen?.get(&port).copied().unwrap_or_default(),
            )),
            None => {
                // The clock first: a request that starts after it adds nothing negative.
                let at_us = peregrine_contract::counters::coarse_now_us();
                let word = tracked.counter.in_flight()?;
                Some(rates::InFlightReading::Kept { word, at_us })
            }
        }
    }

    /// The requests in flight on the tracked passed listeners, by port, from the kernel's socket
    /// tables; `None` when they cannot be read (no figure, rather than a zero).
    fn seen_in_flight(&mut self) -> Option<HashMap<u16, sock_diag::Held>> {
        let listeners: Vec<(u16, bool)> = self
            .tracked
            .values()
            .filter_map(|t| t.port)
            .chain(self.shared.values().copied())
            .collect();
        if listeners.is_empty() {
            return Some(HashMap::new());
        }
        let ports: std::collections::HashSet<u16> =
            listeners.iter().map(|&(port, _)| port).collect();
        let families = sock_diag::Families {
            ipv4: listeners.iter().any(|&(_, ipv6)| !ipv6),
            ipv6: listeners.iter().any(|&(_, ipv6)| ipv6),
        };
        let diag = self.diag.get_or_insert_with(|| {
            sock_diag::SockDiag::open().map_err(|error| {
                tracing::warn!(error = %ErrorChain(&error), "Cannot read the kernel's socket tables: servers on passed listeners have no requests in flight");
            })
        });
        let Ok(socket) = diag else {
            return None;
        };
        match socket.in_flight(&ports, families) {
            Ok(seen) => Some(seen),
            Err(error) => {
                tracing::warn!(error = %ErrorChain(&error), "Cannot read the kernel's socket tables: servers on passed listeners have no requests in flight");
                self.diag = Some(Err(()));
                None
            }
        }
    }

    /// Follows the workers of `snapshot` that are new and takes their baseline reading at `now`,
    /// between ticks; publishes nothing (a baseline has no rates). A read that fails is left to the
    /// next tick, which reports it.
    fn baseline_new(&mut self, snapshot: &Snapshot, now: Instant) {
        for Current { lane, .. } in self.reconcile(snapshot) {
            let Some(tracked) = self.tracked.get_mut(&lane) else {
                continue;
            };
            if tracked.history.is_some() {
                continue;
            }
            let Ok(sched) = self.source.read(lane, tracked.pid) else {
                continue;
            };
            // A passed listener's count is only seen at ticks: its first mean comes a tick later.
            let reading = rates::Reading {
                pid: tracked.pid,
                sched,
                requests: tracked.counter.load(),
                in_flight: Self::in_flight_of(tracked, None),
                at: now,
            };
            tracked.history = Some(rates::step(None, reading).0);
            tracked.baseline_at = Some(now);
        }
    }

    /// One sample of every worker in `snapshot`: the loads to publish, and the stalls that changed.
    fn tick(&mut self, snapshot: &Snapshot, now: Instant, wall: SystemTime) -> Sample {
        let workers = self.reconcile(snapshot);
        let seen = self.seen_in_flight();
        self.sample(workers, (now, wall), stall::queued_in, seen.as_ref())
    }

    /// [`Sampler::tick`], with `queued` telling what waits in a process's sockets.
    #[cfg(test)]
    fn tick_with(
        &mut self,
        snapshot: &Snapshot,
        now: Instant,
        wall: SystemTime,
        queued: impl Fn(u32) -> Option<u64>,
    ) -> Sample {
        let workers = self.reconcile(snapshot);
        self.sample(workers, (now, wall), queued, Some(&HashMap::new()))
    }

    /// Samples the tracked `workers`, with `queued` telling what waits in a process's sockets and
    /// `seen` the requests in flight on passed listeners by port.
    fn sample(
        &mut self,
        workers: Vec<Current>,
        (now, wall): (Instant, SystemTime),
        queued: impl Fn(u32) -> Option<u64>,
        seen: Option<&HashMap<u16, sock_diag::Held>>,
    ) -> Sample {
        let mut sample = Sample {
            loads: Vec::with_capacity(workers.len()),
            listeners: Vec::new(),
            stalls: Vec::new(),
        };
        // The rates of each shared listener's workers at this tick, and their concurrency.
        let mut on_shared: BTreeMap<&str, (Vec<rates::Rates>, Option<u32>)> = BTreeMap::new();
        for Current {
            lane,
            service,
            index,
            shared,
        } in workers
        {
            let Some(tracked) = self.tracked.get_mut(&lane) else {
                continue;
            };
            let pid = tracked.pid;
            // A baseline of a moment ago: no rates yet.
            if let (Some(at), Some(history)) = (tracked.baseline_at, tracked.history.as_ref())
                && now.saturating_duration_since(at) < self.min_window
            {
                sample
                    .loads
                    .push(history.load(service, index, None, (tracked.concurrency, wall)));
                continue;
            }
            tracked.baseline_at = None;
            // Scheduler time first: a worker that is gone fails here, before its lane's counter could
            // have been zeroed for a successor.
            let sched = match self.source.read(lane, pid) {
                Ok(sched) => sched,
                Err(SampleError::Gone { .. }) => continue,
                Err(error) => {
                    if !std::mem::replace(&mut tracked.warned, true) {
                        tracing::warn!(%service, index, pid, error = %ErrorChain(&error), "Cannot sample worker");
                    }
                    continue;
                }
            };
            let reading = rates::Reading {
                pid,
                sched,
                requests: tracked.counter.load(),
                in_flight: Self::in_flight_of(tracked, seen),
                at: now,
            };
            let (history, rates) = rates::step(tracked.history.as_ref(), reading);
            tracked.history = Some(history);
            if shared && let Some((listener, _)) = self.shared.get_key_value(&service) {
                let (all, concurrency) = on_shared.entry(listener.as_str()).or_default();
                all.extend(rates);
                *concurrency = tracked.concurrency;
            }
            // Only a worker that served nothing can be stalled; one that did is not. One that counts
            // no requests (a server on a passed listener) is never judged by them.
            let (stall, suspect) = match rates {
                Some(_) if !tracked.counted => (None, false),
                Some(rates) if rates.requests_per_second == 0.0 => {
                    let seen = stall::Observation {
                        state: peregrine_contract::procfs::stat(pid).ok().map(|s| s.state),
                        cpu_cores: rates.cpu_cores,
                        queued_bytes: queued(pid),
                    };
                    stall::judge(seen, tracked.suspect)
                }
                Some(_) => (None, false),
                // A baseline tells nothing yet.
                None => (tracked.stall, tracked.suspect),
            };
            tracked.suspect = suspect;
            if tracked.stall != stall {
                tracked.stall = stall;
                sample.stalls.push(StallChange {
                    service: service.clone(),
                    index,
                    pid,
                    stall,
                });
            }
            sample
                .loads
                .push(history.load(service, index, rates, (tracked.concurrency, wall)));
        }
        // Each shared listener: what the kernel shows on it now, and its workers' load as one
        // endpoint's. Unread tables make no figure (not a zero) and leave the means as they were.
        if let Some(seen) = seen {
            for (service, (port, _)) in &self.shared {
                let held = seen.get(port).copied().unwrap_or_default();
                let (workers, concurrency) = on_shared
                    .get(service.as_str())
                    .map_or((&[][..], None), |(rates, c)| (rates.as_slice(), *c));
                let history = match self.listener_history.get(service) {
                    Some(previous) => previous.step(held.total(), now, workers),
                    None => rates::ListenerHistory::new(held.total(), now),
                };
                self.listener_history.insert(service.clone(), history);
                let load = ListenerLoad {
                    queued: held.queued,
                    serving: held.serving,
                    smoothed: history.load(concurrency),
                };
                sample.listeners.push((service.clone(), load));
            }
        }
        sample
    }

    /// Tracks the workers of `snapshot` that are new, untracks those that are gone; returns the
    /// tracked workers, by lane.
    fn reconcile(&mut self, snapshot: &Snapshot) -> Vec<Current> {
        let mut current: BTreeMap<usize, Found<'_>> = BTreeMap::new();
        self.shared.clear();
        for (service, view) in &snapshot.services {
            for worker in view.workers.values() {
                // A worker the manager no longer lists has exited (its lane may be reused already).
                if let Some(child) = self.children.child(worker.pid) {
                    if let Some(port) = child.listen_port.filter(|_| child.listen_shared) {
                        self.shared
                            .insert(service.clone(), (port, child.listen_ipv6));
                    }
                    current.insert(
                        child.lane,
                        (
                            worker.pid,
                            service,
                            worker.index,
                            child.counter,
                            match (child.counts_requests, child.listen_port) {
                                (true, _) => Counting::ByWorker,
                                (false, Some(port)) => Counting::Sends(port),
                                (false, None) => Counting::None,
                            },
                            (
                                child
                                    .listen_port
                                    .filter(|_| !child.counts_requests && !child.listen_shared)
                                    .map(|port| (port, child.listen_ipv6)),
                                child.concurrency,
                                child.listen_shared,
                            ),
                        ),
                    );
                }
            }
        }
        self.listener_history
            .retain(|service, _| self.shared.contains_key(service));
        self.tracked.retain(|lane, tracked| {
            let keep = current
                .get(lane)
                .is_some_and(|(pid, ..)| *pid == tracked.pid);
            if !keep {
                self.source.untrack(*lane, tracked.pid);
            }
            keep
        });
        let mut workers = Vec::with_capacity(current.len());
        for (lane, (pid, service, index, counter, counting, (port, concurrency, shared))) in current
        {
            if !self.tracked.contains_key(&lane) {
                match self.source.track(lane, pid) {
                    Ok(()) => {
                        tracing::debug!(%service, index, pid, lane, "Sampling worker");
                        let counted = match counting {
                            Counting::ByWorker => true,
                            Counting::Sends(port) => self.source.count_sends(lane, port),
                            Counting::None => false,
                        };
                        self.tracked.insert(
                            lane,
                            Tracked {
                                pid,
                                counter,
                                counted,
                                history: None,
                                warned: false,
                                suspect: false,
                                stall: None,
                                baseline_at: None,
                                port,
                                concurrency,
                            },
                        );
                    }
                    Err(SampleError::Gone { .. }) => continue,
                    Err(error) => {
                        // Tried again on the next tick.
                        tracing::warn!(%service, index, pid, error = %ErrorChain(&error), "Cannot sample worker");
                        continue;
                    }
                }
            }
            workers.push(Current {
                lane,
                service: service.to_owned(),
                index,
                shared,
            });
        }
        workers
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Mutex, atomic::Ordering};

    use prometheus_client::metrics::histogram::Histogram;

    use super::*;
    use crate::children::{Child, Counters};
    use crate::registry::{Address, Protocol, SmoothedLoad, Worker};

    /// What a test has the fake do at its next read.
    type OnRead = Box<dyn FnOnce() + Send>;

    /// A source whose totals the test sets, and which records what it was asked.
    #[derive(Clone, Default)]
    struct Fake {
        totals: Arc<Mutex<HashMap<u32, SchedTotals>>>,
        calls: Arc<Mutex<Vec<String>>>,
        /// Run at the next read (in the middle of a tick), once.
        on_read: Arc<Mutex<Option<OnRead>>>,
    }

    impl SchedSource for Fake {
        fn kind(&self) -> SamplerKind {
            SamplerKind::Procfs
        }
        fn track(&mut self, lane: usize, pid: u32) -> Result<(), SampleError> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("track {lane} {pid}"));
            Ok(())
        }
        fn untrack(&mut self, lane: usize, pid: u32) {
            self.calls
                .lock()
                .unwrap()
                .push(format!("untrack {lane} {pid}"));
        }
        fn read(&mut self, _lane: usize, pid: u32) -> Result<SchedTotals, SampleError> {
            let on_read = self.on_read.lock().unwrap().take();
            if let Some(on_read) = on_read {
                on_read();
            }
            self.totals
                .lock()
                .unwrap()
                .get(&pid)
                .copied()
                .ok_or(SampleError::Gone { pid })
        }
    }

    fn register(registry: &Registry, service: &str, index: u32, pid: u32) {
        let addr = Address::Tcp(([127, 0, 0, 1], 9000).into());
        registry
            .register(Worker::ready(
                service,
                index,
                pid,
                vec![Protocol::Http1],
                vec![addr],
            ))
            .unwrap();
    }

    #[test]
    fn follows_the_registry_and_turns_readings_into_loads() {
        let fake = Fake::default();
        let counters = Arc::new(Counters::memfd(4).unwrap());
        let registry = Registry::new(["a".to_string(), "b".to_string()]);
        let children = Arc::new(Children::default());
        let mut sampler = Sampler::new(Box::new(fake.clone()), children.clone());
        children.insert_with_lane_for_test(100, "a", 1, 1, &counters);
        children.insert_with_lane_for_test(200, "b", 0, 2, &counters);
        register(&registry, "a", 1, 100);
        register(&registry, "b", 0, 200);
        fake.totals.lock().unwrap().extend([
            (
                100,
                SchedTotals {
                    on_cpu_ns: 1_000_000_000,
                    runq_wait_ns: 0,
                },
            ),
            (200, SchedTotals::default()),
        ]);
        counters.region().lane(1).store(10, Ordering::Relaxed);
        let t0 = Instant::now();
        let wall = SystemTime::UNIX_EPOCH;

        let first = sampler.tick(&registry.snapshot(), t0, wall).loads;
        assert_eq!(first.len(), 2);
        assert_eq!(
            (first[0].service.as_str(), first[0].index, first[0].pid),
            ("a", 1, 100)
        );
        assert_eq!(first[0].cpu_cores, None, "the first sample is a baseline");
        assert_eq!(first[0].requests_total, 10);
        assert_eq!(first[0].cpu_seconds_total, 1.0);

        fake.totals.lock().unwrap().insert(
            100,
            SchedTotals {
                on_cpu_ns: 1_500_000_000,
                runq_wait_ns: 250_000_000,
            },
        );
        counters.region().lane(1).store(30, Ordering::Relaxed);
        let second = sampler
            .tick(&registry.snapshot(), t0 + Duration::from_secs(1), wall)
            .loads;
        assert_eq!(second[0].cpu_cores, Some(0.5));
        assert_eq!(second[0].runq_wait_cores, Some(0.25));
        assert_eq!(second[0].requests_per_second, Some(20.0));
        assert_eq!(second[0].requests_total, 30);

        // A successor in its own lane is sampled beside its draining predecessor, from a new
        // baseline; the predecessor is untracked once reaped.
        children.insert_with_lane_for_test(101, "a", 1, 3, &counters);
        register(&registry, "a", 1, 101);
        fake.totals
            .lock()
            .unwrap()
            .insert(101, SchedTotals::default());
        counters.region().lane(3).store(2, Ordering::Relaxed);
        let both = sampler
            .tick(&registry.snapshot(), t0 + Duration::from_millis(1500), wall)
            .loads;
        let pids: Vec<u32> = both.iter().map(|l| l.pid).collect();
        assert_eq!(pids, [100, 200, 101], "by lane");
        assert_eq!((both[2].cpu_cores, both[2].requests_total), (None, 2));
        children.remove(100);
        assert!(registry.deregister("a", 1, 100));
        let third = sampler
            .tick(&registry.snapshot(), t0 + Duration::from_secs(2), wall)
            .loads;
        assert_eq!(third.len(), 2);
        assert_eq!((third[1].pid, third[1].requests_total), (101, 2));
        // A vanished process is left out; the registry still lists it until the manager reaps it.
        fake.totals.lock().unwrap().remove(&200);
        let fourth = sampler
            .tick(&registry.snapshot(), t0 + Duration::from_secs(3), wall)
            .loads;
        assert_eq!(fourth.iter().map(|l| l.pid).collect::<Vec<_>>(), [101]);
        children.remove(200);
        assert!(registry.deregister("b", 0, 200));
        sampler.tick(&registry.snapshot(), t0 + Duration::from_secs(4), wall);

        let calls = fake.calls.lock().unwrap().clone();
        assert_eq!(
            calls,
            [
                "track 1 100",
                "track 2 200",
                "track 3 101",
                "untrack 1 100",
                "untrack 2 200"
            ]
        );
    }

    #[test]
    fn a_new_worker_is_baselined_between_ticks_and_gets_rates_at_the_next_tick_past_half_an_interval()
     {
        let fake = Fake::default();
        let counters = Arc::new(Counters::memfd(2).unwrap());
        let registry = Registry::new(["a".to_string()]);
        let children = Arc::new(Children::default());
        let mut sampler = Sampler::new(Box::new(fake.clone()), children.clone());
        sampler.min_window = Duration::from_millis(100);
        children.insert_with_lane_for_test(100, "a", 0, 0, &counters);
        register(&registry, "a", 0, 100);
        fake.totals
            .lock()
            .unwrap()
            .insert(100, SchedTotals::default());
        let t0 = Instant::now();
        let wall = SystemTime::UNIX_EPOCH;
        let ms = |n: u64| t0 + Duration::from_millis(n);

        sampler.baseline_new(&registry.snapshot(), ms(0));
        assert_eq!(fake.calls.lock().unwrap().as_slice(), ["track 0 100"]);
        // Work done after the baseline counts from it.
        fake.totals.lock().unwrap().insert(
            100,
            SchedTotals {
                on_cpu_ns: 60_000_000,
                runq_wait_ns: 30_000_000,
            },
        );
        counters.region().lane(0).store(12, Ordering::Relaxed);
        // A tick 50 ms after the baseline: too soon for a rate.
        let soon = sampler.tick(&registry.snapshot(), ms(50), wall).loads;
        assert_eq!((soon[0].pid, soon[0].cpu_cores), (100, None));
        // The next one, 150 ms after the baseline: rates over those 150 ms.
        let next = sampler.tick(&registry.snapshot(), ms(150), wall).loads;
        assert!((next[0].cpu_cores.unwrap() - 0.4).abs() < 1e-9, "{next:?}");
        assert!((next[0].runq_wait_cores.unwrap() - 0.2).abs() < 1e-9);
        assert!((next[0].requests_per_second.unwrap() - 80.0).abs() < 1e-9);
        // Baselining again changes nothing for a worker already followed.
        sampler.baseline_new(&registry.snapshot(), ms(160));
        let later = sampler.tick(&registry.snapshot(), ms(170), wall).loads;
        assert!(
            later[0].cpu_cores.is_some(),
            "a regular reading is never held back"
        );
        assert_eq!(fake.calls.lock().unwrap().len(), 1, "tracked once");
    }

    #[test]
    fn a_stopped_worker_and_one_that_leaves_bytes_unread_are_stalled_until_they_move() {
        let fake = Fake::default();
        let counters = Arc::new(Counters::memfd(4).unwrap());
        let registry = Registry::new(["a".to_string()]);
        let children = Arc::new(Children::default());
        let mut sampler = Sampler::new(Box::new(fake.clone()), children.clone());
        // A real process to stop and continue.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let rustix_pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
        children.insert_with_lane_for_test(pid, "a", 0, 0, &counters);
        register(&registry, "a", 0, pid);
        fake.totals
            .lock()
            .unwrap()
            .insert(pid, SchedTotals::default());
        let t0 = Instant::now();
        let wall = SystemTime::UNIX_EPOCH;
        let at = |s: u64| t0 + Duration::from_secs(s);
        let quiet = |_| Some(0);
        let snapshot = registry.snapshot();
        assert!(
            sampler
                .tick_with(&snapshot, at(0), wall, quiet)
                .stalls
                .is_empty()
        );
        assert!(
            sampler
                .tick_with(&snapshot, at(1), wall, quiet)
                .stalls
                .is_empty(),
            "idle"
        );

        rustix::process::kill_process(rustix_pid, rustix::process::Signal::STOP).unwrap();
        let stopped = crate::sampler::tests::wait_for_state(pid, 'T');
        assert!(stopped, "the child stopped");
        let sample = sampler.tick_with(&snapshot, at(2), wall, quiet);
        assert_eq!(
            sample.stalls,
            [StallChange {
                service: "a".into(),
                index: 0,
                pid,
                stall: Some(Stall::Stopped)
            }]
        );
        assert!(
            sampler
                .tick_with(&snapshot, at(3), wall, quiet)
                .stalls
                .is_empty(),
            "no change"
        );
        rustix::process::kill_process(rustix_pid, rustix::process::Signal::CONT).unwrap();
        assert!(crate::sampler::tests::wait_for_state(pid, 'S'));
        let sample = sampler.tick_with(&snapshot, at(4), wall, quiet);
        assert_eq!(sample.stalls.len(), 1);
        assert_eq!(sample.stalls[0].stall, None, "moving again");

        // Bytes wait in its sockets through two samples: not reading.
        let waiting = |_| Some(512);
        assert!(
            sampler
                .tick_with(&snapshot, at(5), wall, waiting)
                .stalls
                .is_empty(),
            "suspect"
        );
        let sample = sampler.tick_with(&snapshot, at(6), wall, waiting);
        assert_eq!(
            sample.stalls[0].stall,
            Some(Stall::NotReading { queued_bytes: 512 })
        );
        // It serves a request: not stalled.
        counters.region().lane(0).store(1, Ordering::Relaxed);
        let sample = sampler.tick_with(&snapshot, at(7), wall, waiting);
        assert_eq!(sample.stalls[0].stall, None);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn requests_in_flight_come_from_the_workers_line_or_the_kernels_count_on_its_own_port() {
        use peregrine_contract::counters::{FEATURE_IN_FLIGHT, InFlight};
        let fake = Fake::default();
        let counters = Arc::new(Counters::memfd(3).unwrap());
        let registry = Registry::new(["a".to_string()]);
        let children = Arc::new(Children::default());
        let mut sampler = Sampler::new(Box::new(fake.clone()), children.clone());
        let child = |index: u32, counts_requests, port: Option<u16>, shared| Child {
            slot: crate::children::Slot {
                service: "a".into(),
                index,
            },
            lane: index as usize,
            counter: CounterRef::new(counters.clone(), index as usize),
            counts_requests,
            listen_port: port,
            listen_ipv6: false,
            listen_shared: shared,
            uid: 0,
            concurrency: Some(2),
        };
        // A built-in worker that keeps its word, a server on a listener of its own (port 8001), and
        // one on a shared listener (port 8002).
        children.insert(100, child(0, true, None, false));
        children.insert(101, child(1, false, Some(8001), false));
        children.insert(102, child(2, false, Some(8002), true));
        for (index, pid) in [(0, 100), (1, 101), (2, 102)] {
            register(&registry, "a", index, pid);
            fake.totals
                .lock()
                .unwrap()
                .insert(pid, SchedTotals::default());
        }
        let region = counters.region();
        region
            .features(0)
            .store(FEATURE_IN_FLIGHT, Ordering::Relaxed);
        let start = InFlight::start_delta(peregrine_contract::counters::coarse_now_us());
        // Two requests open in the built-in worker all along.
        region
            .in_flight(0)
            .store(start.wrapping_mul(2), Ordering::Relaxed);
        let t0 = Instant::now();
        let wall = SystemTime::UNIX_EPOCH;
        let snapshot = registry.snapshot();
        let workers = sampler.reconcile(&snapshot);
        let held = |queued, serving| sock_diag::Held { queued, serving };
        let seen = HashMap::from([(8001, held(2, 1)), (8002, held(4, 1))]);
        sampler.sample(workers, (t0, wall), |_| Some(0), Some(&seen));
        std::thread::sleep(Duration::from_millis(30));
        let workers = sampler.reconcile(&snapshot);
        let seen = HashMap::from([(8001, held(0, 1)), (8002, held(4, 1))]);
        let sample = sampler.sample(
            workers,
            (t0 + Duration::from_millis(30), wall),
            |_| Some(0),
            Some(&seen),
        );
        let loads = sample.loads;
        let by_index = |i: u32| loads.iter().find(|l| l.index == i).unwrap();
        // Kept: exactly two throughout, over a concurrency of 2.
        assert_eq!(by_index(0).in_flight, Some(2.0));
        assert_eq!(by_index(0).in_flight_utilization, Some(1.0));
        assert_eq!(by_index(0).in_flight_now, Some(2));
        // Seen: the mean of the two counts, 3 and 1.
        assert_eq!(by_index(1).in_flight, Some(2.0));
        assert_eq!(by_index(1).in_flight_now, Some(1));
        // Smoothed from its first rates on, but not settled before its means cover a time constant
        // (`rates::SMOOTHING`): two in flight over a concurrency of two.
        let smoothed = by_index(1).smoothed.unwrap();
        assert_eq!((smoothed.utilization, smoothed.settled), (1.0, false));
        // A shared listener's count is no worker's own: it is the service's, as seen at the tick,
        // and its load is that of the workers on it (here one, of the three): 5 in flight over one
        // worker of 2 at once, unsettled.
        assert_eq!(by_index(2).in_flight, None);
        let on_the_listener = ListenerLoad {
            queued: 4,
            serving: 1,
            smoothed: Some(SmoothedLoad {
                requests_per_second: 0.0,
                utilization: 2.5,
                settled: false,
            }),
        };
        assert_eq!(sample.listeners, [("a".to_string(), on_the_listener)]);
        // The kernel's tables could not be read: no figure, not a zero.
        let workers = sampler.reconcile(&snapshot);
        let sample = sampler.sample(
            workers,
            (t0 + Duration::from_millis(60), wall),
            |_| Some(0),
            None,
        );
        let loads = sample.loads;
        assert_eq!(loads.iter().find(|l| l.index == 1).unwrap().in_flight, None);
        assert!(sample.listeners.is_empty());
    }

    #[test]
    fn a_worker_that_counts_no_requests_is_never_judged_stalled_by_them() {
        let fake = Fake::default();
        let counters = Arc::new(Counters::memfd(2).unwrap());
        let registry = Registry::new(["a".to_string()]);
        let children = Arc::new(Children::default());
        let mut sampler = Sampler::new(Box::new(fake.clone()), children.clone());
        // A server on a passed listener: bytes wait in its sockets while its arbiter sleeps, and its
        // requests are served (by a child process) without a count.
        let pid = std::process::id();
        children.insert_counted_for_test(pid, ("a", 0), 0, &counters, false);
        register(&registry, "a", 0, pid);
        fake.totals
            .lock()
            .unwrap()
            .insert(pid, SchedTotals::default());
        let t0 = Instant::now();
        let snapshot = registry.snapshot();
        for s in 0..4 {
            let sample = sampler.tick_with(
                &snapshot,
                t0 + Duration::from_secs(s),
                SystemTime::UNIX_EPOCH,
                |_| Some(512),
            );
            assert!(sample.stalls.is_empty(), "tick {s}: {:?}", sample.stalls);
        }
    }

    /// Waits (up to 5 s) until process `pid` is in scheduler state `state`.
    fn wait_for_state(pid: u32, state: char) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if peregrine_contract::procfs::stat(pid).is_ok_and(|s| s.state == state) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    #[tokio::test]
    async fn the_loop_publishes_until_stopped() {
        let fake = Fake::default();
        fake.totals
            .lock()
            .unwrap()
            .insert(7, SchedTotals::default());
        let registry = Arc::new(Registry::new(["a".to_string()]));
        let children = Arc::new(Children::default());
        children.insert_for_test(7, "a", 0);
        register(&registry, "a", 0, 7);
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut loads = registry.subscribe_loads();
        let task = tokio::spawn(run(
            Box::new(fake),
            children,
            registry.clone(),
            Options {
                interval: Duration::from_millis(10),
                pass_time: None,
            },
            stop_rx,
        ));
        let sampled = tokio::time::timeout(
            Duration::from_secs(10),
            loads.wait_for(|l| l.get("a", 0, 7).is_some_and(|w| w.cpu_cores.is_some())),
        )
        .await
        .expect("two samples in time")
        .unwrap()
        .clone();
        let info = sampled.sampler.unwrap();
        assert_eq!(
            (info.kind, info.interval),
            (SamplerKind::Procfs, Duration::from_millis(10))
        );
        assert_eq!(sampled.by_pid(7).map(|w| w.index), Some(0));
        stop_tx.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the loop stops")
            .unwrap();
        assert!(
            registry.loads().sampler.is_none(),
            "a stopped sampler says so"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_loop_does_not_wake_for_its_own_stall_writes_but_does_for_anyone_elses() {
        use std::io::Write;
        let interval = Duration::from_secs(1);
        let passes = || PASSES_BETWEEN_TICKS.with(|passes| passes.get());
        let fake = Fake::default();
        let counters = Arc::new(Counters::memfd(3).unwrap());
        let registry = Arc::new(Registry::new(["a".to_string()]));
        let children = Arc::new(Children::default());
        // The worker that stalls is this process: it serves nothing, spends no CPU (its totals do
        // not move) and leaves bytes unread, so its second rates find it not reading.
        let (mut sender, _unread) = std::os::unix::net::UnixStream::pair().unwrap();
        sender.write_all(b"waiting").unwrap();
        let pid = std::process::id();
        children.insert_with_lane_for_test(pid, "a", 0, 0, &counters);
        register(&registry, "a", 0, pid);
        // Two workers that register later; no process has their pids (above any pid_max).
        let (second, third) = (0x3fff_ff01, 0x3fff_ff02);
        for (lane, worker) in [(1, second), (2, third)] {
            children.insert_with_lane_for_test(worker, "a", lane as u32, lane, &counters);
        }
        fake.totals
            .lock()
            .unwrap()
            .extend([pid, second, third].map(|worker| (worker, SchedTotals::default())));
        // The loop times each sample it takes in this histogram: its count is the samples taken.
        let samples = Histogram::new([1.0]);
        let (_stop, stop_rx) = watch::channel(false);
        tokio::spawn(run(
            Box::new(fake.clone()),
            children,
            registry.clone(),
            Options {
                interval,
                pass_time: Some(samples.clone()),
            },
            stop_rx,
        ));
        let mut snapshots = registry.subscribe();
        let stalled =
            |s: &Arc<Snapshot>| s.instance("a", 0, pid).is_some_and(|w| w.stalled.is_some());
        let tracked = |lane: usize, worker: u32| {
            let calls = fake.calls.lock().unwrap();
            calls.contains(&format!("track {lane} {worker}"))
        };

        // Its own stall write: the loop samples at its ticks and makes no pass between them.
        let woken = passes();
        tokio::time::timeout(interval * 10, snapshots.wait_for(stalled))
            .await
            .expect("stalled at its second rates")
            .unwrap();
        let sampled = samples.count();
        tokio::time::sleep(interval * 2 + interval / 2).await;
        assert_eq!(samples.count() - sampled, 2, "a sample per tick");
        assert_eq!(passes() - woken, 0, "not woken by its own write");

        // A registration between ticks wakes it: a pass that takes the new worker's baseline, and
        // no sample.
        let (woken, sampled) = (passes(), samples.count());
        register(&registry, "a", 1, second);
        tokio::time::sleep(interval / 4).await;
        assert_eq!(passes() - woken, 1, "woken by a registration");
        assert!(tracked(1, second), "{:?}", fake.calls);
        assert_eq!(samples.count(), sampled, "a pass, not a sample");

        // A registration during a tick whose own write ends the stall (the worker serves a
        // request): its own write does not hide the other one, which still wakes it.
        let (woken, sampled) = (passes(), samples.count());
        counters.region().lane(0).store(1, Ordering::Relaxed);
        *fake.on_read.lock().unwrap() = Some(Box::new({
            let registry = registry.clone();
            move || register(&registry, "a", 2, third)
        }));
        tokio::time::timeout(interval * 10, snapshots.wait_for(|s| !stalled(s)))
            .await
            .expect("moving again at the next tick")
            .unwrap();
        tokio::time::sleep(interval / 4).await;
        assert_eq!(samples.count() - sampled, 1);
        assert!(
            fake.on_read.lock().unwrap().is_none(),
            "registered mid-tick"
        );
        assert_eq!(
            passes() - woken,
            1,
            "woken by the registration beside its own write"
        );
        assert!(tracked(2, third), "{:?}", fake.calls);
    }
}
