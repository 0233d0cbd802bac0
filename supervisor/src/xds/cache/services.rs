//! What the cache built for each service, and from what, so that a change rebuilds only the services
//! it touched.
//!
//! A service's resources (its three cluster flavours and its load assignment) depend on this host's
//! workers of it, on the other hosts' workers of it with their localities, and on the options it is
//! served with. A build reuses a service's resources when all three are as they were: the local view
//! compares by value (it holds this host's workers of one service), each other host by pointer first
//! (the fleet view replaces only the hosts that changed), then by its workers of the service alone,
//! which a host's worker map holds side by side. A change on one host of a fleet of 10,000 endpoints
//! in 100 services thus encodes and hashes one service's endpoints, not 10,000.
//!
//! Invariant: reused resources are byte for byte those a rebuild would make (the inputs compared are
//! every input of [`make_cluster`] and [`make_load_assignment`]).

use std::{
    collections::{BTreeMap, HashMap},
    ops::Bound,
    sync::Arc,
};

use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;

use super::{VersionedResource, versioned};
use crate::{
    config::Locality,
    registry::{RemoteHost, RemoteWorker, ServiceView, Snapshot},
    xds::resources::{ClusterOptions, make_cluster, make_load_assignment, pack},
};

/// The options of the three cluster flavours a service is served with.
#[derive(Debug)]
pub(super) struct Flavours<'a> {
    /// Endpoints over a dedicated state-of-the-world EDS stream.
    pub(super) grpc: &'a ClusterOptions,
    /// Endpoints over a dedicated delta EDS stream.
    pub(super) delta: &'a ClusterOptions,
    /// Endpoints over ADS.
    pub(super) ads: &'a ClusterOptions,
}

/// One service's resources, as built.
#[derive(Debug)]
pub(super) struct Built {
    /// Its cluster with endpoints over a dedicated state-of-the-world EDS stream.
    pub(super) cluster: VersionedResource,
    /// Its cluster with endpoints over a dedicated delta EDS stream.
    pub(super) delta_cluster: VersionedResource,
    /// Its cluster with endpoints over ADS.
    pub(super) ads_cluster: VersionedResource,
    /// Its load assignment, encoded.
    pub(super) endpoints: VersionedResource,
    /// Its load assignment (local-first routing derives each requester's variant from it).
    pub(super) assignment: Arc<ClusterLoadAssignment>,
}

/// A service's resources and the inputs they were built from.
#[derive(Debug)]
struct Entry {
    /// This host's workers of the service.
    local: ServiceView,
    /// The other hosts with workers of the service, by name, as last compared.
    hosts: Vec<(String, Arc<RemoteHost>)>,
    built: Arc<Built>,
}

/// Every served service's last build, valid for the options it was made with.
#[derive(Debug, Default)]
pub(super) struct ServiceMemo {
    /// The options every entry was built with (a reload or a fleet's new spec clears the memo).
    options: Option<ClusterOptions>,
    entries: HashMap<String, Entry>,
    /// How many services the last build made anew (the rest were reused).
    pub(super) rebuilt: usize,
}

impl ServiceMemo {
    /// Starts a build with `options`: entries made with other options are dropped.
    pub(super) fn begin(&mut self, options: &ClusterOptions) {
        if self.options.as_ref() != Some(options) {
            self.entries.clear();
            self.options = Some(options.clone());
        }
        self.rebuilt = 0;
    }

    /// Service `name`'s resources in `snapshot`, built again only if its inputs changed.
    pub(super) fn service(
        &mut self,
        snapshot: &Snapshot,
        name: &str,
        view: &ServiceView,
        flavours: &Flavours<'_>,
    ) -> Arc<Built> {
        let hosts = hosts_with(snapshot, name);
        if let Some(entry) = self.entries.get_mut(name)
            && entry.local == *view
            && same_remote(&entry.hosts, &hosts, name)
        {
            // Hold the current hosts: the next comparison is then a pointer per unchanged host.
            for ((_, held), (_, host)) in entry.hosts.iter_mut().zip(&hosts) {
                if !Arc::ptr_eq(held, host) {
                    *held = Arc::clone(host);
                }
            }
            return Arc::clone(&entry.built);
        }
        let remote = hosts
            .iter()
            .flat_map(|(host, remote)| {
                workers_of(remote, name).map(move |w| (host.as_str(), &remote.locality, w))
            })
            .collect::<Vec<(&str, &Locality, &RemoteWorker)>>();
        let cluster = |options| versioned(name, pack(&make_cluster(name, view, &remote, options)));
        let assignment = make_load_assignment(name, view, &remote, flavours.grpc);
        let built = Arc::new(Built {
            cluster: cluster(flavours.grpc),
            delta_cluster: cluster(flavours.delta),
            ads_cluster: cluster(flavours.ads),
            endpoints: versioned(name, pack(&assignment)),
            assignment: Arc::new(assignment),
        });
        self.rebuilt += 1;
        self.entries.insert(
            name.to_owned(),
            Entry {
                local: view.clone(),
                hosts: hosts
                    .into_iter()
                    .map(|(host, remote)| (host.clone(), Arc::clone(remote)))
                    .collect(),
                built: Arc::clone(&built),
            },
        );
        built
    }

    /// Ends a build that served `served`: entries of services no longer served are dropped.
    pub(super) fn retain(&mut self, served: &BTreeMap<&String, Arc<Built>>) {
        self.entries.retain(|name, _| served.contains_key(name));
    }
}

/// The other hosts of `snapshot` with workers of `service`, in the fleet's order.
fn hosts_with<'a>(snapshot: &'a Snapshot, service: &str) -> Vec<(&'a String, &'a Arc<RemoteHost>)> {
    snapshot
        .fleet
        .iter()
        .filter(|(_, host)| workers_of(host, service).next().is_some())
        .collect()
}

/// `host`'s workers of `service`: its worker map is keyed by service first, so they are one range.
fn workers_of<'a>(
    host: &'a RemoteHost,
    service: &'a str,
) -> impl Iterator<Item = &'a RemoteWorker> {
    host.workers
        .range((
            Bound::Included((service.to_owned(), 0, 0)),
            Bound::Unbounded,
        ))
        .take_while(move |((s, _, _), _)| s == service)
        .map(|(_, worker)| worker)
}

/// Whether `now`'s hosts hold the same workers of `service`, in the same localities, as `held`.
fn same_remote(
    held: &[(String, Arc<RemoteHost>)],
    now: &[(&String, &Arc<RemoteHost>)],
    service: &str,
) -> bool {
    held.len() == now.len()
        && held
            .iter()
            .zip(now)
            .all(|((held_name, held), (name, host))| {
                held_name == *name
                    && (Arc::ptr_eq(held, host)
                        || (held.locality == host.locality
                            && workers_of(held, service).eq(workers_of(host, service))))
            })
}
