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
//! The three discovery services are [`transport::ClusterServer`], [`transport::EndpointServer`] and
//! [`transport::AggregatedServer`] over one [`transport::XdsService`]; the gRPC port that serves them
//! (with ORCA beside them) is wired in `run::grpc`. This module knows no listener and no other
//! service.

pub mod acks;
pub mod cache;
pub mod convergence;
pub mod counters;
pub mod own_reports;
pub mod priorities;
pub mod resources;
pub mod stream_kind;
pub mod transport;
pub mod upstream_tls;

use std::{collections::BTreeMap, future::Future, sync::Arc, time::Duration};

use tokio::sync::watch;

use self::{
    cache::{Cache, Resources},
    resources::{Balancer, ClusterOptions, EdsSource},
};
use crate::registry::Snapshot;

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
