//! The worker registry: the one source of truth for which workers exist, where they listen and in which
//! state they are.
//!
//! Writers (the registration server, the process manager) call [`Registry::register`],
//! [`Registry::drain`] and [`Registry::deregister`]; every change publishes a new immutable [`Snapshot`]
//! on a watch channel. Readers (xDS, status, ORCA, the sampler) only ever see whole snapshots.
//!
//! A slot holds one serving instance and, while it is being replaced or removed, draining ones: a worker
//! that registers in a slot whose instance is still serving takes over, and its predecessor turns
//! [`WorkerState::Draining`] in the same snapshot (xDS publishes it with `health_status: DRAINING`, so
//! Envoy sends it no new requests) until the manager stops it.
//!
//! Beside endpoints it holds the workers' sampled [`Loads`] (written by the sampler) and each slot's
//! [`SlotStatus`] (restarts, written by the manager), each on a watch channel of its own so that neither
//! moves the endpoint snapshot (see [`load`]).
//!
//! Invariant: nothing else in the supervisor stores endpoints or loads; everything that needs them
//! subscribes.

pub mod fleet;
pub mod load;

use std::{
    collections::BTreeMap,
    fmt,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Instant,
};

use tokio::sync::watch;

pub use self::fleet::{
    Fleet, Health, RemoteHost, RemoteWorker, SpecChoice, SpecChoices, choose_specs,
};
pub use self::load::{
    ListenerLoad, Loads, SamplerInfo, SamplerKind, SlotStatus, Slots, SmoothedLoad, WorkerLoad,
};

/// An application protocol a worker's listener speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    /// HTTP/1.1.
    Http1,
    /// HTTP/2 with prior knowledge (h2c).
    Http2,
}

/// One concrete address a worker bound.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Address {
    /// An IP socket.
    Tcp(SocketAddr),
    /// A Unix-domain stream socket.
    Unix(PathBuf),
}

impl Address {
    /// The port of a TCP address.
    pub fn port(&self) -> Option<u16> {
        match self {
            Address::Tcp(addr) => Some(addr.port()),
            Address::Unix(_) => None,
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Tcp(addr) => write!(f, "{addr}"),
            Address::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// A worker's listener, as it registered it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listener {
    /// The listener's name.
    pub name: String,
    /// `http` for now.
    pub scheme: String,
    /// Protocols spoken, without duplicates.
    pub protocols: Vec<Protocol>,
    /// Every address bound, in order of preference; never empty.
    pub addresses: Vec<Address>,
}

/// Where a worker is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerState {
    /// Registered and serving.
    Ready,
    /// Still serving what it has, but to get no new requests: it is about to be stopped.
    Draining,
}

impl WorkerState {
    /// `ready` or `draining`.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Ready => "ready",
            WorkerState::Draining => "draining",
        }
    }
}

/// Why a worker that has requests to serve serves none (see [`crate::sampler::stall`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stall {
    /// The process is stopped (SIGSTOP, a tracer).
    Stopped,
    /// It leaves bytes unread in its sockets and serves nothing, off the CPU.
    NotReading {
        /// The bytes waiting in its sockets when it was judged.
        queued_bytes: u64,
    },
}

impl std::fmt::Display for Stall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stall::Stopped => f.write_str("stopped (SIGSTOP or a tracer)"),
            Stall::NotReading { queued_bytes } => write!(
                f,
                "not reading its connections ({queued_bytes} bytes waiting, no request served, off the CPU)"
            ),
        }
    }
}

/// A worker instance's key in its service: slot index, then process id (a slot may hold an instance
/// that serves and others that drain).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerKey {
    /// The slot index.
    pub index: u32,
    /// The process id.
    pub pid: u32,
}

/// A registered worker instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Worker {
    /// Its service.
    pub service: String,
    /// Its slot in the service, `0..count`.
    pub index: u32,
    /// Its process id.
    pub pid: u32,
    /// A hostname unique to this instance (a restarted worker gets a new one); EDS publishes it and
    /// ORCA tells workers apart by it.
    pub hostname: String,
    /// What it listens on.
    pub listener: Listener,
    /// Its state.
    pub state: WorkerState,
    /// Why it serves nothing though requests wait for it, while it does: Envoy is told to send it
    /// nothing new (EDS `UNHEALTHY`) until it moves again.
    pub stalled: Option<Stall>,
}

impl Worker {
    /// A ready worker of `service` in slot `index`, process `pid`, with its listener named after the
    /// service, scheme `http`, and the instance's unique hostname.
    pub fn ready(
        service: &str,
        index: u32,
        pid: u32,
        protocols: Vec<Protocol>,
        addresses: Vec<Address>,
    ) -> Worker {
        Worker {
            service: service.into(),
            index,
            pid,
            hostname: hostname_for(service, index, pid),
            listener: Listener {
                name: service.into(),
                scheme: "http".into(),
                protocols,
                addresses,
            },
            state: WorkerState::Ready,
            stalled: None,
        }
    }
}

impl Worker {
    /// How it is to be sent requests: draining once it is stopping, unhealthy while stalled.
    pub fn health(&self) -> Health {
        match (self.state, self.stalled) {
            (WorkerState::Draining, _) => Health::Draining,
            (WorkerState::Ready, Some(_)) => Health::Unhealthy,
            (WorkerState::Ready, None) => Health::Serving,
        }
    }

    /// Its key in its service.
    pub fn key(&self) -> WorkerKey {
        WorkerKey {
            index: self.index,
            pid: self.pid,
        }
    }
}

/// One service in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ServiceView {
    /// Registered worker instances, by slot index then pid.
    pub workers: BTreeMap<WorkerKey, Worker>,
}

impl ServiceView {
    /// The instance serving slot `index` (not draining), if one is registered.
    pub fn serving(&self, index: u32) -> Option<&Worker> {
        self.instances(index)
            .find(|w| w.state == WorkerState::Ready)
    }

    /// Every registered instance of slot `index`, serving or draining.
    pub fn instances(&self, index: u32) -> impl Iterator<Item = &Worker> {
        self.workers
            .range(
                WorkerKey { index, pid: 0 }..=WorkerKey {
                    index,
                    pid: u32::MAX,
                },
            )
            .map(|(_, w)| w)
    }

    /// The instance of slot `index` with process id `pid`.
    pub fn instance(&self, index: u32, pid: u32) -> Option<&Worker> {
        self.workers.get(&WorkerKey { index, pid })
    }

    /// Whether two or more of its workers listen on the same addresses: one shared listener, which
    /// EDS publishes as one endpoint named [`shared_hostname`].
    pub fn shares_listener(&self) -> bool {
        let mut seen = std::collections::HashSet::new();
        self.workers
            .values()
            .any(|w| !seen.insert(&w.listener.addresses))
    }
}

/// An immutable view of the registry at one revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// Increases by one with every change (not across supervisor restarts).
    pub revision: u64,
    /// When this revision was made: where the time an Envoy takes to converge on it starts.
    pub changed_at: Instant,
    /// Every configured service, by name (also those without workers).
    pub services: BTreeMap<String, ServiceView>,
    /// The other hosts of the fleet (empty on a single host).
    pub fleet: Fleet,
}

impl Default for Snapshot {
    fn default() -> Self {
        Snapshot {
            revision: 0,
            changed_at: Instant::now(),
            services: BTreeMap::new(),
            fleet: Fleet::new(),
        }
    }
}

impl Snapshot {
    /// Moves to the next revision, made now, and sends it to every subscriber.
    fn publish(&mut self, tx: &watch::Sender<Arc<Snapshot>>) {
        self.revision += 1;
        self.changed_at = Instant::now();
        tx.send_replace(Arc::new(self.clone()));
    }

    /// The registered instance `pid` of `service`'s slot `index`.
    pub fn instance(&self, service: &str, index: u32, pid: u32) -> Option<&Worker> {
        self.services.get(service)?.instance(index, pid)
    }

    /// The registered worker of this host whose hostname is `hostname`, found through the key its
    /// hostname is made of ([`hostname_for`]: `service-index-pid`, in a fleet `host-service-index-pid`)
    /// rather than by a scan of the workers: the slot and pid are read from the right, then the
    /// service is the rest, less the host in a fleet (a service's name may itself hold `-`).
    pub fn worker_by_hostname(&self, hostname: &str) -> Option<&Worker> {
        let mut parts = hostname.rsplitn(3, '-');
        let pid = parts.next()?.parse().ok()?;
        let index = parts.next()?.parse().ok()?;
        let named = parts.next()?;
        let in_service = |service: &str| {
            self.services
                .get(service)?
                .instance(index, pid)
                .filter(|worker| worker.hostname == hostname)
        };
        in_service(named).or_else(|| {
            // In a fleet: `host-service`, the service a suffix after a `-`.
            self.services
                .keys()
                .filter(|service| {
                    named.len() > service.len()
                        && named.ends_with(service.as_str())
                        && named.as_bytes()[named.len() - service.len() - 1] == b'-'
                })
                .find_map(|service| in_service(service))
        })
    }

    /// Whether a worker of this host with `hostname` is registered.
    pub fn has_hostname(&self, hostname: &str) -> bool {
        self.worker_by_hostname(hostname).is_some()
    }

    /// The workers of `service` on other hosts, with their host, by host.
    pub fn remote_workers<'a>(
        &'a self,
        service: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a RemoteHost, &'a RemoteWorker)> + 'a {
        self.fleet.iter().flat_map(move |(host, remote)| {
            remote
                .workers
                .values()
                .filter(move |w| w.service == service)
                .map(move |w| (host.as_str(), &**remote, w))
        })
    }
}

/// Why a registration was not recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// The service is not configured.
    #[error("unknown service {0:?}")]
    UnknownService(String),
    /// The listener has no address.
    #[error("listener has no address")]
    NoAddress,
}

/// The registry. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct Registry {
    state: Mutex<Snapshot>,
    tx: watch::Sender<Arc<Snapshot>>,
    loads: watch::Sender<Arc<Loads>>,
    slots: watch::Sender<Arc<Slots>>,
    /// In a fleet, this host's name: it leads every worker's hostname.
    host: Option<String>,
}

/// The hostname published for a worker instance: unique per (service, slot, process).
pub fn hostname_for(service: &str, index: u32, pid: u32) -> String {
    format!("{service}-{index}-{pid}")
}

/// In a fleet, where pids of different machines may be equal, the hostname also names the host:
/// `<host>-<service>-<index>-<pid>`, unique fleet-wide.
pub fn fleet_hostname_for(host: &str, service: &str, index: u32, pid: u32) -> String {
    format!("{host}-{}", hostname_for(service, index, pid))
}

/// The hostname (and hash key) of a service's shared listener, the one endpoint its workers are to
/// Envoy: `<service>-shared`, in a fleet `<host>-<service>-shared`; the same across its workers'
/// restarts.
pub fn shared_hostname(host: Option<&str>, service: &str) -> String {
    match host {
        Some(host) => format!("{host}-{service}-shared"),
        None => format!("{service}-shared"),
    }
}

impl Registry {
    /// A registry for the given services, with no workers yet.
    pub fn new(services: impl IntoIterator<Item = String>) -> Self {
        let snapshot = Snapshot {
            revision: 0,
            changed_at: Instant::now(),
            services: services
                .into_iter()
                .map(|s| (s, ServiceView::default()))
                .collect(),
            fleet: Fleet::new(),
        };
        let (tx, _) = watch::channel(Arc::new(snapshot.clone()));
        Registry {
            state: Mutex::new(snapshot),
            tx,
            loads: watch::Sender::new(Arc::default()),
            slots: watch::Sender::new(Arc::default()),
            host: None,
        }
    }

    /// The registry of host `host` of a fleet: every worker registered gets a hostname that names
    /// the host ([`fleet_hostname_for`]), so that hostnames (the ORCA `:authority`, and what Envoy's
    /// stats and `status` show) are unique across the fleet's machines.
    pub fn in_fleet(mut self, host: &str) -> Self {
        self.host = Some(host.to_owned());
        self
    }

    /// The registered worker with this hostname.
    pub fn find_hostname(&self, hostname: &str) -> Option<Worker> {
        self.snapshot().worker_by_hostname(hostname).cloned()
    }

    /// The service of this host whose shared listener is published as `hostname`
    /// ([`shared_hostname`]), while it has workers that share one listener.
    pub fn find_shared(&self, hostname: &str) -> Option<String> {
        let snapshot = self.snapshot();
        snapshot
            .services
            .iter()
            .find(|(service, view)| {
                shared_hostname(self.host.as_deref(), service) == hostname && view.shares_listener()
            })
            .map(|(service, _)| service.clone())
    }

    /// A receiver that sees every published snapshot (at least the latest).
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.tx.subscribe()
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.tx.borrow().clone()
    }

    /// Records a worker and publishes the change. Another instance still serving its slot (the one it
    /// replaces) turns draining in the same snapshot; a worker registering again replaces its own entry.
    pub fn register(&self, mut worker: Worker) -> Result<(), RegistryError> {
        if worker.listener.addresses.is_empty() {
            return Err(RegistryError::NoAddress);
        }
        if let Some(host) = &self.host {
            worker.hostname = fleet_hostname_for(host, &worker.service, worker.index, worker.pid);
        }
        self.update(|state| {
            let service = state
                .services
                .get_mut(&worker.service)
                .ok_or_else(|| RegistryError::UnknownService(worker.service.clone()))?;
            let index = worker.index;
            for (key, other) in service.workers.iter_mut() {
                if key.index == index && key.pid != worker.pid {
                    other.state = WorkerState::Draining;
                }
            }
            service.workers.insert(worker.key(), worker);
            Ok(true)
        })
        .map(drop)
    }

    /// Marks the instance `pid` of `service`'s slot `index` draining; returns the revision of the
    /// first snapshot that shows it draining (`None` if it is not registered).
    pub fn drain(&self, service: &str, index: u32, pid: u32) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let worker = state
            .services
            .get_mut(service)?
            .workers
            .get_mut(&WorkerKey { index, pid })?;
        if worker.state == WorkerState::Draining {
            // Already draining: the revision that published it is no later than this one.
            return Some(state.revision);
        }
        worker.state = WorkerState::Draining;
        state.publish(&self.tx);
        Some(state.revision)
    }

    /// Removes the instance `pid` of `service`'s slot `index`; returns whether it was registered.
    pub fn deregister(&self, service: &str, index: u32, pid: u32) -> bool {
        self.update(|state| {
            let Some(view) = state.services.get_mut(service) else {
                return Ok::<_, RegistryError>(false);
            };
            Ok(view.workers.remove(&WorkerKey { index, pid }).is_some())
        })
        .unwrap_or(false)
    }

    /// Makes `services` the configured services: new ones start empty, and those no longer listed
    /// go (with any instance still registered in them). Publishes if anything changed.
    pub fn set_services(&self, services: impl IntoIterator<Item = String>) {
        let wanted: std::collections::BTreeSet<String> = services.into_iter().collect();
        let _ = self.update(|state| {
            let before = state.services.len();
            state.services.retain(|name, _| wanted.contains(name));
            let mut changed = state.services.len() != before;
            for name in &wanted {
                if !state.services.contains_key(name) {
                    state.services.insert(name.clone(), ServiceView::default());
                    changed = true;
                }
            }
            Ok::<_, RegistryError>(changed)
        });
    }

    /// Records whether the instance `pid` of `service`'s slot `index` is stalled; publishes a new
    /// snapshot if that changed, and returns its revision.
    pub fn set_stalled(
        &self,
        service: &str,
        index: u32,
        pid: u32,
        stall: Option<Stall>,
    ) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let worker = state
            .services
            .get_mut(service)?
            .workers
            .get_mut(&WorkerKey { index, pid })?;
        if worker.stalled == stall {
            return None;
        }
        worker.stalled = stall;
        state.publish(&self.tx);
        Some(state.revision)
    }

    /// Replaces the view of the fleet's other hosts; publishes a new snapshot if it changed, and
    /// returns whether it did.
    pub fn set_fleet(&self, fleet: Fleet) -> bool {
        self.update(|state| {
            let changed = state.fleet != fleet;
            state.fleet = fleet;
            Ok::<_, RegistryError>(changed)
        })
        .unwrap_or(false)
    }

    /// Publishes the workers' loads of one sample (replacing the previous sample's).
    pub fn publish_loads(&self, loads: Loads) {
        self.loads.send_replace(Arc::new(loads));
    }

    /// A receiver that sees every published [`Loads`] (at least the latest).
    pub fn subscribe_loads(&self) -> watch::Receiver<Arc<Loads>> {
        self.loads.subscribe()
    }

    /// The latest loads.
    pub fn loads(&self) -> Arc<Loads> {
        self.loads.borrow().clone()
    }

    /// Records how often the worker in `service`'s slot `index` was restarted.
    pub fn set_restarts(&self, service: &str, index: u32, restarts: u64) {
        self.update_slot(service, index, |status| status.restarts = restarts);
    }

    /// Changes the status of `service`'s slot `index` (the manager's record of its restarts, last
    /// exit and backoff); publishes it if anything changed.
    pub fn update_slot(&self, service: &str, index: u32, change: impl FnOnce(&mut SlotStatus)) {
        self.slots
            .send_if_modified(|slots| Arc::make_mut(slots).update(service, index, change));
    }

    /// Forgets the status of `service`'s slot `index`: the slot was removed from the config.
    pub fn remove_slot(&self, service: &str, index: u32) {
        self.slots
            .send_if_modified(|slots| Arc::make_mut(slots).remove(service, index));
    }

    /// A receiver that sees every change of the slot statuses.
    pub fn subscribe_slots(&self) -> watch::Receiver<Arc<Slots>> {
        self.slots.subscribe()
    }

    /// The current slot statuses.
    pub fn slots(&self) -> Arc<Slots> {
        self.slots.borrow().clone()
    }

    /// Applies `change` under the lock; publishes a new revision if it reports a change.
    fn update<E>(&self, change: impl FnOnce(&mut Snapshot) -> Result<bool, E>) -> Result<bool, E> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let changed = change(&mut state)?;
        if changed {
            state.publish(&self.tx);
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(service: &str, index: u32, pid: u32) -> Worker {
        let addr = Address::Tcp(([127, 0, 0, 1], 8000 + index as u16).into());
        Worker::ready(service, index, pid, vec![Protocol::Http1], vec![addr])
    }

    #[test]
    fn in_a_fleet_every_hostname_names_its_host() {
        let registry = Registry::new(["web".to_string()]).in_fleet("host-a");
        registry.register(worker("web", 0, 10)).unwrap();
        let snapshot = registry.snapshot();
        let hostname = &snapshot.instance("web", 0, 10).unwrap().hostname;
        assert_eq!(hostname, "host-a-web-0-10");
        assert!(registry.find_hostname("host-a-web-0-10").is_some());
        assert!(registry.find_hostname("web-0-10").is_none());
        // On one host, as before.
        let single = Registry::new(["web".to_string()]);
        single.register(worker("web", 0, 10)).unwrap();
        assert_eq!(
            single.snapshot().instance("web", 0, 10).unwrap().hostname,
            "web-0-10"
        );
    }

    #[test]
    fn a_worker_is_found_by_its_hostname_through_its_key() {
        // Service names with `-`, and one that is another's suffix.
        let services = [
            "api".to_string(),
            "web-api".to_string(),
            "a-b-c".to_string(),
        ];
        for host in [None, Some("host-1"), Some("web")] {
            let registry = match host {
                Some(host) => Registry::new(services.clone()).in_fleet(host),
                None => Registry::new(services.clone()),
            };
            for (service, index, pid) in [("api", 0, 10), ("web-api", 3, 11), ("a-b-c", 12, 12)] {
                registry.register(worker(service, index, pid)).unwrap();
            }
            let snapshot = registry.snapshot();
            for worker in snapshot.services.values().flat_map(|v| v.workers.values()) {
                let found = snapshot.worker_by_hostname(&worker.hostname);
                assert_eq!(found, Some(worker), "{host:?}: {}", worker.hostname);
            }
            let prefix = host.map(|h| format!("{h}-")).unwrap_or_default();
            for absent in [
                "api-0-11", "api-1-10", "web-0-10", "api-0", "", "api-x-10", "-0-10",
            ] {
                let hostname = format!("{prefix}{absent}");
                assert!(!snapshot.has_hostname(&hostname), "{hostname}");
            }
        }
    }

    #[test]
    fn publishes_each_change_as_a_new_revision() {
        let registry = Registry::new(["a".to_string()]);
        let mut rx = registry.subscribe();
        registry.register(worker("a", 0, 10)).unwrap();
        assert!(rx.has_changed().unwrap());
        let snap = rx.borrow_and_update().clone();
        assert_eq!(snap.revision, 1);
        assert_eq!(snap.services["a"].serving(0).unwrap().pid, 10);
    }

    #[test]
    fn a_successor_takes_over_its_slot_and_the_predecessor_drains() {
        let registry = Registry::new(["a".to_string()]);
        registry.register(worker("a", 0, 10)).unwrap();
        registry.register(worker("a", 1, 20)).unwrap();
        registry.register(worker("a", 0, 11)).unwrap();
        let snap = registry.snapshot();
        let view = &snap.services["a"];
        assert_eq!(view.serving(0).unwrap().pid, 11);
        assert_eq!(view.instance(0, 10).unwrap().state, WorkerState::Draining);
        assert_eq!(
            view.serving(1).unwrap().pid,
            20,
            "other slots are untouched"
        );
        assert!(registry.deregister("a", 0, 10));
        assert!(!registry.deregister("a", 0, 10), "removed once");
        assert_eq!(registry.snapshot().services["a"].instances(0).count(), 1);
        assert!(registry.deregister("a", 0, 11));
        assert_eq!(registry.snapshot().revision, 5);
    }

    #[test]
    fn drain_publishes_once_and_says_in_which_revision() {
        let registry = Registry::new(["a".to_string()]);
        registry.register(worker("a", 0, 10)).unwrap();
        assert_eq!(registry.drain("a", 0, 10), Some(2));
        assert_eq!(registry.drain("a", 0, 10), Some(2), "no new revision");
        assert_eq!(registry.drain("a", 0, 99), None);
        assert!(registry.snapshot().services["a"].serving(0).is_none());
        assert_eq!(registry.snapshot().revision, 2);
    }

    #[test]
    fn services_come_and_go() {
        let registry = Registry::new(["a".to_string()]);
        registry.register(worker("a", 0, 10)).unwrap();
        registry.set_services(["a".to_string(), "b".to_string()]);
        assert_eq!(registry.snapshot().revision, 2);
        registry.set_services(["b".to_string(), "a".to_string()]);
        assert_eq!(registry.snapshot().revision, 2, "the same set is no change");
        registry.set_services(["b".to_string()]);
        let snap = registry.snapshot();
        assert_eq!(snap.services.keys().collect::<Vec<_>>(), ["b"]);
    }

    #[test]
    fn loads_and_restarts_do_not_move_the_endpoint_snapshot() {
        let registry = Registry::new(["a".to_string()]);
        let mut endpoints = registry.subscribe();
        let loads = registry.subscribe_loads();
        let mut slots = registry.subscribe_slots();
        registry.publish_loads(Loads::default());
        registry.set_restarts("a", 0, 1);
        assert!(loads.has_changed().unwrap() && slots.has_changed().unwrap());
        assert!(!endpoints.has_changed().unwrap());
        assert_eq!(registry.snapshot().revision, 0);
        assert_eq!(
            registry.slots().get("a", 0),
            Some(SlotStatus {
                restarts: 1,
                ..SlotStatus::default()
            })
        );
        slots.borrow_and_update();
        registry.set_restarts("a", 0, 1);
        assert!(
            !slots.has_changed().unwrap(),
            "an unchanged count is not a change"
        );
        endpoints.borrow_and_update();
    }

    #[test]
    fn refuses_unknown_services_and_empty_listeners() {
        let registry = Registry::new(["a".to_string()]);
        assert_eq!(
            registry.register(worker("b", 0, 1)),
            Err(RegistryError::UnknownService("b".into()))
        );
        let mut w = worker("a", 0, 1);
        w.listener.addresses.clear();
        assert_eq!(registry.register(w), Err(RegistryError::NoAddress));
        assert_eq!(registry.snapshot().revision, 0);
    }
}
