//! The sampler's arithmetic, pure: two readings of a worker make its rates; totals never go backwards.
//!
//! A worker's first reading (or the first after its pid changed) is a baseline: totals, no rates. Every
//! later reading adds its increase since the previous one to the totals and divides it by the time
//! between the two. A reading lower than the previous one (a procfs thread that exited between two
//! samples takes its time with it; a counter read just as its lane was zeroed) adds nothing.

use std::time::{Instant, SystemTime};

use super::SchedTotals;
use crate::registry::WorkerLoad;

/// What one tick read for one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    /// The worker process.
    pub pid: u32,
    /// Its cumulative scheduler time, as the source reports it.
    pub sched: SchedTotals,
    /// Its lane's request counter.
    pub requests: u64,
    /// When it was read.
    pub at: Instant,
}

/// A worker's sampling history: its last reading and its running totals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct History {
    last: Reading,
    totals: SchedTotals,
    requests: u64,
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
}

/// Adds `now` to a worker's history: the new history, and the rates since the previous reading (`None`
/// for a baseline: no previous reading of this pid, or no time passed since it).
pub fn step(previous: Option<&History>, now: Reading) -> (History, Option<Rates>) {
    let Some(previous) = previous.filter(|p| p.last.pid == now.pid) else {
        let baseline = History {
            last: now,
            totals: now.sched,
            requests: now.requests,
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
    let history = History {
        last: now,
        totals: previous.totals.saturating_add(SchedTotals {
            on_cpu_ns: on_cpu,
            runq_wait_ns: runq_wait,
        }),
        requests: previous.requests.saturating_add(requests),
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
    };
    (history, Some(rates))
}

impl History {
    /// The published load of this worker, in `service`'s slot `index`, read at wall time `sampled_at`.
    pub fn load(
        &self,
        service: String,
        index: u32,
        rates: Option<Rates>,
        sampled_at: SystemTime,
    ) -> WorkerLoad {
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
            sampled_at,
        }
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
            at,
        }
    }

    #[test]
    fn the_first_reading_is_a_baseline() {
        let t0 = Instant::now();
        let (history, rates) = step(None, reading(1, 300, 20, 5, t0));
        assert_eq!(rates, None);
        let load = history.load("a".into(), 0, rates, SystemTime::UNIX_EPOCH);
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
                requests_per_second: 0.0
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
    fn no_time_between_readings_gives_no_rates() {
        let t0 = Instant::now();
        let (history, _) = step(None, reading(1, 1, 1, 1, t0));
        let (_, rates) = step(Some(&history), reading(1, 2, 2, 2, t0));
        assert_eq!(rates, None);
    }
}
