//! Prometheus metrics at `GET /metrics` on `supervisor.metrics` (loopback by default), in the
//! OpenMetrics text format, with the `prometheus-client` crate: a registry of this supervisor's own,
//! never a global one.
//!
//! Every figure is read at scrape time from where it already lives ([`collector`]): the workers and
//! their loads from the registry's status report (the same one `peregrine status` prints, so the two
//! never disagree, with the records kept beside the registry: xDS streams, ORCA, the fleet session),
//! the open xDS streams from their ACK records, the xDS pushes and NACKs from the streams' counters,
//! and the process's own figures from
//! `/proc/self` ([`process`]). Labels are services and slot indexes, never pids, so a restart adds no
//! series. [`server`] answers the scrapes.
//!
//! Invariant: reads the registry, the status records and the xDS counters; writes nothing anywhere.

pub mod collector;
pub mod process;
pub mod server;

use std::sync::Arc;

use prometheus_client::registry::{Registry as Metrics, Unit};

use crate::{registry::Registry, status, timings::Timings, xds::counters::XdsCounters};

/// This supervisor's metrics registry: the status collector, the process collector and the
/// histograms of `timings`.
pub fn registry(
    registry: Arc<Registry>,
    records: status::Records,
    xds: Arc<XdsCounters>,
    timings: &Timings,
) -> Metrics {
    let mut metrics = Metrics::default();
    metrics.register_with_unit(
        "peregrine_sampler_pass",
        "One sampler pass over every worker",
        Unit::Seconds,
        timings.sampler_pass.clone(),
    );
    metrics.register_with_unit(
        "peregrine_drain",
        "A worker's drain: from DRAINING in EDS until every Envoy (and every host of a fleet) has it, or the drain timeout",
        Unit::Seconds,
        timings.drain.clone(),
    );
    metrics.register_with_unit(
        "peregrine_xds_convergence",
        "A registry change an xDS stream had to send, until its Envoy ACKed it",
        Unit::Seconds,
        timings.xds_convergence.clone(),
    );
    metrics.register_collector(Box::new(collector::StatusCollector::new(
        registry, records, xds,
    )));
    metrics.register_collector(Box::new(process::ProcessCollector));
    metrics
}
