//! The worker registry: the one source of truth for which workers exist, where they listen and in which
//! state they are.
//!
//! Writers (the registration server, the process manager) call [`Registry::register`] and
//! [`Registry::deregister`]; every change publishes a new immutable [`Snapshot`] on a watch channel.
//! Readers (xDS, status, later ORCA) only ever see whole snapshots.
//!
//! Beside endpoints it holds the workers' sampled [`Loads`] (written by the sampler) and each slot's
//! [`SlotStatus`] (restarts, written by the manager), each on a watch channel of its own so that neither
//! moves the endpoint snapshot (see [`load`]).
//!
//! Invariant: nothing else in the supervisor stores endpoints or loads; everything that needs them
//! subscribes.

pub mod load;
pub mod orca;

use std::{
    collections::BTreeMap,
    fmt,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use tokio::sync::watch;

pub use self::load::{Loads, SamplerInfo, SlotStatus, Slots, WorkerLoad};
pub use self::orca::{OrcaByHostname, OrcaStreams, ReportSummary};

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
        }
    }
}

/// One service in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ServiceView {
    /// Registered workers by slot index.
    pub workers: BTreeMap<u32, Worker>,
}

/// An immutable view of the registry at one revision.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Snapshot {
    /// Increases by one with every change (not across supervisor restarts).
    pub revision: u64,
    /// Every configured service, by name (also those without workers).
    pub services: BTreeMap<String, ServiceView>,
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
    orca: Mutex<OrcaByHostname>,
}

/// The hostname published for a worker instance: unique per (service, slot, process).
pub fn hostname_for(service: &str, index: u32, pid: u32) -> String {
    format!("{service}-{index}-{pid}")
}

impl Registry {
    /// A registry for the given services, with no workers yet.
    pub fn new(services: impl IntoIterator<Item = String>) -> Self {
        let snapshot = Snapshot {
            revision: 0,
            services: services
                .into_iter()
                .map(|s| (s, ServiceView::default()))
                .collect(),
        };
        let (tx, _) = watch::channel(Arc::new(snapshot.clone()));
        Registry {
            state: Mutex::new(snapshot),
            tx,
            loads: watch::Sender::new(Arc::default()),
            slots: watch::Sender::new(Arc::default()),
            orca: Mutex::default(),
        }
    }

    /// Records that Envoy opened an ORCA stream for the worker `hostname`.
    pub fn orca_opened(&self, hostname: &str) {
        self.orca_lock()
            .entry(hostname.to_owned())
            .or_default()
            .open += 1;
    }

    /// Records that an ORCA stream of `hostname` ended; the worker's entry goes once its last stream
    /// ends and it is no longer registered.
    pub fn orca_closed(&self, hostname: &str) {
        let registered = self.find_hostname(hostname).is_some();
        let mut orca = self.orca_lock();
        if let Some(streams) = orca.get_mut(hostname) {
            streams.open = streams.open.saturating_sub(1);
            if streams.open == 0 && !registered {
                orca.remove(hostname);
            }
        }
    }

    /// Records a report sent for `hostname`.
    pub fn orca_reported(&self, hostname: &str, report: ReportSummary) {
        let mut orca = self.orca_lock();
        let streams = orca.entry(hostname.to_owned()).or_default();
        streams.reports += 1;
        streams.last_report = Some(report);
    }

    /// The ORCA streams of every worker that has or had one.
    pub fn orca_streams(&self) -> OrcaByHostname {
        self.orca_lock().clone()
    }

    /// The registered worker with this hostname.
    pub fn find_hostname(&self, hostname: &str) -> Option<Worker> {
        self.snapshot()
            .services
            .values()
            .flat_map(|view| view.workers.values())
            .find(|worker| worker.hostname == hostname)
            .cloned()
    }

    fn orca_lock(&self) -> std::sync::MutexGuard<'_, OrcaByHostname> {
        self.orca.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A receiver that sees every published snapshot (at least the latest).
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.tx.subscribe()
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.tx.borrow().clone()
    }

    /// Records a worker (replacing any earlier instance in its slot) and publishes the change.
    pub fn register(&self, worker: Worker) -> Result<(), RegistryError> {
        if worker.listener.addresses.is_empty() {
            return Err(RegistryError::NoAddress);
        }
        self.update(|state| {
            let service = state
                .services
                .get_mut(&worker.service)
                .ok_or_else(|| RegistryError::UnknownService(worker.service.clone()))?;
            service.workers.insert(worker.index, worker);
            Ok(true)
        })
        .map(drop)
    }

    /// Removes the worker in `service`'s slot `index` if it is still process `pid`; returns whether it
    /// was removed.
    pub fn deregister(&self, service: &str, index: u32, pid: u32) -> bool {
        self.update(|state| {
            let Some(view) = state.services.get_mut(service) else {
                return Ok::<_, RegistryError>(false);
            };
            if view.workers.get(&index).is_some_and(|w| w.pid == pid) {
                if let Some(gone) = view.workers.remove(&index) {
                    // Its ORCA state goes with it, unless a stream is still open (the stream's
                    // end removes it then).
                    let mut orca = self.orca.lock().unwrap_or_else(|e| e.into_inner());
                    if orca.get(&gone.hostname).is_some_and(|s| s.open == 0) {
                        orca.remove(&gone.hostname);
                    }
                }
                return Ok(true);
            }
            Ok(false)
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
            state.revision += 1;
            self.tx.send_replace(Arc::new(state.clone()));
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
    fn publishes_each_change_as_a_new_revision() {
        let registry = Registry::new(["a".to_string()]);
        let mut rx = registry.subscribe();
        registry.register(worker("a", 0, 10)).unwrap();
        assert!(rx.has_changed().unwrap());
        let snap = rx.borrow_and_update().clone();
        assert_eq!(snap.revision, 1);
        assert_eq!(snap.services["a"].workers[&0].pid, 10);
    }

    #[test]
    fn deregisters_only_the_same_instance() {
        let registry = Registry::new(["a".to_string()]);
        registry.register(worker("a", 0, 10)).unwrap();
        registry.register(worker("a", 0, 11)).unwrap();
        assert!(
            !registry.deregister("a", 0, 10),
            "an old instance must not remove its successor"
        );
        assert!(registry.deregister("a", 0, 11));
        assert!(registry.snapshot().services["a"].workers.is_empty());
        assert_eq!(registry.snapshot().revision, 3);
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
