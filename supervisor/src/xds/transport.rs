//! The gRPC transport: CDS, EDS and ADS streams, state of the world or delta ([`delta`]), over the
//! [`Resources`] the cache publishes.
//!
//! On a state-of-the-world stream, per type it keeps the last nonce sent, the names subscribed and
//! what it last sent (name -> resource version). It sends a response exactly when what the client should have differs
//! from what it was last sent, so an ACK gets no reply, a NACK is not answered with the same content
//! again (go-control-plane's resend loop, its issue #962) and a request naming new resources gets them
//! even at the same version. A request echoing a stale nonce is ignored. CDS is always the full set
//! (wildcard); EDS answers only the names requested and answers a name that does not exist yet as soon
//! as it appears. On ADS, clusters are always sent before the endpoints that name them: endpoints are
//! held until their cluster was sent on the same stream, and a changed cluster's endpoints are sent
//! again right after it (Envoy finishes warming a changed cluster only with a new EDS response).
//!
//! Delta streams follow the same rules with per-resource versions; see [`delta`].
//!
//! Each stream also follows how far Envoy has ACKed its endpoints: its *synced revision* is the highest
//! registry revision at which every EDS response it owed was ACKed (a NACK or a stale nonce never
//! advances it; an ADS endpoint response held back for its cluster is owed). Streams publish it to
//! [`Acks`], which draining waits on.
//!
//! Invariant: the transport never builds resources; it only selects from the cache's.

mod delta;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use envoy_types::pb::{
    envoy::{
        config::core::v3::Node,
        service::{
            cluster::v3::cluster_discovery_service_server::ClusterDiscoveryService,
            discovery::v3::{
                DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
                aggregated_discovery_service_server::AggregatedDiscoveryService,
            },
            endpoint::v3::endpoint_discovery_service_server::EndpointDiscoveryService,
        },
    },
    google::rpc::Status as RpcStatus,
};
use tokio::{
    sync::{mpsc, watch},
    time::Instant,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use self::delta::DeltaWatch;
use super::{
    acks::Acks,
    cache::{EdsVia, Resources},
    resources::{CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL},
};

/// The response stream of every state-of-the-world method.
pub type ResponseStream = ReceiverStream<Result<DiscoveryResponse, Status>>;

/// The response stream of every delta method.
pub type DeltaResponseStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

/// How many responses may wait for a slow client before a stream stops reading the cache.
const RESPONSE_BUFFER: usize = 8;

/// Serves CDS, EDS and ADS from the cache's watch channel. Cheap to clone.
///
/// Each stream ends when its client ends it or when the cache's sender is dropped (the control plane
/// shutting down), so graceful shutdown of the server is not held up by long-lived streams. Each
/// stream is registered in [`Acks`] from its first request until it ends.
#[derive(Clone, Debug)]
pub struct XdsService {
    resources: watch::Receiver<Arc<Resources>>,
    acks: Arc<Acks>,
}

/// Which RPC a stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// `ClusterDiscoveryService.StreamClusters`.
    Cds,
    /// `EndpointDiscoveryService.StreamEndpoints`.
    Eds,
    /// `AggregatedDiscoveryService.StreamAggregatedResources`.
    Ads,
    /// `ClusterDiscoveryService.DeltaClusters`.
    DeltaCds,
    /// `EndpointDiscoveryService.DeltaEndpoints`.
    DeltaEds,
    /// `AggregatedDiscoveryService.DeltaAggregatedResources`.
    DeltaAds,
}

/// The rules of one variant of the protocol (state of the world or delta): fed the client's requests
/// and the cache's resources, they say what to send. Pure, so they can be followed step by step in
/// tests.
trait StreamRules {
    type Request: Send + 'static;
    type Response: Send + 'static;

    /// The node a request names (Envoy names it on a stream's first request).
    fn node(request: &Self::Request) -> Option<&Node>;

    /// Applies a request and returns the responses now owed.
    fn on_request(
        &mut self,
        request: Self::Request,
        resources: &Resources,
    ) -> Result<Vec<Self::Response>, Status>;

    /// Returns the responses owed after the cache published new resources.
    fn on_resources(&mut self, resources: &Resources) -> Vec<Self::Response>;
}

/// The responses of the streams whose state is `Stream<W>`.
type Responses<W> = ReceiverStream<Result<<Stream<W> as StreamRules>::Response, Status>>;

// === impl XdsService ===

impl XdsService {
    /// A service reading `resources` and publishing each stream's ACK progress to `acks`.
    pub fn new(resources: watch::Receiver<Arc<Resources>>, acks: Arc<Acks>) -> Self {
        XdsService { resources, acks }
    }

    fn open<W: Send + 'static>(
        &self,
        kind: StreamKind,
        requests: Streaming<<Stream<W> as StreamRules>::Request>,
    ) -> Responses<W>
    where
        Stream<W>: StreamRules,
    {
        let (tx, rx) = mpsc::channel(RESPONSE_BUFFER);
        tokio::spawn(run_stream::<W>(
            kind,
            requests,
            self.resources.clone(),
            self.acks.clone(),
            tx,
        ));
        ReceiverStream::new(rx)
    }
}

fn fetch_unimplemented() -> Status {
    Status::unimplemented("fetch (REST-style) xDS is not supported, use a stream")
}

#[tonic::async_trait]
impl ClusterDiscoveryService for XdsService {
    type StreamClustersStream = ResponseStream;
    type DeltaClustersStream = DeltaResponseStream;

    async fn stream_clusters(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamClustersStream>, Status> {
        Ok(Response::new(
            self.open::<TypeWatch>(StreamKind::Cds, request.into_inner()),
        ))
    }

    async fn delta_clusters(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaClustersStream>, Status> {
        Ok(Response::new(self.open::<DeltaWatch>(
            StreamKind::DeltaCds,
            request.into_inner(),
        )))
    }

    async fn fetch_clusters(
        &self,
        _: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        Err(fetch_unimplemented())
    }
}

#[tonic::async_trait]
impl EndpointDiscoveryService for XdsService {
    type StreamEndpointsStream = ResponseStream;
    type DeltaEndpointsStream = DeltaResponseStream;

    async fn stream_endpoints(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamEndpointsStream>, Status> {
        Ok(Response::new(
            self.open::<TypeWatch>(StreamKind::Eds, request.into_inner()),
        ))
    }

    async fn delta_endpoints(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaEndpointsStream>, Status> {
        Ok(Response::new(self.open::<DeltaWatch>(
            StreamKind::DeltaEds,
            request.into_inner(),
        )))
    }

    async fn fetch_endpoints(
        &self,
        _: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        Err(fetch_unimplemented())
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for XdsService {
    type StreamAggregatedResourcesStream = ResponseStream;
    type DeltaAggregatedResourcesStream = DeltaResponseStream;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        Ok(Response::new(
            self.open::<TypeWatch>(StreamKind::Ads, request.into_inner()),
        ))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Ok(Response::new(self.open::<DeltaWatch>(
            StreamKind::DeltaAds,
            request.into_inner(),
        )))
    }
}

// === impl StreamKind ===

impl StreamKind {
    /// The type a dedicated stream serves; `None` for ADS.
    fn dedicated_type(self) -> Option<&'static str> {
        match self {
            StreamKind::Cds | StreamKind::DeltaCds => Some(CLUSTER_TYPE_URL),
            StreamKind::Eds | StreamKind::DeltaEds => Some(ENDPOINT_TYPE_URL),
            StreamKind::Ads | StreamKind::DeltaAds => None,
        }
    }

    /// Whether the stream is ADS (delta or not).
    fn is_ads(self) -> bool {
        self.dedicated_type().is_none()
    }

    /// Where the clusters sent on this stream fetch their endpoints.
    fn eds_via(self) -> EdsVia {
        match self {
            StreamKind::Ads | StreamKind::DeltaAds => EdsVia::Ads,
            StreamKind::DeltaCds | StreamKind::DeltaEds => EdsVia::DeltaGrpc,
            StreamKind::Cds | StreamKind::Eds => EdsVia::Grpc,
        }
    }

    /// The type a request on this stream is for: `Ok(None)` for a type ADS does not serve (the
    /// request is ignored), an error for the wrong type on a dedicated stream.
    fn requested_type(self, type_url: &str) -> Result<Option<&'static str>, Status> {
        match (self.dedicated_type(), type_url) {
            (Some(expected), "") => Ok(Some(expected)),
            (Some(expected), got) if got == expected => Ok(Some(expected)),
            (Some(expected), got) => {
                tracing::warn!(
                    type_url = got,
                    expected,
                    "Request for the wrong type on a dedicated stream"
                );
                Err(Status::invalid_argument(format!(
                    "this stream serves {expected}, not {got}"
                )))
            }
            (None, CLUSTER_TYPE_URL) => Ok(Some(CLUSTER_TYPE_URL)),
            (None, ENDPOINT_TYPE_URL) => Ok(Some(ENDPOINT_TYPE_URL)),
            (None, got) => {
                tracing::warn!(type_url = got, "Request for a type not served, ignored");
                Ok(None)
            }
        }
    }
}

impl fmt::Display for StreamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StreamKind::Cds => "cds",
            StreamKind::Eds => "eds",
            StreamKind::Ads => "ads",
            StreamKind::DeltaCds => "delta-cds",
            StreamKind::DeltaEds => "delta-eds",
            StreamKind::DeltaAds => "delta-ads",
        })
    }
}

/// Drives one stream until the client ends it, the response channel closes or the cache goes away;
/// keeps it registered in `acks` from its first request until then.
async fn run_stream<W: Send + 'static>(
    kind: StreamKind,
    mut requests: Streaming<<Stream<W> as StreamRules>::Request>,
    mut resources: watch::Receiver<Arc<Resources>>,
    acks: Arc<Acks>,
    tx: mpsc::Sender<Result<<Stream<W> as StreamRules>::Response, Status>>,
) where
    Stream<W>: StreamRules,
{
    let first = match requests.message().await {
        Ok(Some(first)) => first,
        Ok(None) => return,
        Err(status) => {
            tracing::debug!(%kind, code = ?status.code(), "Stream failed before its first request");
            return;
        }
    };
    let node = Stream::<W>::node(&first)
        .map(|n| n.id.clone())
        .unwrap_or_default();
    let id = STREAMS.fetch_add(1, Ordering::Relaxed) + 1;
    let span = tracing::info_span!("xds_stream", id, %kind, node = %node);
    async move {
        tracing::debug!("Stream opened");
        // Dropped on every way out of this block, which removes the stream from `acks`.
        let registered = acks.register(id, node.clone(), kind);
        let mut state = Stream::<W>::new(kind, node);
        let mut next = Some(first);
        // Since when the client has owed an answer to an endpoints response, without answering any
        // (a late answer to an outdated response restarts the clock: that client is alive).
        let mut silent_since = None;
        let mut replies = 0;
        loop {
            let responses = if let Some(request) = next.take() {
                // Not marked seen: if the request is ignored (a stale nonce), `changed()` below still
                // fires for resources newer than the stream has answered.
                let current = resources.borrow().clone();
                match state.on_request(request, &current) {
                    Ok(responses) => responses,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                }
            } else {
                tokio::select! {
                    request = requests.message() => match request {
                        Ok(Some(request)) => {
                            next = Some(request);
                            continue;
                        }
                        Ok(None) => {
                            tracing::debug!("Stream closed by the client");
                            return;
                        }
                        Err(status) => {
                            tracing::debug!(code = ?status.code(), message = status.message(), "Stream failed");
                            return;
                        }
                    },
                    changed = resources.changed() => {
                        if changed.is_err() {
                            tracing::debug!("Control plane stopping, ending stream");
                            let _ = tx.send(Err(Status::unavailable("control plane shutting down"))).await;
                            return;
                        }
                        let current = resources.borrow_and_update().clone();
                        state.on_resources(&current)
                    }
                    () = tx.closed() => return,
                }
            };
            let answered = std::mem::replace(&mut replies, state.replies()) != replies;
            silent_since = state.awaiting_reply().then(|| match silent_since {
                Some(since) if !answered => since,
                _ => Instant::now(),
            });
            registered.publish(state.serves_endpoints(), state.synced_revision(), silent_since);
            for response in responses {
                if tx.send(Ok(response)).await.is_err() {
                    return;
                }
            }
        }
    }
    .instrument(span)
    .await
}

/// What a stream knows about one resource type.
#[derive(Debug, Default)]
struct TypeWatch {
    /// The names subscribed to (ignored for clusters, which are always the full set).
    names: BTreeSet<String>,
    /// The nonce of the last response sent.
    nonce: Option<String>,
    /// What was last sent (name -> resource version); `None` until a response is owed.
    sent: Option<BTreeMap<String, String>>,
}

/// How far the client has ACKed the endpoints a stream owed it.
#[derive(Debug, Default)]
struct EndpointSync {
    /// The latest registry revision the stream has answered for.
    seen: Option<u64>,
    /// Whether endpoints were held back for their cluster at `seen` (ADS): they are owed.
    held: bool,
    /// The nonce and revision of the last EDS response, until it is ACKed (a NACK keeps it here).
    pending: Option<(String, u64)>,
    /// The highest revision at which every EDS response owed was ACKed.
    synced: Option<u64>,
    /// The nonce of the last EDS response, until the client answers it (an ACK or a NACK): while set,
    /// the client owes an answer.
    unanswered: Option<String>,
    /// How many endpoints requests echoed a nonce (current or outdated): a client that answers, if
    /// late, is alive.
    replies: u64,
}

/// What a request says about the last response of its type.
#[derive(Debug)]
enum Reply<'a> {
    /// No nonce: a new subscription (or, on delta streams, a change of subscriptions).
    None,
    /// The last response was accepted.
    Ack(&'a str),
    /// The last response was rejected (logged).
    Nack,
    /// The request echoes a nonce other than the last one sent: it answers an outdated response.
    Stale,
}

/// The protocol state of one stream: pure, so the rules can be followed step by step. `W` is what it
/// knows about one resource type: a [`TypeWatch`] on state-of-the-world streams ([`StreamState`]), a
/// [`DeltaWatch`] on delta streams.
#[derive(Debug)]
struct Stream<W> {
    kind: StreamKind,
    node: String,
    clusters: Option<W>,
    endpoints: Option<W>,
    sync: EndpointSync,
}

/// The state of a state-of-the-world stream.
type StreamState = Stream<TypeWatch>;

/// What one pass over the resources owes the client in endpoints.
#[derive(Debug, Default)]
struct EndpointsOwed {
    /// The nonce of the EDS response the pass sent.
    sent: Option<String>,
    /// Whether existing endpoints were held back because their cluster was not sent yet (ADS).
    held: bool,
}

/// Nonces are unique per supervisor process.
static NONCES: AtomicU64 = AtomicU64::new(0);

/// Stream ids, for logs only.
static STREAMS: AtomicU64 = AtomicU64::new(0);

fn next_nonce() -> String {
    (NONCES.fetch_add(1, Ordering::Relaxed) + 1).to_string()
}

// === impl Reply ===

impl<'a> Reply<'a> {
    /// Reads a request echoing `nonce` (empty if none) with `error`, for a type whose last response
    /// carried `last`. Logs NACKs, with the version the client still runs if it says.
    fn of(
        last: Option<&str>,
        nonce: &'a str,
        error: Option<&RpcStatus>,
        node: &str,
        type_url: &str,
        version: Option<&str>,
    ) -> Self {
        if nonce.is_empty() {
            return Reply::None;
        }
        if last.is_some_and(|last| last != nonce) {
            tracing::debug!(type_url, nonce, last, "Stale nonce");
            return Reply::Stale;
        }
        match error {
            Some(error) => {
                tracing::warn!(
                    node,
                    type_url,
                    version,
                    nonce,
                    error = %error.message,
                    "Envoy rejected a response (NACK)"
                );
                Reply::Nack
            }
            None => {
                tracing::debug!(type_url, version, nonce, "ACK");
                Reply::Ack(nonce)
            }
        }
    }
}

// === impl EndpointSync ===

impl EndpointSync {
    /// The client answered (ACKed or NACKed) the endpoints response `nonce`, or an outdated one.
    fn replied(&mut self, nonce: &str) {
        self.replies += 1;
        if self.unanswered.as_deref() == Some(nonce) {
            self.unanswered = None;
        }
    }

    /// The client ACKed the endpoints response `nonce`.
    fn acked(&mut self, nonce: &str) {
        if self.pending.as_ref().is_some_and(|(n, _)| n == nonce) {
            // Everything owed up to the last revision answered is now with the client.
            self.pending = None;
            if !self.held {
                self.synced = self.synced.max(self.seen);
            }
        }
    }

    /// The stream answered the resources of `revision`: `sent` is the nonce of the endpoints
    /// response it sent for them, if any; `held` says endpoints were held back for their cluster.
    fn answered(&mut self, revision: u64, sent: Option<String>, held: bool) {
        if let Some(nonce) = sent {
            self.unanswered = Some(nonce.clone());
            self.pending = Some((nonce, revision));
        } else if self.pending.is_none() && !held {
            self.synced = self.synced.max(Some(revision));
        }
        self.seen = self.seen.max(Some(revision));
        self.held = held;
    }
}

// === impl Stream ===

impl<W> Stream<W> {
    fn new(kind: StreamKind, node: String) -> Self {
        Stream {
            kind,
            node,
            clusters: None,
            endpoints: None,
            sync: EndpointSync::default(),
        }
    }

    /// Whether the stream serves endpoints: dedicated EDS, or ADS once it subscribed to endpoints.
    fn serves_endpoints(&self) -> bool {
        self.endpoints.is_some()
    }

    /// The highest registry revision at which the client ACKed every endpoints response owed.
    fn synced_revision(&self) -> Option<u64> {
        self.sync.synced
    }

    /// Whether the client has not yet answered the last endpoints response (neither ACK nor NACK).
    fn awaiting_reply(&self) -> bool {
        self.sync.unanswered.is_some()
    }

    /// How many answers to endpoints responses (current or outdated) the client has sent.
    fn replies(&self) -> u64 {
        self.sync.replies
    }
}

// === impl StreamState ===

impl StreamRules for StreamState {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;

    fn node(request: &DiscoveryRequest) -> Option<&Node> {
        request.node.as_ref()
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
        match Reply::of(
            watch.nonce.as_deref(),
            &request.response_nonce,
            request.error_detail.as_ref(),
            &self.node,
            type_url,
            Some(&request.version_info),
        ) {
            Reply::Stale => {
                if type_url == ENDPOINT_TYPE_URL {
                    self.sync.replied(&request.response_nonce);
                }
                return Ok(Vec::new());
            }
            Reply::Nack => {
                if type_url == ENDPOINT_TYPE_URL {
                    self.sync.replied(&request.response_nonce);
                }
            }
            Reply::None => {
                tracing::debug!(type_url, version = %request.version_info, names = ?request.resource_names, "Subscribed");
                // A new subscription is owed a response, whatever was sent before.
                watch.sent = None;
            }
            Reply::Ack(nonce) => {
                if type_url == ENDPOINT_TYPE_URL {
                    self.sync.acked(nonce);
                    self.sync.replied(nonce);
                }
            }
        }
        if type_url == ENDPOINT_TYPE_URL {
            let names = request.resource_names.into_iter().collect::<BTreeSet<_>>();
            if names != watch.names {
                // Forget what was sent for names no longer subscribed, so they are sent again if the
                // client subscribes to them later.
                if let Some(sent) = &mut watch.sent {
                    sent.retain(|name, _| names.contains(name));
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

    fn on_resources(&mut self, resources: &Resources) -> Vec<DiscoveryResponse> {
        self.respond_all(resources, None)
    }
}

impl StreamState {
    /// Clusters first, then endpoints; `fresh` names a type whose subscription is owed a response even
    /// if it would be empty. Then moves the synced revision.
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
                .get(CLUSTER_TYPE_URL, self.kind.eds_via())
                .expect("clusters are served");
            let before = watch.sent.clone().unwrap_or_default();
            let payload = set
                .resources
                .values()
                .map(|r| (r.name.clone(), r.version.clone()))
                .collect::<BTreeMap<_, _>>();
            let owed = fresh == Some(CLUSTER_TYPE_URL) || watch.sent.as_ref() != Some(&payload);
            if owed {
                out.push(respond(watch, set, payload.clone()));
                if ads && let Some(endpoints) = &mut self.endpoints {
                    // A new or changed cluster only finishes warming with a new EDS response: resend
                    // the endpoints of every cluster that changed.
                    if let Some(sent) = &mut endpoints.sent {
                        sent.retain(|name, _| before.get(name) == payload.get(name));
                    }
                }
            }
        }
        if let Some(watch) = &mut self.endpoints {
            let set = resources
                .get(ENDPOINT_TYPE_URL, self.kind.eds_via())
                .expect("endpoints are served");
            // On ADS, never name endpoints of a cluster the client was not sent on this stream yet:
            // an ADS client gets endpoints only for clusters it also receives over the same stream
            // (Envoy subscribes to CDS first whenever its clusters come over ADS).
            let empty = BTreeMap::new();
            let known = ads.then(|| {
                self.clusters
                    .as_ref()
                    .and_then(|c| c.sent.as_ref())
                    .unwrap_or(&empty)
            });
            let existing = watch
                .names
                .iter()
                .filter_map(|name| set.resources.get(name));
            let (payload, held): (Vec<_>, Vec<_>) =
                existing.partition(|r| known.is_none_or(|k| k.contains_key(&r.name)));
            owed.held = !held.is_empty();
            let payload = payload
                .into_iter()
                .map(|r| (r.name.clone(), r.version.clone()))
                .collect::<BTreeMap<_, _>>();
            let changed = watch.sent.as_ref() != Some(&payload);
            if changed && !payload.is_empty() {
                let response = respond(watch, set, payload);
                owed.sent = Some(response.nonce.clone());
                out.push(response);
            } else if payload.is_empty() && fresh == Some(ENDPOINT_TYPE_URL) {
                tracing::debug!(names = ?watch.names, "No requested endpoints exist yet, waiting");
            }
        }
        owed
    }
}

/// Builds the response carrying `payload` from `set` and records it as sent.
fn respond(
    watch: &mut TypeWatch,
    set: &super::cache::TypeResources,
    payload: BTreeMap<String, String>,
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

#[cfg(test)]
mod tests {
    use envoy_types::pb::google::rpc::Status as RpcStatus;

    use super::*;
    use crate::{
        registry::{Address, Protocol, Registry, Worker},
        xds::{cache::Cache, resources::ClusterOptions},
    };

    /// A registry with services `a` and `b` and a cache building resources from it.
    pub(super) struct Fixture {
        pub(super) registry: Registry,
        cache: Cache,
    }

    impl Fixture {
        pub(super) fn new() -> Self {
            Fixture {
                registry: Registry::new(["a".to_string(), "b".to_string()]),
                cache: Cache::new("e1".into(), ClusterOptions::default()),
            }
        }

        /// Registers a worker and returns the resources of the new revision.
        pub(super) fn register(&mut self, service: &str, index: u32, pid: u32) -> Resources {
            let addr = Address::Tcp(([127, 0, 0, 1], 8000 + index as u16).into());
            let worker = Worker::ready(service, index, pid, vec![Protocol::Http1], vec![addr]);
            self.registry.register(worker).unwrap();
            self.resources()
        }

        pub(super) fn resources(&mut self) -> Resources {
            self.cache.build(&self.registry.snapshot())
        }
    }

    fn subscribe(type_url: &str, names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: type_url.into(),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            ..Default::default()
        }
    }

    /// The request that ACKs `response`, still subscribed to `names`.
    fn ack(response: &DiscoveryResponse, names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: response.version_info.clone(),
            response_nonce: response.nonce.clone(),
            ..subscribe(&response.type_url, names)
        }
    }

    /// The request that NACKs `response` (keeping the version accepted before).
    fn nack(response: &DiscoveryResponse, names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: String::new(),
            error_detail: Some(RpcStatus {
                code: 3,
                message: "rejected".into(),
                details: vec![],
            }),
            ..ack(response, names)
        }
    }

    /// A dedicated EDS stream subscribed to `a`, whose first response (at revision 1) was ACKed.
    fn eds_synced_at_one(fixture: &mut Fixture) -> StreamState {
        let r1 = fixture.register("a", 0, 10);
        assert_eq!(r1.revision, 1);
        let mut state = StreamState::new(StreamKind::Eds, "envoy".into());
        let out = state
            .on_request(subscribe(ENDPOINT_TYPE_URL, &["a"]), &r1)
            .unwrap();
        assert_eq!(out.len(), 1);
        assert!(state.serves_endpoints());
        assert_eq!(state.synced_revision(), None, "owed until ACKed");
        let out = state.on_request(ack(&out[0], &["a"]), &r1).unwrap();
        assert!(out.is_empty());
        assert_eq!(state.synced_revision(), Some(1));
        state
    }

    #[test]
    fn an_ack_advances_the_synced_revision() {
        let mut fixture = Fixture::new();
        let mut state = eds_synced_at_one(&mut fixture);
        let r2 = fixture.register("a", 1, 11);
        let out = state.on_resources(&r2);
        assert_eq!(out.len(), 1);
        assert_eq!(state.synced_revision(), Some(1), "not past 1 until ACKed");
        assert!(
            state
                .on_request(ack(&out[0], &["a"]), &r2)
                .unwrap()
                .is_empty()
        );
        assert_eq!(state.synced_revision(), Some(2));
    }

    #[test]
    fn a_stream_owes_an_answer_until_it_acks_or_nacks_the_last_endpoints_response() {
        let mut fixture = Fixture::new();
        let mut state = eds_synced_at_one(&mut fixture);
        assert!(!state.awaiting_reply());
        let r2 = fixture.register("a", 1, 11);
        let first = state.on_resources(&r2);
        assert!(state.awaiting_reply());
        let r3 = fixture.register("a", 2, 12);
        let second = state.on_resources(&r3);
        // An answer to an outdated response is not an answer to the last one.
        state.on_request(ack(&first[0], &["a"]), &r3).unwrap();
        assert!(state.awaiting_reply());
        // A NACK is an answer: the client is there, it just rejected the content.
        state.on_request(nack(&second[0], &["a"]), &r3).unwrap();
        assert!(!state.awaiting_reply());
        assert_eq!(state.synced_revision(), Some(1));
    }

    #[test]
    fn a_nack_does_not_advance_the_synced_revision() {
        let mut fixture = Fixture::new();
        let mut state = eds_synced_at_one(&mut fixture);
        let r2 = fixture.register("a", 1, 11);
        let out = state.on_resources(&r2);
        assert_eq!(out.len(), 1);
        assert!(
            state
                .on_request(nack(&out[0], &["a"]), &r2)
                .unwrap()
                .is_empty()
        );
        assert_eq!(state.synced_revision(), Some(1));
        // A change the stream does not serve still leaves the rejected content owed.
        let r3 = fixture.register("b", 0, 20);
        assert!(state.on_resources(&r3).is_empty());
        assert_eq!(state.synced_revision(), Some(1));
        // New content, ACKed this time.
        let r4 = fixture.register("a", 2, 12);
        let out = state.on_resources(&r4);
        assert_eq!(out.len(), 1);
        assert!(
            state
                .on_request(ack(&out[0], &["a"]), &r4)
                .unwrap()
                .is_empty()
        );
        assert_eq!(state.synced_revision(), Some(4));
    }

    #[test]
    fn a_stale_nonce_does_not_advance_the_synced_revision() {
        let mut fixture = Fixture::new();
        let r1 = fixture.register("a", 0, 10);
        let mut state = StreamState::new(StreamKind::Eds, "envoy".into());
        let first = state
            .on_request(subscribe(ENDPOINT_TYPE_URL, &["a"]), &r1)
            .unwrap();
        let r2 = fixture.register("a", 1, 11);
        let second = state.on_resources(&r2);
        assert_eq!((first.len(), second.len()), (1, 1));
        // The ACK of the first response arrives after the second was sent.
        assert!(
            state
                .on_request(ack(&first[0], &["a"]), &r2)
                .unwrap()
                .is_empty()
        );
        assert_eq!(state.synced_revision(), None);
        assert!(
            state
                .on_request(ack(&second[0], &["a"]), &r2)
                .unwrap()
                .is_empty()
        );
        assert_eq!(state.synced_revision(), Some(2));
    }

    #[test]
    fn an_unrelated_change_syncs_at_once() {
        let mut fixture = Fixture::new();
        let mut state = eds_synced_at_one(&mut fixture);
        let r2 = fixture.register("b", 0, 20);
        assert!(state.on_resources(&r2).is_empty());
        assert_eq!(state.synced_revision(), Some(2));
        // A revision that changes no resource at all (the same worker again).
        let r3 = fixture.register("b", 0, 20);
        assert_eq!(r3.endpoints.version, r2.endpoints.version);
        assert!(state.on_resources(&r3).is_empty());
        assert_eq!(state.synced_revision(), Some(3));
    }

    #[test]
    fn an_ack_covers_later_revisions_that_owed_nothing_new() {
        let mut fixture = Fixture::new();
        let r1 = fixture.register("a", 0, 10);
        let mut state = StreamState::new(StreamKind::Eds, "envoy".into());
        let out = state
            .on_request(subscribe(ENDPOINT_TYPE_URL, &["a"]), &r1)
            .unwrap();
        let r2 = fixture.register("b", 0, 20);
        assert!(state.on_resources(&r2).is_empty());
        assert_eq!(
            state.synced_revision(),
            None,
            "the response of revision 1 is still owed"
        );
        assert!(
            state
                .on_request(ack(&out[0], &["a"]), &r2)
                .unwrap()
                .is_empty()
        );
        assert_eq!(state.synced_revision(), Some(2));
    }

    #[test]
    fn a_subscription_to_nothing_that_exists_is_synced_at_once() {
        let mut fixture = Fixture::new();
        let r1 = fixture.register("a", 0, 10);
        let mut state = StreamState::new(StreamKind::Eds, "envoy".into());
        let out = state
            .on_request(subscribe(ENDPOINT_TYPE_URL, &["c"]), &r1)
            .unwrap();
        assert!(out.is_empty());
        assert!(state.serves_endpoints());
        assert_eq!(state.synced_revision(), Some(1));
    }

    #[test]
    fn ads_endpoints_held_for_their_cluster_are_owed() {
        let mut fixture = Fixture::new();
        let r1 = fixture.register("a", 0, 10);
        let mut state = StreamState::new(StreamKind::Ads, "envoy".into());
        // Endpoints before clusters: held back, so owed.
        let out = state
            .on_request(subscribe(ENDPOINT_TYPE_URL, &["a"]), &r1)
            .unwrap();
        assert!(out.is_empty());
        assert!(state.serves_endpoints());
        assert_eq!(state.synced_revision(), None);
        let out = state
            .on_request(subscribe(CLUSTER_TYPE_URL, &[]), &r1)
            .unwrap();
        let types = out.iter().map(|r| r.type_url.as_str()).collect::<Vec<_>>();
        assert_eq!(types, [CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL]);
        assert!(state.on_request(ack(&out[0], &[]), &r1).unwrap().is_empty());
        assert_eq!(state.synced_revision(), None, "a CDS ACK does not count");
        assert!(
            state
                .on_request(ack(&out[1], &["a"]), &r1)
                .unwrap()
                .is_empty()
        );
        assert_eq!(state.synced_revision(), Some(1));
    }

    #[test]
    fn a_cds_only_stream_does_not_serve_endpoints() {
        let mut fixture = Fixture::new();
        let r1 = fixture.register("a", 0, 10);
        for kind in [StreamKind::Cds, StreamKind::Ads] {
            let mut state = StreamState::new(kind, "envoy".into());
            let out = state
                .on_request(subscribe(CLUSTER_TYPE_URL, &[]), &r1)
                .unwrap();
            assert_eq!(out.len(), 1);
            assert!(state.on_request(ack(&out[0], &[]), &r1).unwrap().is_empty());
            assert!(!state.serves_endpoints(), "{kind}");
            assert_eq!(state.synced_revision(), None, "{kind}");
        }
    }
}
