//! The gRPC transport: CDS, EDS and ADS streams, state of the world ([`sotw`]) or delta ([`delta`]),
//! over the [`Resources`] the cache publishes.
//!
//! This module holds what both variants share: the services on the wire ([`wire`]), the task that
//! drives a stream ([`run_stream`]), and the per-stream state that does not depend on the variant
//! ([`Stream`]: its kind, its node, and how far the client has ACKed its endpoints). Each variant
//! brings what it knows about one resource type (a `W` in [`Stream<W>`]) and its rules
//! ([`StreamRules`]).
//!
//! Both variants send a response exactly when one is owed, so an ACK gets no reply and a NACK is not
//! answered with the same content again (go-control-plane's resend loop, its issue #962). CDS is
//! always the full set (wildcard) on state-of-the-world streams; EDS answers only the names
//! subscribed, sends only the assignments that changed, and answers a name that does not exist yet
//! as soon as it appears. On an ADS stream that subscribed to clusters, clusters are always sent
//! before the endpoints that name them: endpoints are held until their cluster was sent on the same
//! stream, and a changed cluster's endpoints are sent again right after it (Envoy finishes warming a
//! changed cluster only with a new EDS response). An ADS stream that never subscribed to clusters
//! (an Envoy whose EDS clusters are static) gets the endpoints it names, as a dedicated EDS stream
//! does: held, they would never be answered, and every drain would wait its timeout for it.
//!
//! Each stream also follows how far Envoy has ACKed its endpoints: its *synced revision* is the highest
//! registry revision at which every EDS response it owed was ACKed (a NACK or a stale nonce never
//! advances it; an ADS endpoint response held back for its cluster is owed). Streams publish it to
//! [`Acks`], which draining waits on.
//!
//! Invariant: the transport never builds resources; it only selects from the cache's.

mod delta;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod looked;
#[cfg(test)]
mod scenarios;
mod sotw;
mod wire;

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use envoy_types::pb::{envoy::config::core::v3::Node, google::rpc::Status as RpcStatus};
use tokio::{
    sync::{mpsc, watch},
    time::Instant,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use tracing::Instrument;

pub use self::wire::{AggregatedServer, ClusterServer, EndpointServer};
use super::stream_kind::StreamKind;
use super::{
    acks::Acks,
    cache::Resources,
    convergence::Convergence,
    counters::{self, XdsCounters},
    priorities::Requester,
};
use crate::{grpc_port::ClientProof, printable::printable};

/// The most assignment bytes one EDS response carries, state of the world or delta (one assignment
/// larger than this goes alone): about the HTTP/2 stream window a client opens by default (65,535
/// bytes), so a response in flight costs about what one window holds. The rest follow one response
/// per answer (ACK or NACK), and the stream is synced only once the last is ACKed.
const EDS_RESPONSE_BYTES: usize = 64 * 1024;

/// How many responses may wait in a stream's channel: one pass over the resources makes at most
/// two (clusters, then endpoints, on ADS). A stream reads the cache only once its channel is empty,
/// so a client that does not read holds the latest state (the cache's watch), never a queue of old
/// ones.
const RESPONSE_BUFFER: usize = 2;

/// Serves CDS, EDS and ADS from the cache's watch channel. Cheap to clone.
///
/// Each stream ends when its client ends it or when the cache's sender is dropped (the control plane
/// shutting down), so graceful shutdown of the server is not held up by long-lived streams. Each
/// stream is registered in [`Acks`] from its first request until it ends.
#[derive(Clone, Debug)]
pub struct XdsService {
    resources: watch::Receiver<Arc<Resources>>,
    /// The same, published only when a type of clusters changed: what CDS streams wait on, so a
    /// change of endpoints wakes none of them.
    clusters: watch::Receiver<Arc<Resources>>,
    acks: Arc<Acks>,
    counters: Arc<XdsCounters>,
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

    /// Returns the responses owed for `resources`, clusters first, then endpoints (`fresh` names a
    /// type owed a response even if it would be empty), and then moves the synced revision.
    fn respond_all(&mut self, resources: &Resources, fresh: Option<&str>) -> Vec<Self::Response>;

    /// Returns the responses owed after the cache published new resources.
    fn on_resources(&mut self, resources: &Resources) -> Vec<Self::Response> {
        self.respond_all(resources, None)
    }

    /// The type a response carries.
    fn type_url(response: &Self::Response) -> &str;
}

/// What a stream's task hands its response body: a response, boxed because tokio's channel allots
/// 32 slots per stream whatever its bound (a slot holds 16 bytes, not a 150-200 byte response), or
/// the status that ends the stream.
type Outgoing<R> = Result<Box<R>, Status>;

/// The responses of the streams whose state is `Stream<W>`.
type Responses<W> = ReceiverStream<Outgoing<<Stream<W> as StreamRules>::Response>>;

// === impl XdsService ===

impl XdsService {
    /// A service reading `resources`, publishing each stream's ACK progress to `acks` and its
    /// pushes and NACKs to `counters`.
    pub fn new(
        resources: watch::Receiver<Arc<Resources>>,
        acks: Arc<Acks>,
        counters: Arc<XdsCounters>,
    ) -> Self {
        let (tx, clusters) = watch::channel(resources.borrow().clone());
        let mut from = resources.clone();
        tokio::spawn(async move {
            while from.changed().await.is_ok() {
                let now = from.borrow_and_update().clone();
                tx.send_if_modified(|held| {
                    let changed = held.clusters_differ(&now);
                    if changed {
                        *held = now;
                    }
                    changed
                });
            }
            // Dropping `tx` tells CDS streams the control plane is going away, as the cache's
            // sender does the others.
        });
        XdsService {
            resources,
            clusters,
            acks,
            counters,
        }
    }

    fn open<W: Send + 'static>(
        &self,
        kind: StreamKind,
        requests: Streaming<<Stream<W> as StreamRules>::Request>,
        proof: Option<ClientProof>,
    ) -> Responses<W>
    where
        Stream<W>: StreamRules,
    {
        let (tx, rx) = mpsc::channel(RESPONSE_BUFFER);
        let resources = match kind {
            StreamKind::Cds | StreamKind::DeltaCds => &self.clusters,
            _ => &self.resources,
        };
        tokio::spawn(run_stream::<W>(
            kind,
            requests,
            resources.clone(),
            (self.acks.clone(), self.counters.clone()),
            tx,
            proof,
        ));
        ReceiverStream::new(rx)
    }
}

/// Drives one stream until the client ends it, the response channel closes or the cache goes away;
/// keeps it registered in `acks` from its first request until then.
async fn run_stream<W: Send + 'static>(
    kind: StreamKind,
    mut requests: Streaming<<Stream<W> as StreamRules>::Request>,
    mut resources: watch::Receiver<Arc<Resources>>,
    (acks, counters): (Arc<Acks>, Arc<XdsCounters>),
    tx: mpsc::Sender<Outgoing<<Stream<W> as StreamRules>::Response>>,
    proof: Option<ClientProof>,
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
    // A request with a node id is what Envoy sends first: it proves the connection a client, which
    // a new connection no longer evicts. A stream that sends nothing proves nothing.
    if !node.is_empty()
        && let Some(proof) = &proof
    {
        proof.prove();
    }
    let requester = Requester::of(Stream::<W>::node(&first));
    let id = STREAMS.fetch_add(1, Ordering::Relaxed) + 1;
    // The node id is the client's: escaped, so that it cannot write lines of its own into the log.
    let span = tracing::info_span!("xds_stream", id, %kind, node = %printable(&node));
    async move {
        tracing::debug!("Stream opened");
        // Dropped on every way out of this block, which removes the stream from `acks`.
        let registered = acks.register(id, node.clone(), kind);
        let mut state = Stream::<W>::new(kind, node, requester);
        let mut next = Some(first);
        // Since when the client has owed an answer to an endpoints response, without answering any
        // (a late answer to an outdated response restarts the clock: that client is alive).
        let mut silent_since = None;
        let mut replies = 0;
        // The registry changes sent and not yet ACKed, for the convergence times.
        let mut convergence = Convergence::default();
        // Whether the cache published resources the stream has not answered yet.
        let mut owed = false;
        loop {
            // The registry change this step answers, if it is one.
            let mut change = None;
            // Room in the channel for the responses to new resources (taken when the channel is
            // empty).
            let mut room = None;
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
                    changed = resources.changed(), if !owed => {
                        if changed.is_err() {
                            tracing::debug!("Control plane stopping, ending stream");
                            let _ = tx.send(Err(Status::unavailable("control plane shutting down"))).await;
                            return;
                        }
                        owed = true;
                        continue;
                    }
                    permits = tx.reserve_many(RESPONSE_BUFFER), if owed => {
                        let Ok(permits) = permits else { return };
                        owed = false;
                        // The latest resources, however many were published while the client was
                        // not reading.
                        let current = resources.borrow_and_update().clone();
                        change = Some((current.revision, current.changed_at));
                        room = Some(permits);
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
            let synced = state.synced_revision();
            registered.publish(state.serves_endpoints(), synced, silent_since);
            counters.nacked(std::mem::take(&mut state.nacks));
            if let Some((revision, changed_at)) = change
                && !responses.is_empty()
                && state.serves_endpoints()
            {
                convergence.sent(revision, changed_at);
            }
            for took in convergence.synced(synced, std::time::Instant::now()) {
                counters.converged(took);
            }
            for response in responses {
                let type_url = Stream::<W>::type_url(&response).to_owned();
                match room.as_mut().and_then(Iterator::next) {
                    Some(permit) => permit.send(Ok(Box::new(response))),
                    None => {
                        if tx.send(Ok(Box::new(response))).await.is_err() {
                            return;
                        }
                    }
                }
                counters.pushed(&type_url);
            }
        }
    }
    .instrument(span)
    .await
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
/// knows about one resource type: a [`TypeWatch`] on state-of-the-world streams, a [`DeltaWatch`] on
/// delta streams.
#[derive(Debug)]
struct Stream<W> {
    kind: StreamKind,
    node: String,
    /// Where the client is: under local-first routing, what its endpoints' priorities depend on.
    requester: Requester,
    clusters: Option<W>,
    endpoints: Option<W>,
    sync: EndpointSync,
    /// NACKs since the driver last took them, per type of [`counters::TYPES`].
    nacks: [u64; 2],
}

/// Counts a NACK of `type_url` in a stream's `nacks`.
fn count_nack(nacks: &mut [u64; 2], type_url: &str) {
    if let Some(i) = counters::index(type_url) {
        nacks[i] += 1;
    }
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
                    node = %printable(node),
                    type_url,
                    version,
                    nonce,
                    error = %printable(&error.message),
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

    /// Records what an endpoints request echoing `nonce` said about the last endpoints response: an
    /// ACK moves the synced revision, and any echoed nonce (current or outdated) is an answer.
    fn on_reply(&mut self, reply: &Reply<'_>, nonce: &str) {
        match reply {
            Reply::Ack(nonce) => {
                self.acked(nonce);
                self.replied(nonce);
            }
            Reply::Nack | Reply::Stale => self.replied(nonce),
            Reply::None => {}
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
    fn new(kind: StreamKind, node: String, requester: Requester) -> Self {
        Stream {
            kind,
            node,
            requester,
            clusters: None,
            endpoints: None,
            sync: EndpointSync::default(),
            nacks: [0; 2],
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
