//! ORCA out-of-band load reports: `xds.service.orca.v3.OpenRcaService/StreamCoreMetrics` on the
//! supervisor's gRPC port, one stream per worker, so that Envoy's client-side weighted round robin
//! sends more requests to workers with spare capacity.
//!
//! Envoy opens one stream per endpoint, to the endpoint's IP and the supervisor's port, with
//! `:authority` set to the endpoint's EDS hostname (unique per worker instance): that is how one
//! service here tells every worker's stream apart ([`WithAuthority`] hands the authority to the
//! handler). A stream reports the worker's latest sample from the registry's loads (see
//! [`report_for`] for what each field means), first as soon as a real sample exists, then the first
//! sample of every report interval (Envoy's request, never below the configured floor) as soon as
//! the sampler publishes it, and ends with OK when the worker leaves the registry. An authority that
//! names no worker gets NOT_FOUND, which Envoy retries with backoff (UNIMPLEMENTED would disable ORCA
//! for that host until the next CDS change).
//!
//! In band (`orca = "in-band"`), the same reports go into each worker's shared memory instead, and
//! the worker sends them in its responses: see [`in_band`].
//!
//! Invariant: reads the registry (snapshot and loads) and never writes it; what its streams tell
//! about themselves goes to [`stats::OrcaStats`], their own home.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, SystemTime},
};

use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use peregrine_proto::xds::{
    data::orca::v3::OrcaLoadReport,
    service::orca::v3::{
        OrcaLoadReportRequest,
        open_rca_service_server::{OpenRcaService, OpenRcaServiceServer},
    },
};
use tokio::{
    sync::{mpsc, watch},
    time::Instant,
};
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tonic::{
    Request, Response, Status,
    codegen::{Service, http},
    server::NamedService,
};

pub mod in_band;
pub mod stats;

use self::stats::{OrcaStats, ReportSummary};
use crate::{
    config::MAX_REPORT_INTERVAL,
    grpc_port::ClientProof,
    printable::printable,
    registry::{Loads, Registry, SmoothedLoad, Snapshot, Worker, WorkerLoad},
};

/// The smallest utilization reported: Envoy treats 0 as an error and keeps the old weight.
pub const MIN_UTILIZATION: f64 = 0.001;
/// Below this many requests per second a worker counts as idle.
pub const IDLE_RPS: f64 = 0.01;

/// The ORCA service.
#[derive(Clone, Debug)]
pub struct OrcaService {
    registry: Arc<Registry>,
    stats: Arc<OrcaStats>,
    min_interval: Duration,
}

impl OrcaService {
    /// Reports from `registry`'s loads, never more often than every `min_interval`, recording its
    /// streams in `stats`.
    pub fn new(registry: Arc<Registry>, stats: Arc<OrcaStats>, min_interval: Duration) -> Self {
        OrcaService {
            registry,
            stats,
            min_interval,
        }
    }

    /// The service, wrapped to learn each stream's `:authority`, ready for a tonic router.
    pub fn into_server(self) -> WithAuthority<OpenRcaServiceServer<OrcaService>> {
        WithAuthority(OpenRcaServiceServer::new(self))
    }
}

/// The `:authority` of a request (the worker's hostname, for ORCA streams).
#[derive(Clone, Debug)]
struct Authority(String);

/// Hands a request's `:authority` (or `Host`) to the gRPC handler as a request extension; tonic does
/// not expose the URI otherwise.
#[derive(Clone, Debug)]
pub struct WithAuthority<S>(S);

impl<S, B> Service<http::Request<B>> for WithAuthority<S>
where
    S: Service<http::Request<B>, Error = Infallible>,
{
    type Response = S::Response;
    type Error = Infallible;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let authority = request
            .uri()
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| {
                request
                    .headers()
                    .get(http::header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_owned)
            });
        if let Some(authority) = authority {
            request.extensions_mut().insert(Authority(authority));
        }
        self.0.call(request)
    }
}

impl<S: NamedService> NamedService for WithAuthority<S> {
    const NAME: &'static str = S::NAME;
}

type ReportStream = Pin<Box<dyn Stream<Item = Result<OrcaLoadReport, Status>> + Send>>;

#[tonic::async_trait]
impl OpenRcaService for OrcaService {
    type StreamCoreMetricsStream = ReportStream;

    async fn stream_core_metrics(
        &self,
        request: Request<OrcaLoadReportRequest>,
    ) -> Result<Response<ReportStream>, Status> {
        let authority = request
            .extensions()
            .get::<Authority>()
            .map(|a| a.0.as_str());
        let (subject, interval) = self.accept(authority, request.get_ref())?;
        // Only a client that knows a registered worker's hostname (or a shared listener's) gets
        // here: the connection is proven ([`ClientProof`]).
        if let Some(proof) = request.extensions().get::<ClientProof>() {
            proof.prove();
        }
        tracing::info!(hostname = %subject.hostname(), ?interval, "ORCA stream opened");
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(report_loop(
            self.registry.clone(),
            self.stats.clone(),
            subject,
            interval,
            tx,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// What one ORCA stream reports on: the endpoint its `:authority` names.
#[derive(Clone, Debug, PartialEq)]
pub enum Subject {
    /// A worker with a listener of its own (or the only worker on a shared one).
    Worker(Worker),
    /// A service's shared listener: its workers, one endpoint to Envoy.
    Listener {
        /// The service.
        service: String,
        /// Its endpoint's hostname ([`crate::registry::shared_hostname`]).
        hostname: String,
    },
}

impl Subject {
    /// The endpoint's hostname, as Envoy names it.
    pub fn hostname(&self) -> &str {
        match self {
            Subject::Worker(worker) => &worker.hostname,
            Subject::Listener { hostname, .. } => hostname,
        }
    }

    /// Whether it is still published in `snapshot`: the worker instance registered, or workers of
    /// the service still sharing its listener.
    fn is_published(&self, snapshot: &Snapshot) -> bool {
        match self {
            Subject::Worker(worker) => is_registered(snapshot, worker),
            Subject::Listener { service, .. } => snapshot
                .services
                .get(service)
                .is_some_and(|view| view.shares_listener()),
        }
    }

    /// Its report from `loads` ([`report_for`], [`report_for_listener`]).
    fn report(&self, loads: &Loads) -> Option<OrcaLoadReport> {
        match self {
            Subject::Worker(worker) => report_for(loads, worker),
            Subject::Listener { service, .. } => report_for_listener(loads, service),
        }
    }
}

impl OrcaService {
    /// What a stream whose `:authority` is `authority` (`None`: it has none) asking `request` gets:
    /// the registered worker of that hostname (or the shared listener) and the interval to report
    /// it at ([`report_interval`]), or the status it is refused with (NOT_FOUND, which Envoy
    /// retries). Reads the registry, writes nothing.
    pub fn accept(
        &self,
        authority: Option<&str>,
        request: &OrcaLoadReportRequest,
    ) -> Result<(Subject, Duration), Status> {
        let Some(authority) = authority else {
            return Err(Status::not_found(
                "no :authority: Envoy sets it to the worker's EDS hostname",
            ));
        };
        let subject = match self.registry.find_hostname(authority) {
            Some(worker) => Subject::Worker(worker),
            None => match self.registry.find_shared(authority) {
                Some(service) => Subject::Listener {
                    service,
                    hostname: authority.to_owned(),
                },
                None => {
                    tracing::debug!(authority = %printable(authority), "ORCA stream for no registered worker");
                    return Err(Status::not_found(format!(
                        "no registered worker or shared listener has hostname {authority}"
                    )));
                }
            },
        };
        let interval = report_interval(request.report_interval.as_ref(), self.min_interval);
        Ok((subject, interval))
    }
}

/// The interval a stream reports at: the one Envoy asked for (`report_interval`; none, or a
/// negative part, counts as zero), never below `min_interval` and never above
/// [`MAX_REPORT_INTERVAL`], which bounds a floor above it too (the config refuses such a floor, but
/// the default one is the sample interval): the report timer never overflows.
pub fn report_interval(asked: Option<&ProtoDuration>, min_interval: Duration) -> Duration {
    let asked = asked
        .map(|d| {
            Duration::from_secs(u64::try_from(d.seconds).unwrap_or(0))
                + Duration::from_nanos(u64::try_from(d.nanos).unwrap_or(0))
        })
        .unwrap_or_default();
    asked.max(min_interval).min(MAX_REPORT_INTERVAL)
}

/// Marks a stream closed in the stats however the loop ends.
struct OpenStream<'a> {
    registry: &'a Registry,
    stats: &'a OrcaStats,
    subject: &'a Subject,
}

impl Drop for OpenStream<'_> {
    fn drop(&mut self) {
        let published = self.subject.is_published(&self.registry.snapshot());
        self.stats.closed(self.subject.hostname(), published);
        tracing::info!(hostname = %self.subject.hostname(), "ORCA stream closed");
    }
}

/// Whether `worker` (this instance, by its key) is in `snapshot`.
fn is_registered(snapshot: &Snapshot, worker: &Worker) -> bool {
    snapshot
        .instance(&worker.service, worker.index, worker.pid)
        .is_some()
}

/// Sends `subject`'s reports on `tx`: the first once a real sample exists, then the first sample of
/// each `interval` as it is published, until it leaves the registry (the stream then ends with OK)
/// or Envoy goes away.
async fn report_loop(
    registry: Arc<Registry>,
    stats: Arc<OrcaStats>,
    subject: Subject,
    interval: Duration,
    tx: mpsc::Sender<Result<OrcaLoadReport, Status>>,
) {
    stats.opened(subject.hostname());
    let _open = OpenStream {
        registry: &registry,
        stats: &stats,
        subject: &subject,
    };
    let mut loads = registry.subscribe_loads();
    let mut snapshots = registry.subscribe();
    let registered = |snapshots: &mut watch::Receiver<Arc<Snapshot>>| {
        subject.is_published(&snapshots.borrow_and_update())
    };

    // The first report as soon as there is a real sample (rates need two readings).
    loop {
        if !registered(&mut snapshots) {
            return;
        }
        let current = loads.borrow_and_update().clone();
        if let Some(report) = subject.report(&current) {
            if !send(&stats, subject.hostname(), &tx, report).await {
                return;
            }
            break;
        }
        tokio::select! {
            changed = loads.changed() => if changed.is_err() { return },
            changed = snapshots.changed() => {
                if changed.is_err() || !registered(&mut snapshots) { return }
            }
            () = tx.closed() => return,
        }
    }
    // Then each new sample once the interval has passed, as soon as the sampler publishes it (a
    // timer of the stream's own would add up to an interval of age to every report). A sample counts
    // as due half a sample interval early, so the sampler's jitter never skips one. Should the
    // sampler fall silent, the latest sample goes again every two intervals.
    let mut last = Instant::now();
    loop {
        let again = last + interval * 2;
        let current = tokio::select! {
            changed = loads.changed() => {
                if changed.is_err() {
                    return;
                }
                let current = loads.borrow_and_update().clone();
                let early = current.sampler.map_or(Duration::ZERO, |s| s.interval / 2);
                if Instant::now() + early < last + interval {
                    continue;
                }
                current
            }
            () = tokio::time::sleep_until(again) => loads.borrow_and_update().clone(),
            changed = snapshots.changed() => {
                if changed.is_err() || !registered(&mut snapshots) { return }
                continue;
            }
            () = tx.closed() => return,
        };
        if !registered(&mut snapshots) {
            return;
        }
        if let Some(report) = subject.report(&current) {
            if !send(&stats, subject.hostname(), &tx, report).await {
                return;
            }
            last = Instant::now();
        }
    }
}

async fn send(
    stats: &OrcaStats,
    hostname: &str,
    tx: &mpsc::Sender<Result<OrcaLoadReport, Status>>,
    report: OrcaLoadReport,
) -> bool {
    let summary = ReportSummary {
        cpu_utilization: report.cpu_utilization,
        application_utilization: report.application_utilization,
        rps_fractional: report.rps_fractional,
        sent_at: SystemTime::now(),
    };
    if tx.send(Ok(report)).await.is_err() {
        return false;
    }
    stats.reported(hostname, summary);
    true
}

/// The report for `worker` from `loads`, or `None` while it has no real sample (only a baseline, or
/// none). Every field Envoy reads is positive, so no report is an error to Envoy or encodes empty.
///
/// - `cpu_utilization`: the worker's on-CPU time per second of wall time, in cores (all its threads).
/// - `application_utilization`: (on-CPU + run-queue wait) per second of wall time
///   ([`application_utilization`]). Envoy prefers it over `cpu_utilization`. A worker starved by a
///   noisy neighbour on its core waits for the CPU instead of running: its CPU time alone would look
///   low and draw *more* traffic; the time it waits shows it is saturated.
/// - `rps_fractional`: requests per second over the last sample interval.
///
/// A worker of a service of a known concurrency reports its smoothed load in both instead: its
/// requests in flight show it busy while it waits on IO ([`application_utilization`]).
///
/// Envoy's weight is `rps_fractional / utilization`. A worker that served nothing in the last
/// interval ([`IDLE_RPS`]) has no rate to report (0 is an error to Envoy, which would keep a stale
/// weight), so it reports the mean rate of its busy peers and the utilization that makes its weight
/// twice the best busy peer's (or its own utilization, if it is busier than that): it draws traffic
/// without dwarfing the others, and its next report sets its weight from real numbers. With no busy
/// peer it reports 1 request/s. Utilizations are at least [`MIN_UTILIZATION`]. Every field is finite:
/// a sample whose rates are not (NaN, an infinity) makes no report, and counts as no busy peer.
pub fn report_for(loads: &Loads, worker: &Worker) -> Option<OrcaLoadReport> {
    report_for_pid(loads, worker.pid)
}

/// [`report_for`] the worker instance of process `pid`: the one report both ways of sending it
/// (out of band here, in band through [`in_band`]) send. The only worker of a service on a shared
/// listener (EDS names the endpoint after it) reports the listener's load.
pub fn report_for_pid(loads: &Loads, pid: u32) -> Option<OrcaLoadReport> {
    let load = loads.by_pid(pid)?;
    if loads.listener(&load.service).is_some() {
        return report_for_listener(loads, &load.service);
    }
    let (cpu, application, rps) = rates(load)?;
    let (rps, application) = if rps >= IDLE_RPS {
        (rps, application)
    } else {
        let busy: Vec<(f64, f64, f64)> = loads
            .iter()
            .filter(|peer| peer.service == load.service && peer.pid != load.pid)
            .filter_map(rates)
            .filter(|&(_, _, rps)| rps >= IDLE_RPS)
            .collect();
        if busy.is_empty() {
            (1.0, application)
        } else {
            // Each rate divided first, so that the sum of large ones does not overflow.
            let n = busy.len() as f64;
            let mean_rps = busy.iter().map(|&(_, _, rps)| rps / n).sum::<f64>();
            // The best peer's weight, as Envoy computes it (rate over utilization).
            let best_weight = busy
                .iter()
                .map(|&(_, application, rps)| rps / application.max(MIN_UTILIZATION))
                .fold(0.0, f64::max);
            // Twice the best peer's weight, unless the worker itself is busier than that (a long
            // request, or work of its own): a near-zero utilization would weigh it a thousand times
            // its peers and draw nearly every request for a weight period.
            (mean_rps, application.max(mean_rps / (2.0 * best_weight)))
        }
    };
    finite_report(cpu, application, rps)
}

/// The report of `cpu` and `application` utilization (each at least [`MIN_UTILIZATION`]) and `rps`,
/// or `None` where a field is not finite: rates far beyond any machine's can still overflow, and no
/// report is better than an infinite one.
fn finite_report(cpu: f64, application: f64, rps: f64) -> Option<OrcaLoadReport> {
    let report = OrcaLoadReport {
        cpu_utilization: cpu.max(MIN_UTILIZATION),
        application_utilization: application.max(MIN_UTILIZATION),
        rps_fractional: rps,
        ..Default::default()
    };
    [
        report.cpu_utilization,
        report.application_utilization,
        report.rps_fractional,
    ]
    .iter()
    .all(|v| v.is_finite())
    .then_some(report)
}

/// The report for `service`'s shared listener, the one endpoint its workers on this host are to
/// Envoy, from its smoothed load ([`ListenerLoad::smoothed`](crate::registry::ListenerLoad)):
///
/// - `rps_fractional`: the workers' summed request rate;
/// - `application_utilization`: the listener's requests in flight (queued or served) per worker
///   over the service's concurrency, or the workers' mean CPU and run-queue wait where higher;
/// - `cpu_utilization`: the workers' mean CPU at the last sample.
///
/// Envoy's weight, rate over utilization, is then the host's capacity over the mean time a request
/// spends there (Little's law): between hosts, one whose requests take longer (a slower backend, a
/// hogged core) or that has fewer workers weighs less, whichever Envoy sent the requests. Nothing is
/// reported until the means cover their time constant, nor while the listener serves nothing (a
/// rate of [`IDLE_RPS`] at most): Envoy keeps the weight it has, or gives a host without one the
/// others' mean.
pub fn report_for_listener(loads: &Loads, service: &str) -> Option<OrcaLoadReport> {
    let SmoothedLoad {
        requests_per_second,
        utilization,
        settled,
    } = loads.listener(service)?.smoothed?;
    if !settled || requests_per_second.is_nan() || requests_per_second < IDLE_RPS {
        return None;
    }
    let cpus: Vec<f64> = loads
        .iter()
        .filter(|load| load.service == service)
        .filter_map(|load| load.cpu_cores)
        .filter(|cpu| cpu.is_finite())
        .collect();
    let cpu = cpus.iter().sum::<f64>() / cpus.len().max(1) as f64;
    finite_report(cpu, utilization, requests_per_second)
}

/// A sample's CPU, application utilization ([`application_utilization`]) and request rate, if it has
/// them (not a baseline) and they are numbers: a rate that is not finite (a sampler fault, such as a
/// rate over no time) makes none.
fn rates(load: &WorkerLoad) -> Option<(f64, f64, f64)> {
    let cpu = load.cpu_cores.filter(|v| v.is_finite())?;
    if let Some(SmoothedLoad {
        requests_per_second,
        utilization,
        settled,
    }) = load.smoothed
    {
        // Unsettled means make no report: Envoy round-robins a worker without a weight, or gives it
        // its peers' median weight, rather than weigh it by its first samples.
        return (settled && requests_per_second.is_finite() && utilization.is_finite())
            .then_some((cpu, utilization, requests_per_second));
    }
    let rps = load.requests_per_second.filter(|v| v.is_finite())?;
    let wait = load.runq_wait_cores.unwrap_or(0.0);
    let application = application_utilization(cpu, wait);
    application.is_finite().then_some((cpu, application, rps))
}

/// The utilization reported as `application_utilization`, which Envoy weighs by, for a worker of a
/// server of many requests at once: its time on and waiting for a CPU (`cpu + wait`). A worker
/// starved of CPU by a neighbour waits instead of running, so its CPU time alone would look low;
/// counting the wait shows it is saturated.
///
/// A worker of a service of a known `concurrency` (gunicorn's sync worker: one) reports its
/// [`SmoothedLoad`] instead: the higher of the same figure and its requests in flight over the
/// concurrency, and its rate, each an exponential mean over 2 s. A worker of one request at a time
/// that waits on IO uses no CPU and is busy all the same; Envoy's weight, rate over utilization, is
/// then one over its mean time per request, queue included (Little's law). Over one 200 ms sample
/// (a count of 0, one half or 1 for a worker seen at two ticks) the same figure made Envoy's weights
/// herd: p99 553 ms against 334 ms for CPU and wait alone, gunicorn sync workers whose requests wait
/// 5 or 100 ms (2026-12-07). Smoothed requests in flight with the rate of one sample were no better
/// (p99 360-440 ms, p50 45 ms): the rate must be smoothed alike.
pub fn application_utilization(cpu: f64, wait: f64) -> f64 {
    cpu + wait
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Address, Protocol};

    fn worker(pid: u32) -> Worker {
        Worker::ready(
            "web",
            pid % 10,
            pid,
            vec![Protocol::Http1],
            vec![Address::Tcp(([127, 0, 0, 1], 8000).into())],
        )
    }

    fn load(pid: u32, cpu: Option<f64>, wait: f64, rps: Option<f64>) -> WorkerLoad {
        WorkerLoad {
            service: "web".into(),
            index: pid % 10,
            pid,
            cpu_cores: cpu,
            runq_wait_cores: cpu.map(|_| wait),
            requests_per_second: rps,
            cpu_seconds_total: 1.0,
            runq_wait_seconds_total: 0.0,
            requests_total: 10,
            in_flight: None,
            in_flight_now: None,
            in_flight_utilization: None,
            smoothed: None,
            sampled_at: SystemTime::UNIX_EPOCH,
        }
    }

    fn loads(workers: Vec<WorkerLoad>) -> Loads {
        Loads::new(None, workers)
    }

    #[test]
    fn no_report_before_a_real_sample() {
        let l = loads(vec![load(1, None, 0.0, None)]);
        assert_eq!(report_for(&l, &worker(1)), None);
        assert_eq!(report_for(&loads(vec![]), &worker(1)), None);
    }

    #[test]
    fn a_busy_worker_reports_cpu_wait_and_rate() {
        let r = report_for(
            &loads(vec![load(1, Some(0.4), 0.3, Some(250.0))]),
            &worker(1),
        )
        .unwrap();
        assert_eq!(r.cpu_utilization, 0.4);
        assert!((r.application_utilization - 0.7).abs() < 1e-9);
        assert_eq!(r.rps_fractional, 250.0);
    }

    #[test]
    fn a_starved_worker_weighs_less_than_its_twin_on_a_free_core() {
        // Same rate and CPU per request; one waits for its core as long as it runs.
        let l = loads(vec![
            load(1, Some(0.4), 0.4, Some(100.0)),
            load(2, Some(0.4), 0.0, Some(100.0)),
        ]);
        let weight = |pid| {
            let r = report_for(&l, &worker(pid)).unwrap();
            r.rps_fractional / r.application_utilization
        };
        assert!((weight(2) / weight(1) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn an_idle_worker_reports_its_peers_rate_at_twice_the_best_weight() {
        let l = loads(vec![
            load(1, Some(0.0), 0.0, Some(0.0)),
            load(2, Some(0.5), 0.0, Some(100.0)),
            load(3, Some(0.2), 0.0, Some(300.0)),
        ]);
        let r = report_for(&l, &worker(1)).unwrap();
        assert_eq!(r.rps_fractional, 200.0);
        // Twice the best peer's weight (300 / 0.2), not a thousandfold.
        let weight = r.rps_fractional / r.application_utilization;
        assert!((weight - 3000.0).abs() < 1e-6, "{weight}");
        // Peers of very different rates and costs: still twice the best, not the mean over the least.
        let mixed = loads(vec![
            load(1, Some(0.0), 0.0, Some(0.0)),
            load(2, Some(0.05), 0.0, Some(10.0)),
            load(3, Some(0.9), 0.0, Some(1000.0)),
        ]);
        let r = report_for(&mixed, &worker(1)).unwrap();
        let weight = r.rps_fractional / r.application_utilization;
        assert!((weight - 2.0 * 1000.0 / 0.9).abs() < 1e-6, "{weight}");
        // A worker with no requests but busy with work of its own stays as busy as it is.
        let stuck = loads(vec![
            load(1, Some(0.9), 0.0, Some(0.0)),
            load(2, Some(0.5), 0.0, Some(100.0)),
        ]);
        let r = report_for(&stuck, &worker(1)).unwrap();
        assert!((r.application_utilization - 0.9).abs() < 1e-9);
        // Alone and idle: still positive fields, never an all-default (empty) report.
        let alone =
            report_for(&loads(vec![load(1, Some(0.0), 0.0, Some(0.0))]), &worker(1)).unwrap();
        assert_eq!(alone.rps_fractional, 1.0);
        assert_eq!(alone.cpu_utilization, MIN_UTILIZATION);
        assert_eq!(alone.application_utilization, MIN_UTILIZATION);
    }

    #[test]
    fn rates_that_are_not_numbers_make_no_report_and_no_peer() {
        // Found by the orca_requests fuzz target: an infinite CPU rate was reported as an infinite
        // utilization (Envoy would compute a zero or infinite weight from it).
        let infinite = load(12, Some(f64::INFINITY), 0.0, Some(f64::NAN));
        assert_eq!(
            report_for(&loads(vec![infinite.clone()]), &worker(12)),
            None
        );
        for broken in [
            load(1, Some(f64::NAN), 0.0, Some(100.0)),
            load(1, Some(0.5), f64::INFINITY, Some(100.0)),
            load(1, Some(0.5), 0.0, Some(f64::NEG_INFINITY)),
        ] {
            assert_eq!(report_for(&loads(vec![broken]), &worker(1)), None);
        }
        // An idle worker beside a broken peer reports as if alone.
        let idle = load(1, Some(0.0), 0.0, Some(0.0));
        let alone = report_for(&loads(vec![idle.clone()]), &worker(1));
        let beside = report_for(&loads(vec![idle, infinite]), &worker(1));
        assert_eq!(beside, alone);
        // Rates too large to add up stay finite, or make no report.
        let busy = |pid| load(pid, Some(0.0), 0.0, Some(f64::MAX));
        let idle = load(1, Some(0.0), 0.0, Some(0.0));
        let r = report_for(&loads(vec![idle, busy(2), busy(3)]), &worker(1)).unwrap();
        assert_eq!(r.rps_fractional, f64::MAX);
        assert!(r.application_utilization.is_finite());
        let both_huge = load(1, Some(f64::MAX), f64::MAX, Some(100.0));
        assert_eq!(report_for(&loads(vec![both_huge]), &worker(1)), None);
    }

    #[test]
    fn a_worker_of_one_request_at_a_time_reports_its_smoothed_load() {
        // Two workers of one request at a time at the same rate, near no CPU; one holds its requests
        // five times as long (0.9 in flight against 0.18): its weight (rate over utilization) is a
        // fifth of the other's.
        let waiting = |pid, in_flight| WorkerLoad {
            in_flight: Some(in_flight),
            smoothed: Some(SmoothedLoad {
                requests_per_second: 36.0,
                utilization: in_flight,
                settled: true,
            }),
            ..load(pid, Some(0.01), 0.0, Some(50.0))
        };
        let l = loads(vec![waiting(1, 0.9), waiting(2, 0.18)]);
        let report = |pid| report_for(&l, &worker(pid)).unwrap();
        assert_eq!(report(1).application_utilization, 0.9);
        assert_eq!(report(2).application_utilization, 0.18);
        assert_eq!(report(1).rps_fractional, 36.0);
        assert_eq!(report(1).cpu_utilization, 0.01);
        let weight = |pid| report(pid).rps_fractional / report(pid).application_utilization;
        assert!((weight(2) / weight(1) - 5.0).abs() < 1e-9);
        // Without one (a server of many at once), requests in flight weigh nothing.
        let many = WorkerLoad {
            in_flight: Some(3.0),
            in_flight_utilization: Some(3.0),
            ..load(3, Some(0.01), 0.0, Some(36.0))
        };
        let r = report_for(&loads(vec![many]), &worker(3)).unwrap();
        assert!((r.application_utilization - 0.01).abs() < 1e-9);
        assert_eq!(application_utilization(0.5, 0.25), 0.75);
        // A smoothed load that is not finite makes no report.
        let broken = WorkerLoad {
            smoothed: Some(SmoothedLoad {
                requests_per_second: f64::NAN,
                utilization: 0.5,
                settled: true,
            }),
            ..load(4, Some(0.01), 0.0, Some(36.0))
        };
        assert_eq!(report_for(&loads(vec![broken]), &worker(4)), None);
        // Nor does one whose means do not yet cover their time constant, and such a worker is no
        // busy peer to an idle one.
        let unsettled = WorkerLoad {
            smoothed: Some(SmoothedLoad {
                requests_per_second: 36.0,
                utilization: 0.01,
                settled: false,
            }),
            ..load(5, Some(0.01), 0.0, Some(36.0))
        };
        assert_eq!(
            report_for(&loads(vec![unsettled.clone()]), &worker(5)),
            None
        );
        let idle = load(6, Some(0.0), 0.0, Some(0.0));
        let r = report_for(&loads(vec![unsettled, idle]), &worker(6)).unwrap();
        assert_eq!(r.rps_fractional, 1.0, "no busy peer: {r:?}");
    }

    /// `loads` with `service`'s shared listener's smoothed load.
    fn with_listener(loads: Loads, service: &str, smoothed: Option<SmoothedLoad>) -> Loads {
        let listener = crate::registry::ListenerLoad {
            queued: 0,
            serving: 1,
            smoothed,
        };
        loads.with_listeners([(service.to_owned(), listener)])
    }

    #[test]
    fn a_shared_listener_reports_its_workers_as_one_endpoint() {
        let smoothed = |requests_per_second, utilization| {
            Some(SmoothedLoad {
                requests_per_second,
                utilization,
                settled: true,
            })
        };
        let workers = || {
            vec![
                load(1, Some(0.02), 0.0, Some(20.0)),
                load(2, Some(0.04), 0.0, Some(20.0)),
            ]
        };
        // Two hosts' listeners of 2 workers each at the same rate: one holds its requests three
        // times as long (1.5 in flight per worker against 0.5). Its weight is a third.
        let fast = with_listener(loads(workers()), "web", smoothed(40.0, 0.5));
        let slow = with_listener(loads(workers()), "web", smoothed(40.0, 1.5));
        let report = |l: &Loads| report_for_listener(l, "web").unwrap();
        let weight = |l: &Loads| report(l).rps_fractional / report(l).application_utilization;
        assert!((weight(&fast) / weight(&slow) - 3.0).abs() < 1e-9);
        assert_eq!(report(&fast).rps_fractional, 40.0);
        assert!(
            (report(&fast).cpu_utilization - 0.03).abs() < 1e-9,
            "the mean"
        );
        // The only worker of a shared listener (EDS names the endpoint after it) reports the same.
        assert_eq!(report_for(&fast, &worker(1)), Some(report(&fast)));
        // No report before the means settle, while the listener serves nothing, or without means
        // (the kernel's tables unread), or for a service without a shared listener.
        let unsettled = SmoothedLoad {
            settled: false,
            ..smoothed(40.0, 0.5).unwrap()
        };
        for (l, why) in [
            (
                with_listener(loads(workers()), "web", Some(unsettled)),
                "unsettled",
            ),
            (
                with_listener(loads(workers()), "web", smoothed(0.001, 0.5)),
                "idle",
            ),
            (
                with_listener(loads(workers()), "web", smoothed(f64::NAN, 0.5)),
                "no rate",
            ),
            (with_listener(loads(workers()), "web", None), "no means"),
            (loads(workers()), "no listener"),
        ] {
            assert_eq!(report_for_listener(&l, "web"), None, "{why}");
        }
        assert_eq!(report_for_listener(&fast, "api"), None);
    }

    #[test]
    fn a_stream_for_a_shared_listener_is_for_its_hostname_while_workers_share_it() {
        // `worker` gives every worker the same address: one shared listener.
        let shared = worker;
        let request = OrcaLoadReportRequest::default();
        for host in [None, Some("host-a")] {
            let mut registry = Registry::new(["web".to_string(), "api".to_string()]);
            if let Some(host) = host {
                registry = registry.in_fleet(host);
            }
            let registry = Arc::new(registry);
            let orca = OrcaService::new(registry.clone(), Arc::default(), Duration::from_secs(1));
            let hostname = crate::registry::shared_hostname(host, "web");
            registry.register(shared(1)).unwrap();
            // One worker alone is an endpoint of its own (named after it): no shared stream yet.
            assert!(
                orca.accept(Some(&hostname), &request).is_err(),
                "{hostname}"
            );
            registry.register(shared(2)).unwrap();
            let (subject, _) = orca.accept(Some(&hostname), &request).unwrap();
            assert_eq!(
                subject,
                Subject::Listener {
                    service: "web".into(),
                    hostname: hostname.clone()
                }
            );
            assert!(subject.is_published(&registry.snapshot()));
            // Another host's name, or another service's, is not this one's.
            for other in [
                crate::registry::shared_hostname(Some("host-b"), "web"),
                crate::registry::shared_hostname(host, "api"),
            ] {
                assert!(orca.accept(Some(&other), &request).is_err(), "{other}");
            }
            registry.deregister("web", 1, 1);
            assert!(!subject.is_published(&registry.snapshot()));
        }
    }

    #[test]
    fn a_report_from_another_instance_in_the_slot_is_not_used() {
        let l = loads(vec![load(2, Some(0.5), 0.0, Some(10.0))]);
        assert_eq!(report_for(&l, &worker(1)), None);
    }

    fn asked(seconds: i64, nanos: i32) -> ProtoDuration {
        ProtoDuration { seconds, nanos }
    }

    #[test]
    fn the_interval_is_envoys_but_never_below_the_floor() {
        let floor = Duration::from_millis(100);
        assert_eq!(
            report_interval(Some(&asked(2, 500_000_000)), floor),
            Duration::from_millis(2500)
        );
        assert_eq!(report_interval(Some(&asked(0, 1_000)), floor), floor);
        assert_eq!(report_interval(None, floor), floor);
        assert_eq!(report_interval(Some(&asked(-5, -1)), floor), floor);
    }

    #[test]
    fn the_interval_is_at_most_an_hour_whatever_is_asked() {
        // Found by the orca_requests fuzz target: Envoy asking for 7449907063523939383 s made the
        // report timer overflow (a panic in the stream's task).
        let floor = Duration::from_millis(100);
        for huge in [
            asked(7_449_907_063_523_939_383, 0),
            asked(i64::MAX, i32::MAX),
        ] {
            let interval = report_interval(Some(&huge), floor);
            assert_eq!(interval, MAX_REPORT_INTERVAL);
            assert!(tokio::time::Instant::now().checked_add(interval).is_some());
        }
        // A floor above the bound (a sample interval of more than an hour) is capped as well.
        let floor = Duration::from_millis(u64::MAX);
        assert_eq!(report_interval(None, floor), MAX_REPORT_INTERVAL);
    }

    #[test]
    fn a_stream_is_for_a_registered_hostname_only() {
        let registry = Arc::new(Registry::new(["web".to_string()]));
        let registered = worker(7);
        registry.register(registered.clone()).unwrap();
        let orca = OrcaService::new(registry, Arc::default(), Duration::from_secs(1));
        let request = OrcaLoadReportRequest {
            report_interval: Some(asked(3, 0)),
            ..Default::default()
        };
        let (found, interval) = orca.accept(Some(&registered.hostname), &request).unwrap();
        assert_eq!(found, Subject::Worker(registered.clone()));
        assert_eq!(interval, Duration::from_secs(3));
        for authority in [None, Some("web-7-8"), Some("")] {
            let status = orca.accept(authority, &request).unwrap_err();
            assert_eq!(status.code(), tonic::Code::NotFound, "{authority:?}");
        }
    }

    /// The stream's next report's request rate, and how long it took to come (on the paused clock).
    async fn next_report(reports: &mut ReportStream) -> (f64, Duration) {
        use tokio_stream::StreamExt;
        let asked_at = Instant::now();
        let report = tokio::time::timeout(Duration::from_secs(60), reports.next())
            .await
            .expect("a report in time")
            .expect("the stream goes on")
            .expect("a report, not an error");
        (report.rps_fractional, asked_at.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_sends_the_first_sample_of_each_interval_and_resends_only_if_the_sampler_falls_silent()
     {
        let interval = Duration::from_secs(1);
        let registry = Arc::new(Registry::new(["web".to_string()]));
        let registered = worker(7);
        registry.register(registered.clone()).unwrap();
        let stats = Arc::new(OrcaStats::default());
        let orca = OrcaService::new(registry.clone(), stats.clone(), interval);
        // Each sample tells itself apart by its request rate.
        let sampler = Some(crate::registry::SamplerInfo {
            kind: crate::registry::SamplerKind::Procfs,
            interval,
        });
        let publish = |rps: f64| {
            registry.publish_loads(Loads::new(sampler, [load(7, Some(0.5), 0.0, Some(rps))]));
        };
        publish(1.0);
        let mut request = Request::new(OrcaLoadReportRequest {
            report_interval: Some(asked(1, 0)),
            ..Default::default()
        });
        request
            .extensions_mut()
            .insert(Authority(registered.hostname.clone()));
        let mut reports = orca
            .stream_core_metrics(request)
            .await
            .unwrap()
            .into_inner();
        assert_eq!(next_report(&mut reports).await, (1.0, Duration::ZERO));

        // A sampler that publishes every interval: each sample is sent as it is published, and
        // nothing else (a resend in between would come first, with the previous rate).
        for rps in [2.0, 3.0, 4.0, 5.0] {
            tokio::time::sleep(interval).await;
            publish(rps);
            assert_eq!(next_report(&mut reports).await, (rps, Duration::ZERO));
        }
        assert_eq!(stats.reports_total(), 5, "one report per sample");

        // A sampler fallen silent: the latest sample again two intervals after the last report, not
        // before, and every two intervals after that.
        for resend in 1..=3 {
            assert_eq!(
                next_report(&mut reports).await,
                (5.0, interval * 2),
                "resend {resend}"
            );
        }
        assert_eq!(stats.reports_total(), 8);

        // Back again: its next sample is sent as published, and only the first of an interval (one
        // a quarter of an interval after it is not sent on its own, or it would come first).
        tokio::time::sleep(interval).await;
        publish(6.0);
        assert_eq!(next_report(&mut reports).await, (6.0, Duration::ZERO));
        tokio::time::sleep(interval / 4).await;
        publish(7.0);
        tokio::time::sleep(interval * 3 / 4).await;
        publish(8.0);
        assert_eq!(next_report(&mut reports).await, (8.0, Duration::ZERO));
        assert_eq!(stats.reports_total(), 10);
    }
}
