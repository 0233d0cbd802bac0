//! The status answer for people and scripts: the table `peregrine status` prints, and the JSON object
//! `--json` prints (serde).
//!
//! Invariant: every text of the answer reaches the table through [`printable`]. Host and service
//! names, addresses, node ids and reasons come from other hosts (through etcd), from Envoy and from
//! workers; a terminal escape in one must not reach the terminal that shows the table. The JSON
//! escapes them already (serde writes control characters as `\u001b`).

use std::borrow::Cow;

use peregrine_proto::v1;
use schemars::JsonSchema;
use serde::Serialize;

use crate::printable::printable;

/// A status answer for people and scripts: `--json` prints it with serde.
#[derive(Clone, Debug, Default, PartialEq, Serialize, JsonSchema)]
pub struct StatusView {
    /// The sampler's scheduler source, `null` when none runs.
    pub sampler: Option<String>,
    /// The sample interval in milliseconds, `null` when no sampler runs.
    pub sample_interval_ms: Option<u64>,
    /// One row per worker slot.
    pub workers: Vec<WorkerRow>,
    /// The registry's revision (one more with every endpoint change).
    pub revision: u64,
    /// Envoy's open endpoint streams and the revision each has ACKed.
    pub xds_streams: Vec<XdsStreamView>,
    /// This host's place in a fleet, `null` on a single host.
    pub fleet: Option<FleetView>,
    /// The supervisor process and the program image it runs, `null` from an older supervisor.
    pub supervisor: Option<SupervisorView>,
    /// How each service's workers listen and are balanced, by service (empty from an older
    /// supervisor).
    pub services: std::collections::BTreeMap<String, String>,
    /// The shared listeners at the last sample, by service: a service whose workers share one
    /// listener has its requests in flight there, whichever worker holds them.
    pub listeners: std::collections::BTreeMap<String, ListenerView>,
}

/// A shared listener's load at the last sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
pub struct ListenerView {
    /// Connections waiting in its accept queue.
    pub queued: u64,
    /// Accepted connections that hold a request.
    pub serving: u64,
}

/// The supervisor process and its program image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, JsonSchema)]
pub struct SupervisorView {
    /// Its process id (an upgrade in place keeps it).
    pub pid: u32,
    /// Its `--version` line, without the command's name.
    pub version: String,
    /// When this image started, in milliseconds since the Unix epoch (an upgrade changes it).
    pub started_unix_ms: u64,
}

/// A fleet's membership as the supervisor sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, JsonSchema)]
pub struct FleetView {
    /// This host's name.
    pub host: String,
    /// `connecting`, `connected` or `unavailable`.
    pub etcd: String,
    /// Since when, in milliseconds since the Unix epoch.
    pub since_unix_ms: u64,
    /// Why etcd is unavailable, `null` otherwise.
    pub error: Option<String>,
    /// The lease of this host's keys, `null` before one is granted.
    pub lease: Option<i64>,
    /// The other hosts in the view.
    pub hosts: Vec<String>,
    /// The services whose spec hosts disagree on, one line each.
    pub conflicts: Vec<String>,
}

/// One of Envoy's xDS streams that serve endpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, JsonSchema)]
pub struct XdsStreamView {
    /// The stream's id, as in the logs.
    pub id: u64,
    /// Envoy's node id.
    pub node: String,
    /// `eds` or `ads`.
    pub kind: String,
    /// The highest revision Envoy has ACKed on it, `null` before its first ACK.
    pub synced_revision: Option<u64>,
    /// For how long, in milliseconds, it has owed an answer to an endpoints response, once that is
    /// longer than the silence grace (5 s); `null` otherwise. Drains do not wait for a silent stream.
    pub silent_ms: Option<u64>,
}

/// One worker slot in a [`StatusView`]; the load fields are `null` until sampled.
#[derive(Clone, Debug, Default, PartialEq, Serialize, JsonSchema)]
pub struct WorkerRow {
    /// The host it runs on, `null` on a single host.
    pub host: Option<String>,
    /// The service.
    pub service: String,
    /// The slot's index.
    pub index: u32,
    /// The registered worker's pid, `null` without one.
    pub pid: Option<u32>,
    /// The registered worker's hostname, `null` without one.
    pub hostname: Option<String>,
    /// Its addresses.
    pub addresses: Vec<String>,
    /// How often the slot's worker was restarted.
    pub restarts: u64,
    /// `ready` (a worker is registered and serving), `draining` (registered, about to stop: Envoy
    /// sends it no new requests; its successor, if any, has a row of its own), `stalled` (registered
    /// but stopped or not reading its connections: Envoy sends it nothing new), `crash-loop` (its
    /// workers keep exiting at start and the restart delay grows) or `starting`.
    pub state: &'static str,
    /// How the slot's last worker ended, `null` before the first exit.
    pub last_exit: Option<String>,
    /// For a server on a passed listener that is not ready yet, what the last probe of its ready
    /// path found; `null` otherwise.
    pub last_probe: Option<String>,
    /// Why a `stalled` worker is stalled (Envoy sends it nothing new until it moves again), `null`
    /// otherwise.
    pub stall: Option<String>,
    /// The delay before the restart after that exit, in milliseconds.
    pub restart_delay_ms: Option<u64>,
    /// CPU use in cores (from the second sample on).
    pub cpu_cores: Option<f64>,
    /// Run-queue wait in cores (from the second sample on).
    pub runq_wait_cores: Option<f64>,
    /// Requests per second (from the second sample on).
    pub requests_per_second: Option<f64>,
    /// On-CPU seconds.
    pub cpu_seconds_total: Option<f64>,
    /// Run-queue wait seconds.
    pub runq_wait_seconds_total: Option<f64>,
    /// Requests served by this worker instance.
    pub requests_total: Option<u64>,
    /// Mean requests in flight between the last two samples (`null` where not known).
    pub in_flight: Option<f64>,
    /// Requests in flight at the last sample.
    pub in_flight_now: Option<u64>,
    /// The utilization requests in flight make: `in_flight` over the service's concurrency.
    pub in_flight_utilization: Option<f64>,
    /// When the load was sampled, in milliseconds since the Unix epoch.
    pub sampled_at_unix_ms: Option<u64>,
    /// ORCA streams Envoy holds open for this worker (`null`: Envoy never opened one).
    pub orca_streams: Option<u32>,
    /// ORCA reports sent for this worker.
    pub orca_reports: Option<u64>,
    /// The last ORCA report sent, `null` before the first.
    pub orca_last_report: Option<OrcaReportView>,
}

/// An ORCA report as sent to Envoy.
#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
pub struct OrcaReportView {
    /// `cpu_utilization`.
    pub cpu_utilization: f64,
    /// `application_utilization` (what Envoy weighs by).
    pub application_utilization: f64,
    /// `rps_fractional`.
    pub rps_fractional: f64,
    /// When it was sent, in milliseconds since the Unix epoch.
    pub sent_at_unix_ms: u64,
}

impl StatusView {
    /// The JSON Schema of what `--json` prints (`peregrine status --schema`), from these very types:
    /// each field with its description.
    pub fn schema() -> serde_json::Value {
        schemars::schema_for!(StatusView).to_value()
    }

    /// `xds: revision 12; envoy-a (eds) synced 12, envoy-b (ads) synced 11`, or no Envoy connected.
    fn xds_line(&self) -> String {
        if self.xds_streams.is_empty() {
            return format!(
                "xds: revision {}; no Envoy connected for endpoints\n",
                self.revision
            );
        }
        let streams: Vec<String> = self
            .xds_streams
            .iter()
            .map(|s| {
                let synced = s
                    .synced_revision
                    .map_or_else(|| "not synced yet".to_owned(), |r| format!("synced {r}"));
                let (node, kind) = (printable(&s.node), printable(&s.kind));
                match s.silent_ms {
                    Some(ms) => format!(
                        "{node} ({kind}) {synced}, silent for {:.0} s (drains do not wait for it)",
                        ms as f64 / 1000.0
                    ),
                    None => format!("{node} ({kind}) {synced}"),
                }
            })
            .collect();
        format!("xds: revision {}; {}\n", self.revision, streams.join(", "))
    }
}

impl From<v1::Status> for StatusView {
    fn from(status: v1::Status) -> Self {
        let running = !status.sampler.is_empty();
        let listeners = status
            .services
            .iter()
            .filter_map(|s| {
                let view = ListenerView {
                    queued: s.listener_queued?,
                    serving: s.listener_serving?,
                };
                Some((s.name.clone(), view))
            })
            .collect();
        let services = status
            .services
            .into_iter()
            .map(|s| (s.name, s.balanced_on))
            .collect();
        StatusView {
            services,
            listeners,
            sampler: running.then_some(status.sampler),
            sample_interval_ms: running.then_some(status.sample_interval_ms),
            workers: status.workers.into_iter().map(WorkerRow::from).collect(),
            revision: status.revision,
            xds_streams: status
                .xds_streams
                .into_iter()
                .map(|s| XdsStreamView {
                    id: s.id,
                    node: s.node,
                    kind: s.kind,
                    synced_revision: s.synced_revision,
                    silent_ms: s.silent_ms,
                })
                .collect(),
            fleet: status.fleet.map(|f| FleetView {
                host: f.host,
                etcd: f.etcd,
                since_unix_ms: f.since_unix_ms,
                error: Some(f.error).filter(|e| !e.is_empty()),
                lease: (f.lease != 0).then_some(f.lease),
                hosts: f.hosts,
                conflicts: f.conflicts,
            }),
            supervisor: status.supervisor.map(|s| SupervisorView {
                pid: s.pid,
                version: s.version,
                started_unix_ms: s.started_unix_ms,
            }),
        }
    }
}

impl From<v1::WorkerStatus> for WorkerRow {
    fn from(row: v1::WorkerStatus) -> Self {
        let load = row.load.as_ref();
        WorkerRow {
            host: Some(row.host).filter(|h| !h.is_empty()),
            service: row.service,
            index: row.index,
            pid: row.pid,
            hostname: Some(row.hostname).filter(|h| !h.is_empty()),
            addresses: row.addresses,
            restarts: row.restarts,
            state: if row.pid.is_some() {
                match row.state.as_str() {
                    "draining" => "draining",
                    "stalled" => "stalled",
                    _ => "ready",
                }
            } else if row.crash_looping {
                "crash-loop"
            } else {
                "starting"
            },
            last_exit: Some(row.last_exit).filter(|e| !e.is_empty()),
            last_probe: Some(row.last_probe).filter(|p| !p.is_empty()),
            stall: Some(row.stall).filter(|s| !s.is_empty()),
            restart_delay_ms: row.restart_delay_ms,
            cpu_cores: load.and_then(|l| l.cpu_cores),
            runq_wait_cores: load.and_then(|l| l.runq_wait_cores),
            requests_per_second: load.and_then(|l| l.requests_per_second),
            cpu_seconds_total: load.map(|l| l.cpu_seconds_total),
            runq_wait_seconds_total: load.map(|l| l.runq_wait_seconds_total),
            requests_total: load.map(|l| l.requests_total),
            in_flight: load.and_then(|l| l.in_flight),
            in_flight_now: load.and_then(|l| l.in_flight_now),
            in_flight_utilization: load.and_then(|l| l.in_flight_utilization),
            sampled_at_unix_ms: load.map(|l| l.sampled_at_unix_ms),
            orca_streams: row.orca.as_ref().map(|o| o.open_streams),
            orca_reports: row.orca.as_ref().map(|o| o.reports),
            orca_last_report: row.orca.as_ref().and_then(|o| {
                Some(OrcaReportView {
                    cpu_utilization: o.last_cpu_utilization?,
                    application_utilization: o.last_application_utilization?,
                    rps_fractional: o.last_rps_fractional?,
                    sent_at_unix_ms: o.last_sent_unix_ms,
                })
            }),
        }
    }
}

impl StatusView {
    /// The human-readable table: a line naming the sampler, then one row per worker slot. Unknown
    /// values (no worker, no sample yet) show as `-`.
    pub fn table(&self) -> String {
        let mut out = match (&self.sampler, self.sample_interval_ms) {
            (Some(sampler), Some(ms)) => {
                format!("sampler: {}, every {ms} ms\n", printable(sampler))
            }
            _ => "sampler: not running\n".to_owned(),
        };
        out.push_str(&self.xds_line());
        for (service, balanced_on) in &self.services {
            // A shared listener holds the service's requests in flight: what it held last.
            let held = self.listeners.get(service).map_or_else(String::new, |l| {
                format!("; on it now: {} serving, {} queued", l.serving, l.queued)
            });
            out.push_str(&format!(
                "service {}: {}{held}\n",
                printable(service),
                printable(balanced_on)
            ));
        }
        if let Some(fleet) = &self.fleet {
            out.push_str(&fleet_line(fleet));
            for conflict in &fleet.conflicts {
                out.push_str(&format!("fleet: {}\n", printable(conflict)));
            }
        }
        let mut header = vec![
            "SERVICE",
            "WORKER",
            "PID",
            "STATE",
            "ADDRESSES",
            "CPU",
            "RUNQ WAIT",
            "REQ/S",
            "IN FLIGHT",
            "REQUESTS",
            "ORCA",
            "RESTARTS",
        ];
        let dash = || "-".to_owned();
        let fixed = |value: Option<f64>, places: usize| {
            value.map_or_else(dash, |v| format!("{v:.places$}"))
        };
        let mut rows: Vec<Vec<String>> = self
            .workers
            .iter()
            .map(|w| {
                vec![
                    printable(&w.service).into_owned(),
                    w.index.to_string(),
                    w.pid.map_or_else(dash, |p| p.to_string()),
                    w.state.to_owned(),
                    if w.addresses.is_empty() {
                        dash()
                    } else {
                        printable(&w.addresses.join(",")).into_owned()
                    },
                    fixed(w.cpu_cores, 2),
                    fixed(w.runq_wait_cores, 2),
                    fixed(w.requests_per_second, 1),
                    fixed(w.in_flight, 2),
                    w.requests_total.map_or_else(dash, |r| r.to_string()),
                    // Open ORCA streams, and the utilization Envoy weighs the worker by.
                    match (w.orca_streams, &w.orca_last_report) {
                        (Some(n), Some(r)) => format!("{n}@{:.2}", r.application_utilization),
                        (Some(n), None) => n.to_string(),
                        (None, _) => dash(),
                    },
                    w.restarts.to_string(),
                ]
            })
            .collect();
        // Text columns (service, state, addresses) align left, numbers right.
        let mut left = vec![
            true, false, false, true, true, false, false, false, false, false, false, false,
        ];
        // In a fleet, a HOST column first: every host's workers are listed.
        if self.fleet.is_some() {
            header.insert(0, "HOST");
            left.insert(0, true);
            for (row, worker) in rows.iter_mut().zip(&self.workers) {
                let host = worker.host.as_deref().map(printable);
                row.insert(0, host.map_or_else(dash, Cow::into_owned));
            }
        }
        let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
        for row in &rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.len());
            }
        }
        let mut line = |cells: &[&str]| {
            let mut text = String::new();
            for (i, cell) in cells.iter().enumerate() {
                if i > 0 {
                    text.push_str("  ");
                }
                let width = widths[i];
                if left[i] {
                    text.push_str(&format!("{cell:<width$}"));
                } else {
                    text.push_str(&format!("{cell:>width$}"));
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        line(&header);
        for row in &rows {
            line(&row.iter().map(String::as_str).collect::<Vec<_>>());
        }
        out
    }
}

/// `fleet: host a; etcd connected, lease 7587...; 2 other hosts (b, c)`.
fn fleet_line(fleet: &FleetView) -> String {
    let state = printable(&fleet.etcd);
    let etcd = match (&fleet.error, fleet.lease) {
        (Some(error), _) => format!(
            "etcd unavailable for {} ({}): serving the last view",
            ago(fleet.since_unix_ms),
            printable(error)
        ),
        (None, Some(lease)) => format!("etcd {state}, lease {lease:x}"),
        (None, None) => format!("etcd {state}"),
    };
    let hosts: Vec<Cow<'_, str>> = fleet.hosts.iter().map(|h| printable(h)).collect();
    let others = match hosts.len() {
        0 => "no other host".to_owned(),
        1 => format!("1 other host ({})", hosts[0]),
        n => format!("{n} other hosts ({})", hosts.join(", ")),
    };
    format!("fleet: host {}; {etcd}; {others}\n", printable(&fleet.host))
}

/// How long ago `ms` (milliseconds since the Unix epoch) was, for a person: `12.3 s`.
fn ago(ms: u64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    format!("{:.1} s", now.saturating_sub(ms) as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        printable::is_bidi_control,
        registry::{Address, Protocol, Worker},
        status::{report_of, report_with_streams, tests::registry},
        xds::{acks::StreamSync, stream_kind::StreamKind},
    };

    #[test]
    fn a_slot_being_replaced_shows_both_instances() {
        let (registry, records) = registry();
        let addr = Address::Tcp("127.0.0.1:8001".parse().unwrap());
        registry
            .register(Worker::ready(
                "web",
                0,
                101,
                vec![Protocol::Http1],
                vec![addr],
            ))
            .unwrap();
        let view = StatusView::from(report_of(&registry, &records));
        let web0: Vec<(Option<u32>, &str, bool)> = view
            .workers
            .iter()
            .filter(|w| w.service == "web" && w.index == 0)
            .map(|w| (w.pid, w.state, w.requests_total.is_some()))
            .collect();
        assert_eq!(
            web0,
            [(Some(100), "draining", true), (Some(101), "ready", false)],
            "the old one keeps its own load"
        );
    }

    #[test]
    fn the_table_aligns_columns_and_dashes_the_unknown() {
        let (registry, records) = registry();
        let streams = [
            StreamSync {
                id: 3,
                node: "envoy-a".into(),
                kind: StreamKind::Eds,
                synced_revision: Some(2),
                unanswered_since: None,
            },
            StreamSync {
                id: 4,
                node: "envoy-b".into(),
                kind: StreamKind::Ads,
                synced_revision: None,
                unanswered_since: None,
            },
            StreamSync {
                id: 5,
                node: "script".into(),
                kind: StreamKind::Eds,
                synced_revision: None,
                unanswered_since: Some(
                    tokio::time::Instant::now() - crate::xds::acks::SILENCE_GRACE * 2,
                ),
            },
        ];
        let view = StatusView::from(report_with_streams(&registry, &records, &streams));
        let table = view.table();
        let expected = "\
sampler: procfs, every 250 ms
xds: revision 2; envoy-a (eds) synced 2, envoy-b (ads) not synced yet, script (eds) not synced yet, silent for 10 s (drains do not wait for it)
SERVICE  WORKER  PID  STATE       ADDRESSES                   CPU  RUNQ WAIT  REQ/S  IN FLIGHT  REQUESTS    ORCA  RESTARTS
api           1  300  ready       unix:/run/api-1.sock          -          -      -          -         -       -         2
web           0  100  ready       [::1]:8000,127.0.0.1:8000  0.26       0.01   12.3       0.52        42  1@0.27         0
web           1    -  crash-loop  -                             -          -      -          -         -       -         7
";
        assert_eq!(table, expected, "\n{table}");
    }

    #[test]
    fn json_has_nulls_for_the_unknown() {
        let (registry, records) = registry();
        let view = StatusView::from(report_of(&registry, &records));
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["sampler"], "procfs");
        assert_eq!(json["sample_interval_ms"], 250);
        assert_eq!(json["workers"][1]["requests_total"], 42);
        assert_eq!(json["workers"][1]["cpu_cores"], 0.256);
        assert_eq!(json["workers"][1]["in_flight"], 0.52);
        assert_eq!(json["workers"][1]["in_flight_now"], 1);
        assert_eq!(json["workers"][1]["in_flight_utilization"], 0.52);
        assert!(json["workers"][0]["in_flight"].is_null());
        assert_eq!(json["workers"][1]["hostname"], "web-0-100");
        assert!(json["workers"][2]["pid"].is_null());
        assert!(json["workers"][2]["hostname"].is_null());
        assert!(json["workers"][0]["requests_total"].is_null());
        assert_eq!(json["workers"][1]["orca_streams"], 1);
        assert_eq!(json["workers"][1]["orca_reports"], 1);
        assert_eq!(
            json["workers"][1]["orca_last_report"]["application_utilization"],
            0.266
        );
        assert_eq!(
            json["workers"][1]["orca_last_report"]["sent_at_unix_ms"],
            1000
        );
        assert!(json["workers"][0]["orca_streams"].is_null());
        assert_eq!(json["workers"][2]["state"], "crash-loop");
        assert_eq!(json["workers"][2]["last_exit"], "exit code 3");
        assert_eq!(json["workers"][2]["restart_delay_ms"], 6400);
        assert_eq!(json["workers"][1]["state"], "ready");
        assert!(json["workers"][1]["last_exit"].is_null());
        assert_eq!(json["revision"], 2);
        assert_eq!(json["xds_streams"], serde_json::json!([]));
        assert!(json["supervisor"].is_null(), "an older supervisor's answer");
        let answer = v1::Status {
            supervisor: Some(v1::Supervisor {
                pid: 42,
                version: "0.1.0 (abc1234, eBPF sampler built in)".into(),
                started_unix_ms: 1_000,
            }),
            ..Default::default()
        };
        let json = serde_json::to_value(StatusView::from(answer)).unwrap();
        assert_eq!(
            json["supervisor"],
            serde_json::json!({
                "pid": 42,
                "version": "0.1.0 (abc1234, eBPF sampler built in)",
                "started_unix_ms": 1000,
            })
        );

        let idle = StatusView::from(v1::Status::default());
        assert_eq!(
            idle.table(),
            "sampler: not running\nxds: revision 0; no Envoy connected for endpoints\n\
             SERVICE  WORKER  PID  STATE  ADDRESSES  CPU  RUNQ WAIT  REQ/S  IN FLIGHT  REQUESTS  ORCA  RESTARTS\n"
        );
        assert!(serde_json::to_value(&idle).unwrap()["sampler"].is_null());
    }

    #[test]
    fn text_from_outside_reaches_the_table_escaped() {
        const ESC: &str = "\x1b]0;owned\x07\x1b[2J";
        let row = |host: &str| v1::WorkerStatus {
            service: format!("web{ESC}"),
            index: 0,
            pid: Some(7),
            hostname: format!("web-0-7{ESC}"),
            addresses: vec![format!("10.0.0.1:80\r\n{ESC}")],
            state: "ready".into(),
            host: host.into(),
            ..Default::default()
        };
        let view = StatusView::from(v1::Status {
            sampler: format!("ebpf{ESC}"),
            sample_interval_ms: 200,
            workers: vec![row("a"), row(&format!("b\u{202e}{ESC}"))],
            xds_streams: vec![v1::XdsStream {
                id: 1,
                node: format!("envoy{ESC}"),
                kind: format!("eds{ESC}"),
                synced_revision: Some(1),
                silent_ms: Some(9000),
            }],
            fleet: Some(v1::Fleet {
                host: format!("a{ESC}"),
                etcd: format!("connected{ESC}"),
                lease: 1,
                hosts: vec![format!("b\u{202e}{ESC}"), format!("c{ESC}")],
                conflicts: vec![format!("service web{ESC}: c configured otherwise")],
                ..Default::default()
            }),
            ..Default::default()
        });
        let unavailable = StatusView::from(v1::Status {
            fleet: Some(v1::Fleet {
                host: "a".into(),
                etcd: "unavailable".into(),
                error: format!("etcd: {ESC}"),
                ..Default::default()
            }),
            ..Default::default()
        });
        for table in [view.table(), unavailable.table()] {
            let raw: Vec<char> = table
                .chars()
                .filter(|&c| (c.is_control() && c != '\n') || is_bidi_control(c))
                .collect();
            assert!(raw.is_empty(), "{raw:?} in\n{table}");
            assert_eq!(
                table.lines().count(),
                table.matches('\n').count(),
                "one line per line: {table:?}"
            );
        }
        let table = view.table();
        let escaped = "\\x1b]0;owned\\x07\\x1b[2J";
        for shown in [
            format!("sampler: ebpf{escaped}, every 200 ms"),
            format!("envoy{escaped} (eds{escaped}) synced 1, silent for 9 s"),
            format!("fleet: host a{escaped}; etcd connected{escaped}, lease 1"),
            format!("2 other hosts (b\\u{{202e}}{escaped}, c{escaped})"),
            format!("fleet: service web{escaped}: c configured otherwise"),
            format!("web{escaped}"),
            format!("10.0.0.1:80\\x0d\\x0a{escaped}"),
        ] {
            assert!(table.contains(&shown), "{shown:?} not in\n{table}");
        }
        assert!(
            unavailable
                .table()
                .contains(&format!("(etcd: {escaped}): serving the last view")),
            "{}",
            unavailable.table()
        );
        // The JSON keeps the text as it is, escaped by serde.
        let json = serde_json::to_string(&view).unwrap();
        assert!(
            !json.contains('\x1b') && json.contains("\\u001b]0;owned"),
            "{json}"
        );
        assert_eq!(
            serde_json::to_value(&view).unwrap()["workers"][0]["service"],
            format!("web{ESC}")
        );
    }

    #[test]
    fn in_a_fleet_the_table_has_a_host_column_and_a_fleet_line() {
        let row = |host: &str, pid: u32| v1::WorkerStatus {
            service: "web".into(),
            index: 0,
            pid: Some(pid),
            hostname: format!("web-0-{pid}"),
            addresses: vec!["10.0.0.1:8000".into()],
            state: "ready".into(),
            host: host.into(),
            ..Default::default()
        };
        let view = StatusView::from(v1::Status {
            workers: vec![row("a", 10), row("b", 20)],
            fleet: Some(v1::Fleet {
                host: "a".into(),
                etcd: "connected".into(),
                since_unix_ms: 1,
                error: String::new(),
                lease: 255,
                hosts: vec!["b".into()],
                conflicts: vec![
                    "service web: b configured otherwise; every host serves a's spec".into(),
                ],
            }),
            ..Default::default()
        });
        let table = view.table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[2],
            "fleet: host a; etcd connected, lease ff; 1 other host (b)"
        );
        assert_eq!(
            lines[3],
            "fleet: service web: b configured otherwise; every host serves a's spec"
        );
        assert!(lines[4].starts_with("HOST  SERVICE"), "{table}");
        assert!(lines[5].starts_with("a     web"), "{table}");
        assert!(lines[6].starts_with("b     web"), "{table}");
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["workers"][1]["host"], "b");
        assert_eq!(json["fleet"]["etcd"], "connected");
        let away = StatusView::from(v1::Status {
            fleet: Some(v1::Fleet {
                host: "a".into(),
                etcd: "unavailable".into(),
                error: "etcd: connection refused".into(),
                ..Default::default()
            }),
            ..Default::default()
        });
        assert!(
            away.table().contains("etcd unavailable for "),
            "{}",
            away.table()
        );
    }
}
