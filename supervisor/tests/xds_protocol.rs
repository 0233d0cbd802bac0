//! The xDS protocol rules, checked with a scripted gRPC client against the real server on port 0.
//!
//! Every wait is bounded: a response must arrive within [`RESPONSE_WITHIN`], and "no response" is
//! asserted by waiting [`SILENCE`] for one (a bound, not a sleep).
//!
//! Scenarios that hold for both variants are written once and listed in the table at the bottom
//! (`scenarios!`), which runs each on state of the world and on delta. One file on purpose, though
//! over 700 lines: it is one scripted client and the rules it checks, read top to bottom.

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::Duration};

use envoy_types::pb::{
    envoy::{
        config::{
            cluster::v3::Cluster,
            core::v3::{Node, api_config_source::ApiType, config_source::ConfigSourceSpecifier},
            endpoint::v3::{ClusterLoadAssignment, lb_endpoint::HostIdentifier},
        },
        service::{
            cluster::v3::cluster_discovery_service_client::ClusterDiscoveryServiceClient,
            discovery::v3::{
                DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
                aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
            },
            endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient,
        },
    },
    google::{protobuf::Any, rpc::Status as RpcStatus},
};
use peregrine_supervisor::{
    registry::{Address, Protocol, Registry, ServiceView, Snapshot, Worker},
    run,
    xds::{XdsOptions, acks::Acks, counters::XdsCounters},
};
use prometheus_client::metrics::histogram::Histogram;
use prost::Message;
use tokio::{
    sync::{mpsc, oneshot, watch},
    task::JoinHandle,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Streaming, transport::Channel};

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const RESPONSE_WITHIN: Duration = Duration::from_secs(5);
const SILENCE: Duration = Duration::from_millis(200);

/// A running server.
struct Server {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), run::grpc::ServeError>>,
}

impl Server {
    async fn start(snapshots: watch::Receiver<Arc<Snapshot>>) -> Server {
        Server::start_counting(snapshots, Default::default()).await
    }

    /// A server whose streams count their pushes, NACKs and convergence times in `counters`.
    async fn start_counting(
        snapshots: watch::Receiver<Arc<Snapshot>>,
        counters: Arc<XdsCounters>,
    ) -> Server {
        // `RUST_LOG=peregrine_supervisor=debug` shows the server's side of each script.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(run::grpc::serve(
            run::grpc::Ports::single(listener, 1024),
            run::grpc::Inputs {
                snapshots,
                options: tokio::sync::watch::channel(XdsOptions::default()).1,
                acks: Arc::new(Acks::default()),
                counters,
                orca: None,
            },
            async {
                let _ = rx.await;
            },
        ));
        Server {
            addr,
            shutdown: Some(tx),
            task,
        }
    }

    async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One open xDS stream (state of the world unless opened with [`Client::open_delta`]).
struct Client<Q = DiscoveryRequest, P = DiscoveryResponse> {
    tx: mpsc::Sender<Q>,
    rx: Streaming<P>,
}

type DeltaClient = Client<DeltaDiscoveryRequest, DeltaDiscoveryResponse>;

#[derive(Clone, Copy)]
enum Rpc {
    Cds,
    Eds,
    Ads,
}

/// Opens `rpc` on `server` with the client methods named for each service (`stream_*` or `delta_*`).
macro_rules! open_client {
    ($server:expr, $rpc:expr, $cds:ident, $eds:ident, $ads:ident) => {{
        let channel = $server.channel().await;
        let (tx, rx) = mpsc::channel(16);
        let requests = ReceiverStream::new(rx);
        let rx = match $rpc {
            Rpc::Cds => {
                ClusterDiscoveryServiceClient::new(channel)
                    .$cds(requests)
                    .await
            }
            Rpc::Eds => {
                EndpointDiscoveryServiceClient::new(channel)
                    .$eds(requests)
                    .await
            }
            Rpc::Ads => {
                AggregatedDiscoveryServiceClient::new(channel)
                    .$ads(requests)
                    .await
            }
        };
        Client {
            tx,
            rx: rx.unwrap().into_inner(),
        }
    }};
}

impl Client {
    async fn open(server: &Server, rpc: Rpc) -> Client {
        open_client!(
            server,
            rpc,
            stream_clusters,
            stream_endpoints,
            stream_aggregated_resources
        )
    }
}

impl DeltaClient {
    async fn open_delta(server: &Server, rpc: Rpc) -> DeltaClient {
        open_client!(
            server,
            rpc,
            delta_clusters,
            delta_endpoints,
            delta_aggregated_resources
        )
    }
}

impl<Q, P: std::fmt::Debug> Client<Q, P> {
    async fn send(&self, request: Q) {
        self.tx
            .send(request)
            .await
            .unwrap_or_else(|_| panic!("stream open"));
    }

    async fn recv(&mut self) -> P {
        tokio::time::timeout(RESPONSE_WITHIN, self.rx.message())
            .await
            .expect("a response in time")
            .expect("a response, not an error")
            .expect("a response, not the end of the stream")
    }

    async fn expect_silence(&mut self, why: &str) {
        if let Ok(message) = tokio::time::timeout(SILENCE, self.rx.message()).await {
            panic!("expected no response ({why}), got {message:?}");
        }
    }
}

fn request(type_url: &str, version: &str, nonce: &str, names: &[&str]) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: version.into(),
        node: Some(Node {
            id: "test-node".into(),
            cluster: "test".into(),
            ..Default::default()
        }),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        type_url: type_url.into(),
        response_nonce: nonce.into(),
        error_detail: None,
        ..Default::default()
    }
}

fn ack(response: &DiscoveryResponse, names: &[&str]) -> DiscoveryRequest {
    request(
        &response.type_url,
        &response.version_info,
        &response.nonce,
        names,
    )
}

fn nack(response: &DiscoveryResponse, accepted: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        error_detail: Some(RpcStatus {
            code: 3,
            message: "test rejection".into(),
            details: Vec::new(),
        }),
        ..request(&response.type_url, accepted, &response.nonce, &[])
    }
}

fn clusters(response: &DiscoveryResponse) -> BTreeMap<String, Cluster> {
    assert_eq!(response.type_url, CDS);
    response
        .resources
        .iter()
        .map(|any| {
            assert_eq!(any.type_url, CDS);
            let c = Cluster::decode(any.value.as_slice()).unwrap();
            (c.name.clone(), c)
        })
        .collect()
}

fn assignments(response: &DiscoveryResponse) -> BTreeMap<String, ClusterLoadAssignment> {
    assert_eq!(response.type_url, EDS);
    response
        .resources
        .iter()
        .map(|any| {
            assert_eq!(any.type_url, EDS);
            let c = ClusterLoadAssignment::decode(any.value.as_slice()).unwrap();
            (c.cluster_name.clone(), c)
        })
        .collect()
}

fn hostnames(assignment: &ClusterLoadAssignment) -> Vec<String> {
    assignment
        .endpoints
        .iter()
        .flat_map(|l| &l.lb_endpoints)
        .map(|e| match &e.host_identifier {
            Some(HostIdentifier::Endpoint(e)) => e.hostname.clone(),
            other => panic!("unexpected host identifier {other:?}"),
        })
        .collect()
}

/// `(epoch, counter)` of a type version.
fn version_parts(version: &str) -> (String, u64) {
    let (epoch, counter) = version.split_once('-').expect("<epoch>-<counter>");
    assert!(
        !epoch.is_empty() && epoch.chars().all(|c| c.is_ascii_hexdigit()),
        "epoch is hex: {version}"
    );
    (epoch.to_string(), counter.parse().expect("counter"))
}

fn worker(service: &str, index: u32, pid: u32, protocols: &[Protocol]) -> Worker {
    let addr = Address::Tcp(([127, 0, 0, 1], 9000 + index as u16).into());
    Worker::ready(service, index, pid, protocols.to_vec(), vec![addr])
}

async fn registry_server(services: &[&str]) -> (Arc<Registry>, Server) {
    let registry = Arc::new(Registry::new(services.iter().map(|s| s.to_string())));
    let server = Server::start(registry.subscribe()).await;
    (registry, server)
}

#[tokio::test]
async fn cds_sends_the_full_set_and_versions_move_only_with_content() {
    let (registry, server) = registry_server(&["a", "b"]).await;
    let mut cds = Client::open(&server, Rpc::Cds).await;
    cds.send(request(CDS, "", "", &["a"])).await;
    let first = cds.recv().await;
    assert_eq!(
        clusters(&first).keys().collect::<Vec<_>>(),
        ["a", "b"],
        "CDS is always the full set, whatever is named"
    );
    let (epoch, counter) = version_parts(&first.version_info);
    assert!(!first.nonce.is_empty());

    cds.send(ack(&first, &[])).await;
    cds.expect_silence("after an ACK").await;

    // A worker change leaves the clusters as they were: no CDS push.
    registry
        .register(worker("a", 0, 10, &[Protocol::Http1]))
        .unwrap();
    cds.expect_silence("the clusters did not change").await;

    // The first HTTP/2-only worker of `b` changes `b`'s upstream protocol: a push.
    registry
        .register(worker("b", 0, 20, &[Protocol::Http2]))
        .unwrap();
    let second = cds.recv().await;
    assert_eq!(clusters(&second).len(), 2);
    assert_eq!(version_parts(&second.version_info), (epoch, counter + 1));
    assert_ne!(second.nonce, first.nonce, "a fresh nonce on every response");
}

#[tokio::test]
async fn eds_answers_only_requested_names_and_pushes_new_workers() {
    let (registry, server) = registry_server(&["a", "b"]).await;
    let mut eds = Client::open(&server, Rpc::Eds).await;
    eds.send(request(EDS, "", "", &["a"])).await;
    let first = eds.recv().await;
    let got = assignments(&first);
    assert_eq!(got.keys().collect::<Vec<_>>(), ["a"]);
    assert!(hostnames(&got["a"]).is_empty());
    eds.send(ack(&first, &["a"])).await;
    eds.expect_silence("after an ACK").await;

    // A worker of a service not requested: nothing for this stream.
    registry
        .register(worker("b", 0, 20, &[Protocol::Http1]))
        .unwrap();
    eds.expect_silence("b is not requested").await;

    registry
        .register(worker("a", 0, 10, &[Protocol::Http1]))
        .unwrap();
    let second = eds.recv().await;
    assert_eq!(hostnames(&assignments(&second)["a"]), ["a-0-10"]);
    assert_ne!(second.nonce, first.nonce);
    let (_, counter) = version_parts(&second.version_info);
    assert!(counter > version_parts(&first.version_info).1);
}

#[tokio::test]
async fn stale_nonces_are_ignored_and_new_names_answered_at_the_same_version() {
    let (registry, server) = registry_server(&["a", "b"]).await;
    let mut eds = Client::open(&server, Rpc::Eds).await;
    eds.send(request(EDS, "", "", &["a"])).await;
    let first = eds.recv().await;
    registry
        .register(worker("a", 0, 10, &[Protocol::Http1]))
        .unwrap();
    let second = eds.recv().await;

    // Echoing the first nonce is stale: ignored, even though it names `b`.
    eds.send(request(EDS, &first.version_info, &first.nonce, &["a", "b"]))
        .await;
    eds.expect_silence("a stale nonce").await;

    // The same names with the current nonce: answered at the same version, with what the client
    // does not have (`a` is as it was sent: state-of-the-world EDS leaves out what is unchanged).
    eds.send(request(
        EDS,
        &second.version_info,
        &second.nonce,
        &["a", "b"],
    ))
    .await;
    let third = eds.recv().await;
    assert_eq!(third.version_info, second.version_info);
    assert_eq!(assignments(&third).keys().collect::<Vec<_>>(), ["b"]);
    assert_ne!(third.nonce, second.nonce);
}

#[tokio::test]
async fn an_unknown_eds_name_is_remembered_and_sent_when_it_appears() {
    let one = Snapshot {
        revision: 1,
        services: BTreeMap::from([("a".to_string(), ServiceView::default())]),
        ..Snapshot::default()
    };
    let (tx, rx) = watch::channel(Arc::new(one.clone()));
    let server = Server::start(rx).await;
    let mut eds = Client::open(&server, Rpc::Eds).await;
    eds.send(request(EDS, "", "", &["later"])).await;
    eds.expect_silence("the name does not exist yet").await;

    let mut two = one;
    two.revision = 2;
    let mut view = ServiceView::default();
    let later = worker("later", 0, 30, &[Protocol::Http1]);
    view.workers.insert(later.key(), later);
    two.services.insert("later".into(), view);
    tx.send_replace(Arc::new(two));
    let response = eds.recv().await;
    let got = assignments(&response);
    assert_eq!(got.keys().collect::<Vec<_>>(), ["later"]);
    assert_eq!(hostnames(&got["later"]), ["later-0-30"]);
}

#[tokio::test]
async fn eds_names_dropped_and_named_again_are_sent_again() {
    let (_registry, server) = registry_server(&["a", "b"]).await;
    let mut eds = Client::open(&server, Rpc::Eds).await;
    eds.send(request(EDS, "", "", &["a", "b"])).await;
    let first = eds.recv().await;
    assert_eq!(assignments(&first).len(), 2);
    eds.send(ack(&first, &["a"])).await;
    eds.expect_silence("dropping a name needs no response")
        .await;
    eds.send(ack(&first, &["a", "b"])).await;
    let second = eds.recv().await;
    assert_eq!(second.version_info, first.version_info);
    assert_eq!(assignments(&second).keys().collect::<Vec<_>>(), ["b"]);
}

/// A client that stops reading holds the latest state, not a queue: while HTTP/2 flow control keeps
/// the server from writing, the stream takes no new resources until its two-slot channel is empty,
/// and then the newest ones. 40 changes later, the client that reads again gets a few responses
/// already on their way, then the latest version; never the 40.
#[tokio::test]
async fn a_client_that_does_not_read_holds_the_latest_state_not_a_queue() {
    const WORKERS: u32 = 20;
    const CHANGES: u32 = 40;
    let (registry, server) = registry_server(&["a"]).await;
    // Every response (20 endpoints and more) is larger than the stream's flow-control window, so
    // the server cannot write the next one until the client reads.
    for index in 0..WORKERS {
        registry
            .register(worker("a", index, 100 + index, &[Protocol::Http1]))
            .unwrap();
    }
    let channel = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .initial_stream_window_size(1024)
        .connect()
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(16);
    let mut eds = Client {
        tx,
        rx: EndpointDiscoveryServiceClient::new(channel)
            .stream_endpoints(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner(),
    };
    eds.send(request(EDS, "", "", &["a"])).await;
    let first = eds.recv().await;
    let encoded = first.encoded_len();
    assert!(
        encoded > 1024,
        "a response fills the window: {encoded} bytes"
    );
    eds.send(ack(&first, &["a"])).await;

    // Changes further apart than the cache's coalescing window: each is published on its own.
    for index in WORKERS..WORKERS + CHANGES {
        registry
            .register(worker("a", index, 100 + index, &[Protocol::Http1]))
            .unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let latest = WORKERS + CHANGES;
    let mut received = 0;
    loop {
        let response = eds.recv().await;
        received += 1;
        let endpoints = hostnames(&assignments(&response)["a"]).len() as u32;
        if endpoints == latest {
            break;
        }
        assert!(endpoints < latest, "{endpoints} endpoints");
    }
    assert!(
        received <= 6,
        "{received} responses until the latest of {CHANGES} changes: a queue, not the latest state"
    );
    eds.expect_silence("the client has the latest state").await;
}

#[tokio::test]
async fn convergence_is_timed_from_the_registry_change_to_the_ack() {
    let registry = Arc::new(Registry::new(["a".to_string(), "b".to_string()]));
    let convergence = Histogram::new([0.001, 0.01, 0.1, 1.0]);
    let counters = Arc::new(XdsCounters::new(convergence.clone()));
    let server = Server::start_counting(registry.subscribe(), counters).await;
    let mut eds = Client::open(&server, Rpc::Eds).await;
    eds.send(request(EDS, "", "", &["a"])).await;
    let first = eds.recv().await;
    eds.send(ack(&first, &["a"])).await;
    eds.expect_silence("after an ACK").await;
    assert_eq!(convergence.count(), 0, "a first subscription is no change");

    // A change this stream does not serve: nothing to converge on.
    registry
        .register(worker("b", 0, 20, &[Protocol::Http1]))
        .unwrap();
    eds.expect_silence("b is not requested").await;
    assert_eq!(convergence.count(), 0);

    // A change it serves, NACKed first: timed only at the ACK, from the change.
    let changed = std::time::Instant::now();
    registry
        .register(worker("a", 0, 10, &[Protocol::Http1]))
        .unwrap();
    let second = eds.recv().await;
    eds.send(DiscoveryRequest {
        resource_names: vec!["a".into()],
        ..nack(&second, &first.version_info)
    })
    .await;
    eds.expect_silence("a NACK of unchanged content").await;
    assert_eq!(convergence.count(), 0, "a NACK is no convergence");
    registry
        .register(worker("a", 1, 11, &[Protocol::Http1]))
        .unwrap();
    let third = eds.recv().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    eds.send(ack(&third, &["a"])).await;
    // Observed once the server has read the ACK: wait for it, bounded.
    let deadline = tokio::time::Instant::now() + RESPONSE_WITHIN;
    while convergence.count() < 2 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = changed.elapsed().as_secs_f64();
    assert_eq!(convergence.count(), 2, "both changes converged at the ACK");
    // The first change waited through the NACK and the 50 ms before the ACK; neither can exceed the
    // time since it was made.
    assert!(
        convergence.sum() >= 0.05 + 0.05 && convergence.sum() <= 2.0 * took,
        "sum {} s, {took} s since the first change",
        convergence.sum()
    );
}

#[tokio::test]
async fn fetch_is_unimplemented() {
    let (_registry, server) = registry_server(&["a"]).await;
    let mut client = ClusterDiscoveryServiceClient::new(server.channel().await);
    let status = client
        .fetch_clusters(request(CDS, "", "", &[]))
        .await
        .expect_err("fetch must fail");
    assert_eq!(status.code(), Code::Unimplemented);
}

#[tokio::test]
async fn shutdown_ends_open_streams_and_the_server() {
    let (_registry, mut server) = registry_server(&["a"]).await;
    let mut cds = Client::open(&server, Rpc::Cds).await;
    cds.send(request(CDS, "", "", &[])).await;
    cds.recv().await;
    server.shutdown.take().unwrap().send(()).unwrap();
    let end = tokio::time::timeout(RESPONSE_WITHIN, cds.rx.message())
        .await
        .expect("the stream ends in time");
    match end {
        Err(status) => assert_eq!(status.code(), Code::Unavailable),
        Ok(None) => {}
        Ok(Some(message)) => panic!("unexpected response {message:?}"),
    }
    tokio::time::timeout(RESPONSE_WITHIN, &mut server.task)
        .await
        .expect("the server stops in time")
        .unwrap()
        .unwrap();
}

// === delta ===

fn delta_request(type_url: &str, nonce: &str, subscribe: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: Some(Node {
            id: "test-node".into(),
            cluster: "test".into(),
            ..Default::default()
        }),
        type_url: type_url.into(),
        resource_names_subscribe: subscribe.iter().map(|n| n.to_string()).collect(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

fn delta_ack(response: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
    delta_request(&response.type_url, &response.nonce, &[])
}

/// The resources of a delta response by name, each checked to carry its name, a version and a
/// resource of the response's type.
fn delta_resources(response: &DeltaDiscoveryResponse) -> BTreeMap<String, Any> {
    response
        .resources
        .iter()
        .map(|r| {
            assert!(!r.version.is_empty(), "{r:?}");
            let any = r.resource.clone().expect("a resource");
            assert_eq!(any.type_url, response.type_url);
            (r.name.clone(), any)
        })
        .collect()
}

fn delta_names(response: &DeltaDiscoveryResponse) -> Vec<String> {
    delta_resources(response).into_keys().collect()
}

#[tokio::test]
async fn delta_cds_is_a_wildcard_and_an_ack_gets_no_reply() {
    let (_registry, server) = registry_server(&["a", "b"]).await;
    let mut cds = Client::open_delta(&server, Rpc::Cds).await;
    // Envoy's first CDS request subscribes to nothing: a wildcard.
    cds.send(delta_request(CDS, "", &[])).await;
    let first = cds.recv().await;
    assert_eq!(delta_names(&first), ["a", "b"]);
    assert!(first.removed_resources.is_empty());
    assert!(!first.nonce.is_empty());
    version_parts(&first.system_version_info);
    let cluster = Cluster::decode(delta_resources(&first)["a"].value.as_slice()).unwrap();
    let source = cluster
        .eds_cluster_config
        .and_then(|c| c.eds_config)
        .and_then(|c| c.config_source_specifier);
    assert!(
        matches!(
            &source,
            Some(ConfigSourceSpecifier::ApiConfigSource(api))
                if api.api_type == ApiType::DeltaGrpc as i32
        ),
        "clusters sent on delta CDS fetch endpoints over delta: {source:?}"
    );
    cds.send(delta_ack(&first)).await;
    cds.expect_silence("after an ACK").await;
}

#[tokio::test]
async fn delta_eds_pushes_only_the_changed_resource() {
    let (registry, server) = registry_server(&["a", "b"]).await;
    let mut eds = Client::open_delta(&server, Rpc::Eds).await;
    eds.send(delta_request(EDS, "", &["a", "b"])).await;
    let first = eds.recv().await;
    assert_eq!(delta_names(&first), ["a", "b"]);
    eds.send(delta_ack(&first)).await;
    eds.expect_silence("after an ACK").await;

    registry
        .register(worker("b", 0, 20, &[Protocol::Http1]))
        .unwrap();
    let second = eds.recv().await;
    assert_eq!(delta_names(&second), ["b"], "only the changed resource");
    let b = ClusterLoadAssignment::decode(delta_resources(&second)["b"].value.as_slice()).unwrap();
    assert_eq!(hostnames(&b), ["b-0-20"]);
    assert_ne!(second.nonce, first.nonce);
    assert_ne!(second.resources[0].version, first.resources[1].version);
    eds.send(delta_ack(&second)).await;
    eds.expect_silence("after an ACK").await;
}

#[tokio::test]
async fn delta_names_removed_clusters_and_sends_names_that_appear() {
    let snapshot = |revision, services: &[&str]| Snapshot {
        revision,
        services: services
            .iter()
            .map(|s| (s.to_string(), ServiceView::default()))
            .collect(),
        ..Snapshot::default()
    };
    let (tx, rx) = watch::channel(Arc::new(snapshot(1, &["a", "b"])));
    let server = Server::start(rx).await;
    let mut cds = Client::open_delta(&server, Rpc::Cds).await;
    cds.send(delta_request(CDS, "", &["*"])).await;
    let first = cds.recv().await;
    assert_eq!(delta_names(&first), ["a", "b"]);
    cds.send(delta_ack(&first)).await;
    let mut eds = Client::open_delta(&server, Rpc::Eds).await;
    eds.send(delta_request(EDS, "", &["later"])).await;
    eds.expect_silence("the name does not exist yet").await;

    tx.send_replace(Arc::new(snapshot(2, &["a", "later"])));
    let second = cds.recv().await;
    assert_eq!(delta_names(&second), ["later"]);
    assert_eq!(second.removed_resources, ["b"]);
    let appeared = eds.recv().await;
    assert_eq!(delta_names(&appeared), ["later"]);
}

// === both variants ===

/// One variant of the protocol as the shared scenarios drive a client of it.
trait Variant {
    type Request;
    type Response: std::fmt::Debug;

    /// Whether every CDS response carries every cluster (EDS responses carry what changed on both).
    const STATE_OF_THE_WORLD: bool;

    async fn open(server: &Server, rpc: Rpc) -> Client<Self::Request, Self::Response>;
    /// A first request for `type_url` naming `names`.
    fn subscribe(type_url: &str, names: &[&str]) -> Self::Request;
    /// The request that ACKs `response`, still subscribed to `names` (state of the world repeats
    /// them; delta requests carry only changes).
    fn ack(response: &Self::Response, names: &[&str]) -> Self::Request;
    /// The request that NACKs `response`.
    fn nack(response: &Self::Response) -> Self::Request;
    fn type_url(response: &Self::Response) -> &str;
    fn version(response: &Self::Response) -> &str;
    fn nonce(response: &Self::Response) -> &str;
    /// The resources a response carries, by name.
    fn resources(response: &Self::Response) -> BTreeMap<String, Any>;
}

/// State of the world.
struct Sotw;

/// Delta.
struct Delta;

impl Variant for Sotw {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;

    const STATE_OF_THE_WORLD: bool = true;

    async fn open(server: &Server, rpc: Rpc) -> Client {
        Client::open(server, rpc).await
    }

    fn subscribe(type_url: &str, names: &[&str]) -> DiscoveryRequest {
        request(type_url, "", "", names)
    }

    fn ack(response: &DiscoveryResponse, names: &[&str]) -> DiscoveryRequest {
        ack(response, names)
    }

    fn nack(response: &DiscoveryResponse) -> DiscoveryRequest {
        nack(response, "")
    }

    fn type_url(response: &DiscoveryResponse) -> &str {
        &response.type_url
    }

    fn version(response: &DiscoveryResponse) -> &str {
        &response.version_info
    }

    fn nonce(response: &DiscoveryResponse) -> &str {
        &response.nonce
    }

    fn resources(response: &DiscoveryResponse) -> BTreeMap<String, Any> {
        let name = |any: &Any| match response.type_url.as_str() {
            CDS => Cluster::decode(any.value.as_slice()).unwrap().name,
            _ => {
                ClusterLoadAssignment::decode(any.value.as_slice())
                    .unwrap()
                    .cluster_name
            }
        };
        match response.type_url.as_str() {
            CDS => assert_eq!(clusters(response).len(), response.resources.len()),
            _ => assert_eq!(assignments(response).len(), response.resources.len()),
        }
        response
            .resources
            .iter()
            .map(|any| (name(any), any.clone()))
            .collect()
    }
}

impl Variant for Delta {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;

    const STATE_OF_THE_WORLD: bool = false;

    async fn open(server: &Server, rpc: Rpc) -> DeltaClient {
        Client::open_delta(server, rpc).await
    }

    fn subscribe(type_url: &str, names: &[&str]) -> DeltaDiscoveryRequest {
        delta_request(type_url, "", names)
    }

    fn ack(response: &DeltaDiscoveryResponse, _: &[&str]) -> DeltaDiscoveryRequest {
        delta_ack(response)
    }

    fn nack(response: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            error_detail: Some(RpcStatus {
                code: 3,
                message: "test rejection".into(),
                details: Vec::new(),
            }),
            ..delta_ack(response)
        }
    }

    fn type_url(response: &DeltaDiscoveryResponse) -> &str {
        &response.type_url
    }

    fn version(response: &DeltaDiscoveryResponse) -> &str {
        &response.system_version_info
    }

    fn nonce(response: &DeltaDiscoveryResponse) -> &str {
        &response.nonce
    }

    fn resources(response: &DeltaDiscoveryResponse) -> BTreeMap<String, Any> {
        delta_resources(response)
    }
}

fn names<V: Variant>(response: &V::Response) -> Vec<String> {
    V::resources(response).into_keys().collect()
}

/// What a CDS response carries on variant `V` when `all` exist and `changed` changed.
fn sent<V: Variant>(all: &[&str], changed: &[&str]) -> Vec<String> {
    let names = if V::STATE_OF_THE_WORLD { all } else { changed };
    names.iter().map(|n| n.to_string()).collect()
}

async fn a_nack_is_not_answered_until_content_changes<V: Variant>() {
    let (registry, server) = registry_server(&["a", "b"]).await;
    let mut cds = V::open(&server, Rpc::Cds).await;
    cds.send(V::subscribe(CDS, &[])).await;
    let first = cds.recv().await;
    cds.send(V::nack(&first)).await;
    cds.expect_silence("the same content must not be resent after a NACK")
        .await;

    registry
        .register(worker("b", 0, 20, &[Protocol::Http2]))
        .unwrap();
    let second = cds.recv().await;
    assert_eq!(
        names::<V>(&second),
        sent::<V>(&["a", "b"], &["b"]),
        "delta sends only what changed since"
    );
    assert_ne!(V::version(&second), V::version(&first));
    assert_ne!(V::nonce(&second), V::nonce(&first));
}

async fn ads_sends_clusters_before_their_endpoints<V: Variant>() {
    let (registry, server) = registry_server(&["a"]).await;
    let mut ads = V::open(&server, Rpc::Ads).await;
    // Endpoints are asked for before the clusters are answered; they must still come after the
    // clusters. (A stream that never asks for clusters gets its endpoints at once: an Envoy with a
    // static EDS cluster on ADS, the transport's scenarios.)
    ads.send(V::subscribe(CDS, &[])).await;
    ads.send(V::subscribe(EDS, &["a"])).await;
    let first = ads.recv().await;
    let second = ads.recv().await;
    assert_eq!(
        [V::type_url(&first), V::type_url(&second)],
        [CDS, EDS],
        "clusters before endpoints on ADS"
    );
    let cluster = Cluster::decode(V::resources(&first)["a"].value.as_slice()).unwrap();
    let source = cluster
        .eds_cluster_config
        .and_then(|c| c.eds_config)
        .and_then(|c| c.config_source_specifier);
    assert!(
        matches!(source, Some(ConfigSourceSpecifier::Ads(_))),
        "clusters sent over ADS fetch endpoints over ADS: {source:?}"
    );
    ads.send(V::ack(&first, &[])).await;
    ads.send(V::ack(&second, &["a"])).await;
    ads.expect_silence("after both ACKs").await;

    // A change to both the cluster (HTTP/2) and its endpoints: CDS first, then EDS.
    registry
        .register(worker("a", 0, 10, &[Protocol::Http2]))
        .unwrap();
    let first = ads.recv().await;
    let second = ads.recv().await;
    assert_eq!([V::type_url(&first), V::type_url(&second)], [CDS, EDS]);
    let endpoints = V::resources(&second);
    assert_eq!(endpoints.keys().collect::<Vec<_>>(), ["a"]);
    let a = ClusterLoadAssignment::decode(endpoints["a"].value.as_slice()).unwrap();
    assert_eq!(hostnames(&a), ["a-0-10"]);
    ads.send(V::ack(&first, &[])).await;
    ads.send(V::ack(&second, &["a"])).await;
    ads.expect_silence("after both ACKs").await;

    // Only the cluster changes (back to HTTP/1.1): Envoy finishes warming it only with a new EDS
    // response, so the unchanged endpoints follow it, at the same EDS version.
    registry
        .register(worker("a", 0, 10, &[Protocol::Http1]))
        .unwrap();
    let third = ads.recv().await;
    let fourth = ads.recv().await;
    assert_eq!([V::type_url(&third), V::type_url(&fourth)], [CDS, EDS]);
    assert_ne!(V::version(&third), V::version(&first));
    assert_eq!(V::version(&fourth), V::version(&second));
    assert_ne!(V::nonce(&fourth), V::nonce(&second));
    assert_eq!(names::<V>(&fourth), ["a"]);
}

/// The table: every scenario in it is a test on each variant, `<scenario>::sotw` and
/// `<scenario>::delta`.
macro_rules! scenarios {
    ($($scenario:ident;)*) => {
        $(
            mod $scenario {
                #[tokio::test]
                async fn sotw() {
                    super::$scenario::<super::Sotw>().await;
                }

                #[tokio::test]
                async fn delta() {
                    super::$scenario::<super::Delta>().await;
                }
            }
        )*
    };
}

scenarios! {
    a_nack_is_not_answered_until_content_changes;
    ads_sends_clusters_before_their_endpoints;
}
