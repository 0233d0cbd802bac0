//! `peregrine status`: what the running supervisor knows of its workers, asked over its local socket.
//!
//! The supervisor side is [`report`], a pure function of the registry's endpoint snapshot, slot
//! statuses and loads; the registration server answers a `StatusRequest` with it. The client side is
//! [`client`] ([`query`]: connect, ask, read one answer) and [`view`] ([`StatusView`], which turns the
//! answer into the table [`StatusView::table`] prints or the JSON object `--json` prints).
//!
//! A row is a worker *slot*: a slot whose worker is not registered (starting, or crash-looping) still
//! has a row, with its restarts and no pid. A load is shown only with the worker instance it was sampled
//! from, never beside its successor.
//!
//! Invariant: the status is read from the registry and the [`Records`] kept beside it (the xDS
//! streams' ACKs, ORCA's streams, the fleet session), never from the process table or the manager:
//! it shows what Envoy is told, and a slot's status as its task last wrote it.

pub mod client;
pub mod view;
pub mod watch;

use std::{collections::BTreeMap, sync::Arc, time::SystemTime};

use peregrine_proto::v1;

pub use self::{
    client::{QUERY_TIMEOUT, StatusError, ask, control, query},
    view::{OrcaReportView, StatusView, SupervisorView, WorkerRow, XdsStreamView},
};
use crate::{
    config::Config,
    fleet::{EtcdState, FleetStatus, SessionStatus},
    orca::stats::{OrcaByHostname, OrcaStats, OrcaStreams},
    registry::{Health, Loads, Registry, Slots, Snapshot, WorkerLoad},
    xds::acks::{Acks, StreamSync},
};

/// What a status report reads beside the registry, each in its own home: how far each Envoy's xDS
/// streams have ACKed, ORCA's streams, and the fleet session.
#[derive(Clone, Debug, Default)]
pub struct Records {
    /// The xDS streams' ACKs.
    pub acks: Arc<Acks>,
    /// ORCA's streams per worker.
    pub orca: Arc<OrcaStats>,
    /// Where this host's etcd session is (never set on a single host).
    pub fleet: Arc<SessionStatus>,
    /// The supervisor process and the image it runs.
    pub supervisor: Option<v1::Supervisor>,
    /// How each configured service is balanced, as the last config applied says.
    pub services: Arc<ServiceNotes>,
}

/// How each configured service's workers listen and are balanced
/// ([`ServiceConfig::balanced_on`]), set when a config is applied.
#[derive(Debug, Default)]
pub struct ServiceNotes(std::sync::Mutex<Vec<v1::ServiceStatus>>);

impl ServiceNotes {
    /// The services of `config`, now applied.
    pub fn set(&self, config: &Config) {
        let notes = config
            .services
            .values()
            .map(|service| v1::ServiceStatus {
                name: service.name.clone(),
                balanced_on: service.balanced_on(),
                ..Default::default()
            })
            .collect();
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = notes;
    }

    fn get(&self) -> Vec<v1::ServiceStatus> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The status answer for everything `registry` and `records` hold now.
pub fn report_of(registry: &Registry, records: &Records) -> v1::Status {
    report_with_streams(registry, records, &records.acks.streams())
}

/// [`report_of`] with Envoy's endpoint `streams` given (tests give their own).
fn report_with_streams(
    registry: &Registry,
    records: &Records,
    streams: &[StreamSync],
) -> v1::Status {
    let snapshot = registry.snapshot();
    let mut status = report(
        &snapshot,
        &registry.slots(),
        &registry.loads(),
        &records.orca.current(&snapshot),
        streams,
        records.fleet.get().as_ref(),
    );
    status.supervisor = records.supervisor.clone();
    status.services = with_listeners(records.services.get(), &registry.loads());
    status
}

/// `services` with their shared listeners' loads, where `loads` has them.
fn with_listeners(mut services: Vec<v1::ServiceStatus>, loads: &Loads) -> Vec<v1::ServiceStatus> {
    for service in &mut services {
        let load = loads.listener(&service.name);
        service.listener_queued = load.map(|l| l.queued);
        service.listener_serving = load.map(|l| l.serving);
    }
    services
}

/// The status answer for the registry's current state.
pub fn report(
    snapshot: &Snapshot,
    slots: &Slots,
    loads: &Loads,
    orca: &OrcaByHostname,
    streams: &[StreamSync],
    fleet: Option<&FleetStatus>,
) -> v1::Status {
    let now = tokio::time::Instant::now();
    // Every slot the manager runs, and every registered worker instance (a slot being replaced has a
    // serving one and a draining one; the slot's restart record goes with each).
    let mut rows: BTreeMap<(&str, u32, u32), v1::WorkerStatus> = BTreeMap::new();
    let mut records: BTreeMap<(&str, u32), v1::WorkerStatus> = BTreeMap::new();
    for (service, index, status) in slots.iter() {
        let row = records.entry((service, index)).or_default();
        row.restarts = status.restarts;
        row.last_exit = status.last_exit.clone().unwrap_or_default();
        row.restart_delay_ms = status
            .restart_delay
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        row.crash_looping = status.crash_looping;
        row.last_probe = status.last_probe.clone().unwrap_or_default();
    }
    for (service, view) in &snapshot.services {
        for (key, worker) in &view.workers {
            let record = records.get(&(service.as_str(), key.index)).cloned();
            let row = rows
                .entry((service, key.index, key.pid))
                .or_insert_with(|| record.unwrap_or_default());
            row.pid = Some(worker.pid);
            row.state = state_word(worker.health()).to_owned();
            row.stall = worker.stalled.map(|s| s.to_string()).unwrap_or_default();
            row.hostname = worker.hostname.clone();
            row.addresses = worker
                .listener
                .addresses
                .iter()
                .map(ToString::to_string)
                .collect();
            row.load = loads.get(service, key.index, key.pid).map(load_message);
            row.orca = orca.get(&worker.hostname).map(orca_message);
        }
    }
    let own_host = fleet.map(|f| f.host.clone()).unwrap_or_default();
    for row in rows.values_mut().chain(records.values_mut()) {
        row.host = own_host.clone();
    }
    // Other hosts' workers, after this host's: what they published in etcd.
    let remote = snapshot.fleet.iter().flat_map(|(host, remote)| {
        remote.workers.values().map(move |worker| v1::WorkerStatus {
            service: worker.service.clone(),
            index: worker.index,
            pid: Some(worker.pid),
            hostname: worker.hostname.clone(),
            addresses: worker.addresses.iter().map(ToString::to_string).collect(),
            state: state_word(worker.health).to_owned(),
            host: host.clone(),
            ..Default::default()
        })
    });
    let (sampler, sample_interval_ms) = match loads.sampler {
        Some(info) => (
            info.kind.to_string(),
            u64::try_from(info.interval.as_millis()).unwrap_or(u64::MAX),
        ),
        None => (String::new(), 0),
    };
    v1::Status {
        sampler,
        sample_interval_ms,
        supervisor: None,
        services: Vec::new(),
        revision: snapshot.revision,
        xds_streams: streams
            .iter()
            .map(|s| v1::XdsStream {
                id: s.id,
                node: s.node.clone(),
                kind: s.kind.to_string(),
                synced_revision: s.synced_revision,
                silent_ms: s
                    .unanswered_since
                    .filter(|_| s.is_silent(now))
                    .map(|since| {
                        u64::try_from(now.duration_since(since).as_millis()).unwrap_or(u64::MAX)
                    }),
            })
            .collect(),
        workers: rows
            .into_iter()
            .map(|((service, index, _), row)| ((service, index), row))
            .chain(records.into_iter().filter(|((service, index), _)| {
                // A slot with no registered worker still gets a row (starting, crash looping).
                snapshot
                    .services
                    .get(*service)
                    .is_none_or(|view| view.instances(*index).next().is_none())
            }))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|((service, index), mut row)| {
                row.service = service.to_owned();
                row.index = index;
                row
            })
            .chain(remote)
            .collect(),
        fleet: fleet.map(|f| v1::Fleet {
            host: f.host.clone(),
            etcd: f.etcd.as_str().to_owned(),
            since_unix_ms: unix_ms(f.since),
            error: match &f.etcd {
                EtcdState::Unavailable { error } => error.clone(),
                _ => String::new(),
            },
            lease: f.lease.unwrap_or(0),
            hosts: snapshot.fleet.keys().cloned().collect(),
            conflicts: f.conflicts.clone(),
        }),
    }
}

/// A worker's `state` in a status row: `ready`, `draining` or `stalled`.
fn state_word(health: Health) -> &'static str {
    match health {
        Health::Serving => "ready",
        Health::Draining => "draining",
        Health::Unhealthy => "stalled",
    }
}

fn orca_message(streams: &OrcaStreams) -> v1::Orca {
    let last = streams.last_report.as_ref();
    v1::Orca {
        open_streams: streams.open,
        reports: streams.reports,
        last_cpu_utilization: last.map(|r| r.cpu_utilization),
        last_application_utilization: last.map(|r| r.application_utilization),
        last_rps_fractional: last.map(|r| r.rps_fractional),
        last_sent_unix_ms: last.map_or(0, |r| unix_ms(r.sent_at)),
    }
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn load_message(load: &WorkerLoad) -> v1::Load {
    let sampled_at_unix_ms = load
        .sampled_at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    v1::Load {
        cpu_cores: load.cpu_cores,
        runq_wait_cores: load.runq_wait_cores,
        requests_per_second: load.requests_per_second,
        cpu_seconds_total: load.cpu_seconds_total,
        runq_wait_seconds_total: load.runq_wait_seconds_total,
        requests_total: load.requests_total,
        sampled_at_unix_ms,
        in_flight: load.in_flight,
        in_flight_now: load.in_flight_now,
        in_flight_utilization: load.in_flight_utilization,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        registry::{Address, ListenerLoad, Protocol, Registry, SamplerInfo, Worker},
        sampler::SamplerKind,
        status::view::StatusView,
    };

    pub(super) fn load(service: &str, index: u32, pid: u32, sampled: bool) -> WorkerLoad {
        WorkerLoad {
            service: service.into(),
            index,
            pid,
            cpu_cores: sampled.then_some(0.256),
            runq_wait_cores: sampled.then_some(0.01),
            requests_per_second: sampled.then_some(12.34),
            cpu_seconds_total: 1.5,
            runq_wait_seconds_total: 0.25,
            requests_total: 42,
            in_flight: Some(0.52),
            in_flight_now: Some(1),
            in_flight_utilization: Some(0.52),
            smoothed: None,
            sampled_at: SystemTime::UNIX_EPOCH + Duration::from_millis(1234),
        }
    }

    /// A registry of two services, with slot records, loads and ORCA streams kept beside it.
    pub(super) fn registry() -> (Registry, Records) {
        let registry = Registry::new(["api".to_string(), "web".to_string()]);
        let records = Records::default();
        let addresses = vec![
            Address::Tcp("[::1]:8000".parse().unwrap()),
            Address::Tcp("127.0.0.1:8000".parse().unwrap()),
        ];
        registry
            .register(Worker::ready(
                "web",
                0,
                100,
                vec![Protocol::Http1],
                addresses,
            ))
            .unwrap();
        let unix = vec![Address::Unix("/run/api-1.sock".into())];
        registry
            .register(Worker::ready("api", 1, 300, vec![Protocol::Http2], unix))
            .unwrap();
        registry.set_restarts("web", 0, 0);
        registry.update_slot("web", 1, |slot| {
            slot.restarts = 7;
            slot.last_exit = Some("exit code 3".into());
            slot.restart_delay = Some(std::time::Duration::from_millis(6400));
            slot.crash_looping = true;
        });
        registry.set_restarts("api", 1, 2);
        registry.publish_loads(Loads::new(
            Some(SamplerInfo {
                kind: SamplerKind::Procfs,
                interval: Duration::from_millis(250),
            }),
            // The api load belongs to an earlier instance of the slot: it must not show.
            [load("web", 0, 100, true), load("api", 1, 299, true)],
        ));
        records.orca.opened("web-0-100");
        records.orca.reported(
            "web-0-100",
            crate::orca::stats::ReportSummary {
                cpu_utilization: 0.256,
                application_utilization: 0.266,
                rps_fractional: 12.3,
                sent_at: SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1),
            },
        );
        (registry, records)
    }

    #[test]
    fn a_shared_listener_shows_what_it_holds_beside_its_service() {
        let (registry, records) = registry();
        *records.services.0.lock().unwrap() = ["api", "web"]
            .map(|name| v1::ServiceStatus {
                name: name.into(),
                balanced_on: format!("{name}'s way"),
                ..Default::default()
            })
            .to_vec();
        let on_it = ListenerLoad {
            queued: 3,
            serving: 4,
            smoothed: None,
        };
        let loads = (*registry.loads()).clone();
        registry.publish_loads(loads.with_listeners([("web".to_string(), on_it)]));
        let status = report_of(&registry, &records);
        let figures: Vec<_> = status
            .services
            .iter()
            .map(|s| (s.name.as_str(), s.listener_queued, s.listener_serving))
            .collect();
        assert_eq!(figures, [("api", None, None), ("web", Some(3), Some(4))]);
        let view = StatusView::from(status);
        let text = view.table();
        assert!(text.contains("service api: api's way\n"), "{text}");
        assert!(
            text.contains("service web: web's way; on it now: 4 serving, 3 queued\n"),
            "{text}"
        );
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["listeners"]["web"]["serving"], 4);
        assert_eq!(json["listeners"]["web"]["queued"], 3);
        assert!(json["listeners"]["api"].is_null());
    }

    #[test]
    fn a_report_has_a_row_per_slot_and_loads_only_with_their_own_worker() {
        let (registry, records) = registry();
        let status = report_of(&registry, &records);
        assert_eq!(
            (status.sampler.as_str(), status.sample_interval_ms),
            ("procfs", 250)
        );
        let rows: Vec<(&str, u32, Option<u32>, u64, bool)> = status
            .workers
            .iter()
            .map(|w| {
                (
                    w.service.as_str(),
                    w.index,
                    w.pid,
                    w.restarts,
                    w.load.is_some(),
                )
            })
            .collect();
        assert_eq!(
            rows,
            [
                ("api", 1, Some(300), 2, false),
                ("web", 0, Some(100), 0, true),
                ("web", 1, None, 7, false),
            ]
        );
        assert_eq!(
            status.workers[1].addresses,
            ["[::1]:8000", "127.0.0.1:8000"]
        );
        assert_eq!(status.workers[0].addresses, ["unix:/run/api-1.sock"]);
        assert_eq!(status.workers[1].hostname, "web-0-100");
        let load = status.workers[1].load.unwrap();
        assert_eq!((load.requests_total, load.sampled_at_unix_ms), (42, 1234));
    }
}
