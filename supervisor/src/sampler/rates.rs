//! The sampler's arithmetic, pure: two readings of a worker make its rates; totals never go backwards.
//!
//! A worker's first reading (or the first after its pid changed) is a baseline: totals, no rates. Every
//! later reading adds its increase since the previous one to the totals and divides it by the time
//! between the two. A reading lower than the previous one (a procfs thread that exited between two
//! samples takes its time with it; a counter read just as its lane was zeroed) adds nothing.

use std::time::{Duration, Instant, SystemTime};

use peregrine_contract::counters::InFlight;

use super::{SchedTotals, sock_diag::Held};
use crate::registry::{SmoothedLoad, WorkerLoad};

/// How long a smoothed load remembers: the time constant of its exponential means. Ten samples at
/// the default interval, so that the requests in flight seen at the ticks (0, 1 or 2 for a worker
/// of one request at a time) average to a figure a weight can follow.
pub const SMOOTHING: Duration = Duration::from_secs(2);

/// A worker's requests in flight, as one tick read them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InFlightReading {
    /// Kept by the worker: its [`InFlight`] word, read at `at_us` on its clock.
    Kept {
        /// The word.
        word: InFlight,
        /// When it was read (`CLOCK_MONOTONIC_COARSE`, microseconds).
        at_us: u64,
    },
    /// Seen in the kernel's socket tables at the tick: the requests in flight at that moment.
    Seen(Held),
}

impl InFlightReading {
    /// The requests open at the reading.
    pub fn open(self) -> u64 {
        match self {
            InFlightReading::Kept { word, .. } => word.open(),
            InFlightReading::Seen(held) => held.total(),
        }
    }

    /// The mean in flight between `earlier` and this reading: exact from two words a worker kept;
    /// from two counts seen at the ticks, their mean (the trapezoid between the two points).
    fn mean_since(self, earlier: InFlightReading) -> Option<f64> {
        match (earlier, self) {
            (
                InFlightReading::Kept { word: a, at_us: t0 },
                InFlightReading::Kept { word: b, at_us: t1 },
            ) => a.mean_between(t0, b, t1),
            (InFlightReading::Seen(a), InFlightReading::Seen(b)) => {
                Some((a.total() as f64 + b.total() as f64) / 2.0)
            }
            _ => None,
        }
    }
}

/// The utilization that requests in flight make: the mean in flight over the requests a worker
/// serves at once (`concurrency`, its service's), so that a worker of one request at a time that
/// waits through all of its requests is fully busy whatever its CPU. A worker that serves many at
/// once (`None`) counts each request in flight as one: `rps / in flight` is then one over its mean
/// latency (Little's law), which ranks such workers by how long their requests take.
pub fn in_flight_utilization(mean_in_flight: f64, concurrency: Option<u32>) -> f64 {
    match concurrency {
        Some(n) if n > 0 => mean_in_flight / f64::from(n),
        _ => mean_in_flight,
    }
}

/// What one tick read for one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    /// The worker process.
    pub pid: u32,
    /// Its cumulative scheduler time, as the source reports it.
    pub sched: SchedTotals,
    /// Its lane's request counter.
    pub requests: u64,
    /// Its requests in flight, where they are known.
    pub in_flight: Option<InFlightReading>,
    /// When it was read.
    pub at: Instant,
}

/// A worker's sampling history: its last reading and its running totals.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct History {
    last: Reading,
    totals: SchedTotals,
    requests: u64,
    /// Exponential means of its rates, where its requests in flight are known.
    smoothed: Option<Smoothed>,
}

/// Exponential means of a worker's rates over [`SMOOTHING`].
#[derive(Clone, Copy, Debug, PartialEq)]
struct Smoothed {
    requests_per_second: f64,
    /// On-CPU time and run-queue wait, in cores.
    scheduled: f64,
    in_flight: f64,
    /// The seconds of samples the means cover.
    covered: f64,
}

impl Smoothed {
    /// The means after `rates`, taken over `seconds`, from `previous`; the first are the rates
    /// themselves. `None` without requests in flight, or where a mean is not finite.
    fn step(previous: Option<Smoothed>, rates: &Rates, seconds: f64) -> Option<Smoothed> {
        let now = Smoothed {
            requests_per_second: rates.requests_per_second,
            scheduled: rates.cpu_cores + rates.runq_wait_cores,
            in_flight: rates.in_flight?,
            covered: seconds,
        };
        let next = match previous {
            // Each mean moves toward the new figure by the share of the time constant that passed.
            Some(old) => {
                let weight = 1.0 - (-seconds / SMOOTHING.as_secs_f64()).exp();
                let mean = |old: f64, new: f64| old + weight * (new - old);
                Smoothed {
                    requests_per_second: mean(old.requests_per_second, now.requests_per_second),
                    scheduled: mean(old.scheduled, now.scheduled),
                    in_flight: mean(old.in_flight, now.in_flight),
                    covered: old.covered + seconds,
                }
            }
            None => now,
        };
        [next.requests_per_second, next.scheduled, next.in_flight]
            .iter()
            .all(|v| v.is_finite())
            .then_some(next)
    }

    /// As published: the rate, and the higher of the scheduled time and the requests in flight
    /// over `concurrency` (each one request where it is many); settled once the means cover
    /// [`SMOOTHING`].
    fn load(self, concurrency: Option<u32>) -> SmoothedLoad {
        SmoothedLoad {
            requests_per_second: self.requests_per_second,
            utilization: self
                .scheduled
                .max(in_flight_utilization(self.in_flight, concurrency)),
            // A millisecond's slack: ten intervals of 0.2 s add up to a hair under 2 s.
            settled: self.covered + 1e-3 >= SMOOTHING.as_secs_f64(),
        }
    }
}

/// A shared listener's history: what the kernel showed on it at the last tick, and exponential
/// means of its service's load on this host, as one endpoint's ([`ListenerHistory::load`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ListenerHistory {
    /// Requests on the listener (queued and serving) at the last tick, and when.
    held: u64,
    at: Instant,
    smoothed: Option<Smoothed>,
}

impl ListenerHistory {
    /// The first tick's: `held` requests on the listener at `at`, no means yet.
    pub fn new(held: u64, at: Instant) -> Self {
        ListenerHistory {
            held,
            at,
            smoothed: None,
        }
    }

    /// After a tick at `at` that saw `held` requests on the listener and the rates of the service's
    /// workers that have rates at this tick (`workers`): its means move by the workers' summed
    /// request rate, their mean scheduled time, and the listener's mean requests in flight (the
    /// two ticks' counts) per worker. A tick with no worker's rates (all of them new) moves none.
    pub fn step(self, held: u64, at: Instant, workers: &[Rates]) -> ListenerHistory {
        let elapsed = at.saturating_duration_since(self.at);
        let mut next = ListenerHistory {
            held,
            at,
            smoothed: self.smoothed,
        };
        if elapsed.is_zero() || workers.is_empty() {
            return next;
        }
        let n = workers.len() as f64;
        let rates = Rates {
            cpu_cores: workers.iter().map(|r| r.cpu_cores).sum::<f64>() / n,
            runq_wait_cores: workers.iter().map(|r| r.runq_wait_cores).sum::<f64>() / n,
            requests_per_second: workers.iter().map(|r| r.requests_per_second).sum(),
            in_flight: Some((self.held as f64 + held as f64) / 2.0 / n),
        };
        next.smoothed = Smoothed::step(self.smoothed, &rates, elapsed.as_secs_f64());
        next
    }

    /// The endpoint's smoothed load for a service of `concurrency` requests per worker: its
    /// workers' summed rate, and the higher of their mean scheduled time and the requests in
    /// flight per worker over `concurrency`. Envoy's weight (rate over utilization) is then the
    /// host's workers times their concurrency over the mean time a request spends on the host,
    /// queue included (Little's law): a host of slower or fewer workers weighs less. `None`
    /// before the first means.
    pub fn load(&self, concurrency: Option<u32>) -> Option<SmoothedLoad> {
        Some(self.smoothed?.load(concurrency.filter(|&n| n > 0)))
    }
}

/// Rates between two readings: CPU time per wall time ("cores") and requests per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// On-CPU time per wall time.
    pub cpu_cores: f64,
    /// Run-queue wait per wall time.
    pub runq_wait_cores: f64,
    /// Requests per second.
    pub requests_per_second: f64,
    /// Mean requests in flight, where they are known.
    pub in_flight: Option<f64>,
}

/// Adds `now` to a worker's history: the new history, and the rates since the previous reading (`None`
/// for a baseline: no previous reading of this pid, or no time passed since it).
pub fn step(previous: Option<&History>, now: Reading) -> (History, Option<Rates>) {
    let Some(previous) = previous.filter(|p| p.last.pid == now.pid) else {
        let baseline = History {
            last: now,
            totals: now.sched,
            requests: now.requests,
            smoothed: None,
        };
        return (baseline, None);
    };
    let on_cpu = now
        .sched
        .on_cpu_ns
        .saturating_sub(previous.last.sched.on_cpu_ns);
    let runq_wait = now
        .sched
        .runq_wait_ns
        .saturating_sub(previous.last.sched.runq_wait_ns);
    let requests = now.requests.saturating_sub(previous.last.requests);
    let mut history = History {
        last: now,
        totals: previous.totals.saturating_add(SchedTotals {
            on_cpu_ns: on_cpu,
            runq_wait_ns: runq_wait,
        }),
        requests: previous.requests.saturating_add(requests),
        smoothed: previous.smoothed,
    };
    let elapsed = now.at.saturating_duration_since(previous.last.at);
    if elapsed.is_zero() {
        return (history, None);
    }
    let seconds = elapsed.as_secs_f64();
    let rates = Rates {
        cpu_cores: on_cpu as f64 / 1e9 / seconds,
        runq_wait_cores: runq_wait as f64 / 1e9 / seconds,
        requests_per_second: requests as f64 / seconds,
        in_flight: now
            .in_flight
            .zip(previous.last.in_flight)
            .and_then(|(now, earlier)| now.mean_since(earlier))
            .filter(|mean| mean.is_finite()),
    };
    history.smoothed = Smoothed::step(previous.smoothed, &rates, seconds);
    (history, Some(rates))
}

impl History {
    /// The published load of this worker, in `service`'s slot `index`, read at wall time `sampled_at`.
    pub fn load(
        &self,
        service: String,
        index: u32,
        rates: Option<Rates>,
        (concurrency, sampled_at): (Option<u32>, SystemTime),
    ) -> WorkerLoad {
        let in_flight = rates.and_then(|r| r.in_flight);
        WorkerLoad {
            service,
            index,
            pid: self.last.pid,
            cpu_cores: rates.map(|r| r.cpu_cores),
            runq_wait_cores: rates.map(|r| r.runq_wait_cores),
            requests_per_second: rates.map(|r| r.requests_per_second),
            cpu_seconds_total: self.totals.on_cpu_ns as f64 / 1e9,
            runq_wait_seconds_total: self.totals.runq_wait_ns as f64 / 1e9,
            requests_total: self.requests,
            in_flight,
            in_flight_now: self.last.in_flight.map(InFlightReading::open),
            in_flight_utilization: in_flight.map(|mean| in_flight_utilization(mean, concurrency)),
            smoothed: self.smoothed_load(concurrency),
            sampled_at,
        }
    }

    /// The smoothed load of a worker of a service of `concurrency` requests at once: its smoothed
    /// rate, and the higher of its smoothed CPU and run-queue wait and its smoothed requests in
    /// flight over `concurrency`; settled once its means cover [`SMOOTHING`]. `None` for a server
    /// of many at once, or where its requests in flight are not known.
    fn smoothed_load(&self, concurrency: Option<u32>) -> Option<SmoothedLoad> {
        let n = concurrency.filter(|&n| n > 0)?;
        Some(self.smoothed?.load(Some(n)))
    }

    /// The running totals: scheduler time and requests.
    pub fn totals(&self) -> (SchedTotals, u64) {
        (self.totals, self.requests)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const MS: u64 = 1_000_000;

    fn reading(pid: u32, on_cpu_ms: u64, runq_ms: u64, requests: u64, at: Instant) -> Reading {
        Reading {
            pid,
            sched: SchedTotals {
                on_cpu_ns: on_cpu_ms * MS,
                runq_wait_ns: runq_ms * MS,
            },
            requests,
            in_flight: None,
            at,
        }
    }

    #[test]
    fn the_first_reading_is_a_baseline() {
        let t0 = Instant::now();
        let (history, rates) = step(None, reading(1, 300, 20, 5, t0));
        assert_eq!(rates, None);
        let load = history.load("a".into(), 0, rates, (None, SystemTime::UNIX_EPOCH));
        assert_eq!(load.cpu_cores, None);
        assert_eq!(load.requests_per_second, None);
        assert_eq!(load.cpu_seconds_total, 0.3);
        assert_eq!(load.runq_wait_seconds_total, 0.02);
        assert_eq!(load.requests_total, 5);
    }

    #[test]
    fn two_readings_make_rates_and_totals() {
        let t0 = Instant::now();
        let (history, _) = step(None, reading(1, 100, 0, 0, t0));
        let t1 = t0 + Duration::from_millis(500);
        let (history, rates) = step(Some(&history), reading(1, 850, 100, 40, t1));
        let rates = rates.expect("rates from the second reading");
        assert!((rates.cpu_cores - 1.5).abs() < 1e-9, "{rates:?}");
        assert!((rates.runq_wait_cores - 0.2).abs() < 1e-9, "{rates:?}");
        assert!((rates.requests_per_second - 80.0).abs() < 1e-9, "{rates:?}");
        assert_eq!(
            history.totals(),
            (
                SchedTotals {
                    on_cpu_ns: 850 * MS,
                    runq_wait_ns: 100 * MS
                },
                40
            )
        );
    }

    #[test]
    fn a_new_pid_starts_a_new_baseline() {
        let t0 = Instant::now();
        let (history, _) = step(None, reading(1, 100, 10, 50, t0));
        let (history, rates) = step(
            Some(&history),
            reading(2, 5, 1, 0, t0 + Duration::from_secs(1)),
        );
        assert_eq!(rates, None, "no rates across two processes");
        assert_eq!(
            history.totals(),
            (
                SchedTotals {
                    on_cpu_ns: 5 * MS,
                    runq_wait_ns: MS
                },
                0
            )
        );
        let (_, rates) = step(
            Some(&history),
            reading(2, 15, 1, 4, t0 + Duration::from_secs(2)),
        );
        let rates = rates.unwrap();
        assert!((rates.cpu_cores - 0.01).abs() < 1e-9, "{rates:?}");
        assert!((rates.requests_per_second - 4.0).abs() < 1e-9, "{rates:?}");
    }

    #[test]
    fn totals_never_go_backwards() {
        let t0 = Instant::now();
        let (history, _) = step(None, reading(1, 500, 50, 9, t0));
        // A thread exited (its time left the sum) and the counter read lower.
        let (history, rates) = step(
            Some(&history),
            reading(1, 400, 40, 3, t0 + Duration::from_secs(1)),
        );
        assert_eq!(
            rates,
            Some(Rates {
                cpu_cores: 0.0,
                runq_wait_cores: 0.0,
                requests_per_second: 0.0,
                in_flight: None,
            })
        );
        assert_eq!(history.totals().1, 9);
        // Growth from the lower reading counts again.
        let (history, _) = step(
            Some(&history),
            reading(1, 600, 40, 4, t0 + Duration::from_secs(2)),
        );
        assert_eq!(
            history.totals(),
            (
                SchedTotals {
                    on_cpu_ns: 700 * MS,
                    runq_wait_ns: 50 * MS
                },
                10
            )
        );
    }

    #[test]
    fn requests_in_flight_are_a_mean_over_the_interval_scaled_by_the_concurrency() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let with = |r: Reading, in_flight| Reading { in_flight, ..r };
        // A worker that keeps its word: one request from 0 to 150 ms, one from 100 ms on, read at 0
        // and at 200 ms (a coarse clock in microseconds).
        let kept = |word: u64, at_us| {
            Some(InFlightReading::Kept {
                word: InFlight(word),
                at_us,
            })
        };
        let start = |us| InFlight::start_delta(us);
        let end = |us| InFlight::end_delta(us);
        let base = 5_000_000u64;
        let w0 = start(base);
        let w1 = w0
            .wrapping_add(end(base + 150_000))
            .wrapping_add(start(base + 100_000));
        let (history, _) = step(None, with(reading(1, 0, 0, 0, at(0)), kept(w0, base)));
        let (history, rates) = step(
            Some(&history),
            with(reading(1, 10, 0, 1, at(200)), kept(w1, base + 200_000)),
        );
        let rates = rates.unwrap();
        // 150 ms + 100 ms of requests over 200 ms: 1.25 in flight on average, 1 open now.
        assert!((rates.in_flight.unwrap() - 1.25).abs() < 1e-9, "{rates:?}");
        let load = history.load(
            "a".into(),
            0,
            Some(rates),
            (Some(1), SystemTime::UNIX_EPOCH),
        );
        assert_eq!(load.in_flight_now, Some(1));
        assert!((load.in_flight_utilization.unwrap() - 1.25).abs() < 1e-9);
        let load = history.load(
            "a".into(),
            0,
            Some(rates),
            (Some(4), SystemTime::UNIX_EPOCH),
        );
        assert!((load.in_flight_utilization.unwrap() - 0.3125).abs() < 1e-9);
        // Counts seen in the kernel at two ticks: their mean.
        let seen = |serving| Some(InFlightReading::Seen(Held { queued: 0, serving }));
        let (history, _) = step(None, with(reading(2, 0, 0, 0, at(0)), seen(3)));
        let (history, rates) = step(Some(&history), with(reading(2, 0, 0, 0, at(200)), seen(0)));
        assert_eq!(rates.unwrap().in_flight, Some(1.5));
        let load = history.load("a".into(), 0, rates, (None, SystemTime::UNIX_EPOCH));
        assert_eq!(
            (load.in_flight_now, load.in_flight_utilization),
            (Some(0), Some(1.5))
        );
        // Unknown on either side (a worker of an older version): none.
        let (history, _) = step(None, reading(3, 0, 0, 0, at(0)));
        let (_, rates) = step(Some(&history), with(reading(3, 0, 0, 0, at(200)), seen(2)));
        assert_eq!(rates.unwrap().in_flight, None);
    }

    #[test]
    fn a_worker_of_a_known_concurrency_has_a_load_smoothed_over_seconds() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let seen = |queued, serving| Some(InFlightReading::Seen(Held { queued, serving }));
        // Every 200 ms: 10 more requests, 20 ms of CPU, and what it holds.
        let read = |tick: u64, held| Reading {
            in_flight: held,
            ..reading(1, tick * 20, 0, tick * 10, at(tick * 200))
        };
        let smoothed = |h: &History, concurrency| {
            h.load("a".into(), 0, None, (concurrency, SystemTime::UNIX_EPOCH))
                .smoothed
        };
        // Serving one with two queued at every tick: three in flight. Not settled until the means
        // cover a time constant: a first sample could have seen nothing.
        let ticks = SMOOTHING.as_millis() as u64 / 200;
        let (mut history, _) = step(None, read(0, seen(2, 1)));
        assert_eq!(smoothed(&history, Some(1)), None, "a baseline has no rates");
        for tick in 1..=ticks {
            if tick > 1 {
                let early = smoothed(&history, Some(1)).unwrap();
                assert!(!early.settled, "tick {tick}: {early:?}");
            }
            let rates;
            (history, rates) = step(Some(&history), read(tick, seen(2, 1)));
            assert_eq!(rates.unwrap().in_flight, Some(3.0));
        }
        let first = smoothed(&history, Some(1)).unwrap();
        assert!(first.settled, "{first:?}");
        assert!((first.requests_per_second - 50.0).abs() < 1e-9, "{first:?}");
        assert!((first.utilization - 3.0).abs() < 1e-9, "{first:?}");
        assert!((smoothed(&history, Some(4)).unwrap().utilization - 0.75).abs() < 1e-9);
        // A server of many at once has none: it reports its CPU and wait.
        assert_eq!(smoothed(&history, None), None);
        // Idle from then on: in flight falls by the exponential mean, not at once. After one time
        // constant of idle ticks, e^-1 of it is left (the first tick's mean is one half, the
        // trapezoid); the rate stays, the CPU (0.1 core) takes over once in flight is below it.
        for tick in ticks + 1..=ticks * 2 {
            history = step(Some(&history), read(tick, seen(0, 0))).0;
        }
        let left = smoothed(&history, Some(1)).unwrap();
        let weight = 1.0 - (-0.1f64).exp();
        let expected = 3.0 * (1.0 - weight * 0.5) * (1.0 - weight).powi(ticks as i32 - 1);
        assert!(
            (left.utilization - expected).abs() < 1e-9,
            "{left:?} against {expected}"
        );
        assert!((left.requests_per_second - 50.0).abs() < 1e-9, "{left:?}");
        for tick in ticks * 2 + 1..=ticks * 7 {
            history = step(Some(&history), read(tick, seen(0, 0))).0;
        }
        let late = smoothed(&history, Some(1)).unwrap();
        assert!((late.utilization - 0.1).abs() < 1e-6, "{late:?}");
        // A new process starts its own means.
        let (history, _) = step(
            Some(&history),
            Reading {
                pid: 2,
                ..read(100, seen(0, 0))
            },
        );
        assert_eq!(smoothed(&history, Some(1)), None);
    }

    #[test]
    fn a_shared_listener_is_one_endpoint_whose_load_is_its_workers_together() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Each of 4 workers of one request at a time serves 10 requests/s on 5% of a core; the
        // listener holds 6 requests (queued or served) at every tick.
        let worker = Rates {
            cpu_cores: 0.05,
            runq_wait_cores: 0.0,
            requests_per_second: 10.0,
            in_flight: None,
        };
        let mut history = ListenerHistory::new(6, at(0));
        assert_eq!(history.load(Some(1)), None, "the first tick has no means");
        let ticks = SMOOTHING.as_millis() as u64 / 200;
        for tick in 1..=ticks {
            history = history.step(6, at(tick * 200), &[worker; 4]);
            let load = history.load(Some(1)).unwrap();
            assert_eq!(load.settled, tick == ticks, "tick {tick}: {load:?}");
        }
        let load = history.load(Some(1)).unwrap();
        // The rate is the host's (the four together); the utilization, 6 in flight over 4 workers
        // of one at a time. Envoy's weight: 40 / 1.5, the host's 4 workers over its 0.15 s a request.
        assert!((load.requests_per_second - 40.0).abs() < 1e-9, "{load:?}");
        assert!((load.utilization - 1.5).abs() < 1e-9, "{load:?}");
        // Workers that serve many at once: one request each, by Little's law.
        assert!((history.load(None).unwrap().utilization - 1.5).abs() < 1e-9);
        assert!((history.load(Some(3)).unwrap().utilization - 0.5).abs() < 1e-9);
        // Busier on CPU than in flight (a hogged core): the scheduled time shows it.
        let starved = Rates {
            cpu_cores: 0.5,
            runq_wait_cores: 1.5,
            ..worker
        };
        let mut hogged = ListenerHistory::new(0, at(0));
        for tick in 1..=ticks {
            hogged = hogged.step(0, at(tick * 200), &[starved; 2]);
        }
        assert!((hogged.load(Some(1)).unwrap().utilization - 2.0).abs() < 1e-9);
        // A tick with no worker's rates (every worker new) moves nothing but the count.
        let held = history.step(6, at(ticks * 200 + 200), &[]);
        assert_eq!(held.load(Some(1)), history.load(Some(1)));
        assert_eq!(held.held, 6);
        // Nor does one at the same instant.
        let same = history.step(0, at(ticks * 200), &[worker; 4]);
        assert_eq!(same.load(Some(1)), history.load(Some(1)));
    }

    #[test]
    fn no_time_between_readings_gives_no_rates() {
        let t0 = Instant::now();
        let (history, _) = step(None, reading(1, 1, 1, 1, t0));
        let (_, rates) = step(Some(&history), reading(1, 2, 2, 2, t0));
        assert_eq!(rates, None);
    }
}
