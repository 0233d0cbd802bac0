//! The load client: `N` Envoy-like xDS clients, each one HTTP/2 connection to the supervisor with
//! its streams on it (dedicated CDS and EDS, or one ADS stream; state of the world or delta).
//!
//! Each client behaves as Envoy does, as far as the server can tell: its node names an id, a cluster
//! and a locality as the bootstrap writes them; it subscribes to every cluster (CDS is a wildcard,
//! the legacy empty subscription on delta, as Envoy 1.40 sends it) and its EDS to the names CDS gave
//! it; it ACKs every response with the response's version and nonce (it never NACKs: nothing here is
//! invalid); on state of the world, an EDS response names only the clusters that changed (omitted
//! names are unchanged), and a CDS response is the whole set (omitted names are removed); on delta it
//! keeps each resource's version and drops the names removed. On ADS, clusters are ACKed before the
//! endpoints subscription changes, as Envoy does after pausing EDS while it applies clusters.
//!
//! What is measured is kept in [`Shared`]: the bytes and responses received, when each client has
//! every cluster's endpoints after it (re)connected (*served*), and when it ACKed the response that
//! completes the change the coordinator is waiting for (every marker it set, in the latest endpoints
//! of the cluster it is in). A marker is a worker's EDS hostname, unique per change, found in the
//! resource's bytes without decoding them.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use envoy_types::pb::envoy::{
    config::core::v3::{Locality, Node},
    service::{
        cluster::v3::cluster_discovery_service_client::ClusterDiscoveryServiceClient,
        discovery::v3::{
            DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
            aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
        },
        endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient,
    },
};
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Streaming, transport::Channel};

/// The type URL of clusters.
pub(super) const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
/// The type URL of endpoints.
pub(super) const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// Requests a stream may have queued before its sender waits.
const REQUESTS: usize = 16;
/// After a failed session, before the next.
const RETRY: Duration = Duration::from_millis(200);

/// Which streams a client holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// State of the world, dedicated CDS and EDS streams.
    Sotw,
    /// Delta, dedicated CDS and EDS streams.
    Delta,
    /// State of the world, one ADS stream.
    Ads,
    /// Delta, one ADS stream.
    DeltaAds,
}

impl Kind {
    /// Every kind, as `--kind` spells them.
    pub(super) const ALL: [Kind; 4] = [Kind::Sotw, Kind::Delta, Kind::Ads, Kind::DeltaAds];

    /// As `--kind` spells it.
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Sotw => "sotw",
            Kind::Delta => "delta",
            Kind::Ads => "ads",
            Kind::DeltaAds => "delta-ads",
        }
    }

    /// The kind `--kind` names.
    pub(super) fn parse(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }

    fn is_delta(self) -> bool {
        matches!(self, Kind::Delta | Kind::DeltaAds)
    }

    fn is_ads(self) -> bool {
        matches!(self, Kind::Ads | Kind::DeltaAds)
    }

    /// The server's streams per client.
    pub(super) fn streams(self) -> usize {
        if self.is_ads() { 1 } else { 2 }
    }
}

/// What the coordinator waits for: every marker of each cluster, in that cluster's latest
/// endpoints.
#[derive(Debug, Default)]
pub(super) struct Target {
    /// Bumped for each new target.
    pub(super) generation: u64,
    /// Cluster name -> the markers its endpoints must all hold.
    pub(super) markers: HashMap<String, Vec<Vec<u8>>>,
}

/// One client's counters. Times are nanoseconds since [`Shared::epoch`].
#[derive(Debug, Default)]
pub(super) struct ClientStats {
    /// Encoded bytes of every response received (`encoded_len`).
    pub(super) bytes: AtomicU64,
    /// Endpoints responses received.
    pub(super) eds_responses: AtomicU64,
    /// Endpoints responses received at a version other than the one before: the states pushed
    /// (the pieces of one state share its version).
    pub(super) eds_states: AtomicU64,
    /// Clusters responses received.
    pub(super) cds_responses: AtomicU64,
    /// The target generation this client completed last, and when it ACKed the response that did.
    pub(super) done_generation: AtomicU64,
    pub(super) done_at: AtomicU64,
    /// The session in which the client was last served (had every cluster's endpoints and ACKed
    /// them), plus one (0: never), and when.
    pub(super) served_session: AtomicU64,
    pub(super) served_at: AtomicU64,
    /// Sessions that ended in an error.
    pub(super) errors: AtomicU64,
}

/// What every client shares with the coordinator.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) epoch: Instant,
    pub(super) target: RwLock<Arc<Target>>,
    pub(super) clients: Vec<ClientStats>,
    /// The last session error, for the report.
    pub(super) last_error: std::sync::Mutex<Option<String>>,
}

impl Shared {
    /// Nanoseconds since the epoch.
    pub(super) fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// The instant `ns` after the epoch.
    pub(super) fn at(&self, ns: u64) -> Instant {
        self.epoch + Duration::from_nanos(ns)
    }

    /// Publishes a new target; returns its generation.
    pub(super) fn set_target(&self, markers: HashMap<String, Vec<Vec<u8>>>) -> u64 {
        let mut target = self.target.write().expect("target lock");
        let generation = target.generation + 1;
        *target = Arc::new(Target {
            generation,
            markers,
        });
        generation
    }

    /// Sums a counter over every client.
    pub(super) fn sum(&self, counter: impl Fn(&ClientStats) -> &AtomicU64) -> u64 {
        self.clients
            .iter()
            .map(|c| counter(c).load(Ordering::Relaxed))
            .sum()
    }
}

/// What the coordinator tells the clients: reconnect (a new session number) or stop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Control {
    pub(super) session: u64,
    pub(super) stop: bool,
}

/// Starts `n` clients of `kind` against `url`; they run until `control` says stop.
pub(super) fn start(
    n: usize,
    kind: Kind,
    url: &str,
    shared: &Arc<Shared>,
    control: &watch::Receiver<Control>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|index| {
            tokio::spawn(run_client(
                index,
                kind,
                url.to_owned(),
                shared.clone(),
                control.clone(),
            ))
        })
        .collect()
}

/// One client: a session per connection, until told to stop.
async fn run_client(
    index: usize,
    kind: Kind,
    url: String,
    shared: Arc<Shared>,
    mut control: watch::Receiver<Control>,
) {
    loop {
        let now = *control.borrow_and_update();
        if now.stop {
            return;
        }
        let session = Session {
            index,
            number: now.session,
            shared: &shared,
            clusters: BTreeSet::new(),
            served: BTreeSet::new(),
            satisfied: HashMap::new(),
            generation: 0,
            eds_version: String::new(),
        };
        let ended = tokio::select! {
            ended = session.run(kind, &url) => ended,
            changed = control.changed() => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
        };
        if let Err(error) = ended {
            shared.clients[index].errors.fetch_add(1, Ordering::Relaxed);
            *shared.last_error.lock().expect("error lock") = Some(format!("{error:#}"));
            tokio::select! {
                () = tokio::time::sleep(RETRY) => {}
                changed = control.changed() => if changed.is_err() { return; },
            }
        }
    }
}

/// The node a client names: as the bootstrap writes it for host `bench`.
fn node(index: usize) -> Node {
    Node {
        id: format!("envoy-bench-{index}"),
        cluster: "peregrine".into(),
        locality: Some(Locality {
            region: String::new(),
            zone: "z-bench".into(),
            sub_zone: "bench".into(),
        }),
        user_agent_name: "envoy".into(),
        ..Default::default()
    }
}

/// The name of a cluster or an assignment from its encoded bytes: both have it as field 1, which
/// prost writes first.
fn resource_name(bytes: &[u8]) -> Option<&str> {
    let (&tag, rest) = bytes.split_first()?;
    if tag != 0x0a {
        return None;
    }
    let (mut len, mut shift, mut used) = (0usize, 0, 0);
    for &byte in rest.iter().take(5) {
        len |= usize::from(byte & 0x7f) << shift;
        shift += 7;
        used += 1;
        if byte & 0x80 == 0 {
            break;
        }
    }
    std::str::from_utf8(rest.get(used..used + len)?).ok()
}

/// One connection's worth of a client: what it was sent since it connected.
struct Session<'a> {
    index: usize,
    number: u64,
    shared: &'a Shared,
    /// The clusters CDS gave it.
    clusters: BTreeSet<String>,
    /// The clusters whose endpoints it was sent.
    served: BTreeSet<String>,
    /// For the target generation `generation`: whether each cluster's latest endpoints hold its
    /// markers.
    satisfied: HashMap<String, bool>,
    generation: u64,
    /// The version of the last endpoints response.
    eds_version: String,
}

impl Session<'_> {
    async fn run(mut self, kind: Kind, url: &str) -> anyhow::Result<()> {
        let channel = tonic::transport::Endpoint::from_shared(url.to_owned())?
            // Envoy's HTTP/2 windows are large (256 MiB by default): a large push is not held up by
            // window updates.
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(32 << 20)
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(10))
            .connect()
            .await?;
        if kind.is_delta() {
            self.run_delta(kind, channel).await
        } else {
            self.run_sotw(kind, channel).await
        }
    }

    /// Counts a response's bytes, and its state if it is an endpoints response at another
    /// `version` than the last.
    fn received(&mut self, bytes: usize, type_url: &str, version: &str) {
        let stats = &self.shared.clients[self.index];
        stats.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        if type_url != EDS {
            stats.cds_responses.fetch_add(1, Ordering::Relaxed);
            return;
        }
        stats.eds_responses.fetch_add(1, Ordering::Relaxed);
        if self.eds_version != version {
            stats.eds_states.fetch_add(1, Ordering::Relaxed);
            version.clone_into(&mut self.eds_version);
        }
    }

    /// Reads an endpoints response's assignments (name and bytes) and the names it removes.
    fn endpoints<'b>(
        &mut self,
        assignments: impl Iterator<Item = (&'b str, &'b [u8])>,
        removed: &[String],
    ) {
        let target = self.shared.target.read().expect("target lock").clone();
        if target.generation != self.generation {
            self.generation = target.generation;
            self.satisfied.clear();
        }
        for (name, bytes) in assignments {
            self.served.insert(name.to_owned());
            if let Some(markers) = target.markers.get(name) {
                let all = markers
                    .iter()
                    .all(|m| memchr::memmem::find(bytes, m).is_some());
                self.satisfied.insert(name.to_owned(), all);
            }
        }
        for name in removed {
            self.served.remove(name);
            self.satisfied.remove(name);
        }
    }

    /// After an endpoints response was ACKed: records what it completed.
    fn acked_endpoints(&self) {
        let stats = &self.shared.clients[self.index];
        let now = self.shared.now();
        let target = self.shared.target.read().expect("target lock").clone();
        if target.generation == self.generation
            && !target.markers.is_empty()
            && stats.done_generation.load(Ordering::Relaxed) != self.generation
            && target
                .markers
                .keys()
                .all(|c| self.satisfied.get(c) == Some(&true))
        {
            stats.done_at.store(now, Ordering::Relaxed);
            stats
                .done_generation
                .store(self.generation, Ordering::Release);
        }
        self.check_served(now);
    }

    /// Records the session served once every cluster CDS gave has had its endpoints.
    fn check_served(&self, now: u64) {
        let stats = &self.shared.clients[self.index];
        if stats.served_session.load(Ordering::Relaxed) != self.number + 1
            && !self.clusters.is_empty()
            && self.clusters.iter().all(|c| self.served.contains(c))
        {
            stats.served_at.store(now, Ordering::Relaxed);
            stats
                .served_session
                .store(self.number + 1, Ordering::Release);
        }
    }

    async fn run_sotw(&mut self, kind: Kind, channel: Channel) -> anyhow::Result<()> {
        let (cds_tx, cds_rx) = mpsc::channel(REQUESTS);
        let (mut primary, eds_tx, mut secondary) = if kind.is_ads() {
            let stream = AggregatedDiscoveryServiceClient::new(channel)
                .stream_aggregated_resources(ReceiverStream::new(cds_rx))
                .await?
                .into_inner();
            (stream, cds_tx.clone(), None)
        } else {
            let cds = ClusterDiscoveryServiceClient::new(channel.clone())
                .stream_clusters(ReceiverStream::new(cds_rx))
                .await?
                .into_inner();
            let (eds_tx, eds_rx) = mpsc::channel(REQUESTS);
            let eds = EndpointDiscoveryServiceClient::new(channel)
                .stream_endpoints(ReceiverStream::new(eds_rx))
                .await?
                .into_inner();
            (cds, eds_tx, Some(eds))
        };
        cds_tx
            .send(DiscoveryRequest {
                node: Some(node(self.index)),
                type_url: CDS.into(),
                ..Default::default()
            })
            .await?;
        // The last accepted version and nonce of endpoints, and whether EDS was asked yet (a
        // dedicated EDS stream's first request names the node).
        let (mut eds_version, mut eds_nonce, mut eds_asked) = (String::new(), String::new(), false);
        loop {
            let response = tokio::select! {
                r = primary.message() => r?,
                r = next(&mut secondary) => r?,
            };
            let Some(response) = response else {
                anyhow::bail!("the server ended a stream");
            };
            self.received(
                response.encoded_len(),
                &response.type_url,
                &response.version_info,
            );
            if response.type_url == CDS {
                let names: BTreeSet<String> = response
                    .resources
                    .iter()
                    .filter_map(|any| resource_name(&any.value).map(str::to_owned))
                    .collect();
                cds_tx.send(ack(&response, CDS, Vec::new(), None)).await?;
                if names != self.clusters || !eds_asked {
                    self.served.retain(|c| names.contains(c));
                    self.clusters = names;
                    let first = !eds_asked && !kind.is_ads();
                    eds_tx
                        .send(DiscoveryRequest {
                            node: first.then(|| node(self.index)),
                            version_info: eds_version.clone(),
                            response_nonce: eds_nonce.clone(),
                            resource_names: self.clusters.iter().cloned().collect(),
                            type_url: EDS.into(),
                            ..Default::default()
                        })
                        .await?;
                    eds_asked = true;
                }
            } else if response.type_url == EDS {
                self.endpoints(
                    response
                        .resources
                        .iter()
                        .filter_map(|any| Some((resource_name(&any.value)?, &any.value[..]))),
                    &[],
                );
                eds_version.clone_from(&response.version_info);
                eds_nonce.clone_from(&response.nonce);
                eds_tx
                    .send(ack(
                        &response,
                        EDS,
                        self.clusters.iter().cloned().collect(),
                        None,
                    ))
                    .await?;
                self.acked_endpoints();
            }
        }
    }

    async fn run_delta(&mut self, kind: Kind, channel: Channel) -> anyhow::Result<()> {
        let (cds_tx, cds_rx) = mpsc::channel(REQUESTS);
        let (mut primary, eds_tx, mut secondary) = if kind.is_ads() {
            let stream = AggregatedDiscoveryServiceClient::new(channel)
                .delta_aggregated_resources(ReceiverStream::new(cds_rx))
                .await?
                .into_inner();
            (stream, cds_tx.clone(), None)
        } else {
            let cds = ClusterDiscoveryServiceClient::new(channel.clone())
                .delta_clusters(ReceiverStream::new(cds_rx))
                .await?
                .into_inner();
            let (eds_tx, eds_rx) = mpsc::channel(REQUESTS);
            let eds = EndpointDiscoveryServiceClient::new(channel)
                .delta_endpoints(ReceiverStream::new(eds_rx))
                .await?
                .into_inner();
            (cds, eds_tx, Some(eds))
        };
        // Envoy 1.40's first delta CDS request subscribes to nothing: a wildcard.
        cds_tx
            .send(DeltaDiscoveryRequest {
                node: Some(node(self.index)),
                type_url: CDS.into(),
                ..Default::default()
            })
            .await?;
        // What the client has: name -> version, per type.
        let mut clusters_had: BTreeMap<String, String> = BTreeMap::new();
        let mut endpoints_had: BTreeMap<String, String> = BTreeMap::new();
        let mut subscribed: BTreeSet<String> = BTreeSet::new();
        let mut eds_asked = false;
        loop {
            let response: Option<DeltaDiscoveryResponse> = tokio::select! {
                r = primary.message() => r?,
                r = next(&mut secondary) => r?,
            };
            let Some(response) = response else {
                anyhow::bail!("the server ended a stream");
            };
            self.received(
                response.encoded_len(),
                &response.type_url,
                &response.system_version_info,
            );
            if response.type_url == CDS {
                for resource in &response.resources {
                    clusters_had.insert(resource.name.clone(), resource.version.clone());
                }
                for name in &response.removed_resources {
                    clusters_had.remove(name);
                }
                cds_tx.send(delta_ack(&response)).await?;
                let names: BTreeSet<String> = clusters_had.keys().cloned().collect();
                let subscribe: Vec<String> = names.difference(&subscribed).cloned().collect();
                let unsubscribe: Vec<String> = subscribed.difference(&names).cloned().collect();
                self.served.retain(|c| names.contains(c));
                self.clusters.clone_from(&names);
                if !subscribe.is_empty() || !unsubscribe.is_empty() {
                    for name in &unsubscribe {
                        endpoints_had.remove(name);
                    }
                    let first = !eds_asked && !kind.is_ads();
                    eds_tx
                        .send(DeltaDiscoveryRequest {
                            node: first.then(|| node(self.index)),
                            type_url: EDS.into(),
                            resource_names_subscribe: subscribe,
                            resource_names_unsubscribe: unsubscribe,
                            ..Default::default()
                        })
                        .await?;
                    eds_asked = true;
                    subscribed = names;
                }
                self.check_served(self.shared.now());
            } else if response.type_url == EDS {
                for resource in &response.resources {
                    endpoints_had.insert(resource.name.clone(), resource.version.clone());
                }
                for name in &response.removed_resources {
                    endpoints_had.remove(name);
                }
                self.endpoints(
                    response
                        .resources
                        .iter()
                        .filter_map(|r| Some((r.name.as_str(), &r.resource.as_ref()?.value[..]))),
                    &response.removed_resources,
                );
                eds_tx.send(delta_ack(&response)).await?;
                self.acked_endpoints();
            }
        }
    }
}

/// The next message of an optional stream; never ready without one.
async fn next<T>(stream: &mut Option<Streaming<T>>) -> Result<Option<T>, tonic::Status> {
    match stream {
        Some(stream) => stream.message().await,
        None => std::future::pending().await,
    }
}

/// The ACK of a state-of-the-world response.
fn ack(
    response: &DiscoveryResponse,
    type_url: &str,
    names: Vec<String>,
    node: Option<Node>,
) -> DiscoveryRequest {
    DiscoveryRequest {
        node,
        version_info: response.version_info.clone(),
        response_nonce: response.nonce.clone(),
        resource_names: names,
        type_url: type_url.into(),
        ..Default::default()
    }
}

/// The ACK of a delta response.
fn delta_ack(response: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: response.type_url.clone(),
        response_nonce: response.nonce.clone(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;

    use super::*;

    #[test]
    fn reads_a_resource_name_from_its_bytes() {
        let name = "svc-".repeat(40);
        let bytes = ClusterLoadAssignment {
            cluster_name: name.clone(),
            ..Default::default()
        }
        .encode_to_vec();
        assert_eq!(resource_name(&bytes), Some(name.as_str()));
        assert_eq!(resource_name(&[]), None);
        assert_eq!(resource_name(&[0x12, 0]), None);
    }
}
