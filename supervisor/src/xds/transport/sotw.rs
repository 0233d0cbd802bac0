//! State of the world: the rules of `StreamClusters`, `StreamEndpoints` and
//! `StreamAggregatedResources` streams.
//!
//! Per type a stream keeps the last nonce sent, the names subscribed and what it last sent (name ->
//! the resource's serial, which moves with its version). It sends a response exactly when what the client should have differs from what
//! it was last sent, so an ACK gets no reply, a NACK is not answered with the same content again and
//! a request naming new resources gets them even at the same version. A request echoing a stale nonce
//! is ignored (subscriptions included: unlike delta, each request carries the whole subscription, so
//! the next current one brings it).
//!
//! A CDS response carries every cluster (Envoy removes a cluster a response leaves out). An EDS
//! response carries only the subscribed assignments the client does not have as they are: Envoy
//! updates the clusters a state-of-the-world EDS response names and leaves the others as they were
//! (its gRPC mux delivers a response only to the watches of the resources in it), so a change of one
//! service costs every stream that service's assignment, not the whole fleet's.
//!
//! An EDS response carries at most [`EDS_RESPONSE_BYTES`] of assignments (always at least one): the
//! rest follow one response per ACK (or NACK), and the stream counts as synced only once the last
//! is ACKed. So a first subscription to a large fleet (10,000 endpoints: about 1.3 MB) costs the
//! supervisor one small response in flight per stream, not a copy of the whole fleet per stream at
//! once.
//!
//! Invariant: what was sent is recorded only when a response carrying it is built ([`respond`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    hash::{DefaultHasher, Hash, Hasher},
};

use envoy_types::pb::envoy::{
    config::core::v3::Node,
    service::discovery::v3::{DiscoveryRequest, DiscoveryResponse},
};
use tonic::Status;

use super::{EDS_RESPONSE_BYTES, Reply, Stream, StreamRules, looked::Looked, next_nonce};
use crate::{
    printable::printable,
    xds::{
        cache::{Resources, TypeResources},
        resources::{CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL},
    },
};

/// What a stream knows about one resource type.
#[derive(Debug, Default)]
pub(super) struct TypeWatch {
    /// The names subscribed to (ignored for clusters, which are always the full set).
    names: BTreeSet<String>,
    /// The nonce of the last response sent.
    nonce: Option<String>,
    /// What was last sent: name -> the resource's serial, which moves exactly when its version
    /// does (a number, not the version string: 1,000 streams hold this for every cluster);
    /// `None` until a response is owed.
    sent: Option<BTreeMap<String, u64>>,
    /// A digest of the names of the last request, in its order: a request naming the same (an
    /// ACK, as Envoy sends them) is recognised without building a set or keeping the names twice.
    requested: Option<u64>,
    /// Which resources a pass has yet to look at: a pass costs what changed since the last.
    looked: Looked,
}

/// The state of a state-of-the-world stream.
pub(super) type StreamState = Stream<TypeWatch>;

/// What one pass over the resources owes the client in endpoints.
#[derive(Debug, Default)]
struct EndpointsOwed {
    /// The nonce of the EDS response the pass sent.
    sent: Option<String>,
    /// Whether existing endpoints were held back: their cluster was not sent yet (ADS), or more
    /// changed than one response carries.
    held: bool,
}

// === impl StreamState ===

impl StreamRules for StreamState {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;

    fn node(request: &DiscoveryRequest) -> Option<&Node> {
        request.node.as_ref()
    }

    fn type_url(response: &DiscoveryResponse) -> &str {
        &response.type_url
    }

    fn on_request(
        &mut self,
        request: DiscoveryRequest,
        resources: &Resources,
    ) -> Result<Vec<DiscoveryResponse>, Status> {
        let Some(type_url) = self.kind.requested_type(&request.type_url)? else {
            return Ok(Vec::new());
        };
        let watch = match type_url {
            CLUSTER_TYPE_URL => self.clusters.get_or_insert_with(TypeWatch::default),
            _ => self.endpoints.get_or_insert_with(TypeWatch::default),
        };
        let reply = Reply::of(
            watch.nonce.as_deref(),
            &request.response_nonce,
            request.error_detail.as_ref(),
            &self.node,
            type_url,
            Some(&request.version_info),
        );
        if matches!(reply, Reply::Nack) {
            super::count_nack(&mut self.nacks, type_url);
        }
        if type_url == ENDPOINT_TYPE_URL {
            self.sync.on_reply(&reply, &request.response_nonce);
        }
        match reply {
            Reply::Stale => return Ok(Vec::new()),
            Reply::None => {
                tracing::debug!(type_url, version = %printable(&request.version_info), names = ?request.resource_names, "Subscribed");
                // A new subscription is owed a response, whatever was sent before.
                watch.sent = None;
                watch.looked.forget();
            }
            Reply::Ack(_) | Reply::Nack => {}
        }
        let requested = (type_url == ENDPOINT_TYPE_URL).then(|| digest(&request.resource_names));
        if requested.is_some() && requested != watch.requested {
            let names = request
                .resource_names
                .iter()
                .cloned()
                .collect::<BTreeSet<_>>();
            watch.requested = requested;
            if names != watch.names {
                // Forget what was sent for names no longer subscribed, so they are sent again if the
                // client subscribes to them later; look at the names subscribed now.
                if let Some(sent) = &mut watch.sent {
                    sent.retain(|name, _| names.contains(name));
                }
                for name in names.difference(&watch.names) {
                    watch.looked.again(name);
                }
                watch.names = names;
            }
        }
        // A new subscription is owed a first response even if it is empty (an empty CDS response
        // tells Envoy there are no clusters; EDS still waits for a name that exists).
        let fresh = watch.sent.is_none().then_some(type_url);
        watch.sent.get_or_insert_with(BTreeMap::new);
        Ok(self.respond_all(resources, fresh))
    }

    fn respond_all(
        &mut self,
        resources: &Resources,
        fresh: Option<&str>,
    ) -> Vec<DiscoveryResponse> {
        let mut out = Vec::new();
        let owed = self.push_owed(resources, fresh, &mut out);
        if self.endpoints.is_some() {
            self.sync.answered(resources.revision, owed.sent, owed.held);
        }
        out
    }
}

impl StreamState {
    /// Pushes the responses owed for `resources` to `out`; returns what was owed in endpoints.
    fn push_owed(
        &mut self,
        resources: &Resources,
        fresh: Option<&str>,
        out: &mut Vec<DiscoveryResponse>,
    ) -> EndpointsOwed {
        let ads = self.kind.is_ads();
        let mut owed = EndpointsOwed::default();
        if let Some(watch) = &mut self.clusters {
            let set = resources
                .get(CLUSTER_TYPE_URL, self.kind.eds_via(), &self.requester)
                .expect("clusters are served");
            let owed = fresh == Some(CLUSTER_TYPE_URL)
                || (!watch.looked.done(&set)
                    && !watch
                        .sent
                        .as_ref()
                        .is_some_and(|sent| same_versions(sent, &set)));
            watch.looked.finish(&set);
            if owed {
                let payload = set
                    .resources
                    .values()
                    .map(|r| (r.name.clone(), r.serial))
                    .collect::<BTreeMap<_, _>>();
                let before = watch.sent.take().unwrap_or_default();
                if ads && let Some(endpoints) = &mut self.endpoints {
                    // A new or changed cluster only finishes warming with a new EDS response: resend
                    // the endpoints of every cluster that changed.
                    if let Some(sent) = &mut endpoints.sent {
                        sent.retain(|name, _| before.get(name) == payload.get(name));
                    }
                    for (name, version) in &payload {
                        if before.get(name) != Some(version) {
                            endpoints.looked.again(name);
                        }
                    }
                }
                out.push(respond(watch, &set, payload));
            }
        }
        if let Some(watch) = &mut self.endpoints {
            let set = resources
                .get(ENDPOINT_TYPE_URL, self.kind.eds_via(), &self.requester)
                .expect("endpoints are served");
            if fresh != Some(ENDPOINT_TYPE_URL) && watch.looked.done(&set) {
                // Nothing changed since the last pass (an ACK's, as a rule), and nothing was held.
                return owed;
            }
            let sent = watch.sent.get_or_insert_with(BTreeMap::new);
            if watch.looked.removals(&set) {
                // An assignment that is gone (its cluster too) is forgotten: if it comes back, it is
                // sent again.
                sent.retain(|name, _| set.resources.contains_key(name));
            }
            // On ADS with clusters, never name endpoints of a cluster the client was not sent on
            // this stream yet: it gets endpoints only for clusters it also receives over the same
            // stream (Envoy subscribes to CDS first whenever its clusters come over ADS). A stream
            // that never subscribed to clusters (a static EDS cluster on ADS) gets what it names.
            let known = self
                .clusters
                .as_ref()
                .filter(|_| ads)
                .map(|c| c.sent.as_ref());
            let names = &watch.names;
            let filled = watch.looked.fill(
                &set,
                |r| names.contains(&r.name) && sent.get(&r.name) != Some(&r.serial),
                |name| known.is_none_or(|k| k.is_some_and(|k| k.contains_key(name))),
                EDS_RESPONSE_BYTES,
            );
            owed.held = filled.held;
            if !filled.resources.is_empty() {
                let changed = filled
                    .resources
                    .iter()
                    .map(|r| (r.name.clone(), r.serial))
                    .collect();
                let response = respond_changed(watch, &set, changed);
                owed.sent = Some(response.nonce.clone());
                out.push(response);
            } else if fresh == Some(ENDPOINT_TYPE_URL)
                && !watch.names.iter().any(|n| set.resources.contains_key(n))
            {
                tracing::debug!(names = ?watch.names, "No requested endpoints exist yet, waiting");
            }
        }
        owed
    }
}

/// Whether `sent` holds exactly the resources of `set`, at their versions (compared in place: a
/// stream owed nothing allocates nothing).
fn same_versions(sent: &BTreeMap<String, u64>, set: &TypeResources) -> bool {
    sent.len() == set.resources.len()
        && sent
            .iter()
            .zip(set.resources.values())
            .all(|((name, serial), r)| *name == r.name && *serial == r.serial)
}

/// A digest of a request's names, in their order.
fn digest(names: &[String]) -> u64 {
    let mut hasher = DefaultHasher::new();
    names.hash(&mut hasher);
    hasher.finish()
}

/// Builds the response carrying `changed` from `set` and adds it to what was sent.
fn respond_changed(
    watch: &mut TypeWatch,
    set: &TypeResources,
    changed: BTreeMap<String, u64>,
) -> DiscoveryResponse {
    let mut sent = watch.sent.take().unwrap_or_default();
    let response = respond(watch, set, changed);
    sent.extend(watch.sent.take().unwrap_or_default());
    watch.sent = Some(sent);
    response
}

/// Builds the response carrying `payload` from `set` and records it as sent.
fn respond(
    watch: &mut TypeWatch,
    set: &TypeResources,
    payload: BTreeMap<String, u64>,
) -> DiscoveryResponse {
    let nonce = next_nonce();
    let response = DiscoveryResponse {
        version_info: set.version.clone(),
        resources: payload
            .keys()
            .map(|name| set.resources[name].resource.clone())
            .collect(),
        type_url: set.type_url.to_string(),
        nonce: nonce.clone(),
        ..Default::default()
    };
    tracing::debug!(
        type_url = set.type_url,
        version = %response.version_info,
        nonce = %nonce,
        resources = response.resources.len(),
        "Response sent"
    );
    watch.nonce = Some(nonce);
    watch.sent = Some(payload);
    response
}
