//! Local-first routing: the priorities of a cluster's localities as one requesting Envoy is sent
//! them.
//!
//! The cache builds every cluster load assignment once, each host its own locality (region, zone, and
//! the host as sub-zone) at priority 0. Under `routing = "local-first"` each Envoy is sent a variant in
//! which a locality's priority is its distance from the Envoy's own node locality: its own host first,
//! then its zone, its region, the rest. Envoy sends every request to the highest priority that is
//! healthy enough and spills over to the next by its overprovisioning rule (a priority takes all of
//! the traffic while its healthy share times 1.4 covers it); a DRAINING endpoint counts in no health
//! sum, so a host whose workers all drain hands all of its traffic on.
//!
//! Within one priority CSWRR balances every endpoint on its ORCA weight, whichever host it is on: no
//! locality weights are written (wrapping CSWRR in `wrr_locality` with fixed locality weights would
//! pin each host's share and override the load reports).
//!
//! Invariant: a variant differs from the assignment it was made from in its priorities only, and a
//! requester's tiers present are numbered from 0 without gaps (Envoy's priorities are contiguous).

use envoy_types::pb::envoy::config::{
    core::v3::{Locality as PbLocality, Node},
    endpoint::v3::ClusterLoadAssignment,
};

/// Where an Envoy that asks for endpoints is: its node's locality as its stream's first request
/// names it (the bootstrap writes its host's region, zone, and the host as sub-zone); all empty when
/// it names none.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Requester {
    /// `node.locality.region`.
    pub region: String,
    /// `node.locality.zone`.
    pub zone: String,
    /// `node.locality.sub_zone`: the host the Envoy runs on.
    pub sub_zone: String,
}

/// How near a locality is to a requester: the lower, the sooner it is sent requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Tier {
    /// The requester's own host.
    Host,
    /// Another host in the requester's zone.
    Zone,
    /// Another zone of the requester's region.
    Region,
    /// Everywhere else.
    Rest,
}

// === impl Requester ===

impl Requester {
    /// The requester `node` describes.
    pub fn of(node: Option<&Node>) -> Self {
        let locality = node.and_then(|n| n.locality.as_ref());
        Requester {
            region: locality.map(|l| l.region.clone()).unwrap_or_default(),
            zone: locality.map(|l| l.zone.clone()).unwrap_or_default(),
            sub_zone: locality.map(|l| l.sub_zone.clone()).unwrap_or_default(),
        }
    }

    /// How near `locality` (an endpoint group's; none counts as all empty) is to this requester.
    fn tier(&self, locality: Option<&PbLocality>) -> Tier {
        let empty = PbLocality::default();
        let locality = locality.unwrap_or(&empty);
        let region = locality.region == self.region;
        let zone = region && locality.zone == self.zone;
        if zone && !self.sub_zone.is_empty() && locality.sub_zone == self.sub_zone {
            Tier::Host
        } else if zone {
            Tier::Zone
        } else if region {
            Tier::Region
        } else {
            Tier::Rest
        }
    }
}

/// `assignment` as `requester` is sent it under local-first routing: each locality's priority is its
/// tier for the requester, the tiers present numbered from 0 in order.
pub fn prioritised_for(
    assignment: &ClusterLoadAssignment,
    requester: &Requester,
) -> ClusterLoadAssignment {
    let tiers = assignment
        .endpoints
        .iter()
        .map(|group| requester.tier(group.locality.as_ref()))
        .collect::<Vec<_>>();
    let mut present = tiers.clone();
    present.sort_unstable();
    present.dedup();
    let mut variant = assignment.clone();
    for (group, tier) in variant.endpoints.iter_mut().zip(tiers) {
        let rank = present.binary_search(&tier).expect("every tier is present");
        group.priority = u32::try_from(rank).expect("at most four tiers");
    }
    variant
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::endpoint::v3::LocalityLbEndpoints;

    use super::*;

    fn locality(region: &str, zone: &str, host: &str) -> PbLocality {
        PbLocality {
            region: region.into(),
            zone: zone.into(),
            sub_zone: host.into(),
        }
    }

    fn requester(region: &str, zone: &str, host: &str) -> Requester {
        Requester::of(Some(&Node {
            locality: Some(locality(region, zone, host)),
            ..Node::default()
        }))
    }

    /// One endpoint group per host, in the order given.
    fn assignment(hosts: &[PbLocality]) -> ClusterLoadAssignment {
        ClusterLoadAssignment {
            cluster_name: "web".into(),
            endpoints: hosts
                .iter()
                .map(|l| LocalityLbEndpoints {
                    locality: Some(l.clone()),
                    ..LocalityLbEndpoints::default()
                })
                .collect(),
            ..ClusterLoadAssignment::default()
        }
    }

    fn priorities(assignment: &ClusterLoadAssignment) -> Vec<u32> {
        assignment.endpoints.iter().map(|g| g.priority).collect()
    }

    #[test]
    fn own_host_then_zone_then_region_then_the_rest() {
        let fleet = assignment(&[
            locality("r1", "z1", "a"),
            locality("r1", "z1", "b"),
            locality("r1", "z2", "c"),
            locality("r2", "z1", "d"),
        ]);
        let variant = prioritised_for(&fleet, &requester("r1", "z1", "a"));
        assert_eq!(priorities(&variant), [0, 1, 2, 3]);
        // Nothing but the priorities changes.
        let mut back = variant.clone();
        back.endpoints.iter_mut().for_each(|g| g.priority = 0);
        assert_eq!(back, fleet);
        // From host c: its own host first, then the rest of its region (a, b), then region r2.
        let variant = prioritised_for(&fleet, &requester("r1", "z2", "c"));
        assert_eq!(priorities(&variant), [1, 1, 0, 2]);
    }

    #[test]
    fn the_tiers_present_are_numbered_without_gaps() {
        // Host a and a far region only: priorities 0 and 1, not 0 and 3.
        let fleet = assignment(&[locality("r1", "z1", "a"), locality("r9", "z9", "x")]);
        let variant = prioritised_for(&fleet, &requester("r1", "z1", "a"));
        assert_eq!(priorities(&variant), [0, 1]);
        // A requester on no host of the fleet, in a's zone: a first.
        let variant = prioritised_for(&fleet, &requester("r1", "z1", "front"));
        assert_eq!(priorities(&variant), [0, 1]);
    }

    #[test]
    fn a_requester_that_names_no_locality_matches_hosts_that_have_none() {
        let fleet = assignment(&[locality("", "", "a"), locality("r1", "", "b")]);
        let variant = prioritised_for(&fleet, &Requester::of(None));
        // Never its own host (it names none), but the same empty zone as a.
        assert_eq!(priorities(&variant), [0, 1]);
        assert_eq!(Requester::of(Some(&Node::default())), Requester::default());
    }

    #[test]
    fn a_fleet_on_one_host_is_one_priority() {
        let fleet = assignment(&[locality("r1", "z1", "a")]);
        let variant = prioritised_for(&fleet, &requester("r2", "z2", "other"));
        assert_eq!(priorities(&variant), [0]);
    }
}
