//! etcd's own account of the work the fleet gives it, from every member's Prometheus `/metrics`
//! (the names etcd 3.4 exposes): writes (revisions, key puts and deletes, raft proposals), watch
//! events sent, watchers, keys; and its disk latency histograms (WAL fsync, backend commit).

use std::ops::Sub;

use peregrine_e2e::EtcdCluster;

/// The counters read, summed over the members where each member counts only its own share (events
/// and watchers: a watcher is served by the member its client reached), or the most any member
/// counts where each member counts the same (puts, deletes and proposals are applied by every member).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct EtcdCounters {
    /// `etcd_debugging_mvcc_current_revision`: one per write transaction that changed a key.
    pub(super) revision: f64,
    /// `etcd_mvcc_put_total`: keys put.
    pub(super) puts: f64,
    /// `etcd_mvcc_delete_total`: keys deleted (by a request or a lease's expiry).
    pub(super) deletes: f64,
    /// `etcd_mvcc_txn_total`: transactions of more than one operation (etcd counts no other).
    pub(super) txns: f64,
    /// `etcd_mvcc_range_total`: reads.
    pub(super) ranges: f64,
    /// `etcd_server_proposals_committed_total`: raft proposals (writes, lease grants and revokes).
    pub(super) proposals: f64,
    /// `etcd_debugging_mvcc_events_total`: events sent to watchers, summed over the members.
    pub(super) events: f64,
    /// `etcd_debugging_mvcc_watcher_total`: watchers, summed over the members.
    pub(super) watchers: f64,
    /// `etcd_debugging_mvcc_keys_total`: keys.
    pub(super) keys: f64,
}

impl EtcdCounters {
    /// The counters of every member of `etcd` now.
    pub(super) fn read(etcd: &EtcdCluster) -> anyhow::Result<EtcdCounters> {
        let mut total = EtcdCounters::default();
        for member in 0..etcd.size() {
            let text = etcd.metrics(member)?;
            let value = |name: &str| metric(&text, name).unwrap_or(0.0);
            let most = |a: f64, b: f64| a.max(b);
            total.revision = most(
                total.revision,
                value("etcd_debugging_mvcc_current_revision"),
            );
            total.puts = most(total.puts, value("etcd_mvcc_put_total"));
            total.deletes = most(total.deletes, value("etcd_mvcc_delete_total"));
            total.txns = most(total.txns, value("etcd_mvcc_txn_total"));
            total.ranges += value("etcd_mvcc_range_total");
            total.proposals = most(
                total.proposals,
                value("etcd_server_proposals_committed_total"),
            );
            total.events += value("etcd_debugging_mvcc_events_total");
            total.watchers += value("etcd_debugging_mvcc_watcher_total");
            total.keys = most(total.keys, value("etcd_debugging_mvcc_keys_total"));
        }
        Ok(total)
    }
}

impl Sub for EtcdCounters {
    type Output = EtcdCounters;

    /// The counters' growth from `before` to `self` (watchers and keys: their values at `self`).
    fn sub(self, before: EtcdCounters) -> EtcdCounters {
        EtcdCounters {
            revision: self.revision - before.revision,
            puts: self.puts - before.puts,
            deletes: self.deletes - before.deletes,
            txns: self.txns - before.txns,
            ranges: self.ranges - before.ranges,
            proposals: self.proposals - before.proposals,
            events: self.events - before.events,
            watchers: self.watchers,
            keys: self.keys,
        }
    }
}

/// A Prometheus histogram of durations: the cumulative count at each upper bound (`le`, in
/// seconds), as one member exposes it.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Histogram {
    pub(super) buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// The histogram `name` (`<name>_bucket{le="..."}` lines without other labels) in `text`.
    pub(super) fn parse(text: &str, name: &str) -> Histogram {
        let prefix = format!("{name}_bucket{{le=\"");
        let buckets = text
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(&prefix)?;
                let (le, count) = rest.split_once("\"} ")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, count.trim().parse().ok()?))
            })
            .collect();
        Histogram { buckets }
    }

    /// The observations since `before` (the same histogram read earlier).
    pub(super) fn since(&self, before: &Histogram) -> Histogram {
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, count)| {
                    let was = before
                        .buckets
                        .iter()
                        .find(|(l, _)| *l == le)
                        .map_or(0.0, |(_, c)| *c);
                    (le, count - was)
                })
                .collect(),
        }
    }

    /// How many observations there are.
    pub(super) fn count(&self) -> f64 {
        self.buckets.last().map_or(0.0, |(_, c)| *c)
    }

    /// How many observations were above `seconds` (at least: those in buckets wholly above it).
    pub(super) fn above(&self, seconds: f64) -> f64 {
        let within = self
            .buckets
            .iter()
            .filter(|(le, _)| *le >= seconds)
            .map(|(_, c)| *c)
            .next()
            .unwrap_or(0.0);
        self.count() - within
    }

    /// The upper bound of the bucket holding the slowest observation, in seconds.
    pub(super) fn slowest(&self) -> Option<f64> {
        let total = self.count();
        if total == 0.0 {
            return None;
        }
        self.buckets
            .iter()
            .find(|(_, c)| *c >= total)
            .map(|(le, _)| *le)
    }
}

/// etcd's disk latency histograms, per member: WAL fsyncs and backend commits.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Disk {
    pub(super) wal_fsync: Vec<Histogram>,
    pub(super) backend_commit: Vec<Histogram>,
}

impl Disk {
    /// Every member's, now.
    pub(super) fn read(etcd: &EtcdCluster) -> anyhow::Result<Disk> {
        let mut disk = Disk::default();
        for member in 0..etcd.size() {
            let text = etcd.metrics(member)?;
            disk.wal_fsync.push(Histogram::parse(
                &text,
                "etcd_disk_wal_fsync_duration_seconds",
            ));
            disk.backend_commit.push(Histogram::parse(
                &text,
                "etcd_disk_backend_commit_duration_seconds",
            ));
        }
        Ok(disk)
    }

    /// The observations since `before`.
    pub(super) fn since(&self, before: &Disk) -> Disk {
        let each = |now: &[Histogram], was: &[Histogram]| {
            now.iter().zip(was).map(|(n, w)| n.since(w)).collect()
        };
        Disk {
            wal_fsync: each(&self.wal_fsync, &before.wal_fsync),
            backend_commit: each(&self.backend_commit, &before.backend_commit),
        }
    }
}

/// The value of the unlabelled sample `name` in Prometheus text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(' ')?;
        rest.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_histograms() {
        let text = "etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.001\"} 2\n\
                    etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.064\"} 9\n\
                    etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.128\"} 10\n\
                    etcd_disk_wal_fsync_duration_seconds_bucket{le=\"+Inf\"} 11\n\
                    etcd_disk_wal_fsync_duration_seconds_sum 0.5\n";
        let now = Histogram::parse(text, "etcd_disk_wal_fsync_duration_seconds");
        assert_eq!(now.count(), 11.0);
        assert_eq!(now.above(0.064), 2.0);
        assert_eq!(now.slowest(), Some(f64::INFINITY));
        let before = Histogram {
            buckets: vec![
                (0.001, 1.0),
                (0.064, 8.0),
                (0.128, 9.0),
                (f64::INFINITY, 9.0),
            ],
        };
        let since = now.since(&before);
        assert_eq!(since.count(), 2.0);
        assert_eq!(since.above(0.064), 1.0);
        assert_eq!(since.slowest(), Some(f64::INFINITY));
        assert_eq!(now.since(&now).slowest(), None);
    }

    #[test]
    fn reads_unlabelled_samples() {
        let text = "# HELP etcd_mvcc_put_total Total number of puts.\n\
                    # TYPE etcd_mvcc_put_total counter\n\
                    etcd_mvcc_put_total 7\n\
                    etcd_mvcc_put_total_other 9\n\
                    etcd_debugging_mvcc_db_total_size_in_bytes 2.048e+04\n\
                    grpc_server_handled_total{grpc_code=\"OK\"} 3\n";
        assert_eq!(metric(text, "etcd_mvcc_put_total"), Some(7.0));
        assert_eq!(
            metric(text, "etcd_debugging_mvcc_db_total_size_in_bytes"),
            Some(20480.0)
        );
        assert_eq!(metric(text, "grpc_server_handled_total"), None);
        assert_eq!(metric(text, "etcd_mvcc_delete_total"), None);
    }
}
