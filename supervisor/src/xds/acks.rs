//! How far each connected Envoy has ACKed endpoints: what draining waits on before it stops a worker.
//!
//! Every xDS stream registers itself here on its first request and is removed when it ends (a drop
//! guard, so every exit path removes it). The transport publishes each stream's *synced revision*: the
//! highest registry revision at which Envoy has ACKed every endpoints (EDS) response the stream owed.
//! [`Acks::wait_synced`] waits until every open stream that serves endpoints (dedicated EDS, or ADS
//! with an endpoint subscription) has reached a revision. CDS-only streams are tracked but never
//! counted: draining is published in EDS.
//!
//! Invariant: this module knows nothing of the protocol; the rules that move a synced revision live in
//! the transport's pure per-stream state.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::sync::Notify;

use super::transport::StreamKind;

/// The ACK progress of every open xDS stream. Share it as `Arc<Acks>`.
#[derive(Debug, Default)]
pub struct Acks {
    streams: Mutex<BTreeMap<u64, Tracked>>,
    /// Woken on every change of `streams`.
    changed: Notify,
}

/// One open endpoint-serving stream and how far it has ACKed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamSync {
    /// The stream's id (as in the `xds_stream` log span).
    pub id: u64,
    /// The node id Envoy sent on the stream's first request.
    pub node: String,
    /// Which RPC the stream is.
    pub kind: StreamKind,
    /// The highest registry revision at which Envoy has ACKed every endpoints response the stream
    /// owed; `None` until it first has.
    pub synced_revision: Option<u64>,
}

/// What [`Acks::wait_synced`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncOutcome {
    /// How many endpoint-serving streams had ACKed the revision.
    pub synced: usize,
    /// The endpoint-serving streams that had not when the wait ended; empty when everything was
    /// ACKed in time.
    pub lagging: Vec<StreamSync>,
}

/// A stream as the registry of streams knows it.
#[derive(Debug)]
struct Tracked {
    sync: StreamSync,
    /// Whether the stream serves endpoints (only those count).
    endpoints: bool,
}

/// Keeps one stream registered in [`Acks`] and publishes its progress; removes it when dropped.
#[derive(Debug)]
pub(crate) struct Registered {
    acks: Arc<Acks>,
    id: u64,
}

// === impl Acks ===

impl Acks {
    /// Waits until every open stream that serves endpoints (dedicated EDS, or ADS with an endpoint
    /// subscription) has ACKed everything it was owed at registry revision `revision` (or later), or
    /// until `timeout`. Streams that close stop counting. With no such stream it returns at once.
    ///
    /// A stream opened while waiting counts from its first request on, and owes its first response
    /// like any other; a stream Envoy has not opened yet is not waited for (on dedicated streams Envoy
    /// opens a new EDS stream after a cluster changes, so wait on endpoint changes, as draining does).
    pub async fn wait_synced(&self, revision: u64, timeout: Duration) -> SyncOutcome {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Registered before looking, so a change between the look and the wait is not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let outcome = self.outcome(revision);
            if outcome.is_synced() {
                return outcome;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.outcome(revision);
            }
        }
    }

    /// Every open endpoint-serving stream and how far it has ACKed (for logs and `peregrine status`),
    /// by id.
    pub fn streams(&self) -> Vec<StreamSync> {
        self.lock()
            .values()
            .filter(|t| t.endpoints)
            .map(|t| t.sync.clone())
            .collect()
    }

    /// The endpoint-serving streams split by whether they have ACKed `revision`.
    fn outcome(&self, revision: u64) -> SyncOutcome {
        let (synced, lagging): (Vec<_>, Vec<_>) = self
            .streams()
            .into_iter()
            .partition(|s| s.synced_revision.is_some_and(|r| r >= revision));
        SyncOutcome {
            synced: synced.len(),
            lagging,
        }
    }

    /// Registers a stream that serves nothing yet; it stays until the returned guard is dropped.
    pub(crate) fn register(
        self: &Arc<Self>,
        id: u64,
        node: String,
        kind: StreamKind,
    ) -> Registered {
        let sync = StreamSync {
            id,
            node,
            kind,
            synced_revision: None,
        };
        let tracked = Tracked {
            sync,
            endpoints: false,
        };
        self.lock().insert(id, tracked);
        Registered {
            acks: self.clone(),
            id,
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Tracked>> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }
}

// === impl SyncOutcome ===

impl SyncOutcome {
    /// Whether every endpoint-serving stream had ACKed the revision (also when there was none).
    pub fn is_synced(&self) -> bool {
        self.lagging.is_empty()
    }
}

// === impl Registered ===

impl Registered {
    /// Publishes whether the stream serves endpoints and its synced revision; wakes waiters if either
    /// changed.
    pub(crate) fn publish(&self, endpoints: bool, synced_revision: Option<u64>) {
        let changed = match self.acks.lock().get_mut(&self.id) {
            Some(tracked)
                if tracked.endpoints != endpoints
                    || tracked.sync.synced_revision != synced_revision =>
            {
                tracked.endpoints = endpoints;
                tracked.sync.synced_revision = synced_revision;
                true
            }
            _ => false,
        };
        if changed {
            self.acks.changed.notify_waiters();
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let removed = self.acks.lock().remove(&self.id);
        if removed.is_some_and(|t| t.endpoints) {
            self.acks.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    const LONG: Duration = Duration::from_secs(10);

    fn acks() -> Arc<Acks> {
        Arc::new(Acks::default())
    }

    #[tokio::test]
    async fn wait_synced_returns_at_once_without_streams() {
        let acks = acks();
        // A CDS-only stream does not count.
        let _cds = acks.register(1, "envoy".into(), StreamKind::Cds);
        let started = Instant::now();
        let outcome = acks.wait_synced(7, LONG).await;
        assert_eq!(
            outcome,
            SyncOutcome {
                synced: 0,
                lagging: vec![]
            }
        );
        assert!(outcome.is_synced());
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(acks.streams().is_empty());
    }

    #[tokio::test]
    async fn wait_synced_times_out_listing_the_lagging_stream() {
        let acks = acks();
        let ahead = acks.register(1, "envoy-a".into(), StreamKind::Eds);
        ahead.publish(true, Some(5));
        let behind = acks.register(2, "envoy-b".into(), StreamKind::Ads);
        behind.publish(true, Some(4));
        let outcome = acks.wait_synced(5, Duration::from_millis(50)).await;
        assert!(!outcome.is_synced());
        assert_eq!(outcome.synced, 1);
        assert_eq!(
            outcome.lagging,
            [StreamSync {
                id: 2,
                node: "envoy-b".into(),
                kind: StreamKind::Ads,
                synced_revision: Some(4),
            }]
        );
        assert_eq!(acks.streams().len(), 2);
    }

    #[tokio::test]
    async fn an_ack_releases_a_waiter() {
        let acks = acks();
        let stream = acks.register(1, "envoy".into(), StreamKind::Eds);
        stream.publish(true, Some(2));
        let waiter = acks.wait_synced(3, LONG);
        tokio::pin!(waiter);
        assert!(futures::poll!(waiter.as_mut()).is_pending());
        stream.publish(true, Some(3));
        let outcome = tokio::time::timeout(LONG, waiter).await.unwrap();
        assert_eq!(
            outcome,
            SyncOutcome {
                synced: 1,
                lagging: vec![]
            }
        );
    }

    #[tokio::test]
    async fn closing_a_stream_releases_a_waiter() {
        let acks = acks();
        let stream = acks.register(1, "envoy".into(), StreamKind::Eds);
        stream.publish(true, None);
        let waiter = acks.wait_synced(1, LONG);
        tokio::pin!(waiter);
        assert!(futures::poll!(waiter.as_mut()).is_pending());
        drop(stream);
        let started = Instant::now();
        let outcome = tokio::time::timeout(LONG, waiter).await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(
            outcome,
            SyncOutcome {
                synced: 0,
                lagging: vec![]
            }
        );
        assert!(acks.streams().is_empty());
    }
}
