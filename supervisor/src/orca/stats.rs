//! What the ORCA service tells about its streams: per worker hostname, how many streams Envoy holds
//! open and the last report sent ([`OrcaStats`]). `peregrine status` and the metrics show it.

use std::{
    collections::BTreeMap,
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::SystemTime,
};

use crate::registry::Snapshot;

/// One report as sent to Envoy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReportSummary {
    /// `cpu_utilization`.
    pub cpu_utilization: f64,
    /// `application_utilization`.
    pub application_utilization: f64,
    /// `rps_fractional`.
    pub rps_fractional: f64,
    /// When it was sent.
    pub sent_at: SystemTime,
}

/// The ORCA streams of one worker instance.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OrcaStreams {
    /// Streams open now (Envoy holds one per endpoint; more than one while a stream is replaced).
    pub open: u32,
    /// Reports sent over all its streams.
    pub reports: u64,
    /// The last report sent.
    pub last_report: Option<ReportSummary>,
}

/// ORCA stream state by worker hostname.
pub type OrcaByHostname = BTreeMap<String, OrcaStreams>;

/// The home of what ORCA's streams tell about themselves: the ORCA service writes it, `status` and
/// the metrics read it. It follows the registry (a worker's entry goes once the worker has left and
/// its last stream has ended) without writing it.
#[derive(Debug, Default)]
pub struct OrcaStats {
    by_hostname: Mutex<OrcaByHostname>,
    /// Reports sent since the start, over every stream (a worker's own count leaves with it).
    reports: AtomicU64,
}

impl OrcaStats {
    fn lock(&self) -> MutexGuard<'_, OrcaByHostname> {
        self.by_hostname.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that Envoy opened a stream for the worker `hostname`.
    pub fn opened(&self, hostname: &str) {
        self.lock().entry(hostname.to_owned()).or_default().open += 1;
    }

    /// Records that a stream of `hostname` ended; the worker's entry goes once its last stream has
    /// ended and it is no longer `registered`.
    pub fn closed(&self, hostname: &str, registered: bool) {
        let mut streams = self.lock();
        if let Some(entry) = streams.get_mut(hostname) {
            entry.open = entry.open.saturating_sub(1);
            if entry.open == 0 && !registered {
                streams.remove(hostname);
            }
        }
    }

    /// Records a report sent for `hostname`.
    pub fn reported(&self, hostname: &str, report: ReportSummary) {
        let mut streams = self.lock();
        let entry = streams.entry(hostname.to_owned()).or_default();
        entry.reports += 1;
        entry.last_report = Some(report);
        self.reports.fetch_add(1, Ordering::Relaxed);
    }

    /// Reports sent since the start, over every stream.
    pub fn reports_total(&self) -> u64 {
        self.reports.load(Ordering::Relaxed)
    }

    /// The streams of every worker `snapshot` holds or that still has a stream open; the entries of
    /// workers that left with no stream open are forgotten here.
    pub fn current(&self, snapshot: &Snapshot) -> OrcaByHostname {
        let mut streams = self.lock();
        streams.retain(|hostname, entry| entry.open > 0 || snapshot.has_hostname(hostname));
        streams.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Address, Protocol, Registry, Worker};

    fn summary() -> ReportSummary {
        ReportSummary {
            cpu_utilization: 0.5,
            application_utilization: 0.6,
            rps_fractional: 100.0,
            sent_at: SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn a_workers_entry_goes_once_it_has_left_and_its_last_stream_has_ended() {
        let registry = Registry::new(["web".to_string()]);
        let address = Address::Tcp(([127, 0, 0, 1], 8000).into());
        registry
            .register(Worker::ready(
                "web",
                0,
                10,
                vec![Protocol::Http1],
                vec![address],
            ))
            .unwrap();
        let stats = OrcaStats::default();
        stats.opened("web-0-10");
        stats.opened("web-0-10");
        stats.reported("web-0-10", summary());
        stats.closed("web-0-10", true);
        let current = stats.current(&registry.snapshot());
        assert_eq!(current["web-0-10"].open, 1);
        assert_eq!(current["web-0-10"].reports, 1);

        // Gone from the registry with a stream still open: kept until that stream ends.
        assert!(registry.deregister("web", 0, 10));
        assert!(stats.current(&registry.snapshot()).contains_key("web-0-10"));
        stats.closed("web-0-10", false);
        assert!(stats.current(&registry.snapshot()).is_empty());
        assert_eq!(stats.reports_total(), 1, "the total outlives the worker");

        // A stream that ended while its worker was registered, the worker gone since: forgotten at
        // the next read.
        stats.opened("web-0-11");
        stats.closed("web-0-11", true);
        assert!(stats.current(&registry.snapshot()).is_empty());
    }
}
