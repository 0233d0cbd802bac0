//! Pure builders from a registry [`ServiceView`] to Envoy resources.
//!
//! Nothing here does IO, keeps state or knows about streams: the same service view always gives the
//! same protos, so the builders are golden-tested and the cache can hash their encodings.
//!
//! Longer than most modules on purpose: the builders are under 500 lines, and the rest is their golden
//! tests, which stay beside the pure functions they pin down.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    time::Duration,
};

use envoy_types::pb::envoy::config::core::v3::{Address as PbAddress, Locality as PbLocality};
use envoy_types::pb::{
    envoy::{
        config::{
            cluster::v3::{
                CircuitBreakers, Cluster, LoadBalancingPolicy, OutlierDetection,
                circuit_breakers::{Thresholds, thresholds::RetryBudget},
                cluster::{
                    ClusterDiscoveryType, DiscoveryType, EdsClusterConfig, LbPolicy,
                    TransportSocketMatch,
                },
                load_balancing_policy::Policy,
            },
            core::v3::{
                AggregatedConfigSource, ApiConfigSource, ApiVersion, BackoffStrategy, ConfigSource,
                GrpcService, HealthStatus, Http1ProtocolOptions, Http2ProtocolOptions, Metadata,
                Pipe, RetryPolicy, SocketAddress, TransportSocket, TypedExtensionConfig, address,
                api_config_source::ApiType,
                config_source::ConfigSourceSpecifier,
                grpc_service::{EnvoyGrpc, TargetSpecifier},
                socket_address::PortSpecifier,
                transport_socket,
            },
            endpoint::v3::{
                ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
                endpoint::AdditionalAddress, lb_endpoint::HostIdentifier,
            },
        },
        extensions::load_balancing_policies::{
            client_side_weighted_round_robin::v3::ClientSideWeightedRoundRobin,
            common::v3::{ConsistentHashingLbConfig, OrcaOobReportingConfig},
            least_request::v3::LeastRequest,
            maglev::v3::Maglev,
            ring_hash::v3::RingHash,
        },
        extensions::upstreams::http::v3::{
            HttpProtocolOptions,
            http_protocol_options::{
                ExplicitHttpConfig, UpstreamProtocolOptions, explicit_http_config::ProtocolConfig,
            },
        },
    },
    google::protobuf::{
        Any, BoolValue, Duration as PbDuration, Struct, UInt32Value, UInt64Value, Value,
        value::Kind,
    },
};
use prost::Name;

use super::{
    own_reports,
    upstream_tls::{self, EnvoyTls},
};
pub use crate::balancer::{Balancer, OrcaPolicy};
use crate::{
    config::{Locality, Routing},
    registry::{Address, Health, Protocol, RemoteWorker, ServiceView, Snapshot, shared_hostname},
};

/// The type URL of CDS resources.
pub const CLUSTER_TYPE_URL: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
/// The type URL of EDS resources.
pub const ENDPOINT_TYPE_URL: &str =
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
/// The key of the upstream HTTP options in `Cluster.typed_extension_protocol_options`.
pub const HTTP_PROTOCOL_OPTIONS_KEY: &str =
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// Where a cluster tells Envoy to fetch its endpoints from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EdsSource {
    /// A dedicated EDS stream to the named static cluster (the one that serves CDS).
    Grpc {
        /// The name of the xDS cluster in Envoy's bootstrap.
        xds_cluster: String,
        /// Whether the stream is incremental (`DELTA_GRPC`) rather than state of the world (`GRPC`).
        delta: bool,
    },
    /// The ADS stream the cluster arrived on (`ads: {}`).
    Ads,
}

/// The name of Envoy's client-side weighted round robin policy.
pub const CSWRR_POLICY: &str = "envoy.load_balancing_policies.client_side_weighted_round_robin";

/// Options shared by every cluster built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterOptions {
    /// The upstream connect timeout; 1 s by default.
    pub connect_timeout: Duration,
    /// Where endpoints come from; a dedicated stream to `xds_cluster` by default.
    pub eds_source: EdsSource,
    /// Each service's load balancer, by name; round robin if absent.
    pub balancers: BTreeMap<String, Balancer>,
    /// Each service's worker weights, by slot index (1 if absent).
    pub weights: BTreeMap<String, Vec<u32>>,
    /// This host's name and locality in a fleet; `None` on a single host.
    pub fleet: Option<FleetIdentity>,
    /// How this supervisor's Envoys dial a TLS gRPC port (`[envoy.tls]`); `None`: cleartext. ORCA
    /// clusters whose policy says TLS get their ORCA streams over it.
    pub envoy_tls: Option<EnvoyTls>,
}

/// Who this supervisor is in a fleet: endpoints carry their host's locality, and hash keys their host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetIdentity {
    /// This host's name.
    pub host: String,
    /// Where its workers are.
    pub locality: Locality,
    /// Whether each Envoy is sent its near hosts first or the whole fleet in one priority.
    pub routing: Routing,
}

/// A worker slot's consistent-hashing key: `<service>-<index>` on a single host, and
/// `<host>-<service>-<index>` in a fleet, where slots of the same service run on every host.
pub fn slot_hash_key(host: Option<&str>, service: &str, index: u32) -> String {
    match host {
        Some(host) => format!("{host}-{service}-{index}"),
        None => format!("{service}-{index}"),
    }
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            connect_timeout: Duration::from_secs(1),
            eds_source: EdsSource::Grpc {
                xds_cluster: "xds_cluster".into(),
                delta: false,
            },
            balancers: BTreeMap::new(),
            weights: BTreeMap::new(),
            fleet: None,
            envoy_tls: None,
        }
    }
}

/// The cluster's typed `load_balancing_policy`, for the balancers that need one (round robin and random
/// are the cluster's `lb_policy`).
fn typed_policy(balancer: &Balancer, orca_over_tls: bool) -> Option<LoadBalancingPolicy> {
    let consistent = |factor: Option<u32>| {
        factor.map(|value| ConsistentHashingLbConfig {
            hash_balance_factor: Some(UInt32Value { value }),
            ..Default::default()
        })
    };
    let (name, config) = match *balancer {
        Balancer::RoundRobin | Balancer::Random => return None,
        Balancer::Orca(ref orca) => (CSWRR_POLICY, pack(&cswrr(orca, orca_over_tls))),
        Balancer::LeastRequest { choice_count } => (
            "envoy.load_balancing_policies.least_request",
            pack(&LeastRequest {
                choice_count: Some(UInt32Value {
                    value: choice_count,
                }),
                ..Default::default()
            }),
        ),
        Balancer::RingHash {
            min_ring_size,
            max_ring_size,
            hash_balance_factor,
        } => (
            "envoy.load_balancing_policies.ring_hash",
            pack(&RingHash {
                minimum_ring_size: Some(UInt64Value {
                    value: min_ring_size,
                }),
                maximum_ring_size: Some(UInt64Value {
                    value: max_ring_size,
                }),
                consistent_hashing_lb_config: consistent(hash_balance_factor),
                ..Default::default()
            }),
        ),
        Balancer::Maglev {
            table_size,
            hash_balance_factor,
        } => (
            "envoy.load_balancing_policies.maglev",
            pack(&Maglev {
                table_size: Some(UInt64Value { value: table_size }),
                consistent_hashing_lb_config: consistent(hash_balance_factor),
                ..Default::default()
            }),
        ),
    };
    Some(LoadBalancingPolicy {
        policies: vec![Policy {
            typed_extension_config: Some(TypedExtensionConfig {
                name: name.into(),
                typed_config: Some(config),
            }),
        }],
    })
}

/// CSWRR with out-of-band reports from this supervisor; `over_tls`: the ORCA streams take the
/// cluster's TLS entry ([`upstream_tls`](super::upstream_tls)).
fn cswrr(orca: &OrcaPolicy, over_tls: bool) -> ClientSideWeightedRoundRobin {
    ClientSideWeightedRoundRobin {
        // In band, Envoy reads each response's `endpoint-load-metrics-bin` header instead.
        enable_oob_load_report: Some(BoolValue {
            value: !orca.in_band,
        }),
        oob_reporting_period: Some(duration(orca.reporting_period)),
        blackout_period: Some(duration(orca.blackout_period)),
        weight_expiration_period: Some(duration(orca.weight_expiration_period)),
        weight_update_period: Some(duration(orca.weight_update_period)),
        oob_reporting_config: Some(OrcaOobReportingConfig {
            port_value: u32::from(orca.port),
            transport_socket_match_criteria: over_tls.then(upstream_tls::orca_match_criteria),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The `transport_socket_matches` entry ORCA streams use: TLS to the supervisor's port (see
/// [`upstream_tls`]).
fn orca_transport_socket_match(tls: &EnvoyTls) -> TransportSocketMatch {
    TransportSocketMatch {
        name: upstream_tls::ORCA_MATCH.into(),
        r#match: Some(upstream_tls::orca_match_criteria()),
        transport_socket: Some(TransportSocket {
            name: upstream_tls::TLS_TRANSPORT_SOCKET.into(),
            config_type: Some(transport_socket::ConfigType::TypedConfig(pack(
                &upstream_tls::upstream_tls_context(tls),
            ))),
        }),
    }
}

/// Retries as a share of the requests in flight (a quarter, and at least 64 at once) instead of
/// Envoy's default of 3 retries at once: when a worker stalls, every request in its hands times out
/// at about the same moment, and each must be retried on another worker, not fail with "retry
/// overflow".
fn retry_budget() -> CircuitBreakers {
    CircuitBreakers {
        thresholds: vec![Thresholds {
            retry_budget: Some(RetryBudget {
                budget_percent: Some(envoy_types::pb::envoy::r#type::v3::Percent { value: 25.0 }),
                min_retry_concurrency: Some(UInt32Value { value: 64 }),
                budget_interval: None,
            }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Outlier detection for load-balanced clusters: a worker that stops answering is ejected. Under
/// CSWRR a worker whose ORCA reports stop keeps a median weight, so reports are no health signal;
/// five consecutive errors (5xx or connection failures, which count as 5xx here), or three
/// consecutive gateway failures (502, 503, 504: Envoy's own timeouts of a try count as 504), eject a
/// worker for 5 s and longer each time, never more than half of a service's workers at once.
fn outlier_detection() -> OutlierDetection {
    OutlierDetection {
        consecutive_5xx: Some(UInt32Value { value: 5 }),
        consecutive_gateway_failure: Some(UInt32Value { value: 3 }),
        enforcing_consecutive_gateway_failure: Some(UInt32Value { value: 100 }),
        interval: Some(duration(Duration::from_secs(1))),
        base_ejection_time: Some(duration(Duration::from_secs(5))),
        max_ejection_percent: Some(UInt32Value { value: 50 }),
        ..Default::default()
    }
}

/// The EDS cluster for service `name`: its balancer from `options.balancers` (client-side weighted
/// round robin on ORCA reports, with outlier detection; least request; random; ring hash; Maglev;
/// round robin by default); endpoints over `options.eds_source`;
/// HTTP/2 upstream when every worker of the service, here (`view`) and on the other hosts (`remote`),
/// speaks it (and there is at least one), else HTTP/1.1.
pub fn make_cluster(
    name: &str,
    view: &ServiceView,
    remote: &[(&str, &Locality, &RemoteWorker)],
    options: &ClusterOptions,
) -> Cluster {
    let balancer = options
        .balancers
        .get(name)
        .copied()
        .unwrap_or(Balancer::RoundRobin);
    let mut protocols = view
        .workers
        .values()
        .map(|w| &w.listener.protocols)
        .chain(remote.iter().map(|(_, _, w)| &w.protocols))
        .peekable();
    let http2 = protocols.peek().is_some() && protocols.all(|p| p.contains(&Protocol::Http2));
    // ORCA streams over TLS when the workers' supervisors serve their port over it and this
    // supervisor's Envoys have the secrets to dial it.
    let orca_tls = match balancer {
        Balancer::Orca(orca) if orca.tls => options.envoy_tls.as_ref(),
        _ => None,
    };
    let protocol_config = if http2 {
        ProtocolConfig::Http2ProtocolOptions(Http2ProtocolOptions::default())
    } else {
        ProtocolConfig::HttpProtocolOptions(Http1ProtocolOptions::default())
    };
    let http_options = HttpProtocolOptions {
        upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
            ExplicitHttpConfig {
                protocol_config: Some(protocol_config),
            },
        )),
        // Out of band, the supervisor's reports are the only ones: a worker's own, in a response
        // header, is removed before Envoy's weighted round robin reads it.
        http_filters: match balancer {
            Balancer::Orca(orca) if !orca.in_band => own_reports::upstream_filters(),
            _ => Vec::new(),
        },
        ..Default::default()
    };
    Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig {
            eds_config: Some(config_source(&options.eds_source)),
            service_name: String::new(),
        }),
        connect_timeout: Some(duration(options.connect_timeout)),
        lb_policy: match balancer {
            Balancer::Random => LbPolicy::Random,
            _ => LbPolicy::RoundRobin,
        } as i32,
        load_balancing_policy: typed_policy(&balancer, orca_tls.is_some()),
        transport_socket_matches: orca_tls
            .map(orca_transport_socket_match)
            .into_iter()
            .collect(),
        outlier_detection: matches!(balancer, Balancer::Orca(_)).then(outlier_detection),
        circuit_breakers: Some(retry_budget()),
        // One entry only: prost encodes a map in its iteration order, and the cache versions
        // resources by their encoding, so a second entry would make versions flap.
        typed_extension_protocol_options: HashMap::from([(
            HTTP_PROTOCOL_OPTIONS_KEY.to_string(),
            pack(&http_options),
        )]),
        ..Default::default()
    }
}

/// The endpoints of cluster `name`: one endpoint per registered worker, by slot index, with the
/// worker's unique hostname, its first address as the address and the rest as additional addresses;
/// in a fleet, then every other host's workers of the service (`remote`), each host its own locality
/// (region, zone, and the host as sub-zone), all at priority 0.
pub fn make_load_assignment(
    name: &str,
    view: &ServiceView,
    remote: &[(&str, &Locality, &RemoteWorker)],
    options: &ClusterOptions,
) -> ClusterLoadAssignment {
    let weights = options.weights.get(name);
    let host = options.fleet.as_ref().map(|f| f.host.as_str());
    let local = merge_shared(
        view.workers
            .values()
            .map(|worker| EndpointSpec {
                addresses: &worker.listener.addresses,
                hostname: worker.hostname.clone(),
                // A draining worker keeps its endpoint but gets no new requests (and, unlike an
                // unhealthy one, causes no spill-over to other priorities). A stalled one is
                // unhealthy until it moves again: Envoy sends it nothing new meanwhile.
                health: worker.health(),
                weight: weights
                    .and_then(|w| w.get(worker.index as usize))
                    .copied()
                    .unwrap_or(1),
                hash: slot_hash_key(host, &worker.service, worker.index),
                shared_name: shared_hostname(host, &worker.service),
            })
            .collect(),
    );
    let mut localities = Vec::new();
    if !local.is_empty() {
        localities.push(LocalityLbEndpoints {
            locality: options
                .fleet
                .as_ref()
                .map(|f| envoy_locality(&f.host, &f.locality)),
            lb_endpoints: local,
            ..Default::default()
        });
    }
    let mut by_host: BTreeMap<&str, (&Locality, Vec<EndpointSpec<'_>>)> = BTreeMap::new();
    for &(host, locality, worker) in remote {
        by_host
            .entry(host)
            .or_insert((locality, Vec::new()))
            .1
            .push(EndpointSpec {
                addresses: &worker.addresses,
                hostname: worker.hostname.clone(),
                health: worker.health,
                weight: worker.weight,
                hash: worker.hash_key.clone(),
                shared_name: shared_hostname(Some(host), &worker.service),
            });
    }
    for (host, (locality, specs)) in by_host {
        localities.push(LocalityLbEndpoints {
            locality: Some(envoy_locality(host, locality)),
            lb_endpoints: merge_shared(specs),
            ..Default::default()
        });
    }
    ClusterLoadAssignment {
        cluster_name: name.to_string(),
        endpoints: localities,
        ..Default::default()
    }
}

/// One worker's endpoint, before the workers of a shared listener are merged.
struct EndpointSpec<'a> {
    addresses: &'a [Address],
    hostname: String,
    health: Health,
    weight: u32,
    hash: String,
    /// The hostname and hash key of the endpoint it is merged into, if it shares its listener.
    shared_name: String,
}

/// The endpoints of `specs`, in order, where workers that listen on the same addresses (a shared
/// listener: one accept queue) are one endpoint: serving while any of them serves (else draining
/// while any drains, else unhealthy), weighted by the weights of those serving, and named after the
/// service rather than a worker, so that its workers' restarts change nothing in Envoy but its
/// weight. Workers with listeners of their own stay an endpoint each.
fn merge_shared(specs: Vec<EndpointSpec<'_>>) -> Vec<LbEndpoint> {
    let mut merged: Vec<(EndpointSpec<'_>, usize)> = Vec::with_capacity(specs.len());
    for spec in specs {
        match merged
            .iter_mut()
            .find(|(first, _)| first.addresses == spec.addresses)
        {
            None => merged.push((spec, 1)),
            Some((first, members)) => {
                let serving = |s: &EndpointSpec<'_>| match s.health {
                    Health::Serving => s.weight,
                    _ => 0,
                };
                if *members == 1 {
                    first.weight = serving(first);
                    first.hostname = first.shared_name.clone();
                    first.hash = first.shared_name.clone();
                }
                first.weight += serving(&spec);
                first.health = best_health(first.health, spec.health);
                *members += 1;
            }
        }
    }
    merged
        .into_iter()
        .map(|(spec, _)| {
            lb_endpoint(
                spec.addresses,
                &spec.hostname,
                health_status(spec.health),
                spec.weight.max(1),
                &spec.hash,
            )
        })
        .collect()
}

/// The health of an endpoint two workers share: serving if either serves, else draining if either
/// drains.
fn best_health(a: Health, b: Health) -> Health {
    let rank = |h: Health| match h {
        Health::Serving => 2,
        Health::Draining => 1,
        Health::Unhealthy => 0,
    };
    if rank(b) > rank(a) { b } else { a }
}

/// The workers of `service` on the other hosts of `snapshot`'s fleet.
pub fn remote_of<'a>(
    snapshot: &'a Snapshot,
    service: &'a str,
) -> Vec<(&'a str, &'a Locality, &'a RemoteWorker)> {
    snapshot
        .remote_workers(service)
        .map(|(host, remote, worker)| (host, &remote.locality, worker))
        .collect()
}

/// EDS's health of a worker, local or remote.
fn health_status(health: Health) -> HealthStatus {
    match health {
        Health::Serving => HealthStatus::Healthy,
        Health::Draining => HealthStatus::Draining,
        Health::Unhealthy => HealthStatus::Unhealthy,
    }
}

/// Envoy's locality of a host's workers: its region and zone, and the host as sub-zone.
fn envoy_locality(host: &str, locality: &Locality) -> PbLocality {
    PbLocality {
        region: locality.region.clone(),
        zone: locality.zone.clone(),
        sub_zone: host.to_owned(),
    }
}

/// One endpoint.
fn lb_endpoint(
    addresses: &[Address],
    hostname: &str,
    health: HealthStatus,
    weight: u32,
    hash: &str,
) -> LbEndpoint {
    let mut addresses = addresses.iter().map(address);
    LbEndpoint {
        health_status: health as i32,
        // Weight 1 is Envoy's default: left out, so unweighted services keep their bytes.
        load_balancing_weight: (weight != 1).then_some(UInt32Value { value: weight }),
        metadata: Some(hash_key(hash)),
        host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
            address: addresses.next(),
            hostname: hostname.to_owned(),
            additional_addresses: addresses
                .map(|a| AdditionalAddress { address: Some(a) })
                .collect(),
            ..Default::default()
        })),
    }
}

/// The key of endpoint metadata that ring hash and Maglev hash an endpoint by, instead of its address.
pub const HASH_KEY_FILTER: &str = "envoy.lb";

/// `filter_metadata["envoy.lb"]["hash_key"] = key` (see [`slot_hash_key`]): a worker slot's identity,
/// the same across restarts (which change the address), so consistent hashing maps a key to the same
/// slot.
fn hash_key(key: &str) -> Metadata {
    let fields = HashMap::from([(
        "hash_key".to_string(),
        Value {
            kind: Some(Kind::StringValue(key.to_owned())),
        },
    )]);
    // One entry per map only: see the note on `typed_extension_protocol_options`.
    Metadata {
        filter_metadata: HashMap::from([(HASH_KEY_FILTER.to_string(), Struct { fields })]),
        ..Default::default()
    }
}

/// Packs `message` into an `Any`.
pub fn pack<M: Name>(message: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    }
}

fn config_source(source: &EdsSource) -> ConfigSource {
    let specifier = match source {
        EdsSource::Ads => ConfigSourceSpecifier::Ads(AggregatedConfigSource::default()),
        EdsSource::Grpc { xds_cluster, delta } => {
            ConfigSourceSpecifier::ApiConfigSource(ApiConfigSource {
                api_type: if *delta {
                    ApiType::DeltaGrpc
                } else {
                    ApiType::Grpc
                } as i32,
                transport_api_version: ApiVersion::V3 as i32,
                // The node on a stream's first request only: Envoy's is large (every extension
                // it has), and the supervisor reads it from the first.
                set_node_on_first_message_only: true,
                grpc_services: vec![GrpcService {
                    target_specifier: Some(TargetSpecifier::EnvoyGrpc(EnvoyGrpc {
                        cluster_name: xds_cluster.clone(),
                        // As in the bootstrap: reconnect to a restarted supervisor quickly.
                        retry_policy: Some(RetryPolicy {
                            retry_back_off: Some(BackoffStrategy {
                                base_interval: Some(duration(crate::bootstrap::XDS_RETRY_BASE)),
                                max_interval: Some(duration(crate::bootstrap::XDS_RETRY_MAX)),
                            }),
                            ..Default::default()
                        }),
                        ..Default::default()
                    })),
                    ..Default::default()
                }],
                ..Default::default()
            })
        }
    };
    ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(specifier),
        ..Default::default()
    }
}

fn address(address: &Address) -> PbAddress {
    let inner = match address {
        Address::Tcp(addr) => address::Address::SocketAddress(SocketAddress {
            address: addr.ip().to_string(),
            port_specifier: Some(PortSpecifier::PortValue(addr.port().into())),
            ..Default::default()
        }),
        Address::Unix(path) => address::Address::Pipe(Pipe {
            path: path_string(path),
            mode: 0,
        }),
    };
    PbAddress {
        address: Some(inner),
    }
}

fn path_string(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

fn duration(d: Duration) -> PbDuration {
    PbDuration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use prost::Message;

    use super::*;
    use crate::registry::Worker;
    use crate::registry::WorkerState;

    fn worker(index: u32, pid: u32, protocols: &[Protocol], addresses: Vec<Address>) -> Worker {
        Worker::ready("web", index, pid, protocols.to_vec(), addresses)
    }

    fn view(workers: Vec<Worker>) -> ServiceView {
        ServiceView {
            workers: workers
                .into_iter()
                .map(|w| (w.key(), w))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    fn tcp(port: u16) -> Address {
        Address::Tcp(([127, 0, 0, 1], port).into())
    }

    fn protocol_config(cluster: &Cluster) -> ProtocolConfig {
        let any = &cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY];
        assert_eq!(
            any.type_url,
            "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        );
        let options = HttpProtocolOptions::decode(any.value.as_slice()).unwrap();
        match options.upstream_protocol_options {
            Some(UpstreamProtocolOptions::ExplicitHttpConfig(c)) => c.protocol_config.unwrap(),
            other => panic!("unexpected upstream options {other:?}"),
        }
    }

    #[test]
    fn cluster_golden_dedicated_eds() {
        let cluster = make_cluster(
            "web",
            &view(vec![worker(0, 10, &[Protocol::Http1], vec![tcp(8000)])]),
            &[],
            &ClusterOptions::default(),
        );
        let expected = Cluster {
            name: "web".into(),
            cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
            eds_cluster_config: Some(EdsClusterConfig {
                eds_config: Some(ConfigSource {
                    resource_api_version: ApiVersion::V3 as i32,
                    config_source_specifier: Some(ConfigSourceSpecifier::ApiConfigSource(
                        ApiConfigSource {
                            api_type: ApiType::Grpc as i32,
                            transport_api_version: ApiVersion::V3 as i32,
                            set_node_on_first_message_only: true,
                            grpc_services: vec![GrpcService {
                                target_specifier: Some(TargetSpecifier::EnvoyGrpc(EnvoyGrpc {
                                    cluster_name: "xds_cluster".into(),
                                    retry_policy: Some(RetryPolicy {
                                        retry_back_off: Some(BackoffStrategy {
                                            base_interval: Some(PbDuration {
                                                seconds: 0,
                                                nanos: 100_000_000,
                                            }),
                                            max_interval: Some(PbDuration {
                                                seconds: 2,
                                                nanos: 0,
                                            }),
                                        }),
                                        ..Default::default()
                                    }),
                                    ..Default::default()
                                })),
                                ..Default::default()
                            }],
                            ..Default::default()
                        },
                    )),
                    ..Default::default()
                }),
                service_name: String::new(),
            }),
            connect_timeout: Some(PbDuration {
                seconds: 1,
                nanos: 0,
            }),
            lb_policy: LbPolicy::RoundRobin as i32,
            circuit_breakers: Some(CircuitBreakers {
                thresholds: vec![Thresholds {
                    retry_budget: Some(RetryBudget {
                        budget_percent: Some(envoy_types::pb::envoy::r#type::v3::Percent {
                            value: 25.0,
                        }),
                        min_retry_concurrency: Some(UInt32Value { value: 64 }),
                        budget_interval: None,
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            typed_extension_protocol_options: HashMap::from([(
                HTTP_PROTOCOL_OPTIONS_KEY.to_string(),
                pack(&HttpProtocolOptions {
                    upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
                        ExplicitHttpConfig {
                            protocol_config: Some(ProtocolConfig::HttpProtocolOptions(
                                Http1ProtocolOptions::default(),
                            )),
                        },
                    )),
                    ..Default::default()
                }),
            )]),
            ..Default::default()
        };
        assert_eq!(cluster, expected);
    }

    /// A cleartext ORCA policy: port 18000, reports every 500 ms, a 2 s blackout.
    fn orca_policy() -> OrcaPolicy {
        OrcaPolicy {
            port: 18000,
            reporting_period: Duration::from_millis(500),
            blackout_period: Duration::from_secs(2),
            weight_expiration_period: Duration::from_secs(30),
            weight_update_period: Duration::from_millis(500),
            tls: false,
            in_band: false,
        }
    }

    #[test]
    fn orca_services_get_cswrr_with_oob_reports_and_outlier_detection() {
        let policy = orca_policy();
        let options = ClusterOptions {
            balancers: BTreeMap::from([("web".to_string(), Balancer::Orca(policy))]),
            ..ClusterOptions::default()
        };
        let cluster = make_cluster("web", &ServiceView::default(), &[], &options);
        let policies = cluster.load_balancing_policy.expect("a policy").policies;
        assert_eq!(policies.len(), 1);
        let typed = policies[0].typed_extension_config.as_ref().unwrap();
        assert_eq!(typed.name, CSWRR_POLICY);
        let any = typed.typed_config.as_ref().unwrap();
        assert_eq!(
            any.type_url,
            "type.googleapis.com/envoy.extensions.load_balancing_policies.client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin"
        );
        let config = ClientSideWeightedRoundRobin::decode(any.value.as_slice()).unwrap();
        assert_eq!(
            config.enable_oob_load_report,
            Some(BoolValue { value: true })
        );
        assert_eq!(
            config.oob_reporting_period,
            Some(duration(Duration::from_millis(500)))
        );
        assert_eq!(
            config.blackout_period,
            Some(duration(Duration::from_secs(2)))
        );
        assert_eq!(config.oob_reporting_config.unwrap().port_value, 18000);
        let outliers = cluster.outlier_detection.expect("outlier detection");
        assert_eq!(outliers.consecutive_5xx, Some(UInt32Value { value: 5 }));
        assert_eq!(
            outliers.max_ejection_percent,
            Some(UInt32Value { value: 50 })
        );

        let plain = make_cluster("api", &ServiceView::default(), &[], &options);
        assert_eq!(plain.load_balancing_policy, None, "round robin");
        assert_eq!(plain.outlier_detection, None);
        assert!(
            cluster.transport_socket_matches.is_empty(),
            "cleartext ORCA"
        );
    }

    #[test]
    fn in_band_orca_turns_the_oob_stream_off() {
        let policy = OrcaPolicy {
            in_band: true,
            ..orca_policy()
        };
        let options = ClusterOptions {
            balancers: BTreeMap::from([("web".to_string(), Balancer::Orca(policy))]),
            ..ClusterOptions::default()
        };
        let cluster = make_cluster("web", &ServiceView::default(), &[], &options);
        let policies = cluster
            .load_balancing_policy
            .clone()
            .expect("a policy")
            .policies;
        let any = policies[0].typed_extension_config.as_ref().unwrap();
        let config = ClientSideWeightedRoundRobin::decode(
            any.typed_config.as_ref().unwrap().value.as_slice(),
        )
        .unwrap();
        assert_eq!(
            config.enable_oob_load_report,
            Some(BoolValue { value: false })
        );
        assert!(
            upstream_http_filters(&cluster).is_empty(),
            "in band, the header is the report"
        );
    }

    /// The cluster's upstream HTTP filters.
    fn upstream_http_filters(
        cluster: &Cluster,
    ) -> Vec<envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpFilter>
    {
        let any = &cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY];
        HttpProtocolOptions::decode(any.value.as_slice())
            .unwrap()
            .http_filters
    }

    /// Out of band, a worker's own ORCA header is removed before Envoy reads it; clusters that read
    /// no report, or read it in band, keep every header and have no upstream filter.
    #[test]
    fn out_of_band_orca_clusters_remove_the_workers_own_load_reports() {
        let options = ClusterOptions {
            balancers: BTreeMap::from([
                ("oob".to_string(), Balancer::Orca(orca_policy())),
                (
                    "in-band".to_string(),
                    Balancer::Orca(OrcaPolicy {
                        in_band: true,
                        ..orca_policy()
                    }),
                ),
                ("lr".to_string(), Balancer::LeastRequest { choice_count: 2 }),
            ]),
            ..ClusterOptions::default()
        };
        let filters = |name: &str| {
            upstream_http_filters(&make_cluster(name, &ServiceView::default(), &[], &options))
        };
        assert_eq!(filters("oob"), own_reports::upstream_filters());
        for name in ["in-band", "lr", "rr"] {
            assert!(filters(name).is_empty(), "{name}");
        }
    }

    #[test]
    fn orca_over_tls_takes_a_transport_socket_match_that_no_worker_has() {
        let policy = OrcaPolicy {
            tls: true,
            ..orca_policy()
        };
        let envoy_tls = EnvoyTls {
            server_name: "sup.example".into(),
            client_certificate: true,
        };
        let options = ClusterOptions {
            balancers: BTreeMap::from([
                ("web".to_string(), Balancer::Orca(policy)),
                ("rr".to_string(), Balancer::RoundRobin),
            ]),
            envoy_tls: Some(envoy_tls.clone()),
            ..ClusterOptions::default()
        };
        let oob = |cluster: &Cluster| {
            let policies = &cluster.load_balancing_policy.as_ref().unwrap().policies;
            let any = policies[0]
                .typed_extension_config
                .as_ref()
                .unwrap()
                .typed_config
                .as_ref()
                .unwrap();
            ClientSideWeightedRoundRobin::decode(any.value.as_slice())
                .unwrap()
                .oob_reporting_config
                .unwrap()
        };
        let cluster = make_cluster("web", &ServiceView::default(), &[], &options);
        assert_eq!(cluster.transport_socket_matches.len(), 1);
        let entry = &cluster.transport_socket_matches[0];
        assert_eq!(entry.name, upstream_tls::ORCA_MATCH);
        assert_eq!(
            oob(&cluster).transport_socket_match_criteria,
            entry.r#match,
            "the OOB stream selects exactly this entry"
        );
        assert_eq!(cluster.transport_socket, None, "workers stay cleartext");
        let socket = entry.transport_socket.as_ref().unwrap();
        assert_eq!(socket.name, upstream_tls::TLS_TRANSPORT_SOCKET);
        let Some(
            envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
                any,
            ),
        ) = &socket.config_type
        else {
            panic!("a typed config");
        };
        assert_eq!(any, &pack(&upstream_tls::upstream_tls_context(&envoy_tls)));
        let context = upstream_tls::upstream_tls_context(&envoy_tls);
        assert_eq!(context.sni, "sup.example");
        let common = context.common_tls_context.unwrap();
        assert_eq!(common.alpn_protocols, ["h2"]);
        assert_eq!(
            common.tls_certificate_sds_secret_configs[0].name,
            upstream_tls::ENVOY_CERTIFICATE_SECRET
        );
        let rr = make_cluster("rr", &ServiceView::default(), &[], &options);
        assert!(rr.transport_socket_matches.is_empty());
        // Without the secrets (no [envoy.tls] here), no entry the Envoy could not resolve.
        let without = ClusterOptions {
            envoy_tls: None,
            ..options
        };
        let cluster = make_cluster("web", &ServiceView::default(), &[], &without);
        assert!(cluster.transport_socket_matches.is_empty());
        assert_eq!(oob(&cluster).transport_socket_match_criteria, None);
    }

    #[test]
    fn hashing_and_least_request_are_typed_policies_with_their_options() {
        let options = ClusterOptions {
            balancers: BTreeMap::from([
                (
                    "ring".to_string(),
                    Balancer::RingHash {
                        min_ring_size: 2048,
                        max_ring_size: 4096,
                        hash_balance_factor: Some(125),
                    },
                ),
                (
                    "mag".to_string(),
                    Balancer::Maglev {
                        table_size: 65537,
                        hash_balance_factor: None,
                    },
                ),
                ("lr".to_string(), Balancer::LeastRequest { choice_count: 3 }),
            ]),
            ..ClusterOptions::default()
        };
        let typed = |name: &str| {
            let cluster = make_cluster(name, &ServiceView::default(), &[], &options);
            assert_eq!(cluster.outlier_detection, None);
            let policy = cluster.load_balancing_policy.unwrap().policies.remove(0);
            let config = policy.typed_extension_config.unwrap();
            (config.name, config.typed_config.unwrap().value)
        };
        let (name, bytes) = typed("ring");
        assert_eq!(name, "envoy.load_balancing_policies.ring_hash");
        let ring = RingHash::decode(bytes.as_slice()).unwrap();
        assert_eq!(ring.minimum_ring_size, Some(UInt64Value { value: 2048 }));
        assert_eq!(ring.maximum_ring_size, Some(UInt64Value { value: 4096 }));
        assert_eq!(
            ring.consistent_hashing_lb_config
                .unwrap()
                .hash_balance_factor,
            Some(UInt32Value { value: 125 })
        );
        let (name, bytes) = typed("mag");
        assert_eq!(name, "envoy.load_balancing_policies.maglev");
        let maglev = Maglev::decode(bytes.as_slice()).unwrap();
        assert_eq!(maglev.table_size, Some(UInt64Value { value: 65537 }));
        assert_eq!(maglev.consistent_hashing_lb_config, None);
        let (name, bytes) = typed("lr");
        assert_eq!(name, "envoy.load_balancing_policies.least_request");
        assert_eq!(
            LeastRequest::decode(bytes.as_slice()).unwrap().choice_count,
            Some(UInt32Value { value: 3 })
        );
    }

    #[test]
    fn cluster_over_ads_with_custom_timeout() {
        let options = ClusterOptions {
            connect_timeout: Duration::from_millis(250),
            eds_source: EdsSource::Ads,
            balancers: BTreeMap::from([("web".to_string(), Balancer::Random)]),
            weights: BTreeMap::new(),
            fleet: None,
            envoy_tls: None,
        };
        let cluster = make_cluster("web", &ServiceView::default(), &[], &options);
        assert_eq!(cluster.lb_policy, LbPolicy::Random as i32);
        assert_eq!(cluster.load_balancing_policy, None);
        let source = cluster.eds_cluster_config.unwrap().eds_config.unwrap();
        assert_eq!(
            source.config_source_specifier,
            Some(ConfigSourceSpecifier::Ads(AggregatedConfigSource {}))
        );
        assert_eq!(source.resource_api_version, ApiVersion::V3 as i32);
        assert_eq!(
            cluster.connect_timeout,
            Some(PbDuration {
                seconds: 0,
                nanos: 250_000_000
            })
        );
    }

    #[test]
    fn http2_only_when_every_worker_speaks_it() {
        let options = ClusterOptions::default();
        let both = [Protocol::Http1, Protocol::Http2];
        let h2 = view(vec![
            worker(0, 10, &both, vec![tcp(8000)]),
            worker(1, 11, &[Protocol::Http2], vec![tcp(8001)]),
        ]);
        assert!(matches!(
            protocol_config(&make_cluster("web", &h2, &[], &options)),
            ProtocolConfig::Http2ProtocolOptions(_)
        ));
        let mixed = view(vec![
            worker(0, 10, &both, vec![tcp(8000)]),
            worker(1, 11, &[Protocol::Http1], vec![tcp(8001)]),
        ]);
        assert!(matches!(
            protocol_config(&make_cluster("web", &mixed, &[], &options)),
            ProtocolConfig::HttpProtocolOptions(_)
        ));
        assert!(matches!(
            protocol_config(&make_cluster("web", &ServiceView::default(), &[], &options)),
            ProtocolConfig::HttpProtocolOptions(_)
        ));
    }

    #[test]
    fn load_assignment_golden() {
        let sock = std::path::PathBuf::from("/run/peregrine/web-1.sock");
        let options = ClusterOptions {
            weights: BTreeMap::from([("web".to_string(), vec![1, 3])]),
            ..ClusterOptions::default()
        };
        let assignment = make_load_assignment(
            "web",
            &view(vec![
                worker(1, 11, &[Protocol::Http1], vec![Address::Unix(sock)]),
                worker(
                    0,
                    10,
                    &[Protocol::Http1],
                    vec![tcp(8000), Address::Tcp("[::1]:8000".parse().unwrap())],
                ),
            ]),
            &[],
            &options,
        );
        let socket = |ip: &str, port: u32| PbAddress {
            address: Some(address::Address::SocketAddress(SocketAddress {
                address: ip.into(),
                port_specifier: Some(PortSpecifier::PortValue(port)),
                ..Default::default()
            })),
        };
        let expected = ClusterLoadAssignment {
            cluster_name: "web".into(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![
                    LbEndpoint {
                        health_status: HealthStatus::Healthy as i32,
                        host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                            address: Some(socket("127.0.0.1", 8000)),
                            hostname: "web-0-10".into(),
                            additional_addresses: vec![AdditionalAddress {
                                address: Some(socket("::1", 8000)),
                            }],
                            ..Default::default()
                        })),
                        metadata: Some(hash_key("web-0")),
                        ..Default::default()
                    },
                    LbEndpoint {
                        health_status: HealthStatus::Healthy as i32,
                        host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                            address: Some(PbAddress {
                                address: Some(address::Address::Pipe(Pipe {
                                    path: "/run/peregrine/web-1.sock".into(),
                                    mode: 0,
                                })),
                            }),
                            hostname: "web-1-11".into(),
                            ..Default::default()
                        })),
                        load_balancing_weight: Some(UInt32Value { value: 3 }),
                        metadata: Some(hash_key("web-1")),
                    },
                ],
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(assignment, expected);
    }

    #[test]
    fn workers_of_a_shared_listener_are_one_endpoint_serving_while_any_serves() {
        let hosts = |workers: Vec<Worker>| -> Vec<(String, i32, u32, usize)> {
            make_load_assignment("web", &view(workers), &[], &ClusterOptions::default()).endpoints
                [0]
            .lb_endpoints
            .iter()
            .map(|e| match &e.host_identifier {
                Some(HostIdentifier::Endpoint(endpoint)) => (
                    endpoint.hostname.clone(),
                    e.health_status,
                    e.load_balancing_weight.map_or(1, |w| w.value),
                    1 + endpoint.additional_addresses.len(),
                ),
                _ => panic!("an endpoint"),
            })
            .collect()
        };
        let healthy = HealthStatus::Healthy as i32;
        let draining = HealthStatus::Draining as i32;
        // Three workers on one listener, a fourth on its own.
        let shared = vec![tcp(8000)];
        let workers = vec![
            worker(0, 10, &[], shared.clone()),
            worker(1, 11, &[], shared.clone()),
            worker(2, 12, &[], shared.clone()),
            worker(3, 13, &[], vec![tcp(8001)]),
        ];
        assert_eq!(
            hosts(workers.clone()),
            [
                ("web-shared".to_string(), healthy, 3, 1),
                ("web-3-13".to_string(), healthy, 1, 1),
            ]
        );
        // One draining (its replacement starting): the endpoint serves on, weighed by those left.
        let mut one_draining = workers.clone();
        one_draining[1].state = WorkerState::Draining;
        assert_eq!(
            hosts(one_draining)[0],
            ("web-shared".to_string(), healthy, 2, 1)
        );
        // All draining (the supervisor stopping): the endpoint drains.
        let mut all_draining = workers;
        for worker in &mut all_draining[..3] {
            worker.state = WorkerState::Draining;
        }
        assert_eq!(
            hosts(all_draining)[0],
            ("web-shared".to_string(), draining, 1, 1)
        );
    }

    #[test]
    fn a_draining_worker_is_published_draining_beside_its_successor() {
        let mut old = worker(0, 10, &[Protocol::Http2], vec![tcp(8000)]);
        old.state = WorkerState::Draining;
        let new = worker(0, 11, &[Protocol::Http2], vec![tcp(8001)]);
        let assignment = make_load_assignment(
            "web",
            &view(vec![new, old]),
            &[],
            &ClusterOptions::default(),
        );
        let health: Vec<(String, i32)> = assignment.endpoints[0]
            .lb_endpoints
            .iter()
            .map(|e| match &e.host_identifier {
                Some(HostIdentifier::Endpoint(endpoint)) => {
                    (endpoint.hostname.clone(), e.health_status)
                }
                _ => panic!("an endpoint"),
            })
            .collect();
        assert_eq!(
            health,
            [
                ("web-0-10".to_string(), HealthStatus::Draining as i32),
                ("web-0-11".to_string(), HealthStatus::Healthy as i32),
            ]
        );
    }

    #[test]
    fn empty_service_has_no_endpoints() {
        let assignment = make_load_assignment(
            "web",
            &ServiceView::default(),
            &[],
            &ClusterOptions::default(),
        );
        assert_eq!(assignment.cluster_name, "web");
        assert!(assignment.endpoints.is_empty());
    }

    #[test]
    fn in_a_fleet_every_host_is_a_locality_and_hash_keys_name_their_host() {
        let options = ClusterOptions {
            fleet: Some(FleetIdentity {
                host: "a".into(),
                locality: Locality {
                    region: "r1".into(),
                    zone: "z1".into(),
                },
                routing: Routing::Fleet,
            }),
            ..ClusterOptions::default()
        };
        let remote = RemoteWorker {
            service: "web".into(),
            index: 0,
            pid: 99,
            hostname: "web-0-99".into(),
            protocols: vec![Protocol::Http1],
            addresses: vec![Address::Tcp("10.0.0.2:8000".parse().unwrap())],
            health: Health::Draining,
            weight: 2,
            hash_key: "b-web-0".into(),
        };
        let far = Locality {
            region: "r2".into(),
            zone: "z9".into(),
        };
        let assignment = make_load_assignment(
            "web",
            &view(vec![worker(0, 10, &[Protocol::Http1], vec![tcp(8000)])]),
            &[("b", &far, &remote)],
            &options,
        );
        assert_eq!(assignment.endpoints.len(), 2, "one locality per host");
        let locality = |i: usize| assignment.endpoints[i].locality.clone().unwrap();
        assert_eq!(
            (locality(0).region, locality(0).zone, locality(0).sub_zone),
            ("r1".into(), "z1".into(), "a".into())
        );
        assert_eq!(locality(1).sub_zone, "b");
        assert!(assignment.endpoints.iter().all(|l| l.priority == 0));
        let local = &assignment.endpoints[0].lb_endpoints[0];
        assert_eq!(local.metadata, Some(hash_key("a-web-0")));
        let far_end = &assignment.endpoints[1].lb_endpoints[0];
        assert_eq!(far_end.health_status, HealthStatus::Draining as i32);
        assert_eq!(
            far_end.load_balancing_weight,
            Some(UInt32Value { value: 2 })
        );
        assert_eq!(far_end.metadata, Some(hash_key("b-web-0")));
    }
}
