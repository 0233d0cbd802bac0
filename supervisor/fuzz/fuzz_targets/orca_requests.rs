//! ORCA stream requests and load reports: arbitrary `:authority` strings and `OrcaLoadReportRequest`s
//! (any `report_interval`: negative, huge, nanos out of range; any `request_cost_names`) through
//! `OrcaService::accept`, with floors across what the config and its defaults allow, and arbitrary
//! loads (NaN, infinities, zero, negative, huge) through `report_for`.
//!
//! Checked: nothing panics; a stream is accepted exactly for the hostname of a registered worker, and
//! anything else is refused with NOT_FOUND and a message that reaches Envoy as it is (through gRPC
//! headers); the interval a stream reports at is never zero, never below the floor (up to the bound,
//! `MAX_REPORT_INTERVAL`), never above the bound, and never overflows the timer; a report's
//! utilizations and rate are finite and positive, utilizations at least `MIN_UTILIZATION`; a worker
//! with a real, sane sample gets a report, and an idle one's weight (rate over utilization) is at most
//! twice its best busy peer's.
#![no_main]

use std::{
    sync::{Arc, LazyLock},
    time::{Duration, SystemTime},
};

use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use libfuzzer_sys::{arbitrary::Unstructured, fuzz_target};
use peregrine_proto::xds::service::orca::v3::OrcaLoadReportRequest;
use peregrine_supervisor::{
    config::MAX_REPORT_INTERVAL,
    orca::{IDLE_RPS, MIN_UTILIZATION, OrcaService, report_for},
    registry::{Address, Loads, Protocol, Registry, SmoothedLoad, Worker, WorkerLoad},
};

/// The registered workers: service, index, pid.
const WORKERS: [(&str, u32, u32); 4] = [
    ("web", 0, 10),
    ("web", 1, 11),
    ("web", 2, 12),
    ("api", 0, 20),
];

static REGISTRY: LazyLock<Arc<Registry>> = LazyLock::new(|| {
    let registry = Registry::new(["web".to_string(), "api".to_string()]);
    for worker in workers() {
        registry.register(worker).expect("registers");
    }
    Arc::new(registry)
});

fn workers() -> impl Iterator<Item = Worker> {
    WORKERS.into_iter().map(|(service, index, pid)| {
        let address = Address::Tcp(([127, 0, 0, 1], 9000 + pid as u16).into());
        Worker::ready(service, index, pid, vec![Protocol::Http1], vec![address])
    })
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let _ = stream_request(&mut u);
    let _ = loads(&mut u);
});

/// One stream request, with its authority and the configured floor.
fn stream_request(u: &mut Unstructured<'_>) -> libfuzzer_sys::arbitrary::Result<()> {
    let hostnames: Vec<String> = workers().map(|w| w.hostname).collect();
    let authority: Option<String> = match u.int_in_range(0..=5)? {
        0 => None,
        1 | 2 => Some(u.choose(&hostnames)?.clone()),
        // Near misses: another case, a port, a suffix.
        3 => {
            let base = u.choose(&hostnames)?;
            Some(match u.int_in_range(0..=2)? {
                0 => base.to_uppercase(),
                1 => format!("{base}:{}", u.arbitrary::<u16>()?),
                _ => format!("{base}{}", u.arbitrary::<String>()?),
            })
        }
        _ => Some(u.arbitrary()?),
    };
    let report_interval = match u.int_in_range(0..=4)? {
        0 => None,
        1 => Some(ProtoDuration {
            seconds: u.int_in_range(0..=60)?,
            nanos: u.int_in_range(0..=999_999_999)?,
        }),
        _ => Some(ProtoDuration {
            seconds: u.arbitrary()?,
            nanos: u.arbitrary()?,
        }),
    };
    let request = OrcaLoadReportRequest {
        report_interval,
        request_cost_names: u.arbitrary()?,
    };
    // What the floor may be: `orca.min_report_interval_ms` (10 ms to an hour), or by default the
    // sample interval (any number of milliseconds from 10).
    let floor_ms = match u.int_in_range(0..=2)? {
        0 => u.int_in_range(10..=10_000)?,
        _ => u.int_in_range(10..=u64::MAX)?,
    };
    let floor = Duration::from_millis(floor_ms);
    let orca = OrcaService::new(REGISTRY.clone(), floor);

    match orca.accept(authority.as_deref(), &request) {
        Ok((worker, interval)) => {
            assert_eq!(Some(worker.hostname.as_str()), authority.as_deref());
            assert!(hostnames.contains(&worker.hostname));
            assert!(!interval.is_zero());
            // The config allows no floor over the bound; the default floor (the sample interval)
            // is capped there.
            assert!(
                interval >= floor.min(MAX_REPORT_INTERVAL),
                "{interval:?} below the floor {floor:?}"
            );
            assert!(interval <= MAX_REPORT_INTERVAL);
            // The report loop's first tick and every later one are this far apart.
            let start = tokio::time::Instant::now().checked_add(interval);
            assert!(
                start.and_then(|s| s.checked_add(interval)).is_some(),
                "{interval:?} overflows the timer"
            );
        }
        Err(status) => {
            assert!(
                authority.as_ref().is_none_or(|a| !hostnames.contains(a)),
                "refused a registered hostname: {status:?}"
            );
            assert_eq!(status.code(), tonic::Code::NotFound);
            assert!(!status.message().is_empty());
            // What Envoy receives: the status as gRPC headers, read back the same.
            let mut headers = tonic::codegen::http::HeaderMap::new();
            status
                .add_header(&mut headers)
                .expect("the status encodes as headers");
            let received = tonic::Status::from_header_map(&headers).expect("a status");
            assert_eq!(
                (received.code(), received.message()),
                (status.code(), status.message())
            );
        }
    }
    Ok(())
}

/// A number as a sampler might (or should never) produce it.
fn number(u: &mut Unstructured<'_>) -> libfuzzer_sys::arbitrary::Result<f64> {
    Ok(match u.int_in_range(0..=9)? {
        0 => f64::NAN,
        1 => f64::INFINITY,
        2 => f64::NEG_INFINITY,
        3 => 0.0,
        4 => f64::MAX,
        5 => f64::MIN_POSITIVE,
        6 => -u.int_in_range(0..=1000)? as f64,
        7 => f64::from_bits(u.arbitrary()?),
        _ => u.int_in_range(0..=100_000)? as f64 / 100.0,
    })
}

fn optional(u: &mut Unstructured<'_>) -> libfuzzer_sys::arbitrary::Result<Option<f64>> {
    Ok(if u.ratio(1, 8)? {
        None
    } else {
        Some(number(u)?)
    })
}

/// Arbitrary loads for the registered workers (and others), and a report for each worker.
fn loads(u: &mut Unstructured<'_>) -> libfuzzer_sys::arbitrary::Result<()> {
    let mut sampled = Vec::new();
    for _ in 0..u.int_in_range(0..=6)? {
        let &(service, index, pid) = u.choose(&WORKERS)?;
        let pid = if u.ratio(1, 8)? { pid + 100 } else { pid };
        let cpu_cores = optional(u)?;
        sampled.push(WorkerLoad {
            service: service.into(),
            index,
            pid,
            cpu_cores,
            runq_wait_cores: if cpu_cores.is_some() {
                optional(u)?
            } else {
                None
            },
            requests_per_second: optional(u)?,
            cpu_seconds_total: number(u)?,
            runq_wait_seconds_total: number(u)?,
            requests_total: u.arbitrary()?,
            in_flight: optional(u)?,
            in_flight_now: u.arbitrary()?,
            in_flight_utilization: optional(u)?,
            smoothed: if u.arbitrary()? {
                Some(SmoothedLoad {
                    requests_per_second: number(u)?,
                    utilization: number(u)?,
                })
            } else {
                None
            },
            sampled_at: SystemTime::UNIX_EPOCH,
        });
    }
    let loads = Loads::new(None, sampled);
    for worker in workers() {
        check_report(&loads, &worker);
    }
    Ok(())
}

/// A sample's numbers as a working sampler gives them: finite, not negative, and far from overflow.
fn sane(value: f64) -> bool {
    (0.0..1e12).contains(&value)
}

fn check_report(loads: &Loads, worker: &Worker) {
    let own = loads.by_pid(worker.pid);
    let sane_load = |l: &WorkerLoad| {
        [l.cpu_cores, l.runq_wait_cores, l.requests_per_second]
            .iter()
            .all(|v| v.is_none_or(sane))
    };
    let Some(report) = report_for(loads, worker) else {
        if let Some(load) = own {
            let real = load.cpu_cores.is_some() && load.requests_per_second.is_some();
            assert!(
                !(real && loads.iter().all(sane_load)),
                "no report from a real sample {load:?} among {loads:?}"
            );
        }
        return;
    };
    let load = own.expect("a report without a sample of its own");
    for (field, value) in [
        ("cpu_utilization", report.cpu_utilization),
        ("application_utilization", report.application_utilization),
        ("rps_fractional", report.rps_fractional),
    ] {
        assert!(
            value.is_finite() && value > 0.0,
            "{field} is {value} for {load:?} among {loads:?}"
        );
    }
    assert!(report.cpu_utilization >= MIN_UTILIZATION);
    assert!(report.application_utilization >= MIN_UTILIZATION);
    let peers: Vec<&WorkerLoad> = loads
        .iter()
        .filter(|p| p.service == load.service && p.pid != load.pid)
        .collect();
    let all_sane = std::iter::once(load)
        .chain(peers.iter().copied())
        .all(sane_load);
    let rps = load.requests_per_second.expect("a report without a rate");
    if all_sane && rps < IDLE_RPS {
        let best = peers
            .iter()
            // A busy peer: a real sample (a CPU rate and a request rate), busy.
            .filter(|p| p.cpu_cores.is_some())
            .filter(|p| p.requests_per_second.is_some_and(|r| r >= IDLE_RPS))
            .map(|p| {
                let utilization = p.cpu_cores.unwrap_or(0.0) + p.runq_wait_cores.unwrap_or(0.0);
                p.requests_per_second.unwrap_or(0.0) / utilization.max(MIN_UTILIZATION)
            })
            .fold(None, |best: Option<f64>, w| {
                Some(best.map_or(w, |b| b.max(w)))
            });
        if let Some(best) = best {
            let weight = report.rps_fractional / report.application_utilization;
            assert!(
                weight <= 2.0 * best * (1.0 + 1e-9),
                "weight {weight} over twice {best}"
            );
        }
    }
}
