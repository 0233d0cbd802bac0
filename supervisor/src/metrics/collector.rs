//! The metrics read from the registry at each scrape: [`StatusCollector`] turns the status report
//! (`status::report_of`, what `peregrine status` prints) into metric families.
//!
//! Per slot (`{service, index}`) the figures are those of the slot's serving instance: while a
//! worker is replaced, its draining predecessor and its successor both have status rows, and only
//! the successor's count (a counter restarts with each instance, which Prometheus reads as a reset).

use std::{collections::BTreeMap, fmt, sync::Arc};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

use crate::{
    registry::Registry,
    status::{
        self,
        view::{StatusView, WorkerRow},
    },
    xds::{counters::XdsCounters, stream_kind::StreamKind},
};

/// The states a slot's row can be in, each a `peregrine_workers` series of every service (0 when
/// none is), so that an alert on one has a series to watch.
pub const STATES: [&str; 5] = ["ready", "draining", "stalled", "starting", "crash-loop"];

/// Reads the registry and the ACK records at each scrape.
#[derive(Debug)]
pub struct StatusCollector {
    registry: Arc<Registry>,
    records: status::Records,
    xds: Arc<XdsCounters>,
}

impl StatusCollector {
    /// A collector of `registry`'s workers, the `records` kept beside it (xDS streams, ORCA, the
    /// fleet session) and `xds`' pushes and NACKs.
    pub fn new(registry: Arc<Registry>, records: status::Records, xds: Arc<XdsCounters>) -> Self {
        StatusCollector {
            registry,
            records,
            xds,
        }
    }
}

impl Collector for StatusCollector {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        let view = StatusView::from(status::report_of(&self.registry, &self.records));
        let totals = Totals {
            orca_reports: self.records.orca.reports_total(),
            streams: self.records.acks.kinds(),
            pushes: self.xds.pushes(),
            nacks: self.xds.nacks(),
            fleet_skipped: self
                .records
                .fleet
                .get()
                .map(|status| status.skipped)
                .unwrap_or_default(),
        };
        encode(&view, &totals, encoder)
    }
}

/// What the status report does not hold: counts kept beside it.
#[derive(Debug, Default)]
pub struct Totals {
    /// ORCA reports sent.
    pub orca_reports: u64,
    /// The kind of every open xDS stream.
    pub streams: Vec<StreamKind>,
    /// xDS responses sent and NACKs received, per type label.
    pub pushes: [(&'static str, u64); 2],
    pub nacks: [(&'static str, u64); 2],
    /// In a fleet, the other hosts' records skipped now, by reason (empty on a single host).
    pub fleet_skipped: BTreeMap<&'static str, usize>,
}

type Labels = Vec<(&'static str, String)>;

/// `view`'s metric families into `encoder` (pure: the tests feed it views).
pub fn encode(
    view: &StatusView,
    totals: &Totals,
    mut encoder: DescriptorEncoder<'_>,
) -> Result<(), fmt::Error> {
    // A fleet's status has the other hosts' workers too; their supervisors report those.
    let own = |row: &&WorkerRow| match (&row.host, &view.fleet) {
        (Some(host), Some(fleet)) => *host == fleet.host,
        _ => true,
    };
    let rows: Vec<&WorkerRow> = view.workers.iter().filter(own).collect();

    let mut states: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for row in &rows {
        for state in STATES {
            states.entry((&row.service, state)).or_insert(0);
        }
        *states.entry((&row.service, row.state)).or_insert(0) += 1;
    }
    gauges(
        &mut encoder,
        "peregrine_workers",
        "Worker slots and instances by state (a slot being replaced counts its draining instance too)",
        states.iter().map(|((service, state), n)| {
            (
                vec![
                    ("service", service.to_string()),
                    ("state", state.to_string()),
                ],
                *n,
            )
        }),
    )?;

    let slots = serving(&rows);
    let slot = |row: &WorkerRow| -> Labels {
        vec![
            ("service", row.service.clone()),
            ("index", row.index.to_string()),
        ]
    };
    gauges(
        &mut encoder,
        "peregrine_worker_cpu_cores",
        "CPU time per second of wall time over the last sample, in cores (all the worker's threads)",
        slots
            .iter()
            .filter_map(|row| Some((slot(row), row.cpu_cores?))),
    )?;
    gauges(
        &mut encoder,
        "peregrine_worker_runqueue_wait_cores",
        "Time runnable but waiting for a CPU per second of wall time over the last sample, in cores",
        slots
            .iter()
            .filter_map(|row| Some((slot(row), row.runq_wait_cores?))),
    )?;
    gauges(
        &mut encoder,
        "peregrine_worker_requests_in_flight",
        "Mean requests in flight over the last sample (kept by the worker, or seen in the kernel's socket tables for a server on a passed listener)",
        slots
            .iter()
            .filter_map(|row| Some((slot(row), row.in_flight?))),
    )?;
    let service = |name: &String| -> Labels { vec![("service", name.clone())] };
    gauges(
        &mut encoder,
        "peregrine_listener_requests_serving",
        "For a service whose workers share one listener: its accepted connections that hold a request, at the last sample",
        view.listeners
            .iter()
            .map(|(name, listener)| (service(name), listener.serving as i64)),
    )?;
    gauges(
        &mut encoder,
        "peregrine_listener_requests_queued",
        "For a service whose workers share one listener: the connections waiting in its accept queue, at the last sample",
        view.listeners
            .iter()
            .map(|(name, listener)| (service(name), listener.queued as i64)),
    )?;
    counters(
        &mut encoder,
        "peregrine_worker_requests",
        "Requests served by the slot's current worker (starts again with each new worker)",
        slots
            .iter()
            .filter_map(|row| Some((slot(row), row.requests_total?))),
    )?;
    // Every slot, with or without a worker.
    let mut restarts: BTreeMap<(&str, u32), u64> = BTreeMap::new();
    for row in &rows {
        let entry = restarts.entry((&row.service, row.index)).or_insert(0);
        *entry = (*entry).max(row.restarts);
    }
    counters(
        &mut encoder,
        "peregrine_worker_restarts",
        "Times the supervisor started the slot's worker again after it exited",
        restarts.iter().map(|((service, index), n)| {
            (
                vec![
                    ("service", service.to_string()),
                    ("index", index.to_string()),
                ],
                *n,
            )
        }),
    )?;

    let orca_streams: u32 = rows.iter().filter_map(|row| row.orca_streams).sum();
    gauges(
        &mut encoder,
        "peregrine_orca_streams",
        "ORCA load report streams Envoy holds open (one per worker per Envoy)",
        [(Labels::new(), i64::from(orca_streams))],
    )?;
    counters(
        &mut encoder,
        "peregrine_orca_reports",
        "ORCA load reports sent, over every stream",
        [(Labels::new(), totals.orca_reports)],
    )?;

    // Every type and variant has a series, 0 when no stream is open.
    let mut streams: BTreeMap<(&str, &str), i64> = StreamKind::ALL
        .iter()
        .map(|kind| (kind.type_and_variant(), 0))
        .collect();
    for kind in &totals.streams {
        *streams.entry(kind.type_and_variant()).or_insert(0) += 1;
    }
    gauges(
        &mut encoder,
        "peregrine_xds_streams",
        "Open xDS streams by what they serve (cds, eds, ads) and how (sotw, delta)",
        streams.iter().map(|((kind, variant), n)| {
            (
                vec![("type", kind.to_string()), ("variant", variant.to_string())],
                *n,
            )
        }),
    )?;
    let by_type = |counts: &[(&'static str, u64); 2]| -> Vec<(Labels, u64)> {
        counts
            .iter()
            .map(|(kind, n)| (vec![("type", kind.to_string())], *n))
            .collect()
    };
    counters(
        &mut encoder,
        "peregrine_xds_pushes",
        "xDS responses sent, by resource type (ADS streams count under the type they carry)",
        by_type(&totals.pushes),
    )?;
    counters(
        &mut encoder,
        "peregrine_xds_nacks",
        "xDS responses Envoy rejected (NACK), by resource type",
        by_type(&totals.nacks),
    )?;
    if !totals.fleet_skipped.is_empty() {
        gauges(
            &mut encoder,
            "peregrine_fleet_records_skipped",
            "Other hosts' records in etcd that are not served, by why (each is logged once)",
            totals
                .fleet_skipped
                .iter()
                .map(|(reason, n)| (vec![("reason", reason.to_string())], *n as i64)),
        )?;
    }
    Ok(())
}

/// Per slot, the row of its serving instance: a ready (or stalled) one over a draining one.
fn serving<'a>(rows: &[&'a WorkerRow]) -> Vec<&'a WorkerRow> {
    let mut by_slot: BTreeMap<(&str, u32), &WorkerRow> = BTreeMap::new();
    for row in rows.iter().filter(|row| row.pid.is_some()) {
        by_slot
            .entry((&row.service, row.index))
            .and_modify(|current| {
                if current.state == "draining" && row.state != "draining" {
                    *current = row;
                }
            })
            .or_insert(row);
    }
    by_slot.into_values().collect()
}

fn gauges<N>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (Labels, N)>,
) -> Result<(), fmt::Error>
where
    ConstGauge<N>: EncodeMetric,
{
    family(
        encoder,
        (name, help, MetricType::Gauge),
        series,
        ConstGauge::new,
    )
}

fn counters(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (Labels, u64)>,
) -> Result<(), fmt::Error> {
    family(
        encoder,
        (name, help, MetricType::Counter),
        series,
        ConstCounter::new,
    )
}

/// One family (name, help, type) with a series per labels, its value encoded as `metric` makes it;
/// nothing when there is no series.
fn family<N, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder<'_>,
    (name, help, kind): (&str, &str, MetricType),
    series: impl IntoIterator<Item = (Labels, N)>,
    metric: impl Fn(N) -> M,
) -> Result<(), fmt::Error> {
    let series: Vec<(Labels, N)> = series.into_iter().collect();
    if series.is_empty() {
        return Ok(());
    }
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in series {
        metric(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use prometheus_client::{collector::Collector, registry::Registry as Metrics};

    use super::*;
    use crate::status::view::FleetView;

    /// A collector of a fixed view.
    #[derive(Debug)]
    struct Fixed(StatusView);

    impl Collector for Fixed {
        fn encode(&self, encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
            let totals = Totals {
                orca_reports: 7,
                streams: vec![StreamKind::Ads, StreamKind::Ads, StreamKind::DeltaEds],
                pushes: [("cds", 4), ("eds", 9)],
                nacks: [("cds", 0), ("eds", 1)],
                fleet_skipped: BTreeMap::from([("no_lease", 2), ("shape", 0)]),
            };
            encode(&self.0, &totals, encoder)
        }
    }

    fn text(view: StatusView) -> String {
        let mut metrics = Metrics::default();
        metrics.register_collector(Box::new(Fixed(view)));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &metrics).unwrap();
        out
    }

    fn row(index: u32, pid: Option<u32>, state: &'static str) -> WorkerRow {
        WorkerRow {
            service: "web".into(),
            index,
            pid,
            state,
            ..WorkerRow::default()
        }
    }

    #[test]
    fn a_slot_reports_its_serving_instance_and_every_state_has_a_series() {
        let draining = WorkerRow {
            cpu_cores: Some(0.5),
            requests_total: Some(900),
            restarts: 1,
            ..row(0, Some(10), "draining")
        };
        let successor = WorkerRow {
            cpu_cores: Some(0.25),
            runq_wait_cores: Some(0.125),
            in_flight: Some(1.5),
            requests_total: Some(3),
            restarts: 1,
            orca_streams: Some(2),
            ..row(0, Some(11), "ready")
        };
        let crashing = WorkerRow {
            restarts: 6,
            ..row(1, None, "crash-loop")
        };
        let elsewhere = WorkerRow {
            host: Some("b".into()),
            ..row(0, Some(99), "ready")
        };
        let mine = |row: WorkerRow| WorkerRow {
            host: Some("a".into()),
            ..row
        };
        let view = StatusView {
            workers: vec![mine(draining), mine(successor), mine(crashing), elsewhere],
            fleet: Some(FleetView {
                host: "a".into(),
                etcd: "connected".into(),
                since_unix_ms: 0,
                error: None,
                lease: None,
                hosts: vec!["b".into()],
                conflicts: Vec::new(),
            }),
            listeners: BTreeMap::from([(
                "web".to_string(),
                crate::status::view::ListenerView {
                    queued: 2,
                    serving: 3,
                },
            )]),
            ..StatusView::default()
        };
        let text = text(view);
        for line in [
            "peregrine_workers{service=\"web\",state=\"ready\"} 1",
            "peregrine_workers{service=\"web\",state=\"draining\"} 1",
            "peregrine_workers{service=\"web\",state=\"crash-loop\"} 1",
            "peregrine_workers{service=\"web\",state=\"stalled\"} 0",
            "peregrine_worker_cpu_cores{service=\"web\",index=\"0\"} 0.25",
            "peregrine_worker_runqueue_wait_cores{service=\"web\",index=\"0\"} 0.125",
            "peregrine_worker_requests_in_flight{service=\"web\",index=\"0\"} 1.5",
            "peregrine_listener_requests_serving{service=\"web\"} 3",
            "peregrine_listener_requests_queued{service=\"web\"} 2",
            "peregrine_worker_requests_total{service=\"web\",index=\"0\"} 3",
            "peregrine_worker_restarts_total{service=\"web\",index=\"0\"} 1",
            "peregrine_worker_restarts_total{service=\"web\",index=\"1\"} 6",
            "peregrine_orca_streams 2",
            "peregrine_orca_reports_total 7",
            "peregrine_xds_streams{type=\"ads\",variant=\"sotw\"} 2",
            "peregrine_xds_streams{type=\"eds\",variant=\"delta\"} 1",
            "peregrine_xds_streams{type=\"cds\",variant=\"sotw\"} 0",
            "peregrine_xds_pushes_total{type=\"eds\"} 9",
            "peregrine_xds_nacks_total{type=\"eds\"} 1",
            "peregrine_fleet_records_skipped{reason=\"no_lease\"} 2",
            "peregrine_fleet_records_skipped{reason=\"shape\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        // One series per slot (the draining instance's 900 and the other host's worker are not
        // in it), and no pid anywhere.
        assert_eq!(
            text.matches("peregrine_worker_requests_total{").count(),
            1,
            "{text}"
        );
        assert!(!text.contains("pid"), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }
}
