//! What the supervisor tells Envoy about its services, besides endpoints: the xDS options (balancer,
//! ring size, ORCA policy) and where ORCA streams can reach the supervisor.
//!
//! Envoy opens a worker's ORCA stream to the worker's IP with the supervisor's port, so every IP an
//! `orca` service's workers bind must have a supervisor listener ([`orca_listen_addresses`]); a
//! service whose workers it cannot all reach is balanced without ORCA ([`OrcaReach::services`]).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs},
};

use peregrine_contract::url::BindUrl;

use crate::{
    config::{self, Balancing, Config},
    sampler::SchedSource,
    xds::{
        self,
        resources::{Balancer, OrcaPolicy},
    },
};

/// What the running sampler can report, which is all that decides (with the config) the services
/// balanced on ORCA: see [`orca_services`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Sampling {
    /// Whether a sampler runs (without one there is no load to report).
    pub(super) loads: bool,
    /// Whether it counts the responses of servers on passed sockets (eBPF, with one of its send
    /// programs attached): without it they have no request rate to report.
    pub(super) sends: bool,
}

impl Sampling {
    /// What `source` can report; `None` when no sampler runs.
    pub(super) fn of(source: Option<&dyn SchedSource>) -> Self {
        Sampling {
            loads: source.is_some(),
            sends: source.is_some_and(SchedSource::counts_sends),
        }
    }
}

/// The services of `config` balanced on ORCA reports, as far as the sampler decides it: those with
/// `orca` on, when a sampler runs; of the servers on passed sockets, only those whose responses it
/// counts (without a rate, `rps / utilization` would weigh them on noise: they get least request,
/// see [`xds_options`]). The one decision, at start and at every reload; each service it leaves out
/// is named in a warning.
pub(super) fn orca_services(config: &Config, sampling: Sampling) -> BTreeSet<String> {
    let wanted = config.services.values().filter(|s| s.orca());
    if !sampling.loads {
        let wanted: BTreeSet<&str> = wanted.map(|s| s.name.as_str()).collect();
        if !wanted.is_empty() {
            tracing::warn!(
                services = ?wanted,
                "sampler = \"off\": no load to report, so these services get round robin instead of ORCA-weighted round robin"
            );
        }
        return BTreeSet::new();
    }
    wanted
        .filter(|s| {
            let uncounted = s.pass_socket && !sampling.sends;
            if uncounted {
                tracing::warn!(service = %s.name, "The sampler cannot count the responses of servers on passed sockets (it needs the eBPF sampler): least request instead of ORCA");
            }
            !uncounted
        })
        .map(|s| s.name.clone())
        .collect()
}

/// Where ORCA can reach workers: with a sampler running, on the gRPC port's address and the ORCA
/// listeners bound at start.
#[derive(Clone, Debug)]
pub(super) struct OrcaReach {
    /// What the sampler can report.
    pub(super) sampling: Sampling,
    /// The gRPC port's address.
    pub(super) bound: SocketAddr,
    /// Every address the supervisor listens on for ORCA, the gRPC port's included.
    pub(super) listening: BTreeSet<SocketAddr>,
}

impl OrcaReach {
    /// The services of `config` balanced on ORCA: those [`orca_services`] gives, whose workers'
    /// addresses these listeners cover (a service added by reload on another address family gets
    /// round robin until the supervisor starts again, which binds what it needs).
    pub(super) fn services(&self, config: &Config) -> BTreeSet<String> {
        orca_services(config, self.sampling)
            .into_iter()
            .filter(|name| {
                let s = &config.services[name];
                // In band, the reports travel in the workers' responses: no stream to reach.
                if s.orca_in_band() {
                    return true;
                }
                let one = BTreeSet::from([name.clone()]);
                let needed = orca_listen_addresses(config, &one, self.bound);
                let covered = needed.iter().all(|addr| self.listening.contains(addr));
                if !covered {
                    tracing::warn!(service = %name, ?needed, "ORCA would need listeners bound only when the supervisor starts: round robin until then");
                }
                covered
            })
            .collect()
    }
}

pub(super) fn xds_options(config: &Config, orca: &BTreeSet<String>, port: u16) -> xds::XdsOptions {
    let policy = OrcaPolicy {
        port,
        reporting_period: config.supervisor.sample_interval,
        blackout_period: config.orca.blackout_period,
        weight_expiration_period: config.orca.weight_expiration_period,
        weight_update_period: config.orca.weight_update_period,
        tls: config.supervisor.tls.is_some(),
        in_band: false,
    };
    let balancer = |service: &config::ServiceConfig| match service.balancing {
        // Left out by `orca_services`: servers on passed sockets (whose queue Envoy's count of active
        // requests reads) get least request, the others round robin.
        Balancing::Orca(reports) if orca.contains(&service.name) => Balancer::Orca(OrcaPolicy {
            in_band: reports == config::OrcaReports::InBand,
            ..policy
        }),
        Balancing::Orca(_) if service.pass_socket => Balancer::LeastRequest {
            choice_count: config::DEFAULT_CHOICE_COUNT,
        },
        Balancing::Orca(_) | Balancing::RoundRobin => Balancer::RoundRobin,
        Balancing::LeastRequest { choice_count } => Balancer::LeastRequest { choice_count },
        Balancing::Random => Balancer::Random,
        Balancing::RingHash {
            min_ring_size,
            max_ring_size,
            hash_balance_factor,
            ..
        } => Balancer::RingHash {
            min_ring_size: min_ring_size
                .unwrap_or_else(|| ring_size_for(&service.weights))
                .min(max_ring_size),
            max_ring_size,
            hash_balance_factor,
        },
        Balancing::Maglev {
            table_size,
            hash_balance_factor,
            ..
        } => Balancer::Maglev {
            table_size,
            hash_balance_factor,
        },
    };
    xds::XdsOptions {
        xds_cluster_name: config.supervisor.xds_cluster.clone(),
        balancers: config
            .services
            .values()
            .map(|s| (s.name.clone(), balancer(s)))
            .collect(),
        weights: config
            .services
            .values()
            .filter(|s| s.weights.iter().any(|&w| w != 1))
            .map(|s| (s.name.clone(), s.weights.clone()))
            .collect(),
        fleet: config
            .cluster
            .as_ref()
            .map(|c| xds::resources::FleetIdentity {
                host: c.host.clone(),
                locality: c.locality.clone(),
                routing: c.routing,
            }),
        envoy_tls: config
            .envoy
            .tls
            .as_ref()
            .map(|tls| xds::upstream_tls::EnvoyTls {
                server_name: tls.server_name.clone(),
                client_certificate: tls.identity.is_some(),
            }),
        ..xds::XdsOptions::default()
    }
}

/// The ring size that gives every worker [`config::RING_POINTS_PER_WORKER`] points per unit of its
/// weight. Envoy sizes the ring as `minimum_ring_size` in all and gives each host a share in proportion
/// to its weight, so a ring of this size keeps each worker's points (and so its keys) the same whatever
/// the number of workers: adding one adds its points and takes none from the others.
fn ring_size_for(weights: &[u32]) -> u64 {
    let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
    let lightest = u64::from(weights.iter().copied().min().unwrap_or(1).max(1));
    config::RING_POINTS_PER_WORKER * total.div_ceil(lightest).max(1)
}

/// The addresses, besides `bound`, where the supervisor must also listen (for ORCA only) so that Envoy's
/// ORCA streams reach it: Envoy dials each worker's IP with the supervisor's port, so every IP the
/// `orca` services' workers bind must be covered. `bound` covers its own IP; `[::]` covers every IPv6
/// and (dual stack) IPv4 address, `0.0.0.0` every IPv4 one; a worker on a wildcard address needs only
/// the loopback address of its family.
pub fn orca_listen_addresses(
    config: &Config,
    orca: &BTreeSet<String>,
    bound: SocketAddr,
) -> Vec<SocketAddr> {
    let mut ips = BTreeSet::new();
    // In-band services need no listener: Envoy opens no stream to their workers.
    for service in config
        .services
        .values()
        .filter(|s| orca.contains(&s.name) && !s.orca_in_band())
    {
        if let BindUrl::Tcp { host, .. } = service.url_for(0) {
            // A worker on a wildcard address is dialled at it, which Linux connects to the local
            // host: the loopback address of the family covers it without listening everywhere.
            ips.extend(worker_ips(&host).into_iter().map(|ip| match ip {
                IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
                other => other,
            }));
        }
    }
    let covers = |ip: &IpAddr| {
        *ip == bound.ip()
            || match bound.ip() {
                IpAddr::V6(v6) if v6.is_unspecified() => true,
                IpAddr::V4(v4) if v4.is_unspecified() => ip.is_ipv4(),
                _ => false,
            }
    };
    ips.into_iter()
        .filter(|ip| !covers(ip))
        .map(|ip| SocketAddr::new(ip, bound.port()))
        .collect()
}

/// The IPs a worker bound to `host` listens on (as the worker resolves it: `localhost` is both
/// loopback addresses).
fn worker_ips(host: &str) -> Vec<IpAddr> {
    if host.eq_ignore_ascii_case("localhost") {
        return vec![Ipv6Addr::LOCALHOST.into(), Ipv4Addr::LOCALHOST.into()];
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return vec![ip];
    }
    (host, 0)
        .to_socket_addrs()
        .map(|addrs| addrs.map(|a| a.ip()).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, path::Path};

    use super::*;

    fn config(source: &str) -> Config {
        Config::parse(source, Path::new("/tmp"), &HashMap::new()).expect("a valid config")
    }

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    #[test]
    fn orca_listens_on_every_worker_family_the_bind_address_misses() {
        let config = config(
            "[service.local]\nurl = \"http://localhost:0\"\n\
             [service.v4]\nurl = \"http://127.0.0.2:0\"\n\
             [service.sock]\nurl = \"unix:///run/s.sock\"\n\
             [service.any]\nurl = \"http://0.0.0.0:0\"\n",
        );
        let orca = orca_services(&config, COUNTS_SENDS);
        assert_eq!(
            orca,
            BTreeSet::from(["any".into(), "local".into(), "v4".into()])
        );
        assert_eq!(
            orca_listen_addresses(&config, &orca, addr("127.0.0.1:18000")),
            [addr("127.0.0.2:18000"), addr("[::1]:18000")]
        );
        assert_eq!(
            orca_listen_addresses(&config, &orca, addr("[::1]:18000")),
            [addr("127.0.0.1:18000"), addr("127.0.0.2:18000")]
        );
        assert_eq!(
            orca_listen_addresses(&config, &orca, addr("0.0.0.0:18000")),
            [addr("[::1]:18000")]
        );
        assert!(orca_listen_addresses(&config, &orca, addr("[::]:18000")).is_empty());
    }

    #[test]
    fn rings_get_the_same_points_per_worker_whatever_the_count() {
        assert_eq!(ring_size_for(&[1, 1, 1]), 3 * 1024);
        assert_eq!(ring_size_for(&[1, 1, 1, 1]), 4 * 1024);
        assert_eq!(ring_size_for(&[2, 2]), 2 * 1024);
        assert_eq!(ring_size_for(&[1, 3]), 4 * 1024);
    }

    #[test]
    fn without_a_sampler_no_service_is_balanced_on_orca() {
        let config = config("[supervisor]\nsampler = \"off\"\n[service.a]\n");
        assert!(config.services["a"].orca());
        let none = Sampling::of(None);
        assert!(orca_services(&config, none).is_empty());
    }

    /// A sampler that follows processes and may count sends, as [`Sampling::of`] sees it.
    struct Source {
        kind: crate::sampler::SamplerKind,
        sends: bool,
    }

    impl SchedSource for Source {
        fn kind(&self) -> crate::sampler::SamplerKind {
            self.kind
        }
        fn track(&mut self, _lane: usize, _pid: u32) -> Result<(), crate::sampler::SampleError> {
            Ok(())
        }
        fn untrack(&mut self, _lane: usize, _pid: u32) {}
        fn read(
            &mut self,
            _lane: usize,
            pid: u32,
        ) -> Result<crate::sampler::SchedTotals, crate::sampler::SampleError> {
            Err(crate::sampler::SampleError::Gone { pid })
        }
        fn counts_sends(&self) -> bool {
            self.sends
        }
    }

    const COUNTS_SENDS: Sampling = Sampling {
        loads: true,
        sends: true,
    };

    /// A built-in worker's service `web` and a passed-socket server's `app`, both on ORCA by default.
    fn web_and_app() -> Config {
        config(
            "[service.web]\n\
             [service.app]\npass_socket = true\ncommand = [\"/bin/true\"]\nready_path = \"/\"\n",
        )
    }

    /// An eBPF sampler that could attach no send program, and the procfs sampler: neither counts a
    /// passed-socket server's responses, so its service gets least request, while
    /// a built-in worker's, which counts its own, stays on ORCA.
    #[test]
    fn a_passed_socket_service_is_on_orca_only_where_the_sampler_counts_its_responses() {
        let config = web_and_app();
        assert!(config.services["app"].orca());
        let least = Balancer::LeastRequest {
            choice_count: config::DEFAULT_CHOICE_COUNT,
        };
        for (kind, sends, app_on_orca) in [
            (crate::sampler::SamplerKind::Ebpf, true, true),
            (crate::sampler::SamplerKind::Ebpf, false, false),
            (crate::sampler::SamplerKind::Procfs, false, false),
        ] {
            let source = Source { kind, sends };
            let sampling = Sampling::of(Some(&source));
            let orca = orca_services(&config, sampling);
            assert_eq!(orca.contains("app"), app_on_orca, "{kind:?}, sends {sends}");
            assert!(orca.contains("web"), "{kind:?}, sends {sends}");
            let balancers = xds_options(&config, &orca, 18000).balancers;
            assert!(matches!(balancers["web"], Balancer::Orca(_)));
            if app_on_orca {
                assert!(matches!(balancers["app"], Balancer::Orca(_)));
            } else {
                assert_eq!(balancers["app"], least, "{kind:?}, sends {sends}");
            }
        }
    }

    /// Start publishes `orca_services`; a reload publishes `OrcaReach::services`, which must agree
    /// with it wherever the listeners bound at start cover the workers.
    #[test]
    fn a_reload_publishes_the_balancers_the_start_did() {
        let config = web_and_app();
        let bound = addr("127.0.0.1:18000");
        for sampling in [
            COUNTS_SENDS,
            Sampling {
                loads: true,
                sends: false,
            },
            Sampling::of(None),
        ] {
            let at_start = orca_services(&config, sampling);
            // As at start: the gRPC port, and the listeners bound for the services on ORCA.
            let mut listening = BTreeSet::from([bound]);
            listening.extend(orca_listen_addresses(&config, &at_start, bound));
            let reach = OrcaReach {
                sampling,
                bound,
                listening,
            };
            let at_reload = reach.services(&config);
            assert_eq!(at_start, at_reload, "{sampling:?}");
            assert_eq!(
                xds_options(&config, &at_start, bound.port()).balancers,
                xds_options(&config, &at_reload, bound.port()).balancers,
                "{sampling:?}"
            );
        }
    }
}
