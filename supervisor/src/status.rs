//! `peregrine status`: what the running supervisor knows of its workers, asked over its local socket.
//!
//! The supervisor side is [`report`], a pure function of the registry's endpoint snapshot, slot
//! statuses and loads; the registration server answers a `StatusRequest` with it. The client side is
//! [`query`] (connect, ask, read one answer) and [`StatusView`], which turns the answer into the table
//! [`StatusView::table`] prints or the JSON object `--json` prints.
//!
//! A row is a worker *slot*: a slot whose worker is not registered (starting, or crash-looping) still
//! has a row, with its restarts and no pid. A load is shown only with the worker instance it was sampled
//! from, never beside its successor.

use std::{
    collections::BTreeMap,
    io::{self, Read, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use bytes::BytesMut;
use peregrine_proto::{
    FrameError, MAX_STATUS_FRAME_LEN, decode_frame_limited, encode,
    v1::{
        self, StatusRequest, SupervisorMessage, WorkerMessage, supervisor_message, worker_message,
    },
};
use serde::Serialize;

use crate::{
    registry::{Loads, OrcaByHostname, OrcaStreams, Slots, Snapshot, WorkerLoad},
    xds::acks::StreamSync,
};

/// How long [`query`] waits for the supervisor at each step.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

/// The status answer for the registry's current state.
pub fn report(
    snapshot: &Snapshot,
    slots: &Slots,
    loads: &Loads,
    orca: &OrcaByHostname,
    streams: &[StreamSync],
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
    }
    for (service, view) in &snapshot.services {
        for (key, worker) in &view.workers {
            let record = records.get(&(service.as_str(), key.index)).cloned();
            let row = rows
                .entry((service, key.index, key.pid))
                .or_insert_with(|| record.unwrap_or_default());
            row.pid = Some(worker.pid);
            row.state = match (worker.state, worker.stalled) {
                (crate::registry::WorkerState::Ready, Some(_)) => "stalled".to_owned(),
                (state, _) => state.as_str().to_owned(),
            };
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
            .collect(),
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
    }
}

/// Why [`query`] got no status.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// Nothing listens on the socket.
    #[error("no supervisor is running on {path}")]
    NotRunning {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Connecting, writing or reading failed otherwise.
    #[error("cannot ask the supervisor on {path}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The supervisor refused to answer.
    #[error("the supervisor on {path} refused: {reason}")]
    Refused {
        /// The socket path.
        path: PathBuf,
        /// Its reason.
        reason: String,
    },
    /// The answer was not the message asked for.
    #[error("the supervisor on {path} sent no answer to the request")]
    Malformed {
        /// The socket path.
        path: PathBuf,
        /// The cause, when the frame itself was bad.
        #[source]
        source: Option<FrameError>,
    },
}

/// Asks the supervisor listening on `socket` for its status (blocking, [`QUERY_TIMEOUT`] per step).
pub fn query(socket: &Path) -> Result<v1::Status, StatusError> {
    let request = WorkerMessage {
        message: Some(worker_message::Message::Status(StatusRequest {})),
    };
    match ask(socket, &request, Some(QUERY_TIMEOUT))? {
        supervisor_message::Message::Status(status) => Ok(status),
        _ => Err(StatusError::Malformed {
            path: socket.to_owned(),
            source: None,
        }),
    }
}

/// Sends `request` to the supervisor listening on `socket` and returns its answer (blocking; each read
/// waits at most `read_timeout`, for ever if `None`). A refusal is an error.
pub fn ask(
    socket: &Path,
    request: &WorkerMessage,
    read_timeout: Option<Duration>,
) -> Result<supervisor_message::Message, StatusError> {
    let path = socket.to_owned();
    let io_error = |source| StatusError::Io {
        path: path.clone(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => StatusError::NotRunning {
            path: path.clone(),
            source,
        },
        _ => io_error(source),
    })?;
    stream.set_read_timeout(read_timeout).map_err(io_error)?;
    stream
        .set_write_timeout(Some(QUERY_TIMEOUT))
        .map_err(io_error)?;
    stream.write_all(&encode(request)).map_err(io_error)?;
    let mut buf = BytesMut::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let answer = loop {
        let decoded = decode_frame_limited::<SupervisorMessage>(&mut buf, MAX_STATUS_FRAME_LEN)
            .map_err(|source| StatusError::Malformed {
                path: path.clone(),
                source: Some(source),
            })?;
        if let Some(answer) = decoded {
            break answer;
        }
        let n = stream.read(&mut chunk).map_err(io_error)?;
        if n == 0 {
            return Err(StatusError::Malformed { path, source: None });
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    match answer.message {
        Some(supervisor_message::Message::Refused(refused)) => Err(StatusError::Refused {
            path,
            reason: refused.reason,
        }),
        Some(message) => Ok(message),
        None => Err(StatusError::Malformed { path, source: None }),
    }
}

/// Sends a control command (restart, reload) to the supervisor on `socket` and waits for its reply,
/// however long the command takes.
pub fn control(
    socket: &Path,
    request: v1::ControlRequest,
) -> Result<v1::ControlReply, StatusError> {
    let request = WorkerMessage {
        message: Some(worker_message::Message::Control(request)),
    };
    match ask(socket, &request, None)? {
        supervisor_message::Message::Control(reply) => Ok(reply),
        _ => Err(StatusError::Malformed {
            path: socket.to_owned(),
            source: None,
        }),
    }
}

/// A status answer for people and scripts: `--json` prints it with serde.
#[derive(Clone, Debug, PartialEq, Serialize)]
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
}

/// One of Envoy's xDS streams that serve endpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerRow {
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
#[derive(Clone, Debug, PartialEq, Serialize)]
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
                match s.silent_ms {
                    Some(ms) => format!(
                        "{} ({}) {synced}, silent for {:.0} s (drains do not wait for it)",
                        s.node,
                        s.kind,
                        ms as f64 / 1000.0
                    ),
                    None => format!("{} ({}) {synced}", s.node, s.kind),
                }
            })
            .collect();
        format!("xds: revision {}; {}\n", self.revision, streams.join(", "))
    }
}

impl From<v1::Status> for StatusView {
    fn from(status: v1::Status) -> Self {
        let running = !status.sampler.is_empty();
        StatusView {
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
        }
    }
}

impl From<v1::WorkerStatus> for WorkerRow {
    fn from(row: v1::WorkerStatus) -> Self {
        let load = row.load.as_ref();
        WorkerRow {
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
            stall: Some(row.stall).filter(|s| !s.is_empty()),
            restart_delay_ms: row.restart_delay_ms,
            cpu_cores: load.and_then(|l| l.cpu_cores),
            runq_wait_cores: load.and_then(|l| l.runq_wait_cores),
            requests_per_second: load.and_then(|l| l.requests_per_second),
            cpu_seconds_total: load.map(|l| l.cpu_seconds_total),
            runq_wait_seconds_total: load.map(|l| l.runq_wait_seconds_total),
            requests_total: load.map(|l| l.requests_total),
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
            (Some(sampler), Some(ms)) => format!("sampler: {sampler}, every {ms} ms\n"),
            _ => "sampler: not running\n".to_owned(),
        };
        out.push_str(&self.xds_line());
        let header = [
            "SERVICE",
            "WORKER",
            "PID",
            "STATE",
            "ADDRESSES",
            "CPU",
            "RUNQ WAIT",
            "REQ/S",
            "REQUESTS",
            "ORCA",
            "RESTARTS",
        ];
        let dash = || "-".to_owned();
        let fixed = |value: Option<f64>, places: usize| {
            value.map_or_else(dash, |v| format!("{v:.places$}"))
        };
        let rows: Vec<[String; 11]> = self
            .workers
            .iter()
            .map(|w| {
                [
                    w.service.clone(),
                    w.index.to_string(),
                    w.pid.map_or_else(dash, |p| p.to_string()),
                    w.state.to_owned(),
                    if w.addresses.is_empty() {
                        dash()
                    } else {
                        w.addresses.join(",")
                    },
                    fixed(w.cpu_cores, 2),
                    fixed(w.runq_wait_cores, 2),
                    fixed(w.requests_per_second, 1),
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
        let mut widths = header.map(str::len);
        for row in &rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.len());
            }
        }
        // Text columns (service, state, addresses) align left, numbers right.
        let left = [
            true, false, false, true, true, false, false, false, false, false, false,
        ];
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
            line(&row.each_ref().map(String::as_str));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        registry::{Address, Protocol, Registry, SamplerInfo, Worker},
        sampler::SamplerKind,
        xds::stream_kind::StreamKind,
    };

    fn load(service: &str, index: u32, pid: u32, sampled: bool) -> WorkerLoad {
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
            sampled_at: SystemTime::UNIX_EPOCH + Duration::from_millis(1234),
        }
    }

    fn registry() -> Registry {
        let registry = Registry::new(["api".to_string(), "web".to_string()]);
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
        registry.orca_opened("web-0-100");
        registry.orca_reported(
            "web-0-100",
            crate::registry::ReportSummary {
                cpu_utilization: 0.256,
                application_utilization: 0.266,
                rps_fractional: 12.3,
                sent_at: SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1),
            },
        );
        registry
    }

    #[test]
    fn a_report_has_a_row_per_slot_and_loads_only_with_their_own_worker() {
        let registry = registry();
        let status = report(
            &registry.snapshot(),
            &registry.slots(),
            &registry.loads(),
            &registry.orca_streams(),
            &[],
        );
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

    #[test]
    fn a_slot_being_replaced_shows_both_instances() {
        let registry = registry();
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
        let view = StatusView::from(report(
            &registry.snapshot(),
            &registry.slots(),
            &registry.loads(),
            &registry.orca_streams(),
            &[],
        ));
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
        let registry = registry();
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
        let view = StatusView::from(report(
            &registry.snapshot(),
            &registry.slots(),
            &registry.loads(),
            &registry.orca_streams(),
            &streams,
        ));
        let table = view.table();
        let expected = "\
sampler: procfs, every 250 ms
xds: revision 2; envoy-a (eds) synced 2, envoy-b (ads) not synced yet, script (eds) not synced yet, silent for 10 s (drains do not wait for it)
SERVICE  WORKER  PID  STATE       ADDRESSES                   CPU  RUNQ WAIT  REQ/S  REQUESTS    ORCA  RESTARTS
api           1  300  ready       unix:/run/api-1.sock          -          -      -         -       -         2
web           0  100  ready       [::1]:8000,127.0.0.1:8000  0.26       0.01   12.3        42  1@0.27         0
web           1    -  crash-loop  -                             -          -      -         -       -         7
";
        assert_eq!(table, expected, "\n{table}");
    }

    #[test]
    fn json_has_nulls_for_the_unknown() {
        let registry = registry();
        let view = StatusView::from(report(
            &registry.snapshot(),
            &registry.slots(),
            &registry.loads(),
            &registry.orca_streams(),
            &[],
        ));
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["sampler"], "procfs");
        assert_eq!(json["sample_interval_ms"], 250);
        assert_eq!(json["workers"][1]["requests_total"], 42);
        assert_eq!(json["workers"][1]["cpu_cores"], 0.256);
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

        let idle = StatusView::from(v1::Status::default());
        assert_eq!(
            idle.table(),
            "sampler: not running\nxds: revision 0; no Envoy connected for endpoints\n\
             SERVICE  WORKER  PID  STATE  ADDRESSES  CPU  RUNQ WAIT  REQ/S  REQUESTS  ORCA  RESTARTS\n"
        );
        assert!(serde_json::to_value(&idle).unwrap()["sampler"].is_null());
    }

    #[test]
    fn asking_a_socket_without_a_supervisor_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("none.sock");
        let error = query(&path).unwrap_err();
        assert!(matches!(error, StatusError::NotRunning { .. }), "{error:?}");
        assert_eq!(
            error.to_string(),
            format!("no supervisor is running on {}", path.display())
        );
        // A stale socket file, nobody listening.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(matches!(query(&path), Err(StatusError::NotRunning { .. })));
    }
}
