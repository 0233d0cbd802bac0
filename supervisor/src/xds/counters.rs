//! What the xDS streams have sent and had refused, summed over the process: responses (pushes) and
//! NACKs per resource type, for the metrics, and how long each Envoy took to converge on a registry
//! change (a handle on the histogram [`Timings`](crate::timings::Timings) holds). Each stream counts
//! its own NACKs in its pure state and adds them here after every step; its pushes are added as they
//! are sent.
//!
//! Invariant: counts and observations only; knows nothing of streams' state or of who reads them.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use prometheus_client::metrics::histogram::Histogram;

use super::resources::{CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL};

/// The resource types counted: the metric label, and the type URL.
pub const TYPES: [(&str, &str); 2] = [("cds", CLUSTER_TYPE_URL), ("eds", ENDPOINT_TYPE_URL)];

/// Pushes and NACKs per type of [`TYPES`], and convergence times.
#[derive(Debug)]
pub struct XdsCounters {
    pushes: [AtomicU64; 2],
    nacks: [AtomicU64; 2],
    convergence: Histogram,
}

impl Default for XdsCounters {
    /// Counters with a histogram of their own, bucketed as the metrics' is.
    fn default() -> Self {
        XdsCounters::new(crate::timings::Timings::default().xds_convergence)
    }
}

impl XdsCounters {
    /// Counters at zero that observe convergence times in `convergence`.
    pub fn new(convergence: Histogram) -> Self {
        XdsCounters {
            pushes: Default::default(),
            nacks: Default::default(),
            convergence,
        }
    }

    /// A stream's Envoy ACKed a registry change this long after the registry made it.
    pub fn converged(&self, took: Duration) {
        self.convergence.observe(took.as_secs_f64());
    }

    /// A response of `type_url` was sent.
    pub fn pushed(&self, type_url: &str) {
        if let Some(i) = index(type_url) {
            self.pushes[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// NACKs a stream received since it last said, per type of [`TYPES`].
    pub fn nacked(&self, nacks: [u64; 2]) {
        for (total, n) in self.nacks.iter().zip(nacks) {
            total.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Responses sent, per type label.
    pub fn pushes(&self) -> [(&'static str, u64); 2] {
        totals(&self.pushes)
    }

    /// NACKs received, per type label.
    pub fn nacks(&self) -> [(&'static str, u64); 2] {
        totals(&self.nacks)
    }
}

/// Where `type_url` is in [`TYPES`].
pub fn index(type_url: &str) -> Option<usize> {
    TYPES.iter().position(|(_, url)| *url == type_url)
}

fn totals(counts: &[AtomicU64; 2]) -> [(&'static str, u64); 2] {
    [0, 1].map(|i| (TYPES[i].0, counts[i].load(Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_type_and_ignores_others() {
        let counters = XdsCounters::default();
        counters.pushed(CLUSTER_TYPE_URL);
        counters.pushed(ENDPOINT_TYPE_URL);
        counters.pushed(ENDPOINT_TYPE_URL);
        counters.pushed("type.googleapis.com/other");
        counters.nacked([0, 3]);
        assert_eq!(counters.pushes(), [("cds", 1), ("eds", 2)]);
        assert_eq!(counters.nacks(), [("cds", 0), ("eds", 3)]);
    }
}
