//! The xDS control plane: serves the registry to Envoy as CDS, EDS and ADS, state of the world or
//! delta (incremental).
//!
//! Three layers, in go-control-plane's shape: [`resources`] builds Envoy protos from a registry
//! snapshot (pure functions), [`cache`] versions them per resource and per type and publishes them on
//! a watch channel, and [`transport`] runs the gRPC streams (nonces, ACK/NACK, subscriptions) and
//! publishes how far each Envoy has ACKed its endpoints to [`acks`], which draining waits on.
//! The transport never builds resources and the cache never touches gRPC. [`stream_kind`] names the
//! RPCs, for the transport and for [`acks`] alike.
//!
//! [`router`] builds the tonic router (other gRPC services, such as ORCA, can be added to it) and
//! [`serve`] runs it on a listener until shutdown.

pub mod acks;
pub mod cache;
pub mod convergence;
pub mod counters;
pub mod priorities;
pub mod resources;
pub mod stream_kind;
pub mod transport;
pub mod upstream_tls;

use std::{collections::BTreeMap, future::Future, sync::Arc, time::Duration};

use tokio::{net::TcpListener, sync::watch};
use tonic::transport::{Server, server::Router};
use tower::layer::util::{Identity, Stack};

use self::{
    acks::Acks,
    cache::{Cache, Resources},
    resources::{Balancer, ClusterOptions, EdsSource},
    transport::{AggregatedServer, ClusterServer, EndpointServer, XdsService},
};
use crate::{
    grpc_port::{self, Admission, TrackStreamsLayer},
    orca::OrcaService,
    registry::Snapshot,
};

/// The gRPC server the port runs: every request counted as a stream of its connection.
pub type GrpcRouter = Router<Stack<TrackStreamsLayer, Identity>>;

/// How often the server pings a connection's peer, and how long it waits for the answer before it
/// drops the connection: a peer that vanished without a FIN gives its descriptor back.
const KEEPALIVE: (Duration, Duration) = (Duration::from_secs(30), Duration::from_secs(10));

/// The gRPC server's settings, for xDS and ORCA alike.
fn server() -> Server<Stack<TrackStreamsLayer, Identity>> {
    Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE.0))
        .http2_keepalive_timeout(Some(KEEPALIVE.1))
        .layer(TrackStreamsLayer)
}

/// Options of the control plane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XdsOptions {
    /// The name of the static cluster in Envoy's bootstrap that points at this server; clusters sent
    /// on CDS streams fetch their endpoints from it. `"xds_cluster"` by default.
    pub xds_cluster_name: String,
    /// The connect timeout of every cluster; 1 s by default.
    pub connect_timeout: Duration,
    /// Each service's load balancer, by name (round robin if absent).
    pub balancers: BTreeMap<String, Balancer>,
    /// Each service's worker weights by slot index (1 if absent).
    pub weights: BTreeMap<String, Vec<u32>>,
    /// This host in a fleet; `None` on a single host.
    pub fleet: Option<resources::FleetIdentity>,
    /// How Envoy dials the gRPC port over TLS; `None`: cleartext.
    pub envoy_tls: Option<upstream_tls::EnvoyTls>,
}

impl Default for XdsOptions {
    fn default() -> Self {
        XdsOptions {
            xds_cluster_name: "xds_cluster".into(),
            connect_timeout: Duration::from_secs(1),
            balancers: BTreeMap::new(),
            weights: BTreeMap::new(),
            fleet: None,
            envoy_tls: None,
        }
    }
}

impl XdsOptions {
    /// These options, plus the balancer and weights `previous` had for services these do not name
    /// (every service has a balancer): a service being removed keeps its cluster as it was while its
    /// workers drain.
    pub fn keeping_departed(&self, previous: &XdsOptions) -> XdsOptions {
        let mut options = self.clone();
        let departed = |name: &String| !self.balancers.contains_key(name);
        for (name, balancer) in previous.balancers.iter().filter(|(n, _)| departed(n)) {
            options.balancers.insert(name.clone(), *balancer);
        }
        for (name, weights) in previous.weights.iter().filter(|(n, _)| departed(n)) {
            options.weights.insert(name.clone(), weights.clone());
        }
        options
    }

    /// The options of clusters served on dedicated CDS streams.
    pub fn cluster_options(&self) -> ClusterOptions {
        ClusterOptions {
            connect_timeout: self.connect_timeout,
            eds_source: EdsSource::Grpc {
                xds_cluster: self.xds_cluster_name.clone(),
                delta: false,
            },
            balancers: self.balancers.clone(),
            weights: self.weights.clone(),
            fleet: self.fleet.clone(),
            envoy_tls: self.envoy_tls.clone(),
        }
    }
}

/// Why the control plane stopped.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    /// The gRPC server failed.
    #[error("xds server failed")]
    Serve(#[source] tonic::transport::Error),
}

/// Starts a cache following `snapshots` until `stop` completes, returning its resources.
///
/// Must be called within a Tokio runtime. When `stop` completes, every xDS stream reading the cache
/// ends with `UNAVAILABLE`.
pub fn spawn_cache(
    snapshots: watch::Receiver<Arc<Snapshot>>,
    options: &XdsOptions,
    stop: impl Future<Output = ()> + Send + 'static,
) -> watch::Receiver<Arc<Resources>> {
    Cache::new(cache::new_epoch(), options.cluster_options()).spawn(snapshots, stop)
}

/// Like [`spawn_cache`], with options that may change (a reloaded config): each change rebuilds every
/// resource.
pub fn spawn_cache_following(
    snapshots: watch::Receiver<Arc<Snapshot>>,
    mut options: watch::Receiver<XdsOptions>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> watch::Receiver<Arc<Resources>> {
    let first = options.borrow_and_update().cluster_options();
    let (cluster_tx, cluster_rx) = watch::channel(first.clone());
    tokio::spawn(async move {
        while options.changed().await.is_ok() {
            let next = options.borrow_and_update().cluster_options();
            if cluster_tx.send(next).is_err() {
                break;
            }
        }
    });
    Cache::new(cache::new_epoch(), first).spawn_with_options(snapshots, Some(cluster_rx), stop)
}

/// A router serving CDS, EDS and ADS from `resources` (see [`spawn_cache`]), recording each stream's
/// ACKs in `acks` and its pushes and NACKs in `counters`; add more services to it before serving.
pub fn router(
    resources: watch::Receiver<Arc<Resources>>,
    acks: Arc<Acks>,
    counters: Arc<counters::XdsCounters>,
) -> GrpcRouter {
    let service = XdsService::new(resources, acks, counters);
    server()
        .add_service(ClusterServer(service.clone()))
        .add_service(EndpointServer(service.clone()))
        .add_service(AggregatedServer(service))
}

/// Where [`serve`] listens.
#[derive(Debug)]
pub struct Ports {
    /// The gRPC port's listeners: xDS, and ORCA when it is served.
    pub listeners: Vec<TcpListener>,
    /// ORCA alone: the addresses Envoy dials for workers' ORCA streams that the main address does not
    /// cover. They serve no xDS.
    pub orca_listeners: Vec<TcpListener>,
    /// Every connection, on either set of listeners, goes through it (see [`grpc_port`]).
    pub admission: Arc<Admission>,
}

impl Ports {
    /// One listener, no ORCA-only ones, and admission with the default limits and `cap` connections:
    /// the gRPC port as tests and tools that embed the server want it.
    pub fn single(listener: TcpListener, cap: usize) -> Ports {
        Ports {
            listeners: vec![listener],
            orca_listeners: Vec::new(),
            admission: Admission::new(Default::default(), cap),
        }
    }
}

/// What [`serve`] serves from.
#[derive(Debug)]
pub struct Inputs {
    /// The registry's endpoint snapshots.
    pub snapshots: watch::Receiver<Arc<Snapshot>>,
    /// The cluster options, changed by a reload.
    pub options: watch::Receiver<XdsOptions>,
    /// Where every xDS stream records how far its Envoy has ACKed while it is open.
    pub acks: Arc<Acks>,
    /// Where every xDS stream adds its pushes and NACKs.
    pub counters: Arc<counters::XdsCounters>,
    /// ORCA, when load reports are served.
    pub orca: Option<OrcaService>,
}

/// Serves CDS, EDS and ADS, and ORCA when it is given, on `ports` (HTTP/2) until `shutdown`
/// completes.
///
/// On shutdown the cache stops, which ends every open xDS stream, and the servers then finish
/// gracefully. The returned future must be polled for the server to make progress.
pub async fn serve(
    ports: Ports,
    inputs: Inputs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), XdsError> {
    let Ports {
        listeners,
        orca_listeners,
        admission,
    } = ports;
    let Inputs {
        snapshots,
        options,
        acks,
        counters,
        orca,
    } = inputs;
    let (cache_stop_tx, cache_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let resources = spawn_cache_following(snapshots, options, async {
        let _ = cache_stop_rx.await;
    });
    let (stopping, _) = watch::channel(false);
    let orca_server = match (&orca, orca_listeners.is_empty()) {
        (Some(orca), false) => {
            for listener in &orca_listeners {
                if let Ok(addr) = listener.local_addr() {
                    tracing::info!(%addr, "Serving ORCA only");
                }
            }
            let incoming = grpc_port::incoming(orca_listeners, admission.clone());
            let mut stop = stopping.subscribe();
            Some(tokio::spawn(
                server()
                    .add_service(orca.clone().into_server())
                    .serve_with_incoming_shutdown(incoming, async move {
                        let _ = stop.wait_for(|stop| *stop).await;
                    }),
            ))
        }
        _ => None,
    };
    for listener in &listeners {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, orca = orca.is_some(), "Serving xDS");
        }
    }
    let incoming = grpc_port::incoming(listeners, admission);
    let mut router = router(resources, acks, counters);
    if let Some(orca) = orca {
        router = router.add_service(orca.into_server());
    }
    let served = router
        .serve_with_incoming_shutdown(incoming, async move {
            shutdown.await;
            let _ = cache_stop_tx.send(());
            stopping.send_replace(true);
        })
        .await
        .map_err(XdsError::Serve);
    if let Some(server) = orca_server {
        match server.await {
            Ok(result) => result.map_err(XdsError::Serve)?,
            Err(join) => tracing::error!(error = %join, "ORCA server task failed"),
        }
    }
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_departed_service_keeps_its_cluster_options_and_the_others_take_the_new_ones() {
        let previous = XdsOptions {
            balancers: BTreeMap::from([
                ("kept".to_string(), Balancer::Random),
                ("gone".to_string(), Balancer::Random),
            ]),
            weights: BTreeMap::from([
                ("kept".to_string(), vec![1, 3]),
                ("gone".to_string(), vec![2, 5]),
            ]),
            ..XdsOptions::default()
        };
        // `kept` now has round robin and default weights (so no weights entry); `gone` is removed.
        let new = XdsOptions {
            balancers: BTreeMap::from([("kept".to_string(), Balancer::RoundRobin)]),
            ..XdsOptions::default()
        };
        let meanwhile = new.keeping_departed(&previous);
        assert_eq!(meanwhile.balancers["kept"], Balancer::RoundRobin);
        assert_eq!(meanwhile.balancers["gone"], Balancer::Random);
        assert!(
            !meanwhile.weights.contains_key("kept"),
            "its new weights are the default"
        );
        assert_eq!(meanwhile.weights["gone"], [2, 5]);
    }
}
