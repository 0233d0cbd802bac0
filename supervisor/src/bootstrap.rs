//! Writes the Envoy bootstrap that points Envoy at the supervisor's xDS server.
//!
//! The bootstrap has an admin listener on loopback, dedicated CDS over gRPC to a static `xds_cluster`
//! (HTTP/2), and one static HTTP listener routing each service by path prefix (longest first) to the
//! cluster of the same name, with retries on another host when a worker refuses or resets. Clusters
//! and endpoints arrive by CDS/EDS, so the route config has `validate_clusters: false` (Envoy 1.40
//! refuses unknown clusters at start-up otherwise).

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use crate::config::{CertFiles, HashOn, XdsVariant};

/// The static secret with Envoy's client certificate and key (`[envoy.tls]` cert, key); the ORCA
/// clusters the supervisor sends name it too.
pub const ENVOY_CERTIFICATE_SECRET: &str = "peregrine-envoy-certificate";
/// The static secret with the CA that signs supervisors' certificates (`[envoy.tls]` ca).
pub const SUPERVISOR_CA_SECRET: &str = "peregrine-supervisor-ca";
/// Envoy's name of the TLS transport socket.
pub const TLS_TRANSPORT_SOCKET: &str = "envoy.transport_sockets.tls";

/// One routed service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootstrapService {
    /// The service (and cluster) name.
    pub name: String,
    /// The path prefix routed to it; `/` by default.
    pub prefix: String,
    /// The virtual host domains; `["*"]` by default. Services with the same domains share a virtual
    /// host.
    pub domains: Vec<String>,
    /// What the route hashes each request by, for ring hash and Maglev clusters; none by default.
    pub hash_on: Option<HashOn>,
}

impl BootstrapService {
    /// A service routed at `/` for every domain.
    pub fn new(name: impl Into<String>) -> Self {
        BootstrapService {
            name: name.into(),
            prefix: "/".into(),
            domains: vec!["*".into()],
            hash_on: None,
        }
    }
}

/// Everything the bootstrap depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootstrapInput {
    /// Envoy's node id; `"peregrine"` by default.
    pub node_id: String,
    /// Envoy's node cluster; `"peregrine"` by default.
    pub node_cluster: String,
    /// Where the xDS server listens; a wildcard address becomes the loopback address of its family.
    pub xds_address: SocketAddr,
    /// The xDS servers Envoy dials, every one an endpoint of the xDS cluster (a fleet's supervisors:
    /// any one can serve it); empty: `xds_address` alone.
    pub xds_servers: Vec<SocketAddr>,
    /// The name of the static cluster for xDS; `"xds_cluster"` by default.
    pub xds_cluster_name: String,
    /// Envoy's HTTP listener; `0.0.0.0:10000` by default.
    pub listener_address: SocketAddr,
    /// Envoy's admin listener; `127.0.0.1:9901` by default.
    pub admin_address: SocketAddr,
    /// The timeout of each try of a request; 15 s by default. A try that times out is retried on
    /// another worker (a stopped or hung worker's requests are not lost to it).
    pub per_try_timeout: std::time::Duration,
    /// The timeout of a request, all its tries together (the route's `timeout`); 15 s by default.
    pub timeout: std::time::Duration,
    /// The routed services.
    pub services: Vec<BootstrapService>,
    /// Fetch clusters (and so endpoints) over one ADS stream instead of dedicated CDS and EDS streams;
    /// `false` by default.
    pub ads: bool,
    /// The xDS variant on those streams (`api_type: GRPC` or `DELTA_GRPC`); state of the world by
    /// default.
    pub xds: XdsVariant,
    /// In a fleet, the node's locality: its host's region and zone, and the host as sub-zone (the
    /// locality the supervisor gives that host's workers).
    pub locality: Option<NodeLocality>,
    /// How Envoy dials the xDS servers over TLS (and the ORCA streams: the secrets the clusters
    /// name); `None`: cleartext.
    pub tls: Option<BootstrapTls>,
}

/// `[envoy.tls]`, as the bootstrap writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootstrapTls {
    /// Envoy's client certificate and key, if it presents one.
    pub identity: Option<CertFiles>,
    /// The CA that signs supervisors' certificates.
    pub ca: std::path::PathBuf,
    /// The SNI, and the DNS name required in the supervisor's certificate.
    pub server_name: String,
}

/// `node.locality`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLocality {
    /// Region.
    pub region: String,
    /// Zone.
    pub zone: String,
    /// Sub-zone: the host.
    pub sub_zone: String,
}

impl Default for BootstrapInput {
    fn default() -> Self {
        BootstrapInput {
            node_id: "peregrine".into(),
            node_cluster: "peregrine".into(),
            xds_address: (Ipv6Addr::LOCALHOST, 18000).into(),
            xds_servers: Vec::new(),
            xds_cluster_name: "xds_cluster".into(),
            listener_address: (Ipv4Addr::UNSPECIFIED, 10000).into(),
            admin_address: (Ipv4Addr::LOCALHOST, 9901).into(),
            per_try_timeout: std::time::Duration::from_secs(15),
            timeout: std::time::Duration::from_secs(15),
            services: Vec::new(),
            ads: false,
            xds: XdsVariant::StateOfTheWorld,
            locality: None,
            tls: None,
        }
    }
}

/// The Envoy bootstrap (YAML) for `input`.
pub fn envoy_bootstrap(input: &BootstrapInput) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "\
node:
  id: {node_id}
  cluster: {node_cluster}
{locality}
admin:
  address:
    socket_address:
      address: {admin_ip}
      port_value: {admin_port}

dynamic_resources:
{dynamic}
static_resources:
  listeners:
    - name: listener_http
      address:
        socket_address:
          address: {listener_ip}
          port_value: {listener_port}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress_http
                route_config:
                  name: local_route
                  validate_clusters: false
                  virtual_hosts:
",
        node_id = quote(&input.node_id),
        node_cluster = quote(&input.node_cluster),
        locality = match &input.locality {
            Some(l) => format!(
                "  locality:\n    region: {}\n    zone: {}\n    sub_zone: {}\n",
                quote(&l.region),
                quote(&l.zone),
                quote(&l.sub_zone)
            ),
            None => String::new(),
        },
        admin_ip = quote(&input.admin_address.ip().to_string()),
        admin_port = input.admin_address.port(),
        dynamic = dynamic_resources(input),
        listener_ip = quote(&input.listener_address.ip().to_string()),
        listener_port = input.listener_address.port(),
    );
    let hosts = virtual_hosts(&input.services);
    if hosts.is_empty() {
        out.push_str("                    []\n");
    }
    let per_try = format_duration(input.per_try_timeout);
    let timeout = format_duration(input.timeout);
    for (index, (domains, services)) in hosts.iter().enumerate() {
        let _ = write!(
            out,
            "                    - name: {name}
                      domains: [{domains}]
                      routes:
",
            name = quote(&format!("services_{index}")),
            domains = domains
                .iter()
                .map(|d| quote(d))
                .collect::<Vec<_>>()
                .join(", "),
        );
        for service in services {
            let _ = write!(
                out,
                "                        - match:
                            prefix: {prefix}
                          route:
                            cluster: {cluster}
                            timeout: {timeout}
                            retry_policy:
                              retry_on: connect-failure,reset,refused-stream,gateway-error
                              num_retries: 3
                              per_try_timeout: {per_try}
                              retry_host_predicate:
                                - name: envoy.retry_host_predicates.previous_hosts
                                  typed_config:
                                    \"@type\": type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate
                              host_selection_retry_max_attempts: 3
                              # In a fleet, a retry goes to the next priority (the next nearest
                              # hosts): a host whose workers all died is left at the first retry.
                              # With one priority it changes nothing.
                              retry_priority:
                                name: envoy.retry_priorities.previous_priorities
                                typed_config:
                                  \"@type\": type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig
                                  update_frequency: 1
",
                prefix = quote(&service.prefix),
                cluster = quote(&service.name),
            );
            if let Some(hash_on) = &service.hash_on {
                let policy = match hash_on {
                    HashOn::Header(name) => format!(
                        "header:\n                                  header_name: {}",
                        quote(name)
                    ),
                    HashOn::Cookie(name) => format!(
                        "cookie:\n                                  name: {}",
                        quote(name)
                    ),
                    HashOn::SourceIp => {
                        "connection_properties:\n                                  source_ip: true"
                            .to_owned()
                    }
                };
                let _ = write!(
                    out,
                    "                            hash_policy:\n                              - {policy}\n"
                );
            }
        }
    }
    let _ = write!(
        out,
        "                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      \"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router

  clusters:
    - name: {xds_cluster}
      connect_timeout: 1s
      type: STATIC
      load_assignment:
        cluster_name: {xds_cluster}
        endpoints:
          - lb_endpoints:
{xds_endpoints}      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options:
              # A supervisor cut off from the network must not keep this Envoy's xDS streams: the
              # pings find it gone and Envoy dials another of the servers.
              connection_keepalive:
                interval: {keepalive}s
                timeout: {keepalive}s
",
        xds_cluster = quote(&input.xds_cluster_name),
        xds_endpoints = xds_endpoints(input),
        keepalive = XDS_KEEPALIVE.as_secs_f64(),
    );
    if let Some(tls) = &input.tls {
        out.push_str(&tls_sections(tls));
    }
    out
}

/// With TLS: the xDS cluster's transport socket (the TLS context
/// [`upstream_tls_context`](crate::xds::upstream_tls::upstream_tls_context) builds for ORCA, written
/// as YAML), then the static secrets both name.
fn tls_sections(tls: &BootstrapTls) -> String {
    let path = |p: &std::path::Path| quote(&p.to_string_lossy());
    let mut out = format!(
        "      transport_socket:
        name: {socket}
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
          sni: {name}
          common_tls_context:
            alpn_protocols: [\"h2\"]
",
        socket = TLS_TRANSPORT_SOCKET,
        name = quote(&tls.server_name),
    );
    if tls.identity.is_some() {
        let _ = write!(
            out,
            "            tls_certificate_sds_secret_configs:
              - name: {}
",
            quote(ENVOY_CERTIFICATE_SECRET)
        );
    }
    let _ = write!(
        out,
        "            combined_validation_context:
              default_validation_context:
                match_typed_subject_alt_names:
                  - san_type: DNS
                    matcher:
                      exact: {name}
              validation_context_sds_secret_config:
                name: {ca_secret}

  # The certificates of the gRPC port's TLS, by name: the xDS cluster above and the supervisor's ORCA
  # clusters refer to these.
  secrets:
    - name: {ca_secret}
      validation_context:
        trusted_ca:
          filename: {ca}
",
        name = quote(&tls.server_name),
        ca_secret = quote(SUPERVISOR_CA_SECRET),
        ca = path(&tls.ca),
    );
    if let Some(identity) = &tls.identity {
        let _ = write!(
            out,
            "    - name: {}
      tls_certificate:
        certificate_chain:
          filename: {}
        private_key:
          filename: {}
",
            quote(ENVOY_CERTIFICATE_SECRET),
            path(&identity.cert),
            path(&identity.key),
        );
    }
    out
}

/// The xDS cluster's endpoints: every `xds_servers` entry, or the supervisor's own address.
fn xds_endpoints(input: &BootstrapInput) -> String {
    let own = [dial_address(input.xds_address)];
    let servers = if input.xds_servers.is_empty() {
        &own[..]
    } else {
        &input.xds_servers[..]
    };
    servers
        .iter()
        .map(|server| {
            format!(
                "              - endpoint:
                  address:
                    socket_address:
                      address: {}
                      port_value: {}
",
                quote(&server.ip().to_string()),
                server.port()
            )
        })
        .collect()
}

/// How often Envoy pings its xDS server's connection, and how long it waits for the answer before it
/// drops the connection (and its streams) and dials again: a cut-off supervisor is left within two of
/// these.
pub const XDS_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(1);

/// The first delay before Envoy reconnects an xDS stream to the supervisor.
pub const XDS_RETRY_BASE: std::time::Duration = std::time::Duration::from_millis(100);
/// The longest delay between Envoy's attempts to reconnect an xDS stream.
pub const XDS_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// The body of `dynamic_resources`: dedicated CDS, or ADS with CDS over it; delta or not.
fn dynamic_resources(input: &BootstrapInput) -> String {
    let cluster = quote(&input.xds_cluster_name);
    let api_type = match input.xds {
        XdsVariant::StateOfTheWorld => "GRPC",
        XdsVariant::Delta => "DELTA_GRPC",
    };
    // A supervisor that restarts is back within a second: Envoy reconnects sooner than its default
    // backoff (500 ms, up to 30 s) would let it (the EDS config source in every cluster says the same).
    let retry = format!(
        "retry_policy: {{ retry_back_off: {{ base_interval: {}s, max_interval: {}s }} }}",
        XDS_RETRY_BASE.as_secs_f64(),
        XDS_RETRY_MAX.as_secs_f64()
    );
    // Envoy names its node (hundreds of extensions among it) on every request unless told to on a
    // stream's first only: the supervisor reads it from the first (the EDS config source in every
    // cluster says the same).
    if input.ads {
        format!(
            "  ads_config:
    api_type: {api_type}
    transport_api_version: V3
    set_node_on_first_message_only: true
    grpc_services:
      - envoy_grpc:
          cluster_name: {cluster}
          {retry}
  cds_config:
    resource_api_version: V3
    ads: {{}}
"
        )
    } else {
        format!(
            "  cds_config:
    resource_api_version: V3
    api_config_source:
      api_type: {api_type}
      transport_api_version: V3
      set_node_on_first_message_only: true
      grpc_services:
        - envoy_grpc:
            cluster_name: {cluster}
            {retry}
"
        )
    }
}

/// The address Envoy dials for a server bound to `addr`: a wildcard becomes loopback.
fn dial_address(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

/// Services grouped into virtual hosts by domains (in first-seen order), each host's routes ordered by
/// longest prefix first so a `/` route never shadows a longer one.
fn virtual_hosts(services: &[BootstrapService]) -> Vec<(Vec<String>, Vec<&BootstrapService>)> {
    let mut hosts: Vec<(Vec<String>, Vec<&BootstrapService>)> = Vec::new();
    for service in services {
        match hosts.iter_mut().find(|(d, _)| *d == service.domains) {
            Some((_, routes)) => routes.push(service),
            None => hosts.push((service.domains.clone(), vec![service])),
        }
    }
    for (_, routes) in &mut hosts {
        routes.sort_by_key(|s| std::cmp::Reverse(s.prefix.len()));
    }
    hosts
}

/// A YAML double-quoted scalar (JSON string syntax is valid YAML).
fn quote(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// A protobuf JSON duration such as `1.5s`.
fn format_duration(d: std::time::Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    fn input() -> BootstrapInput {
        BootstrapInput {
            xds_address: "[::]:18000".parse().unwrap(),
            services: vec![
                BootstrapService::new("web"),
                BootstrapService {
                    prefix: "/api/".into(),
                    hash_on: Some(HashOn::Header("x-entity-id".into())),
                    ..BootstrapService::new("api")
                },
                BootstrapService {
                    domains: vec!["admin.example.com".into()],
                    hash_on: Some(HashOn::Cookie("session".into())),
                    ..BootstrapService::new("admin")
                },
                BootstrapService {
                    prefix: "/ip/".into(),
                    hash_on: Some(HashOn::SourceIp),
                    ..BootstrapService::new("ip")
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn wildcard_xds_addresses_become_loopback() {
        assert_eq!(
            dial_address("[::]:1".parse().unwrap()),
            "[::1]:1".parse().unwrap()
        );
        assert_eq!(
            dial_address("0.0.0.0:1".parse().unwrap()),
            "127.0.0.1:1".parse().unwrap()
        );
        assert_eq!(
            dial_address("10.0.0.1:1".parse().unwrap()),
            "10.0.0.1:1".parse().unwrap()
        );
        let yaml = envoy_bootstrap(&input());
        assert!(yaml.contains("address: \"::1\"\n                      port_value: 18000"));
    }

    #[test]
    fn every_xds_server_is_an_endpoint_of_the_xds_cluster_and_the_node_has_its_locality() {
        let yaml = envoy_bootstrap(&BootstrapInput {
            xds_servers: vec![
                "10.0.0.1:18000".parse().unwrap(),
                "10.0.0.2:18000".parse().unwrap(),
            ],
            locality: Some(NodeLocality {
                region: "r1".into(),
                zone: "z1".into(),
                sub_zone: "a".into(),
            }),
            ..input()
        });
        for ip in ["10.0.0.1", "10.0.0.2"] {
            assert!(
                yaml.contains(&format!(
                    "address: \"{ip}\"\n                      port_value: 18000"
                )),
                "{yaml}"
            );
        }
        assert!(
            !yaml.contains("address: \"::1\"\n                      port_value"),
            "{yaml}"
        );
        assert!(
            yaml.contains(
                "  locality:\n    region: \"r1\"\n    zone: \"z1\"\n    sub_zone: \"a\"\n"
            ),
            "{yaml}"
        );
    }

    #[test]
    fn routes_longest_prefix_first_per_virtual_host() {
        let yaml = envoy_bootstrap(&input());
        let api = yaml.find("prefix: \"/api/\"").unwrap();
        let root = yaml.find("prefix: \"/\"").unwrap();
        assert!(api < root, "the longer prefix must come first:\n{yaml}");
        assert!(yaml.contains("domains: [\"admin.example.com\"]"));
        assert_eq!(
            yaml.matches("retry_on: connect-failure,reset,refused-stream")
                .count(),
            4,
            "one retry policy per route"
        );
        assert!(yaml.contains("validate_clusters: false"));
        assert!(yaml.contains("per_try_timeout: 15s"));
        assert!(yaml.contains("\n                            timeout: 15s\n"));
        assert!(yaml.contains("retry_on: connect-failure,reset,refused-stream,gateway-error"));
    }

    #[test]
    fn hashing_services_get_a_hash_policy_on_their_route() {
        let yaml = envoy_bootstrap(&input());
        assert!(
            yaml.contains("hash_policy:\n                              - header:\n                                  header_name: \"x-entity-id\""),
            "{yaml}"
        );
        assert!(yaml.contains("- cookie:\n                                  name: \"session\""));
        assert!(yaml.contains(
            "- connection_properties:\n                                  source_ip: true"
        ));
        assert_eq!(
            yaml.matches("hash_policy:").count(),
            3,
            "only hashing services"
        );
    }

    #[test]
    fn delta_asks_for_delta_grpc_where_the_streams_are_configured() {
        for ads in [false, true] {
            let sotw = envoy_bootstrap(&BootstrapInput { ads, ..input() });
            let delta = envoy_bootstrap(&BootstrapInput {
                ads,
                xds: XdsVariant::Delta,
                ..input()
            });
            assert!(sotw.contains("api_type: GRPC\n") && !sotw.contains("DELTA_GRPC"));
            assert_eq!(
                delta,
                sotw.replace("api_type: GRPC\n", "api_type: DELTA_GRPC\n")
            );
            assert!(delta.contains("retry_policy:"), "{delta}");
        }
    }

    #[test]
    fn envoy_names_its_node_on_a_streams_first_request_only() {
        for ads in [false, true] {
            let yaml = envoy_bootstrap(&BootstrapInput { ads, ..input() });
            assert_eq!(
                yaml.matches("set_node_on_first_message_only: true").count(),
                1,
                "{yaml}"
            );
        }
    }

    #[test]
    fn envoy_validates_the_bootstrap() {
        let Some(envoy) = peregrine_e2e::envoy_or_skip("envoy_validates_the_bootstrap") else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let ads = BootstrapInput {
            ads: true,
            ..input()
        };
        let delta = BootstrapInput {
            xds: XdsVariant::Delta,
            ..input()
        };
        let delta_ads = BootstrapInput {
            xds: XdsVariant::Delta,
            ..ads.clone()
        };
        let certs = dir.path().join("tls");
        crate::tls::init::init(&certs, &[]).unwrap();
        let mutual = BootstrapInput {
            tls: Some(BootstrapTls {
                identity: Some(CertFiles {
                    cert: certs.join("envoy.pem"),
                    key: certs.join("envoy.key"),
                }),
                ca: certs.join("ca.pem"),
                server_name: "peregrine".into(),
            }),
            ..delta_ads.clone()
        };
        let server_only = BootstrapInput {
            tls: Some(BootstrapTls {
                identity: None,
                ..mutual.tls.clone().unwrap()
            }),
            ..input()
        };
        for (name, input) in [
            ("full", input()),
            ("ads", ads),
            ("delta", delta),
            ("delta-ads", delta_ads),
            ("empty", BootstrapInput::default()),
            ("mutual-tls", mutual),
            ("server-tls", server_only),
        ] {
            let path = dir.path().join(format!("{name}.yaml"));
            std::fs::write(&path, envoy_bootstrap(&input)).unwrap();
            let output = Command::new(&envoy)
                .args(["--mode", "validate", "-c"])
                .arg(&path)
                .args([
                    "--disable-hot-restart",
                    "--concurrency",
                    "1",
                    "--log-level",
                    "warn",
                ])
                .output()
                .unwrap();
            assert!(
                output.status.success(),
                "Envoy refused the {name} bootstrap:\n{}\n{}\n{}",
                envoy_bootstrap(&input),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
}
