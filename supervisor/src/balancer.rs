//! How Envoy balances one service's cluster: the part of a service's Envoy-facing spec that its
//! config decides, which xDS turns into the cluster's policy and which a fleet shares through etcd
//! (so that every supervisor serves the same cluster for a service, also one it does not run).
//!
//! Invariant: plain data, serializable, with no dependency on the rest of the crate.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How Envoy balances one cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Balancer {
    /// Round robin.
    RoundRobin,
    /// Least request of `choice_count` random hosts.
    LeastRequest {
        /// Hosts compared per pick.
        choice_count: u32,
    },
    /// Random.
    Random,
    /// Consistent hashing on a ring; endpoints are hashed by their `hash_key` metadata.
    RingHash {
        /// `minimum_ring_size`: the ring's size in all (Envoy shares it among hosts by weight).
        min_ring_size: u64,
        /// `maximum_ring_size`.
        max_ring_size: u64,
        /// Bounded loads, in percent of the average.
        hash_balance_factor: Option<u32>,
    },
    /// Maglev; endpoints are hashed by their `hash_key` metadata.
    Maglev {
        /// A prime.
        table_size: u64,
        /// Bounded loads, in percent of the average.
        hash_balance_factor: Option<u32>,
    },
    /// Client-side weighted round robin on ORCA reports from this supervisor.
    Orca(OrcaPolicy),
}

/// Client-side weighted round robin fed by ORCA reports: out of band from this supervisor, or in band
/// from the workers' responses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrcaPolicy {
    /// The supervisor's gRPC port: Envoy opens each worker's ORCA stream to the worker's IP and this
    /// port (`oob_reporting_config.port_value`).
    pub port: u16,
    /// The report interval Envoy asks for (`oob_reporting_period`): the sample interval.
    pub reporting_period: Duration,
    /// `blackout_period`.
    pub blackout_period: Duration,
    /// `weight_expiration_period`.
    pub weight_expiration_period: Duration,
    /// `weight_update_period`.
    pub weight_update_period: Duration,
    /// Whether the supervisors serve ORCA over TLS (`[supervisor.tls]`): Envoy must dial the
    /// streams with TLS. Records written before TLS existed lack it: cleartext.
    #[serde(default)]
    pub tls: bool,
    /// Whether the workers carry their reports in band, in their responses'
    /// `endpoint-load-metrics-bin` header (`orca = "in-band"`): Envoy then opens no stream
    /// (`enable_oob_load_report` off). Records written before in-band reports existed lack it: out
    /// of band.
    #[serde(default)]
    pub in_band: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_balancer_round_trips_through_its_record() {
        let orca = OrcaPolicy {
            port: 18000,
            reporting_period: Duration::from_millis(500),
            blackout_period: Duration::from_secs(2),
            weight_expiration_period: Duration::from_secs(180),
            weight_update_period: Duration::from_secs(1),
            tls: true,
            in_band: false,
        };
        for balancer in [
            Balancer::RoundRobin,
            Balancer::LeastRequest { choice_count: 2 },
            Balancer::Random,
            Balancer::RingHash {
                min_ring_size: 1024,
                max_ring_size: 8_388_608,
                hash_balance_factor: Some(150),
            },
            Balancer::Maglev {
                table_size: 65537,
                hash_balance_factor: None,
            },
            Balancer::Orca(orca),
            Balancer::Orca(OrcaPolicy {
                in_band: true,
                ..orca
            }),
        ] {
            let json = serde_json::to_string(&balancer).unwrap();
            assert_eq!(
                serde_json::from_str::<Balancer>(&json).unwrap(),
                balancer,
                "{json}"
            );
        }
        assert_eq!(
            serde_json::to_string(&Balancer::LeastRequest { choice_count: 2 }).unwrap(),
            r#"{"kind":"least_request","choice_count":2}"#
        );
    }
}
