//! The durations the metrics show as histograms, observed where they happen: every sampler pass
//! (`peregrine_sampler_pass_seconds`), every drain, from publishing a worker as draining to the
//! moment every Envoy (and, in a fleet, every host) has it so and it is asked to stop
//! (`peregrine_drain_seconds`), and every registry change an xDS stream sent, until its Envoy ACKed
//! it (`peregrine_xds_convergence_seconds`, observed through
//! [`XdsCounters`](crate::xds::counters::XdsCounters)). `prometheus-client` histograms are shared handles: the metrics
//! registry holds one clone and the code that times holds another.
//!
//! Invariant: plain data; knows nothing of who observes or who reads.

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

/// Every histogram, shared between the code that times and the metrics registry.
#[derive(Clone, Debug)]
pub struct Timings {
    /// One sampler pass over every worker (a read of each, rates, stall checks).
    pub sampler_pass: Histogram,
    /// A drain, until every Envoy has the worker as draining (or the drain timeout).
    pub drain: Histogram,
    /// A registry change, until the Envoy of one stream that had to be sent it ACKed it.
    pub xds_convergence: Histogram,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            // 20 µs (a few eBPF reads) to 0.33 s (procfs over thousands of workers).
            sampler_pass: Histogram::new(exponential_buckets(20e-6, 2.0, 15)),
            // 5 ms (one Envoy on loopback) to 41 s (past the default 10 s drain timeout).
            drain: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            // 1 ms (an Envoy on loopback) to 16 s (an Envoy far away, or stalled).
            xds_convergence: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
        }
    }
}
