//! The other hosts of a fleet, as their supervisors published them in etcd: the part of the endpoint
//! snapshot that this supervisor does not run but serves to its Envoys.
//!
//! Invariant: only the fleet membership task writes it ([`Registry::set_fleet`]), and it holds other
//! hosts only, never this one's workers (those are the registry's own, registered here).
//!
//! [`Registry::set_fleet`]: super::Registry::set_fleet

use std::{collections::BTreeMap, sync::Arc};

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

/// [`choose_specs`] across calls: chosen again only when this host's services or another host's
/// services changed, not its workers. A worker change on one host of a fleet of 100 hosts and 100
/// services then costs a pointer comparison per host, not 10,000 map insertions.
#[derive(Debug, Default)]
pub struct SpecChoices {
    /// What the choice was made from.
    from: Option<ChoiceInputs>,
    chosen: BTreeMap<String, SpecChoice>,
}

/// What a choice of specs is made from: this host's name and services, and the other hosts.
type ChoiceInputs = (
    String,
    BTreeMap<String, Balancer>,
    Vec<(String, Arc<RemoteHost>)>,
);

impl SpecChoices {
    /// What [`choose_specs`] returns for these arguments.
    pub fn choose(
        &mut self,
        own_host: &str,
        own: &BTreeMap<String, Balancer>,
        fleet: &Fleet,
    ) -> &BTreeMap<String, SpecChoice> {
        let same = self.from.as_mut().is_some_and(|(host, services, hosts)| {
            let same = host == own_host
                && services == own
                && hosts.len() == fleet.len()
                && hosts
                    .iter()
                    .zip(fleet)
                    .all(|((held_name, held), (name, now))| {
                        held_name == name
                            && (Arc::ptr_eq(held, now) || held.services == now.services)
                    });
            if same {
                // Hold the hosts as they are now, so the next call compares pointers again.
                for ((_, held), (_, now)) in hosts.iter_mut().zip(fleet) {
                    if !Arc::ptr_eq(held, now) {
                        *held = Arc::clone(now);
                    }
                }
            }
            same
        });
        if !same {
            self.chosen = choose_specs(own_host, own, fleet);
            self.from = Some((
                own_host.to_owned(),
                own.clone(),
                fleet
                    .iter()
                    .map(|(name, host)| (name.clone(), Arc::clone(host)))
                    .collect(),
            ));
        }
        &self.chosen
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

    #[test]
    fn kept_choices_follow_services_not_workers() {
        let least = Balancer::LeastRequest { choice_count: 2 };
        let own = BTreeMap::from([("web".to_string(), Balancer::RoundRobin)]);
        let mut fleet = Fleet::from([
            ("b".to_string(), host_running(&[("web", least)])),
            ("c".to_string(), host_running(&[("web", least)])),
        ]);
        let mut specs = SpecChoices::default();
        assert_eq!(
            *specs.choose("a", &own, &fleet),
            choose_specs("a", &own, &fleet)
        );
        // A worker change on b: a new host value, the same services.
        let mut b = (*fleet["b"]).clone();
        b.grpc_port = 1;
        fleet.insert("b".into(), Arc::new(b));
        assert_eq!(specs.choose("a", &own, &fleet)["web"].balancer, least);
        // b and c change their spec: the choice follows.
        for host in ["b", "c"] {
            fleet.insert(host.into(), host_running(&[("web", Balancer::Random)]));
        }
        assert_eq!(
            *specs.choose("a", &own, &fleet),
            choose_specs("a", &own, &fleet)
        );
        assert_eq!(
            specs.choose("a", &own, &fleet)["web"].balancer,
            Balancer::Random
        );
        // So does a change of this host's own services, and a host leaving.
        let own = BTreeMap::from([("web".to_string(), Balancer::Random)]);
        fleet.remove("c");
        assert_eq!(
            *specs.choose("a", &own, &fleet),
            choose_specs("a", &own, &fleet)
        );
    }
}
