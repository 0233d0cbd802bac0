//! The gRPC port's servers: CDS, EDS and ADS (from [`xds`]) and ORCA (from [`orca`]) on the port's
//! listeners, ORCA alone on the addresses Envoy dials for workers the port does not cover, every
//! connection through the port's [`Admission`] and every request counted as a stream of its
//! connection ([`TrackStreamsLayer`]).
//!
//! This is wiring: the discovery services know no listener and no other gRPC service, and the ORCA
//! service none of xDS's; both are put on one tonic server here.

use std::{future::Future, sync::Arc, time::Duration};

use tokio::{net::TcpListener, sync::watch};
use tonic::transport::Server;
use tower::layer::util::{Identity, Stack};

use crate::{
    grpc_port::{self, Admission, TrackStreamsLayer},
    orca::OrcaService,
    registry::Snapshot,
    xds::{
        self, XdsOptions,
        acks::Acks,
        counters::XdsCounters,
        transport::{AggregatedServer, ClusterServer, EndpointServer, XdsService},
    },
};

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
    pub counters: Arc<XdsCounters>,
    /// ORCA, when load reports are served.
    pub orca: Option<OrcaService>,
}

/// Why the gRPC port stopped serving.
#[derive(Debug, thiserror::Error)]
#[error("the gRPC server (xDS, ORCA) failed")]
pub struct ServeError(#[source] tonic::transport::Error);

/// Serves CDS, EDS and ADS, and ORCA when it is given, on `ports` (HTTP/2) until `shutdown`
/// completes.
///
/// The xDS cache runs as long as the servers do. On shutdown the cache stops, which ends every open
/// xDS stream, and the servers then finish gracefully. The returned future must be polled for the
/// server to make progress.
pub async fn serve(
    ports: Ports,
    inputs: Inputs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
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
    let resources = xds::spawn_cache_following(snapshots, options, async {
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
    let xds = XdsService::new(resources, acks, counters);
    let mut router = server()
        .add_service(ClusterServer(xds.clone()))
        .add_service(EndpointServer(xds.clone()))
        .add_service(AggregatedServer(xds));
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
        .map_err(ServeError);
    if let Some(server) = orca_server {
        match server.await {
            Ok(result) => result.map_err(ServeError)?,
            Err(join) => tracing::error!(error = %join, "ORCA server task failed"),
        }
    }
    served
}
