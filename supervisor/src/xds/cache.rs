//! The xDS cache: the current resources of every type, versioned, built from registry snapshots.
//!
//! Each resource carries its own version (a hash of its encoding), which delta xDS needs; each type
//! carries a version `<epoch>-<counter>` that changes only when that type's content changes. The epoch
//! is the supervisor's start time, so versions never repeat across supervisor restarts and a
//! reconnecting Envoy never takes new state for old.
//!
//! Under local-first routing in a fleet, endpoints depend on who asks: [`Resources::endpoints_for`]
//! gives each requester locality its variant (see [`priorities`](super::priorities)), built the
//! first time a stream of that locality asks for the resources of a revision, so a supervisor builds
//! one variant per distinct locality among its Envoys, never one per Envoy and none nobody asked for.
//! A variant's type version is the one built from the snapshot: it changes exactly when they do.
//!
//! Invariant: the cache never touches gRPC or streams; it publishes whole [`Resources`] on a watch
//! channel and the transport reads them. CDS and EDS are built from the same snapshot, so every EDS
//! name is a CDS cluster.

mod services;
mod window;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    future::Future,
    hash::{DefaultHasher, Hasher},
    sync::{Arc, Mutex, PoisonError},
    time::{SystemTime, UNIX_EPOCH},
};

use envoy_types::pb::{envoy::config::endpoint::v3::ClusterLoadAssignment, google::protobuf::Any};
use prost::Message;
use tokio::sync::watch;

use self::{
    services::{Built, Flavours, ServiceMemo},
    window::Window,
};
use super::{
    priorities::{Requester, prioritised_for},
    resources::{Balancer, CLUSTER_TYPE_URL, ClusterOptions, ENDPOINT_TYPE_URL, EdsSource, pack},
};
use crate::{
    config::Routing,
    registry::{ServiceView, Snapshot, SpecChoices},
};

/// One resource with its own version.
#[derive(Clone, Debug, PartialEq)]
pub struct VersionedResource {
    /// The resource name.
    pub name: String,
    /// A hash of the encoded resource, in hex.
    pub version: String,
    /// The encoded resource.
    pub resource: Any,
    /// The [`TypeResources::serial`] at which the resource took this version (or appeared): a stream
    /// that looked at a set of serial `s` need only look again at resources of a higher serial.
    pub serial: u64,
}

/// Every resource of one type, at one version.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeResources {
    /// The type URL.
    pub type_url: &'static str,
    /// `<epoch>-<counter>`; changes exactly when a resource is added, removed or changed.
    pub version: String,
    /// The counter of `version`: streams compare serials, not version strings.
    pub serial: u64,
    /// The serial at which a resource was last removed (0: never).
    pub last_removal: u64,
    /// The resources by name.
    pub resources: BTreeMap<String, VersionedResource>,
}

/// The resources of every type served, as built from one registry snapshot.
#[derive(Clone, Debug, PartialEq)]
pub struct Resources {
    /// The registry revision they were built from.
    pub revision: u64,
    /// When the registry made that revision.
    pub changed_at: std::time::Instant,
    /// Clusters whose endpoints come over a dedicated EDS stream (served on CDS streams).
    pub clusters: Arc<TypeResources>,
    /// The same clusters with endpoints over a dedicated delta EDS stream (served on delta CDS
    /// streams).
    pub delta_clusters: Arc<TypeResources>,
    /// The same clusters with endpoints over ADS (served on ADS streams, delta or not).
    pub ads_clusters: Arc<TypeResources>,
    /// Cluster load assignments, every locality at priority 0: what every Envoy is sent unless
    /// routing is local-first.
    pub endpoints: Arc<TypeResources>,
    /// Under local-first routing, the variants of `endpoints` by requester.
    local_first: Option<Arc<Variants>>,
}

/// The assignments of one snapshot under local-first routing, and the variant of them each requester
/// locality asked for so far.
#[derive(Debug)]
struct Variants {
    /// Cluster load assignments by name, as built (every locality at priority 0).
    assignments: BTreeMap<String, Arc<ClusterLoadAssignment>>,
    /// Each requester's variant, built when first asked for.
    built: Mutex<HashMap<Requester, Arc<TypeResources>>>,
    /// Each requester's variant of each assignment across builds: an assignment a change left as it
    /// was keeps its variants.
    memo: Arc<Mutex<VariantMemo>>,
}

/// Each requester's variants across builds, kept while it asks.
///
/// Invariant: a requester is forgotten once it has not asked for [`KEPT_BUILDS`] builds. The
/// requester is what a client says its locality is, so without this, clients that come and go (or
/// one that names a new sub-zone on each stream) would leave their variants of every assignment in
/// the memo for good. A live stream asks for every build it sees, so it keeps its entry.
#[derive(Debug, Default)]
struct VariantMemo {
    /// Builds so far.
    build: u64,
    /// Requester -> its variants.
    made: HashMap<Requester, Made>,
}

/// The variants made for one requester.
#[derive(Debug, Default)]
struct Made {
    /// The build during which it last asked.
    asked: u64,
    /// Service -> (the assignment a variant was made from, the variant).
    variants: HashMap<String, (Arc<ClusterLoadAssignment>, VersionedResource)>,
}

/// How many builds a requester's variants are kept without its asking: a stream that skipped a
/// build (it reads only the latest) is not made to rebuild all of its variants.
const KEPT_BUILDS: u64 = 2;

/// Where the clusters served on a stream tell Envoy to fetch their endpoints: picks the cluster
/// flavour of [`Resources::get`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EdsVia {
    /// A dedicated state-of-the-world EDS stream.
    Grpc,
    /// A dedicated delta EDS stream.
    DeltaGrpc,
    /// The ADS stream the clusters came on.
    Ads,
}

impl Resources {
    /// The resources of `type_url` for a stream whose clusters fetch endpoints `via` there, and
    /// whose Envoy is `requester`.
    pub fn get(
        &self,
        type_url: &str,
        via: EdsVia,
        requester: &Requester,
    ) -> Option<Arc<TypeResources>> {
        match type_url {
            CLUSTER_TYPE_URL => Some(
                match via {
                    EdsVia::Grpc => &self.clusters,
                    EdsVia::DeltaGrpc => &self.delta_clusters,
                    EdsVia::Ads => &self.ads_clusters,
                }
                .clone(),
            ),
            ENDPOINT_TYPE_URL => Some(self.endpoints_for(requester)),
            _ => None,
        }
    }

    /// Whether a type of clusters is at another version in `other`.
    pub fn clusters_differ(&self, other: &Resources) -> bool {
        self.clusters.version != other.clusters.version
            || self.delta_clusters.version != other.delta_clusters.version
            || self.ads_clusters.version != other.ads_clusters.version
    }

    /// The cluster load assignments `requester` is sent: under local-first routing its variant
    /// (built on first ask), else [`Resources::endpoints`].
    pub fn endpoints_for(&self, requester: &Requester) -> Arc<TypeResources> {
        let Some(variants) = &self.local_first else {
            return self.endpoints.clone();
        };
        let mut built = variants
            .built
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        built
            .entry(requester.clone())
            .or_insert_with(|| {
                let mut memo = variants.memo.lock().unwrap_or_else(PoisonError::into_inner);
                let build = memo.build;
                let made = memo.made.entry(requester.clone()).or_default();
                made.asked = build;
                let made = &mut made.variants;
                let resources = variants
                    .assignments
                    .iter()
                    .map(|(name, a)| {
                        let mut variant = match made.get(name) {
                            Some((from, variant)) if Arc::ptr_eq(from, a) => variant.clone(),
                            _ => {
                                let variant = versioned(name, pack(&prioritised_for(a, requester)));
                                made.insert(name.clone(), (Arc::clone(a), variant.clone()));
                                variant
                            }
                        };
                        // A variant changes only with the assignment it is made from.
                        variant.serial = self
                            .endpoints
                            .resources
                            .get(name)
                            .map_or(self.endpoints.serial, |r| r.serial);
                        (name.clone(), variant)
                    })
                    .collect();
                tracing::debug!(?requester, version = %self.endpoints.version, "Endpoints built for a requester locality");
                Arc::new(TypeResources {
                    type_url: ENDPOINT_TYPE_URL,
                    version: self.endpoints.version.clone(),
                    serial: self.endpoints.serial,
                    last_removal: self.endpoints.last_removal,
                    resources,
                })
            })
            .clone()
    }
}

// === impl Variants ===

impl PartialEq for Variants {
    /// Variants are made from the assignments alone: equal assignments make equal variants.
    fn eq(&self, other: &Self) -> bool {
        self.assignments == other.assignments
    }
}

/// Builds [`Resources`] from snapshots and keeps the per-type version counters.
#[derive(Debug)]
pub struct Cache {
    epoch: String,
    options: ClusterOptions,
    clusters: TypeVersion,
    delta_clusters: TypeVersion,
    ads_clusters: TypeVersion,
    endpoints: TypeVersion,
    /// Each service's last build: a change rebuilds only the services it touched.
    services: ServiceMemo,
    /// Each requester's variants under local-first routing, across builds.
    variants: Arc<Mutex<VariantMemo>>,
    /// The fleet's choice of each service's balancer, across builds.
    specs: SpecChoices,
}

/// The content last seen for one type and its counter.
#[derive(Debug, Default)]
struct TypeVersion {
    counter: u64,
    /// Name -> (version, the counter at which the resource took it); `None` before the first build.
    content: Option<BTreeMap<String, (String, u64)>>,
    /// The counter at which a resource was last removed.
    last_removal: u64,
}

/// A fresh epoch: the current time in nanoseconds since the Unix epoch, in hex.
pub fn new_epoch() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{nanos:x}")
}

// === impl Cache ===

impl Cache {
    /// A cache with the given epoch; `options.eds_source` is used for CDS streams, delta CDS streams
    /// get the same clusters with a delta EDS source and ADS streams with `ads: {}`.
    pub fn new(epoch: String, options: ClusterOptions) -> Self {
        Cache {
            epoch,
            options,
            clusters: TypeVersion::default(),
            delta_clusters: TypeVersion::default(),
            ads_clusters: TypeVersion::default(),
            endpoints: TypeVersion::default(),
            services: ServiceMemo::default(),
            variants: Arc::default(),
            specs: SpecChoices::default(),
        }
    }

    /// The options `snapshot` is served with: in a fleet, every service of the fleet gets the
    /// balancer the fleet agrees on ([`choose_specs`]), also those this host does not run.
    fn served_options(&mut self, snapshot: &Snapshot) -> ClusterOptions {
        let Some(fleet) = &self.options.fleet else {
            return self.options.clone();
        };
        let own = snapshot
            .services
            .keys()
            .map(|service| {
                let balancer = self.options.balancers.get(service).copied();
                (service.clone(), balancer.unwrap_or(Balancer::RoundRobin))
            })
            .collect();
        let balancers = self
            .specs
            .choose(&fleet.host, &own, &snapshot.fleet)
            .iter()
            .map(|(service, choice)| (service.clone(), choice.balancer))
            .collect();
        ClusterOptions {
            balancers,
            ..self.options.clone()
        }
    }

    /// The epoch every type version starts with.
    pub fn epoch(&self) -> &str {
        &self.epoch
    }

    /// The resources for `snapshot`, with versions advanced for the types whose content changed since
    /// the last call.
    pub fn build(&mut self, snapshot: &Snapshot) -> Resources {
        let options = self.served_options(snapshot);
        let ads_options = ClusterOptions {
            eds_source: EdsSource::Ads,
            ..options.clone()
        };
        let delta_options = ClusterOptions {
            eds_source: match &options.eds_source {
                EdsSource::Grpc { xds_cluster, .. } => EdsSource::Grpc {
                    xds_cluster: xds_cluster.clone(),
                    delta: true,
                },
                EdsSource::Ads => EdsSource::Ads,
            },
            ..options.clone()
        };
        // Every service of the fleet: this host's (with its workers), and those only other hosts run
        // (none here). Each is built again only if its inputs changed.
        let none = ServiceView::default();
        let flavours = Flavours {
            grpc: &options,
            delta: &delta_options,
            ads: &ads_options,
        };
        self.services.begin(&options);
        let served = snapshot
            .services
            .keys()
            .chain(snapshot.fleet.values().flat_map(|h| h.services.keys()))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .map(|name| {
                let view = snapshot.services.get(name).unwrap_or(&none);
                let built = self.services.service(snapshot, name, view, &flavours);
                (name, built)
            })
            .collect::<BTreeMap<_, _>>();
        self.services.retain(&served);
        tracing::trace!(
            services = served.len(),
            rebuilt = self.services.rebuilt,
            "Services built"
        );
        let of = |pick: fn(&Built) -> &VersionedResource| {
            served
                .values()
                .map(move |built| pick(built).clone())
                .collect::<Vec<_>>()
        };
        let clusters = of(|b| &b.cluster);
        let delta_clusters = of(|b| &b.delta_cluster);
        let ads_clusters = of(|b| &b.ads_cluster);
        let endpoints = of(|b| &b.endpoints);
        let endpoints = self
            .endpoints
            .advance(&self.epoch, ENDPOINT_TYPE_URL, endpoints);
        let local_first = self
            .options
            .fleet
            .as_ref()
            .is_some_and(|f| f.routing == Routing::LocalFirst);
        {
            let mut memo = self.variants.lock().unwrap_or_else(PoisonError::into_inner);
            memo.build += 1;
            let build = memo.build;
            if local_first {
                memo.made
                    .retain(|_, made| made.asked + KEPT_BUILDS >= build);
                for made in memo.made.values_mut() {
                    made.variants.retain(|name, _| served.contains_key(name));
                }
            } else {
                memo.made.clear();
            }
            memo.made.shrink_to_fit();
        }
        Resources {
            revision: snapshot.revision,
            changed_at: snapshot.changed_at,
            clusters: Arc::new(
                self.clusters
                    .advance(&self.epoch, CLUSTER_TYPE_URL, clusters),
            ),
            delta_clusters: Arc::new(self.delta_clusters.advance(
                &self.epoch,
                CLUSTER_TYPE_URL,
                delta_clusters,
            )),
            ads_clusters: Arc::new(self.ads_clusters.advance(
                &self.epoch,
                CLUSTER_TYPE_URL,
                ads_clusters,
            )),
            endpoints: Arc::new(endpoints),
            local_first: local_first.then(|| {
                Arc::new(Variants {
                    assignments: served
                        .iter()
                        .map(|(name, built)| ((*name).clone(), Arc::clone(&built.assignment)))
                        .collect(),
                    built: Mutex::default(),
                    memo: Arc::clone(&self.variants),
                })
            }),
        }
    }

    /// Publishes the resources of every snapshot on a watch channel until `stop` completes; then the
    /// sender is dropped, which tells every stream reading it that the control plane is going away.
    ///
    /// A snapshot that changes no resource is published too (only its `revision` moves): streams
    /// send nothing for it, but learn that their client is synced at that revision.
    ///
    /// Must be called within a Tokio runtime; the returned receiver already holds the resources of the
    /// current snapshot.
    pub fn spawn(
        self,
        snapshots: watch::Receiver<Arc<Snapshot>>,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> watch::Receiver<Arc<Resources>> {
        self.spawn_with_options(snapshots, None, stop)
    }

    /// Like [`Cache::spawn`], and also rebuilds every resource with the new options each time
    /// `options` changes (a reloaded config: balancers, weights, ring sizes).
    pub fn spawn_with_options(
        mut self,
        mut snapshots: watch::Receiver<Arc<Snapshot>>,
        mut options: Option<watch::Receiver<ClusterOptions>>,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> watch::Receiver<Arc<Resources>> {
        if let Some(options) = &mut options {
            self.options = options.borrow_and_update().clone();
        }
        let first = self.build(&snapshots.borrow_and_update());
        let (tx, rx) = watch::channel(Arc::new(first));
        tokio::spawn(async move {
            tokio::pin!(stop);
            let mut window = Window::default();
            loop {
                let options_changed = async {
                    match &mut options {
                        Some(rx) => rx.changed().await.is_ok(),
                        None => std::future::pending().await,
                    }
                };
                let deadline = window.deadline();
                let held = async {
                    match deadline {
                        Some(deadline) => tokio::time::sleep_until(deadline).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = &mut stop => break,
                    changed = options_changed => {
                        match &mut options {
                            Some(rx) if changed => self.options = rx.borrow_and_update().clone(),
                            // The sender is gone: the options stay as they are.
                            _ => {
                                options = None;
                                continue;
                            }
                        }
                        let snapshot = snapshots.borrow().clone();
                        let resources = self.build(&snapshot);
                        tracing::debug!(
                            cds = %resources.clusters.version,
                            eds = %resources.endpoints.version,
                            "Resources rebuilt with new options"
                        );
                        tx.send_if_modified(|current| {
                            let modified = **current != resources;
                            if modified {
                                *current = Arc::new(resources);
                            }
                            modified
                        });
                    }
                    changed = snapshots.changed() => {
                        if changed.is_err() {
                            // The registry is gone: keep serving the last resources until stopped.
                            stop.await;
                            break;
                        }
                        if window.changed(tokio::time::Instant::now()) {
                            self.publish(&mut snapshots, &tx);
                        }
                    }
                    () = held => {
                        if window.elapsed(tokio::time::Instant::now()) {
                            self.publish(&mut snapshots, &tx);
                        }
                    }
                }
            }
            tracing::debug!("Cache stopped");
        });
        rx
    }

    /// Builds the resources of the latest snapshot and publishes them (also when only the revision
    /// moved: streams then learn their client is synced at it).
    fn publish(
        &mut self,
        snapshots: &mut watch::Receiver<Arc<Snapshot>>,
        tx: &watch::Sender<Arc<Resources>>,
    ) {
        let snapshot = snapshots.borrow_and_update().clone();
        let resources = self.build(&snapshot);
        tx.send_if_modified(|current| {
            let changed = current.clusters_differ(&resources)
                || current.endpoints.version != resources.endpoints.version;
            if changed {
                tracing::debug!(
                    revision = snapshot.revision,
                    cds = %resources.clusters.version,
                    eds = %resources.endpoints.version,
                    rebuilt = self.services.rebuilt,
                    "Resources updated"
                );
            }
            let modified = changed || current.revision != resources.revision;
            if modified {
                *current = Arc::new(resources);
            }
            modified
        });
    }
}

// === impl TypeVersion ===

impl TypeVersion {
    /// The set of `resources`, with the counter advanced if its content changed since the last call,
    /// and each resource's serial: the counter at which it took its version.
    fn advance(
        &mut self,
        epoch: &str,
        type_url: &'static str,
        resources: impl IntoIterator<Item = VersionedResource>,
    ) -> TypeResources {
        let mut resources = resources
            .into_iter()
            .map(|r| (r.name.clone(), r))
            .collect::<BTreeMap<_, _>>();
        let same = self.content.as_ref().is_some_and(|content| {
            content.len() == resources.len()
                && content
                    .iter()
                    .zip(resources.values())
                    .all(|((name, (version, _)), r)| *name == r.name && *version == r.version)
        });
        if !same {
            self.counter += 1;
            let before = self.content.take().unwrap_or_default();
            if before.keys().any(|name| !resources.contains_key(name)) {
                self.last_removal = self.counter;
            }
            let counter = self.counter;
            self.content = Some(
                resources
                    .values()
                    .map(|r| {
                        let serial = match before.get(&r.name) {
                            Some((version, serial)) if *version == r.version => *serial,
                            _ => counter,
                        };
                        (r.name.clone(), (r.version.clone(), serial))
                    })
                    .collect(),
            );
        }
        let content = self.content.as_ref().expect("set above");
        for (r, (_, serial)) in resources.values_mut().zip(content.values()) {
            r.serial = *serial;
        }
        TypeResources {
            type_url,
            version: format!("{epoch}-{}", self.counter),
            serial: self.counter,
            last_removal: self.last_removal,
            resources,
        }
    }
}

fn versioned(name: &str, resource: Any) -> VersionedResource {
    let mut hasher = DefaultHasher::new();
    hasher.write(&resource.encode_to_vec());
    VersionedResource {
        name: name.to_string(),
        version: format!("{:016x}", hasher.finish()),
        resource,
        serial: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Address, Protocol, Registry, Worker};

    fn worker(service: &str, index: u32, pid: u32) -> Worker {
        let addr = Address::Tcp(([127, 0, 0, 1], 8000 + index as u16).into());
        Worker::ready(service, index, pid, vec![Protocol::Http1], vec![addr])
    }

    fn cache() -> Cache {
        Cache::new("e1".into(), ClusterOptions::default())
    }

    /// A registry with one worker of service `a`, a cache, and the resources it built for them.
    fn a_with_one_worker() -> (Registry, Cache, Resources) {
        let registry = Registry::new(["a".to_string()]);
        registry.register(worker("a", 0, 10)).unwrap();
        let mut cache = cache();
        let resources = cache.build(&registry.snapshot());
        (registry, cache, resources)
    }

    #[test]
    fn versions_carry_the_epoch_and_start_at_one() {
        let registry = Registry::new(["a".to_string()]);
        let resources = cache().build(&registry.snapshot());
        assert_eq!(resources.clusters.version, "e1-1");
        assert_eq!(resources.endpoints.version, "e1-1");
        assert_eq!(resources.clusters.type_url, CLUSTER_TYPE_URL);
        assert_eq!(resources.endpoints.type_url, ENDPOINT_TYPE_URL);
        assert_eq!(
            resources.clusters.resources.keys().collect::<Vec<_>>(),
            ["a"]
        );
    }

    #[test]
    fn a_worker_change_moves_only_eds() {
        let registry = Registry::new(["a".to_string(), "b".to_string()]);
        registry.register(worker("a", 0, 10)).unwrap();
        let mut cache = cache();
        let before = cache.build(&registry.snapshot());
        registry.register(worker("a", 1, 11)).unwrap();
        let after = cache.build(&registry.snapshot());
        assert_eq!(before.clusters.version, after.clusters.version);
        assert_eq!(before.delta_clusters.version, after.delta_clusters.version);
        assert_eq!(before.ads_clusters.version, after.ads_clusters.version);
        assert_ne!(before.endpoints.version, after.endpoints.version);
        assert_eq!(after.endpoints.version, "e1-2");
        // Only the changed resource gets a new per-resource version.
        assert_ne!(
            before.endpoints.resources["a"].version,
            after.endpoints.resources["a"].version
        );
        assert_eq!(
            before.endpoints.resources["b"].version,
            after.endpoints.resources["b"].version
        );
    }

    #[test]
    fn an_unchanged_snapshot_keeps_every_version() {
        let (registry, mut cache, before) = a_with_one_worker();
        let after = cache.build(&registry.snapshot());
        assert_eq!(before, after);
    }

    #[test]
    fn a_protocol_change_moves_cds() {
        let (registry, mut cache, before) = a_with_one_worker();
        let mut h2 = worker("a", 0, 10);
        h2.listener.protocols = vec![Protocol::Http2];
        registry.register(h2).unwrap();
        let after = cache.build(&registry.snapshot());
        assert_ne!(before.clusters.version, after.clusters.version);
        assert_ne!(before.delta_clusters.version, after.delta_clusters.version);
        assert_ne!(before.ads_clusters.version, after.ads_clusters.version);
        assert_eq!(before.endpoints.version, after.endpoints.version);
    }

    /// A cache of host `a` (zone z1) under `routing`, and a registry with one local worker of `web`
    /// and host `b` (zone z2) running one.
    fn fleet_of_two(routing: Routing) -> (Registry, Cache) {
        use crate::{
            config::Locality,
            registry::{Health, RemoteHost, RemoteWorker},
            xds::resources::FleetIdentity,
        };
        let locality = |zone: &str| Locality {
            region: "r1".into(),
            zone: zone.into(),
        };
        let registry = Registry::new(["web".to_string()]);
        registry.register(worker("web", 0, 10)).unwrap();
        let remote = RemoteWorker {
            service: "web".into(),
            index: 0,
            pid: 20,
            hostname: "b-web-0-20".into(),
            protocols: vec![Protocol::Http1],
            addresses: vec![Address::Tcp("10.0.0.2:8000".parse().unwrap())],
            health: Health::Serving,
            weight: 1,
            hash_key: "b-web-0".into(),
        };
        let b = RemoteHost {
            locality: locality("z2"),
            grpc_port: 18000,
            services: [("web".to_string(), Balancer::RoundRobin)].into(),
            workers: [(("web".to_string(), 0, 20), remote)].into(),
        };
        registry.set_fleet([("b".to_string(), Arc::new(b))].into());
        let options = ClusterOptions {
            fleet: Some(FleetIdentity {
                host: "a".into(),
                locality: locality("z1"),
                routing,
            }),
            ..ClusterOptions::default()
        };
        (registry, Cache::new("e1".into(), options))
    }

    /// The priority of each host's endpoints in `web`'s assignment in `set`, by sub-zone.
    fn priorities(set: &TypeResources) -> BTreeMap<String, u32> {
        let assignment =
            ClusterLoadAssignment::decode(set.resources["web"].resource.value.as_slice()).unwrap();
        assignment
            .endpoints
            .iter()
            .map(|g| (g.locality.clone().unwrap().sub_zone, g.priority))
            .collect()
    }

    fn requester(host: &str, zone: &str) -> Requester {
        Requester {
            region: "r1".into(),
            zone: zone.into(),
            sub_zone: host.into(),
        }
    }

    #[test]
    fn local_first_gives_each_requester_its_own_host_first() {
        let (registry, mut cache) = fleet_of_two(Routing::LocalFirst);
        let resources = cache.build(&registry.snapshot());
        let on_a = resources.endpoints_for(&requester("a", "z1"));
        let on_b = resources.endpoints_for(&requester("b", "z2"));
        assert_eq!(priorities(&on_a), [("a".into(), 0), ("b".into(), 1)].into());
        assert_eq!(priorities(&on_b), [("a".into(), 1), ("b".into(), 0)].into());
        // One type version for every variant: they change exactly when the assignments do.
        assert_eq!(on_a.version, resources.endpoints.version);
        assert_eq!(on_b.version, resources.endpoints.version);
        assert_ne!(on_a.resources["web"].version, on_b.resources["web"].version);
        // A variant is built once per resources and requester.
        assert!(Arc::ptr_eq(
            &on_a,
            &resources.endpoints_for(&requester("a", "z1"))
        ));
        // The same snapshot again: the same resources, variants included.
        let again = cache.build(&registry.snapshot());
        assert_eq!(again, resources);
        assert_eq!(
            again.endpoints_for(&requester("a", "z1")).resources,
            on_a.resources
        );
        // Through `get`, as a stream asks.
        let got = resources
            .get(ENDPOINT_TYPE_URL, EdsVia::Grpc, &requester("b", "z2"))
            .unwrap();
        assert!(Arc::ptr_eq(&got, &on_b));
    }

    #[test]
    fn local_first_forgets_the_variants_of_requesters_that_stopped_asking() {
        let (registry, mut cache) = fleet_of_two(Routing::LocalFirst);
        let resources = cache.build(&registry.snapshot());
        // A thousand Envoys, each naming a host of its own, ask once and are gone.
        for host in 0..1000 {
            resources.endpoints_for(&requester(&format!("gone-{host}"), "z9"));
        }
        drop(resources);
        let variants = |cache: &Cache| cache.variants.lock().unwrap().made.len();
        assert_eq!(variants(&cache), 1000);
        // One stays and asks for every build.
        for _ in 0..=KEPT_BUILDS {
            let resources = cache.build(&registry.snapshot());
            resources.endpoints_for(&requester("a", "z1"));
        }
        assert_eq!(variants(&cache), 1, "only the requester that still asks");
        let resources = cache.build(&registry.snapshot());
        assert_eq!(
            priorities(&resources.endpoints_for(&requester("a", "z1"))),
            [("a".into(), 0), ("b".into(), 1)].into()
        );
    }

    #[test]
    fn a_service_only_other_hosts_run_is_served_with_their_spec() {
        let (registry, mut cache) = fleet_of_two(Routing::Fleet);
        let mut fleet = registry.snapshot().fleet.clone();
        let b = Arc::make_mut(fleet.get_mut("b").unwrap());
        b.services
            .insert("api".into(), Balancer::LeastRequest { choice_count: 4 });
        let mut api = b.workers.values().next().unwrap().clone();
        api.service = "api".into();
        api.protocols = vec![Protocol::Http2];
        b.workers.insert(("api".into(), 0, 20), api);
        registry.set_fleet(fleet);
        let resources = cache.build(&registry.snapshot());
        assert_eq!(
            resources.clusters.resources.keys().collect::<Vec<_>>(),
            ["api", "web"]
        );
        let cluster = envoy_types::pb::envoy::config::cluster::v3::Cluster::decode(
            resources.clusters.resources["api"]
                .resource
                .value
                .as_slice(),
        )
        .unwrap();
        let policy = cluster
            .load_balancing_policy
            .expect("least request is a typed policy");
        assert!(
            policy.policies[0]
                .typed_extension_config
                .as_ref()
                .unwrap()
                .name
                .contains("least_request"),
            "{policy:?}"
        );
        // HTTP/2 upstream: every worker of api, all on b, speaks it.
        let options = &cluster.typed_extension_protocol_options
            [crate::xds::resources::HTTP_PROTOCOL_OPTIONS_KEY];
        let options =
            envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions::decode(
                options.value.as_slice(),
            )
            .unwrap();
        assert!(
            format!("{options:?}").contains("Http2ProtocolOptions"),
            "{options:?}"
        );
        let assignment = ClusterLoadAssignment::decode(
            resources.endpoints.resources["api"]
                .resource
                .value
                .as_slice(),
        )
        .unwrap();
        assert_eq!(assignment.endpoints.len(), 1);
        assert_eq!(
            assignment.endpoints[0].locality.as_ref().unwrap().sub_zone,
            "b"
        );
    }

    /// What a cache built equals what a fresh cache builds from the same snapshot, resource by
    /// resource (type versions and serials aside: they count changes).
    fn assert_as_fresh(cache: &Cache, resources: &Resources, snapshot: &Snapshot) {
        let fresh = Cache::new("e1".into(), cache.options.clone()).build(snapshot);
        let content = |set: &TypeResources| {
            set.resources
                .values()
                .map(|r| (r.name.clone(), r.version.clone(), r.resource.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(content(&resources.clusters), content(&fresh.clusters));
        assert_eq!(
            content(&resources.delta_clusters),
            content(&fresh.delta_clusters)
        );
        assert_eq!(
            content(&resources.ads_clusters),
            content(&fresh.ads_clusters)
        );
        assert_eq!(content(&resources.endpoints), content(&fresh.endpoints));
        for who in [requester("a", "z1"), requester("b", "z2")] {
            assert_eq!(
                content(&resources.endpoints_for(&who)),
                content(&fresh.endpoints_for(&who))
            );
        }
    }

    #[test]
    fn a_change_rebuilds_only_the_services_it_touched() {
        let registry = Registry::new(["a".to_string(), "b".to_string()]);
        registry.register(worker("a", 0, 10)).unwrap();
        registry.register(worker("b", 0, 11)).unwrap();
        let mut cache = cache();
        cache.build(&registry.snapshot());
        assert_eq!(cache.services.rebuilt, 2);
        registry.register(worker("a", 1, 12)).unwrap();
        let after = cache.build(&registry.snapshot());
        assert_eq!(cache.services.rebuilt, 1, "only a");
        assert_as_fresh(&cache, &after, &registry.snapshot());
        cache.build(&registry.snapshot());
        assert_eq!(cache.services.rebuilt, 0, "nothing changed");
    }

    #[test]
    fn a_remote_change_rebuilds_only_its_service_and_new_options_rebuild_all() {
        let (registry, mut cache) = fleet_of_two(Routing::LocalFirst);
        // b also runs api.
        let mut fleet = registry.snapshot().fleet.clone();
        let b = Arc::make_mut(fleet.get_mut("b").unwrap());
        b.services.insert("api".into(), Balancer::RoundRobin);
        let mut api = b.workers.values().next().unwrap().clone();
        api.service = "api".into();
        b.workers.insert(("api".into(), 0, 21), api);
        registry.set_fleet(fleet);
        let before = cache.build(&registry.snapshot());
        let variant = before.endpoints_for(&requester("a", "z1"));
        assert_eq!(cache.services.rebuilt, 2);
        // b's web worker drains: b is a new host value, api's workers on it are as they were.
        let mut fleet = registry.snapshot().fleet.clone();
        let b = Arc::make_mut(fleet.get_mut("b").unwrap());
        b.workers.get_mut(&("web".into(), 0, 20)).unwrap().health =
            crate::registry::Health::Draining;
        registry.set_fleet(fleet);
        let after = cache.build(&registry.snapshot());
        assert_eq!(cache.services.rebuilt, 1, "only web");
        assert_ne!(
            before.endpoints.resources["web"],
            after.endpoints.resources["web"]
        );
        assert_eq!(
            before.endpoints.resources["api"],
            after.endpoints.resources["api"]
        );
        // api's variant is the one made before; web's is new.
        let again = after.endpoints_for(&requester("a", "z1"));
        assert_eq!(again.resources["api"], variant.resources["api"]);
        assert_ne!(again.resources["web"], variant.resources["web"]);
        assert_as_fresh(&cache, &after, &registry.snapshot());
        // Other options (a reload): every service again.
        cache.options.connect_timeout = std::time::Duration::from_secs(3);
        let reloaded = cache.build(&registry.snapshot());
        assert_eq!(cache.services.rebuilt, 2);
        assert_as_fresh(&cache, &reloaded, &registry.snapshot());
    }

    #[test]
    fn fleet_routing_sends_every_requester_one_priority() {
        let (registry, mut cache) = fleet_of_two(Routing::Fleet);
        let resources = cache.build(&registry.snapshot());
        let on_b = resources.endpoints_for(&requester("b", "z2"));
        assert!(Arc::ptr_eq(&on_b, &resources.endpoints));
        assert_eq!(priorities(&on_b), [("a".into(), 0), ("b".into(), 0)].into());
    }

    #[test]
    fn epoch_is_hex_nanos() {
        let epoch = u128::from_str_radix(&new_epoch(), 16).unwrap();
        assert!(epoch > 1_700_000_000 * 1_000_000_000, "after 2023: {epoch}");
    }

    #[tokio::test]
    async fn spawn_publishes_every_revision() {
        let registry = Registry::new(["a".to_string()]);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let mut rx = cache().spawn(registry.subscribe(), async {
            let _ = stop_rx.await;
        });
        assert_eq!(rx.borrow_and_update().endpoints.version, "e1-1");
        registry.register(worker("a", 0, 10)).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), rx.changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(rx.borrow_and_update().endpoints.version, "e1-2");
        // The same worker again: a new revision with the same resources.
        registry.register(worker("a", 0, 10)).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), rx.changed())
            .await
            .unwrap()
            .unwrap();
        let current = rx.borrow_and_update().clone();
        assert_eq!(current.revision, 2);
        assert_eq!(current.endpoints.version, "e1-2");
        stop_tx.send(()).unwrap();
        let closed = tokio::time::timeout(std::time::Duration::from_secs(5), rx.changed())
            .await
            .unwrap();
        assert!(closed.is_err(), "the channel closes when stopped");
    }
}
