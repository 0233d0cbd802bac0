//! The steps of the zero-downtime tests, for one Envoy cluster of a supervisor's workers: wait until
//! Envoy routes to a given set of workers, run load through Envoy, and check that none of it failed.

use std::{collections::BTreeSet, net::SocketAddr, ops::Range, time::Duration};

use crate::{Envoy, FailedRequest, Load, LoadReport, Supervisor, wait_until};

/// How long a step (hosts in Envoy, a restart, more requests served) may take.
pub const STEP: Duration = Duration::from_secs(60);
/// The longest any load runs (each test stops its load long before).
pub const LOAD_LIMIT: Duration = Duration::from_secs(150);
/// Envoy's `delayed_close_timeout` (its default; the bootstrap leaves it): when Envoy cuts an
/// answer short (its worker died after the head), it closes the client's HTTP/1.1 connection only
/// after waiting this long for the client to close it, and the client sees the cut only then.
pub const ENVOY_DELAYED_CLOSE: Duration = Duration::from_secs(1);
/// Slack on the window a cut answer is seen in: the client's read of the close.
const CLOSE_SLACK: Duration = Duration::from_millis(500);

/// An Envoy routing `cluster` to `supervisor`'s workers, with its listener at `listen`.
#[derive(Clone, Copy, Debug)]
pub struct Deployed<'a> {
    /// The Envoy.
    pub envoy: &'a Envoy,
    /// The supervisor (its logs go with every failure).
    pub supervisor: &'a Supervisor,
    /// The cluster (and service) under test.
    pub cluster: &'a str,
    /// Envoy's HTTP listener.
    pub listen: SocketAddr,
}

impl Deployed<'_> {
    /// The pids of the hosts Envoy routes to (healthy), and of all it lists.
    pub fn envoy_pids(&self) -> (BTreeSet<u32>, BTreeSet<u32>) {
        self.envoy
            .host_pids(self.cluster)
            .expect("Envoy's admin /clusters")
    }

    /// Waits until Envoy lists exactly `n` hosts, all healthy and none of them in `not`; returns their
    /// pids.
    pub fn wait_for_workers(&self, n: usize, not: &BTreeSet<u32>) -> BTreeSet<u32> {
        wait_until(
            STEP,
            &format!("{n} healthy hosts in Envoy, none of {not:?}"),
            || {
                let (healthy, all) = self.envoy_pids();
                (healthy.len() == n && all.len() == n && healthy.is_disjoint(not))
                    .then_some(healthy)
            },
        )
    }

    /// Envoy's counters of what cuts a request short, those above zero, a line each: resets,
    /// timeouts, connections closed with requests on them, retries.
    pub fn resets(&self) -> String {
        let Ok(stats) = self.envoy.admin_get("/stats") else {
            return "(Envoy's admin did not answer)".to_owned();
        };
        const TELLING: [&str; 6] = [
            "reset",
            "timeout",
            "with_active_rq",
            "retry",
            "5xx",
            "premature",
        ];
        stats
            .lines()
            .filter(|line| TELLING.iter().any(|word| line.contains(word)))
            .filter(|line| !line.ends_with(": 0"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Starts the load: two HTTP/1.1 and two HTTP/2 clients through Envoy; returns once it is served.
    pub fn load(&self) -> Load {
        let load = Load::start(self.listen, 2, 2, LOAD_LIMIT);
        wait_until(STEP, "the load to be served", || {
            let seen = load.snapshot();
            assert!(seen.failures.is_empty(), "{:?}", seen.failures);
            (seen.ok.len() == 2 && seen.ok.values().all(|n| *n >= 20)).then_some(())
        });
        load
    }

    /// Lets the load serve `more` requests per protocol, stops it, and checks that none failed and that
    /// only `workers` answered; says how many Envoy retried.
    pub fn finish(&self, load: Load, more: u64, workers: &BTreeSet<u32>) -> LoadReport {
        self.finish_through(load, more, workers, None)
    }

    /// [`finish`](Self::finish) for a load that a worker's SIGKILL went through: a response the
    /// killed server had begun to write is lost with it (Envoy has passed its head on and cannot
    /// retry it), so answers cut short within `killed` (on the load's clock: from the signal to the
    /// successor's first answer) are allowed, one per client at most. The client sees such a cut
    /// only when Envoy closes its connection, up to [`ENVOY_DELAYED_CLOSE`] later, so the window
    /// ends that much after `killed` does. Every other failure still fails the test: a request the
    /// killed worker had not begun to answer must be retried.
    pub fn finish_through_kill(
        &self,
        load: Load,
        more: u64,
        workers: &BTreeSet<u32>,
        killed: Range<Duration>,
    ) -> LoadReport {
        self.finish_through(load, more, workers, Some(killed))
    }

    fn finish_through(
        &self,
        load: Load,
        more: u64,
        workers: &BTreeSet<u32>,
        killed: Option<Range<Duration>>,
    ) -> LoadReport {
        let clients = load.clients();
        let before = load.snapshot();
        wait_until(STEP, "more requests served", || {
            let now = load.snapshot();
            now.ok
                .iter()
                .all(|(protocol, n)| *n >= before.ok[protocol] + more)
                .then_some(())
        });
        let report = load.stop();
        let killed =
            killed.map(|killed| killed.start..killed.end + ENVOY_DELAYED_CLOSE + CLOSE_SLACK);
        let cut_by_kill = |failure: &FailedRequest| {
            failure.cut
                && killed
                    .as_ref()
                    .is_some_and(|killed| killed.contains(&failure.after))
        };
        let (cut, failures): (Vec<&FailedRequest>, Vec<&FailedRequest>) =
            report.failures.iter().partition(|f| cut_by_kill(f));
        assert!(
            failures.is_empty() && cut.len() <= clients,
            "{} of {} requests failed ({} cut short by the kill at {killed:?}): {:?}\n\
             Envoy's resets and timeouts:\n{}\n{}",
            report.failures.len(),
            report.served() + report.failures.len() as u64,
            cut.len(),
            &report.failures[..report.failures.len().min(10)],
            self.resets(),
            self.supervisor.all_logs()
        );
        let strangers: Vec<&u32> = report
            .by_pid
            .keys()
            .filter(|pid| !workers.contains(pid))
            .collect();
        assert!(
            strangers.is_empty(),
            "answered by {strangers:?}, not a worker of {workers:?}"
        );
        // Envoy's own retries (the route retries resets and refused streams) would hide a drain that
        // let a request reach a stopping worker: say how many there were.
        let retries = self
            .envoy
            .stat(&format!("cluster.{}.upstream_rq_retry", self.cluster))
            .unwrap_or(0);
        eprintln!(
            "{} requests in {:?} ({:?} by protocol), {} failed ({} cut short by the kill), {retries} retried by Envoy; by worker: {:?}",
            report.served(),
            report.elapsed,
            report.ok,
            report.failures.len(),
            cut.len(),
            report.by_pid
        );
        report
    }
}
