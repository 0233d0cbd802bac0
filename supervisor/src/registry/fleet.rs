//! The other hosts of a fleet, as their supervisors published them in etcd: the part of the endpoint
//! snapshot that this supervisor does not run but serves to its Envoys.
//!
//! Invariant: only the fleet membership task writes it ([`Registry::set_fleet`]), and it holds other
//! hosts only, never this one's workers (those are the registry's own, registered here).
//!
//! [`Registry::set_fleet`]: super::Registry::set_fleet

use std::{collections::BTreeMap, sync::Arc, time::SystemTime};

use super::{Address, Protocol};
use crate::{balancer::Balancer, config::Locality};

/// How a remote worker is to be sent requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Health {
    /// Registered and serving.
    Serving,
    /// About to stop: no new requests (EDS `DRAINING`).
    Draining,
    /// Stalled on its host: no new requests until it moves again (EDS `UNHEALTHY`).
    Unhealthy,
}

impl Health {
    /// `serving`, `draining` or `unhealthy`, as stored in etcd.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Serving => "serving",
            Health::Draining => "draining",
            Health::Unhealthy => "unhealthy",
        }
    }

    /// The health named `text`.
    pub fn parse(text: &str) -> Option<Health> {
        [Health::Serving, Health::Draining, Health::Unhealthy]
            .into_iter()
            .find(|h| h.as_str() == text)
    }
}

/// One worker instance of another host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteWorker {
    /// Its service.
    pub service: String,
    /// Its slot in the service on its host.
    pub index: u32,
    /// Its process id on its host.
    pub pid: u32,
    /// Its EDS hostname (the ORCA `:authority`), unique in the fleet.
    pub hostname: String,
    /// The protocols it speaks.
    pub protocols: Vec<Protocol>,
    /// Where it listens: IP sockets only (another host cannot reach a Unix socket).
    pub addresses: Vec<Address>,
    /// Its state.
    pub health: Health,
    /// Its load-balancing weight.
    pub weight: u32,
    /// Its consistent-hashing key, stable per (host, service, slot).
    pub hash_key: String,
}

/// Another host of the fleet.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemoteHost {
    /// Where its workers are.
    pub locality: Locality,
    /// Its supervisor's gRPC port (0 before its host record is seen).
    pub grpc_port: u16,
    /// The services it runs, with how its config balances each.
    pub services: BTreeMap<String, Balancer>,
    /// Its workers, by (service, index, pid).
    pub workers: BTreeMap<(String, u32, u32), RemoteWorker>,
}

/// Every other host of the fleet, by name. Each host is shared: a change on one host replaces that
/// host alone, so a snapshot's copy and a comparison of the view cost a pointer per other host.
pub type Fleet = BTreeMap<String, Arc<RemoteHost>>;

/// The spec a service is served with across the fleet, and who holds another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecChoice {
    /// The balancer every supervisor serves the service's cluster with.
    pub balancer: Balancer,
    /// The host whose spec it is (the first by name among those that hold it).
    pub from: String,
    /// The hosts whose config says otherwise, by name.
    pub disagreeing: Vec<String>,
}

/// The spec of every service of the fleet: this host's own (`own`, by service, for the services it
/// runs, named `own_host`) and every other host's. Hosts that disagree get the same answer
/// everywhere: the spec most hosts hold, a tie going to the spec of the host whose name sorts first.
pub fn choose_specs(
    own_host: &str,
    own: &BTreeMap<String, Balancer>,
    fleet: &Fleet,
) -> BTreeMap<String, SpecChoice> {
    // Each service's hosts by name, with their spec.
    let mut held: BTreeMap<&str, BTreeMap<&str, Balancer>> = BTreeMap::new();
    for (service, balancer) in own {
        held.entry(service).or_default().insert(own_host, *balancer);
    }
    for (host, remote) in fleet {
        for (service, balancer) in &remote.services {
            held.entry(service).or_default().insert(host, *balancer);
        }
    }
    held.into_iter()
        .map(|(service, hosts)| {
            // Distinct specs in order of their first host by name, with how many hold each.
            let mut specs: Vec<(Balancer, &str, usize)> = Vec::new();
            for (&host, balancer) in &hosts {
                match specs.iter_mut().find(|(b, _, _)| b == balancer) {
                    Some((_, _, count)) => *count += 1,
                    None => specs.push((*balancer, host, 1)),
                }
            }
            let most = specs.iter().map(|&(_, _, n)| n).max().unwrap_or(0);
            let &(balancer, from, _) = specs
                .iter()
                .find(|&&(_, _, n)| n == most)
                .expect("a service here has a host");
            let disagreeing = hosts
                .iter()
                .filter(|&(_, b)| *b != balancer)
                .map(|(&h, _)| h.to_owned())
                .collect();
            let choice = SpecChoice {
                balancer,
                from: from.to_owned(),
                disagreeing,
            };
            (service.to_owned(), choice)
        })
        .collect()
}

/// The etcd session of this host, for `status`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetStatus {
    /// This host's name.
    pub host: String,
    /// Where the session is.
    pub etcd: EtcdState,
    /// Since when.
    pub since: SystemTime,
    /// The lease of this host's keys, once granted.
    pub lease: Option<i64>,
    /// The services whose spec hosts disagree on, each with the hosts that disagree and whose spec
    /// is served, as one line each.
    pub conflicts: Vec<String>,
    /// The other hosts' records skipped now, by reason (`too_large`, `no_lease`, ...).
    pub skipped: BTreeMap<&'static str, usize>,
}

/// Where the etcd session is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EtcdState {
    /// Not joined yet.
    Connecting,
    /// Joined: this host's keys are in etcd and the view follows the watch.
    Connected,
    /// Away: the view is the last one seen.
    Unavailable {
        /// Why.
        error: String,
    },
}

impl EtcdState {
    /// `connecting`, `connected` or `unavailable`.
    pub fn as_str(&self) -> &'static str {
        match self {
            EtcdState::Connecting => "connecting",
            EtcdState::Connected => "connected",
            EtcdState::Unavailable { .. } => "unavailable",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_running(services: &[(&str, Balancer)]) -> Arc<RemoteHost> {
        Arc::new(RemoteHost {
            services: services.iter().map(|&(s, b)| (s.to_string(), b)).collect(),
            ..RemoteHost::default()
        })
    }

    #[test]
    fn most_hosts_win_and_a_tie_goes_to_the_first_host_by_name() {
        let least = Balancer::LeastRequest { choice_count: 2 };
        let own = BTreeMap::from([("web".to_string(), Balancer::RoundRobin)]);
        let fleet = Fleet::from([
            (
                "b".to_string(),
                host_running(&[("web", least), ("api", least)]),
            ),
            ("c".to_string(), host_running(&[("web", least)])),
            ("d".to_string(), host_running(&[("api", Balancer::Random)])),
        ]);
        let chosen = choose_specs("a", &own, &fleet);
        // web: b and c against a.
        assert_eq!(
            chosen["web"],
            SpecChoice {
                balancer: least,
                from: "b".into(),
                disagreeing: vec!["a".into()],
            }
        );
        // api: b against d, one each: b sorts first. A service this host does not run is there.
        assert_eq!(chosen["api"].balancer, least);
        assert_eq!(chosen["api"].disagreeing, ["d"]);
        // Every host computes the same: d's answer for web is b's spec too.
        let own_d = BTreeMap::from([("api".to_string(), Balancer::Random)]);
        let fleet_d = Fleet::from([
            (
                "a".to_string(),
                host_running(&[("web", Balancer::RoundRobin)]),
            ),
            (
                "b".to_string(),
                host_running(&[("web", least), ("api", least)]),
            ),
            ("c".to_string(), host_running(&[("web", least)])),
        ]);
        assert_eq!(choose_specs("d", &own_d, &fleet_d), chosen);
    }

    #[test]
    fn agreement_has_no_disagreeing_hosts() {
        let own = BTreeMap::from([("web".to_string(), Balancer::Random)]);
        let fleet = Fleet::from([("b".to_string(), host_running(&[("web", Balancer::Random)]))]);
        let chosen = choose_specs("a", &own, &fleet);
        assert_eq!(chosen["web"].from, "a");
        assert!(chosen["web"].disagreeing.is_empty());
    }
}
