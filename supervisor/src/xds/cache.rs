//! The xDS cache: the current resources of every type, versioned, built from registry snapshots.
//!
//! Each resource carries its own version (a hash of its encoding), which delta xDS needs; each type
//! carries a version `<epoch>-<counter>` that changes only when that type's content changes. The epoch
//! is the supervisor's start time, so versions never repeat across supervisor restarts and a
//! reconnecting Envoy never takes new state for old.
//!
//! Invariant: the cache never touches gRPC or streams; it publishes whole [`Resources`] on a watch
//! channel and the transport reads them. CDS and EDS are built from the same snapshot, so every EDS
//! name is a CDS cluster.

use std::{
    collections::BTreeMap,
    future::Future,
    hash::{DefaultHasher, Hasher},
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tokio::sync::watch;

use super::resources::{
    CLUSTER_TYPE_URL, ClusterOptions, ENDPOINT_TYPE_URL, EdsSource, make_cluster,
    make_load_assignment, pack, remote_of,
};
use crate::registry::Snapshot;

/// One resource with its own version.
#[derive(Clone, Debug, PartialEq)]
pub struct VersionedResource {
    /// The resource name.
    pub name: String,
    /// A hash of the encoded resource, in hex.
    pub version: String,
    /// The encoded resource.
    pub resource: Any,
}

/// Every resource of one type, at one version.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeResources {
    /// The type URL.
    pub type_url: &'static str,
    /// `<epoch>-<counter>`; changes exactly when a resource is added, removed or changed.
    pub version: String,
    /// The resources by name.
    pub resources: BTreeMap<String, VersionedResource>,
}

/// The resources of every type served, as built from one registry snapshot.
#[derive(Clone, Debug, PartialEq)]
pub struct Resources {
    /// The registry revision they were built from.
    pub revision: u64,
    /// Clusters whose endpoints come over a dedicated EDS stream (served on CDS streams).
    pub clusters: TypeResources,
    /// The same clusters with endpoints over a dedicated delta EDS stream (served on delta CDS
    /// streams).
    pub delta_clusters: TypeResources,
    /// The same clusters with endpoints over ADS (served on ADS streams, delta or not).
    pub ads_clusters: TypeResources,
    /// Cluster load assignments.
    pub endpoints: TypeResources,
}

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
    /// The resources of `type_url` for a stream whose clusters fetch endpoints `via` there.
    pub fn get(&self, type_url: &str, via: EdsVia) -> Option<&TypeResources> {
        match type_url {
            CLUSTER_TYPE_URL => Some(match via {
                EdsVia::Grpc => &self.clusters,
                EdsVia::DeltaGrpc => &self.delta_clusters,
                EdsVia::Ads => &self.ads_clusters,
            }),
            ENDPOINT_TYPE_URL => Some(&self.endpoints),
            _ => None,
        }
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
}

/// The content last seen for one type and its counter.
#[derive(Debug, Default)]
struct TypeVersion {
    counter: u64,
    content: Option<BTreeMap<String, String>>,
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
        }
    }

    /// The epoch every type version starts with.
    pub fn epoch(&self) -> &str {
        &self.epoch
    }

    /// The resources for `snapshot`, with versions advanced for the types whose content changed since
    /// the last call.
    pub fn build(&mut self, snapshot: &Snapshot) -> Resources {
        let ads_options = ClusterOptions {
            eds_source: EdsSource::Ads,
            ..self.options.clone()
        };
        let delta_options = ClusterOptions {
            eds_source: match &self.options.eds_source {
                EdsSource::Grpc { xds_cluster, .. } => EdsSource::Grpc {
                    xds_cluster: xds_cluster.clone(),
                    delta: true,
                },
                EdsSource::Ads => EdsSource::Ads,
            },
            ..self.options.clone()
        };
        let built = |options: &ClusterOptions| {
            snapshot
                .services
                .iter()
                .map(|(name, view)| versioned(name, pack(&make_cluster(name, view, options))))
                .collect::<Vec<_>>()
        };
        let clusters = built(&self.options);
        let delta_clusters = built(&delta_options);
        let ads_clusters = built(&ads_options);
        let endpoints = snapshot.services.iter().map(|(name, view)| {
            let remote = remote_of(snapshot, name);
            versioned(
                name,
                pack(&make_load_assignment(name, view, &remote, &self.options)),
            )
        });
        Resources {
            revision: snapshot.revision,
            clusters: self
                .clusters
                .advance(&self.epoch, CLUSTER_TYPE_URL, clusters),
            delta_clusters: self.delta_clusters.advance(
                &self.epoch,
                CLUSTER_TYPE_URL,
                delta_clusters,
            ),
            ads_clusters: self
                .ads_clusters
                .advance(&self.epoch, CLUSTER_TYPE_URL, ads_clusters),
            endpoints: self
                .endpoints
                .advance(&self.epoch, ENDPOINT_TYPE_URL, endpoints),
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
            loop {
                let options_changed = async {
                    match &mut options {
                        Some(rx) => rx.changed().await.is_ok(),
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
                        let snapshot = snapshots.borrow_and_update().clone();
                        let resources = self.build(&snapshot);
                        tx.send_if_modified(|current| {
                            let changed = current.clusters.version != resources.clusters.version
                                || current.delta_clusters.version
                                    != resources.delta_clusters.version
                                || current.ads_clusters.version != resources.ads_clusters.version
                                || current.endpoints.version != resources.endpoints.version;
                            if changed {
                                tracing::debug!(
                                    revision = snapshot.revision,
                                    cds = %resources.clusters.version,
                                    eds = %resources.endpoints.version,
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
            }
            tracing::debug!("Cache stopped");
        });
        rx
    }
}

// === impl TypeVersion ===

impl TypeVersion {
    fn advance(
        &mut self,
        epoch: &str,
        type_url: &'static str,
        resources: impl IntoIterator<Item = VersionedResource>,
    ) -> TypeResources {
        let resources = resources
            .into_iter()
            .map(|r| (r.name.clone(), r))
            .collect::<BTreeMap<_, _>>();
        let content = resources
            .iter()
            .map(|(name, r)| (name.clone(), r.version.clone()))
            .collect::<BTreeMap<_, _>>();
        if self.content.as_ref() != Some(&content) {
            self.counter += 1;
            self.content = Some(content);
        }
        TypeResources {
            type_url,
            version: format!("{epoch}-{}", self.counter),
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
