//! Delta (incremental) xDS: the rules of `DeltaClusters`, `DeltaEndpoints` and
//! `DeltaAggregatedResources` streams.
//!
//! Per stream and per type the server keeps what the client subscribed to (CDS is a wildcard: Envoy
//! subscribes to `*`, or sends an empty first subscription, which means the same; EDS names clusters)
//! and what the client has, name -> resource version (kept as the serial of the resource at that
//! version). The first request's `initial_resource_versions` seeds what the client has (a
//! reconnecting Envoy sends them), so an unchanged resource is not sent again; resource versions are
//! hashes of the content, so they stay valid across supervisor restarts.
//! (Measured with Envoy 1.40: its first CDS request subscribes to nothing, its EDS requests name the
//! cluster; on reconnecting it sends the same subscriptions with `initial_resource_versions`.)
//! A response carries every subscribed resource whose version differs from what the client has, and
//! in `removed_resources` every name the client has that no longer exists; each has a fresh nonce.
//! A response is sent exactly when one is owed, so an ACK gets no reply.
//!
//! What the client has is updated when a response is sent. A NACKed response therefore stays "had"
//! (Envoy keeps its previous version): it is not offered again until the resource changes, which
//! avoids go-control-plane's resend loop. A name subscribed (again) is owed its resource even if the
//! client had it; a name unsubscribed is forgotten, with nothing sent; a subscribed name that does
//! not exist yet is sent when it appears. Unlike state of the world, a request echoing a stale nonce
//! still changes subscriptions (Envoy sends subscription changes with its ACKs, and each request
//! carries only the change), it just does not count as an ACK.
//!
//! On delta ADS clusters come before the endpoints that name them, as on ADS: endpoints are held until
//! their cluster was sent on the stream, and a changed cluster's endpoints are sent again after it.
//! The synced revision follows the same rules as on state-of-the-world streams ([`EndpointSync`]).
//! An EDS response carries at most [`EDS_RESPONSE_BYTES`] of assignments; the rest follow one
//! response per answer, as on state-of-the-world streams.

use std::collections::{BTreeMap, BTreeSet};

use envoy_types::pb::envoy::{
    config::core::v3::Node,
    service::discovery::v3::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource},
};
use tonic::Status;

use super::{EDS_RESPONSE_BYTES, Reply, Stream, StreamRules, looked::Looked, next_nonce};
use crate::xds::{
    cache::{Resources, TypeResources},
    resources::{CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL},
};

/// The name that subscribes to every resource of a type.
const WILDCARD: &str = "*";

/// The serial of what a client has when it said it had a version that is not the one served (or
/// one of a resource that does not exist): no resource has it, so the resource is owed.
const OTHER: u64 = u64::MAX;

/// What a delta stream knows about one resource type.
#[derive(Debug, Default)]
pub(super) struct DeltaWatch {
    /// Subscribed to every resource of the type.
    wildcard: bool,
    /// The names subscribed to explicitly.
    names: BTreeSet<String>,
    /// The nonce of the last response sent.
    nonce: Option<String>,
    /// What the client has, name -> the serial of that resource (which moves exactly when its
    /// version does; a number, not the version string: 1,000 streams hold this for every cluster):
    /// what it was sent (a NACKed resource included: see the module docs), or what it said it had
    /// on its first request ([`OTHER`] when that is not the version served). Only subscribed names.
    has: BTreeMap<String, u64>,
    /// Which resources a pass has yet to look at: a pass costs what changed since the last.
    looked: Looked,
}

/// The state of a delta stream.
pub(super) type DeltaStreamState = Stream<DeltaWatch>;

// === impl DeltaWatch ===

impl DeltaWatch {
    fn subscribed(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }

    /// Applies a request's subscription changes; `first` says it is the type's first request, whose
    /// `initial_resource_versions` are compared with `served` (given when there are any).
    fn subscribe(
        &mut self,
        request: &mut DeltaDiscoveryRequest,
        first: bool,
        served: Option<&TypeResources>,
    ) {
        let was_wildcard = self.wildcard;
        if first && request.resource_names_subscribe.is_empty() {
            // An empty first subscription is a wildcard (the legacy form of `*`).
            self.wildcard = true;
        }
        for name in request.resource_names_subscribe.drain(..) {
            if name == WILDCARD {
                self.wildcard = true;
            } else {
                // Owed even if the client had it.
                self.has.remove(&name);
                self.looked.again(&name);
                self.names.insert(name);
            }
        }
        for name in &request.resource_names_unsubscribe {
            if name == WILDCARD {
                self.wildcard = false;
            } else {
                self.names.remove(name);
            }
        }
        if self.wildcard && !was_wildcard {
            self.looked.forget();
        }
        if !request.resource_names_unsubscribe.is_empty() {
            let (wildcard, names) = (self.wildcard, &self.names);
            self.has.retain(|name, _| wildcard || names.contains(name));
        }
        if first && let Some(served) = served {
            for (name, version) in request.initial_resource_versions.drain() {
                if self.subscribed(&name) {
                    let serial = served
                        .resources
                        .get(&name)
                        .filter(|r| r.version == version)
                        .map_or(OTHER, |r| r.serial);
                    self.has.insert(name, serial);
                }
            }
        }
    }

    /// The response that brings the client up to date with `set`, if one is owed (`fresh`: even an
    /// empty one), carrying at most `limit` bytes of resources (at least one). Resources for which
    /// `sendable` is false, or past the limit, are held back; the second value says whether any was.
    fn respond(
        &mut self,
        set: &TypeResources,
        sendable: impl Fn(&str) -> bool,
        fresh: bool,
        limit: usize,
    ) -> (Option<DeltaDiscoveryResponse>, bool) {
        if !fresh && self.looked.done(set) {
            // Nothing changed since the last pass (an ACK's, as a rule), and nothing was held.
            return (None, false);
        }
        // Only a removal (or a first look) can leave the client a name that no longer exists.
        let removed = if self.looked.removals(set) {
            self.has
                .keys()
                .filter(|name| !set.resources.contains_key(*name))
                .cloned()
                .collect::<Vec<_>>()
        } else {
            Vec::new()
        };
        let (wildcard, names, has) = (self.wildcard, &self.names, &self.has);
        let filled = self.looked.fill(
            set,
            |r| (wildcard || names.contains(&r.name)) && has.get(&r.name) != Some(&r.serial),
            sendable,
            limit,
        );
        let (updated, held) = (filled.resources, filled.held);
        if updated.is_empty() && removed.is_empty() && !fresh {
            return (None, held);
        }
        for resource in &updated {
            self.has.insert(resource.name.clone(), resource.serial);
        }
        for name in &removed {
            self.has.remove(name);
        }
        let nonce = next_nonce();
        let response = DeltaDiscoveryResponse {
            system_version_info: set.version.clone(),
            resources: updated
                .iter()
                .map(|r| Resource {
                    name: r.name.clone(),
                    version: r.version.clone(),
                    resource: Some(r.resource.clone()),
                    ..Default::default()
                })
                .collect(),
            type_url: set.type_url.to_string(),
            removed_resources: removed,
            nonce: nonce.clone(),
            ..Default::default()
        };
        tracing::debug!(
            type_url = set.type_url,
            version = %response.system_version_info,
            nonce = %nonce,
            resources = ?response.resources.iter().map(|r| &r.name).collect::<Vec<_>>(),
            removed = ?response.removed_resources,
            "Delta response sent"
        );
        self.nonce = Some(nonce);
        (Some(response), held)
    }
}

// === impl DeltaStreamState ===

impl StreamRules for DeltaStreamState {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;

    fn node(request: &DeltaDiscoveryRequest) -> Option<&Node> {
        request.node.as_ref()
    }

    fn type_url(response: &DeltaDiscoveryResponse) -> &str {
        &response.type_url
    }

    fn on_request(
        &mut self,
        mut request: DeltaDiscoveryRequest,
        resources: &Resources,
    ) -> Result<Vec<DeltaDiscoveryResponse>, Status> {
        let Some(type_url) = self.kind.requested_type(&request.type_url)? else {
            return Ok(Vec::new());
        };
        let slot = match type_url {
            CLUSTER_TYPE_URL => &mut self.clusters,
            _ => &mut self.endpoints,
        };
        let first = slot.is_none();
        let watch = slot.get_or_insert_with(DeltaWatch::default);
        let reply = Reply::of(
            watch.nonce.as_deref(),
            &request.response_nonce,
            request.error_detail.as_ref(),
            &self.node,
            type_url,
            None,
        );
        // A stale nonce still changes subscriptions (see the module docs): only the sync minds it.
        if matches!(reply, Reply::Nack) {
            super::count_nack(&mut self.nacks, type_url);
        }
        if type_url == ENDPOINT_TYPE_URL {
            self.sync.on_reply(&reply, &request.response_nonce);
        }
        if !request.resource_names_subscribe.is_empty()
            || !request.resource_names_unsubscribe.is_empty()
            || first
        {
            tracing::debug!(
                type_url,
                subscribe = ?request.resource_names_subscribe,
                unsubscribe = ?request.resource_names_unsubscribe,
                initial = ?request.initial_resource_versions,
                "Subscriptions changed"
            );
        }
        // A first wildcard subscription is owed a response even if it is empty (it tells Envoy there
        // are no clusters), unless the client already has resources.
        let fresh = first && request.initial_resource_versions.is_empty();
        // What the client says it has is compared with what is served, once.
        let served = (first && !fresh).then(|| {
            resources
                .get(type_url, self.kind.eds_via(), &self.requester)
                .expect("every requested type is served")
        });
        watch.subscribe(&mut request, first, served.as_deref());
        let fresh = (fresh && watch.wildcard).then_some(type_url);
        Ok(self.respond_all(resources, fresh))
    }

    fn respond_all(
        &mut self,
        resources: &Resources,
        fresh: Option<&str>,
    ) -> Vec<DeltaDiscoveryResponse> {
        let ads = self.kind.is_ads();
        let via = self.kind.eds_via();
        let mut out = Vec::new();
        if let Some(watch) = &mut self.clusters {
            let set = resources
                .get(CLUSTER_TYPE_URL, via, &self.requester)
                .expect("clusters are served");
            if let (Some(response), _) =
                watch.respond(&set, |_| true, fresh == Some(CLUSTER_TYPE_URL), usize::MAX)
            {
                if ads && let Some(endpoints) = &mut self.endpoints {
                    // A new or changed cluster only finishes warming with a new EDS response: resend
                    // the endpoints of every cluster sent.
                    for cluster in &response.resources {
                        endpoints.has.remove(&cluster.name);
                        endpoints.looked.again(&cluster.name);
                    }
                }
                out.push(response);
            }
        }
        if let Some(watch) = &mut self.endpoints {
            let set = resources
                .get(ENDPOINT_TYPE_URL, via, &self.requester)
                .expect("endpoints are served");
            // On ADS with clusters, never send endpoints of a cluster the client does not have from
            // this stream; one that never subscribed to clusters (a static EDS cluster on ADS) gets
            // what it names.
            let clusters = self.clusters.as_ref().map(|c| &c.has);
            let sendable = |name: &str| !ads || clusters.is_none_or(|has| has.contains_key(name));
            let (response, held) = watch.respond(
                &set,
                sendable,
                fresh == Some(ENDPOINT_TYPE_URL),
                EDS_RESPONSE_BYTES,
            );
            let sent = response.as_ref().map(|r| r.nonce.clone());
            out.extend(response);
            self.sync.answered(resources.revision, sent, held);
        }
        out
    }
}

/// The rules delta has and state of the world does not; the scenarios both share are in the
/// transport's scenario table.
#[cfg(test)]
mod tests {
    use super::{
        super::{
            Requester, StreamKind,
            scenarios::{Fixture, Variant, eds_synced_at_one},
        },
        *,
    };

    fn subscribe(type_url: &str, names: &[&str]) -> DeltaDiscoveryRequest {
        <DeltaWatch as Variant>::subscribe(type_url, names)
    }

    fn ack(response: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
        <DeltaWatch as Variant>::ack(response, &[])
    }

    fn names(response: &DeltaDiscoveryResponse) -> Vec<String> {
        <DeltaWatch as Variant>::names(response)
    }

    #[test]
    fn a_stale_nonce_is_no_ack_but_still_subscribes() {
        let mut fixture = Fixture::new();
        let r1 = fixture.register("a", 0, 10);
        let mut state =
            DeltaStreamState::new(StreamKind::DeltaEds, "envoy".into(), Requester::default());
        let first = state
            .on_request(subscribe(ENDPOINT_TYPE_URL, &["a"]), &r1)
            .unwrap();
        let r2 = fixture.register("a", 1, 11);
        let second = state.on_resources(&r2);
        assert_eq!((first.len(), second.len()), (1, 1));
        // The ACK of the first response arrives after the second was sent, subscribing to `b`.
        let out = state
            .on_request(
                DeltaDiscoveryRequest {
                    resource_names_subscribe: vec!["b".into()],
                    ..ack(&first[0])
                },
                &r2,
            )
            .unwrap();
        assert_eq!(names(&out[0]), ["b"]);
        assert_eq!(state.synced_revision(), None);
        // The ACK of the second response is stale too now; the third's counts.
        assert!(state.on_request(ack(&second[0]), &r2).unwrap().is_empty());
        assert_eq!(state.synced_revision(), None);
        assert!(state.on_request(ack(&out[0]), &r2).unwrap().is_empty());
        assert_eq!(state.synced_revision(), Some(2));
    }

    #[test]
    fn subscribe_and_unsubscribe() {
        let mut fixture = Fixture::new();
        let mut state = eds_synced_at_one::<DeltaWatch>(&mut fixture);
        let r1 = fixture.resources();
        // Unsubscribing sends nothing.
        let unsubscribe = DeltaDiscoveryRequest {
            resource_names_unsubscribe: vec!["a".into()],
            ..subscribe(ENDPOINT_TYPE_URL, &[])
        };
        assert!(state.on_request(unsubscribe, &r1).unwrap().is_empty());
        // A change of a name no longer subscribed sends nothing either.
        let r2 = fixture.register("a", 1, 11);
        assert!(state.on_resources(&r2).is_empty());
        // Subscribing again sends it, even unchanged since.
        let out = state
            .on_request(subscribe(ENDPOINT_TYPE_URL, &["a"]), &r2)
            .unwrap();
        assert_eq!(names(&out[0]), ["a"]);
        // A name that does not exist yet is remembered and sent when it appears.
        assert!(state.on_request(ack(&out[0]), &r2).unwrap().is_empty());
        assert!(
            state
                .on_request(subscribe(ENDPOINT_TYPE_URL, &["c"]), &r2)
                .unwrap()
                .is_empty()
        );
        assert_eq!(state.synced_revision(), Some(2));
    }

    #[test]
    fn cds_is_a_wildcard_and_removed_clusters_are_named() {
        let mut fixture = Fixture::new();
        let r1 = fixture.register("a", 0, 10);
        for first in [
            subscribe(CLUSTER_TYPE_URL, &[]),
            subscribe(CLUSTER_TYPE_URL, &["*"]),
        ] {
            let mut state =
                DeltaStreamState::new(StreamKind::DeltaCds, "envoy".into(), Requester::default());
            let out = state.on_request(first, &r1).unwrap();
            assert_eq!(names(&out[0]), ["a", "b"]);
            assert!(state.on_request(ack(&out[0]), &r1).unwrap().is_empty());
            assert!(!state.serves_endpoints());
            // A worker change leaves the clusters alone.
            let r2 = fixture.register("a", 1, 11);
            assert!(state.on_resources(&r2).is_empty());
            // A cluster the client has that is gone is removed.
            let mut gone = r2.clone();
            let clusters = std::sync::Arc::make_mut(&mut gone.delta_clusters);
            clusters.resources.remove("b");
            // As the cache counts a removal.
            clusters.serial += 1;
            clusters.last_removal = clusters.serial;
            let out = state.on_resources(&gone);
            assert!(out[0].resources.is_empty());
            assert_eq!(out[0].removed_resources, ["b"]);
        }
    }

    #[test]
    fn delta_cds_clusters_fetch_endpoints_over_delta() {
        let mut fixture = Fixture::new();
        let r1 = fixture.register("a", 0, 10);
        let mut state =
            DeltaStreamState::new(StreamKind::DeltaCds, "envoy".into(), Requester::default());
        let out = state
            .on_request(subscribe(CLUSTER_TYPE_URL, &[]), &r1)
            .unwrap();
        assert_eq!(
            out[0].resources[0].resource.as_ref(),
            Some(&r1.delta_clusters.resources["a"].resource)
        );
        assert_ne!(
            r1.delta_clusters.resources["a"].version,
            r1.clusters.resources["a"].version
        );
    }

    #[test]
    fn initial_resource_versions_suppress_unchanged_resources() {
        let mut fixture = Fixture::new();
        let r1 = fixture.register("a", 0, 10);
        let mut state =
            DeltaStreamState::new(StreamKind::DeltaCds, "envoy".into(), Requester::default());
        let reconnect = DeltaDiscoveryRequest {
            initial_resource_versions: [
                (
                    "a".to_string(),
                    r1.delta_clusters.resources["a"].version.clone(),
                ),
                ("b".to_string(), "old".to_string()),
                ("gone".to_string(), "old".to_string()),
            ]
            .into(),
            ..subscribe(CLUSTER_TYPE_URL, &["*"])
        };
        let out = state.on_request(reconnect, &r1).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(names(&out[0]), ["b"], "`a` is unchanged");
        assert_eq!(out[0].removed_resources, ["gone"]);
        // Nothing owed at all: no response.
        let mut state =
            DeltaStreamState::new(StreamKind::DeltaEds, "envoy".into(), Requester::default());
        let reconnect = DeltaDiscoveryRequest {
            initial_resource_versions: [(
                "a".to_string(),
                r1.endpoints.resources["a"].version.clone(),
            )]
            .into(),
            ..subscribe(ENDPOINT_TYPE_URL, &["a"])
        };
        assert!(state.on_request(reconnect, &r1).unwrap().is_empty());
        assert_eq!(state.synced_revision(), Some(1));
        // What the client said it had is held as that version: a change after it is sent.
        let r2 = fixture.register("a", 1, 11);
        let out = state.on_resources(&r2);
        assert_eq!(out.len(), 1);
        assert_eq!(names(&out[0]), ["a"]);
    }
}
