//! How far each connected Envoy has ACKed endpoints: what draining waits on before it stops a worker.
//!
//! Every xDS stream registers itself here on its first request and is removed when it ends (a drop
//! guard, so every exit path removes it). The transport publishes each stream's *synced revision*: the
//! highest registry revision at which Envoy has ACKed every endpoints (EDS) response the stream owed.
//! [`Acks::wait_synced`] waits until every open stream that serves endpoints (dedicated EDS, or ADS
//! with an endpoint subscription) has reached a revision. CDS-only streams are tracked but never
//! counted: draining is published in EDS.
//!
//! An Envoy whose endpoint stream just ended is still waited for, for [`RECONNECT_GRACE`]: Envoy
//! replaces a changed cluster's EDS stream (and reconnects after a blip) within that time, and its new
//! stream must ACK too. An Envoy that does not come back stops counting when the grace ends.
//!
//! A supervisor that starts again has no stream yet, while Envoy still routes by what the one before
//! it served. So the Envoys that were *proven* (an endpoint stream that ACKed at least once and is
//! not silent) are [`remembered`] in a file beside the control socket, and a supervisor that starts
//! waits for them as for departed Envoys, with a grace that ends `drain_timeout` after its start
//! ([`Acks::remember`]): a drain in that window waits until each has reconnected and ACKed, and an
//! Envoy that never comes back costs at most that once.
//!
//! A stream that has owed an answer (an ACK or a NACK) to an endpoints response for
//! [`SILENCE_GRACE`] is *silent*: Envoy answers within milliseconds, so such a stream is not an Envoy
//! that matters (a script that never ACKs, a wedged proxy), and it stops counting until it answers
//! again. Without this, anyone who can open an EDS stream could hold every drain to its timeout.
//! `peregrine status` shows silent streams as such.
//!
//! A stream that answers, but late, is never silent: each answer restarts its clock. So a wait also
//! stops waiting for a stream that has owed its answer for [`LATE_ANSWER`] (*late*, for that wait
//! only): a client that ACKs every push seconds late costs each drain at most that, not its delay.
//!
//! Invariant: this module knows nothing of the protocol; the rules that move a synced revision live in
//! the transport's pure per-stream state.

pub mod remembered;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

use super::stream_kind::StreamKind;

/// The ACK progress of every open xDS stream. Share it as `Arc<Acks>`.
#[derive(Debug, Default)]
pub struct Acks {
    streams: Mutex<BTreeMap<u64, Tracked>>,
    /// Nodes whose last endpoint stream ended (or that a supervisor before this one served), and
    /// until when they are waited for.
    departed: Mutex<BTreeMap<String, Departed>>,
    /// Woken on every change of `streams`.
    changed: Notify,
}

/// How long an Envoy whose endpoint stream ended still counts as connected (see the module docs).
pub const RECONNECT_GRACE: Duration = Duration::from_secs(1);

/// How long a wait waits for a stream that owes an answer to an endpoints response (see the module
/// docs). Envoy 1.40 ACKs a push within 4-20 ms here (the drains of the rolling restarts in
/// `tests/tests/lifecycle.rs`, under load, debug build, 2026-12-07), and 1,000 Envoy-like clients
/// of 10,000 endpoints ACK a change within 81 ms at p99 (`BENCHMARKS.md`, xds-scale): 1 s is over
/// ten times either.
pub const LATE_ANSWER: Duration = Duration::from_secs(1);

/// How long a stream may owe an answer to an endpoints response before it stops counting (see the
/// module docs): Envoy answers in milliseconds, even loaded; this is well inside the default
/// `drain_timeout_ms` of 10 s.
pub const SILENCE_GRACE: Duration = Duration::from_secs(5);

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
    /// Since when the stream has owed an answer (ACK or NACK) to its last endpoints response; `None`
    /// when it has answered everything.
    pub unanswered_since: Option<Instant>,
}

// === impl StreamSync ===

impl StreamSync {
    /// Whether the stream has owed an answer for longer than [`SILENCE_GRACE`] at `now`.
    pub fn is_silent(&self, now: Instant) -> bool {
        self.silent_from().is_some_and(|at| at <= now)
    }

    /// When the stream turns silent if it goes on owing its answer.
    fn silent_from(&self) -> Option<Instant> {
        self.unanswered_since.map(|since| since + SILENCE_GRACE)
    }

    /// When the stream turns late in a wait that first saw it owe an answer at `owing`: [`LATE_ANSWER`]
    /// later, if it goes on owing one. `None` while it owes nothing.
    fn late_from(&self, owing: &BTreeMap<u64, Instant>) -> Option<Instant> {
        self.unanswered_since?;
        owing.get(&self.id).map(|at| *at + LATE_ANSWER)
    }
}

/// What [`Acks::wait_synced`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncOutcome {
    /// How many endpoint-serving streams had ACKed the revision.
    pub synced: usize,
    /// The endpoint-serving streams that had not when the wait ended; empty when everything was
    /// ACKed in time.
    pub lagging: Vec<StreamSync>,
    /// The streams not waited for because they are silent (see the module docs).
    pub silent: Vec<StreamSync>,
    /// The streams not waited for because they had owed their answer for [`LATE_ANSWER`] (and are
    /// not silent yet).
    pub late: Vec<StreamSync>,
    /// The departed (or remembered) Envoys the wait waited for to come back, whether they did or
    /// their grace ended.
    pub awaited: Vec<String>,
}

/// An Envoy with no endpoint stream that is still waited for.
#[derive(Clone, Copy, Debug)]
struct Departed {
    /// When its grace ends.
    until: Instant,
    /// What its last endpoint stream was.
    kind: StreamKind,
    /// Whether that stream had proven it an Envoy: it ACKed, and was not silent.
    proven: bool,
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
    /// until `timeout`. Streams that close, turn silent, or turn late in this wait stop counting.
    /// With no such stream it returns at once.
    ///
    /// A stream opened while waiting counts from its first request on, and owes its first response
    /// like any other; a stream Envoy has not opened yet is not waited for (on dedicated streams Envoy
    /// opens a new EDS stream after a cluster changes, so wait on endpoint changes, as draining does).
    pub async fn wait_synced(&self, revision: u64, timeout: Duration) -> SyncOutcome {
        let begun = Instant::now();
        let deadline = begun + timeout;
        let mut awaited = BTreeSet::new();
        // Since when this wait has seen each stream owe an answer (see `outcome`).
        let mut owing = BTreeMap::new();
        loop {
            // Registered before looking, so a change between the look and the wait is not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let (mut outcome, grace_ends) = self.outcome(revision, begun, &mut owing);
            awaited.extend(outcome.awaited.drain(..));
            // A departed Envoy's grace ending is a change too.
            let wake = grace_ends.map_or(deadline, |at| at.min(deadline));
            if outcome.is_synced()
                || (tokio::time::timeout_at(wake, changed).await.is_err() && wake == deadline)
            {
                if !outcome.is_synced() {
                    outcome = self.outcome(revision, begun, &mut owing).0;
                    awaited.extend(outcome.awaited.drain(..));
                }
                outcome.awaited = awaited.into_iter().collect();
                return outcome;
            }
        }
    }

    /// Waits for each of `nodes` (with the kind of its last endpoint stream) as for an Envoy whose
    /// stream just ended, until `until`: the Envoys a supervisor before this one served (see the
    /// module docs). A node already connected is unaffected; one waited for longer keeps its grace.
    pub fn remember(&self, nodes: impl IntoIterator<Item = (String, StreamKind)>, until: Instant) {
        let mut departed = self.departed();
        for (node, kind) in nodes {
            let entry = departed.entry(node).or_insert(Departed {
                until,
                kind,
                proven: true,
            });
            entry.until = entry.until.max(until);
            entry.proven = true;
        }
        drop(departed);
        self.changed.notify_waiters();
    }

    /// The proven Envoys (see the module docs), at most `cap`, those connected longest first: the
    /// nodes of open endpoint streams that ACKed at least once and are not silent, and of departed
    /// ones still in their grace whose last stream was. Also when that may change without a stream
    /// changing (a grace ending, a stream turning silent).
    pub(crate) fn proven(&self, cap: usize) -> (Vec<(String, StreamKind)>, Option<Instant>) {
        let now = Instant::now();
        let streams = self.streams();
        let mut departed = self.departed();
        departed.retain(|_, d| d.until > now);
        let mut next = departed.values().map(|d| d.until).min();
        let mut nodes: Vec<(String, StreamKind)> = departed
            .iter()
            .filter(|(_, d)| d.proven)
            .map(|(node, d)| (node.clone(), d.kind))
            .collect();
        drop(departed);
        // `streams` is ordered by id: oldest first.
        for stream in streams {
            if stream.synced_revision.is_none() || stream.is_silent(now) {
                continue;
            }
            if let Some(at) = stream.silent_from() {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
            match nodes.iter_mut().find(|(node, _)| *node == stream.node) {
                Some(known) => known.1 = stream.kind,
                None => nodes.push((stream.node, stream.kind)),
            }
        }
        nodes.truncate(cap);
        (nodes, next)
    }

    /// The kind of every open stream, endpoint-serving or not.
    pub fn kinds(&self) -> Vec<StreamKind> {
        self.lock().values().map(|t| t.sync.kind).collect()
    }

    pub fn streams(&self) -> Vec<StreamSync> {
        self.lock()
            .values()
            .filter(|t| t.endpoints)
            .map(|t| t.sync.clone())
            .collect()
    }

    /// Who has and who has not reached `revision` in a wait begun at `begun` (silent and late
    /// streams apart), and when that may change without a stream changing: the earliest grace of a
    /// departed Envoy that still counts ending, or a lagging stream turning late.
    ///
    /// `owing` is the wait's own clock per stream: since when it has seen the stream owe an answer
    /// (from when the wait began at the earliest). An answer to an outdated response restarts the
    /// stream's clock (it is alive), never the wait's; a stream that owes nothing leaves it.
    fn outcome(
        &self,
        revision: u64,
        begun: Instant,
        owing: &mut BTreeMap<u64, Instant>,
    ) -> (SyncOutcome, Option<Instant>) {
        let streams = self.streams();
        let now = Instant::now();
        let mut departed = self.departed();
        departed.retain(|_, d| d.until > now);
        let waiting: Vec<StreamSync> = departed
            .iter()
            .filter(|(node, _)| !streams.iter().any(|s| &s.node == *node))
            .map(|(node, d)| StreamSync {
                id: 0,
                node: node.clone(),
                kind: d.kind,
                synced_revision: None,
                unanswered_since: None,
            })
            .collect();
        let awaited = waiting.iter().map(|s| s.node.clone()).collect();
        let (synced, unsynced): (Vec<_>, Vec<_>) = streams
            .into_iter()
            .partition(|s| s.synced_revision.is_some_and(|r| r >= revision));
        let (silent, unsilent): (Vec<_>, Vec<_>) =
            unsynced.into_iter().partition(|s| s.is_silent(now));
        *owing = unsilent
            .iter()
            .filter_map(|s| {
                let since = s.unanswered_since?;
                let seen = owing.get(&s.id).copied().unwrap_or(since.max(begun));
                Some((s.id, seen))
            })
            .collect();
        let (late, mut lagging): (Vec<_>, Vec<_>) = unsilent
            .into_iter()
            .partition(|s| s.late_from(owing).is_some_and(|at| at <= now));
        // A departed Envoy's grace ending, or a lagging stream turning late, changes the outcome.
        let grace_ends = departed
            .values()
            .map(|d| d.until)
            .chain(lagging.iter().filter_map(|s| s.late_from(owing)))
            .min();
        lagging.extend(waiting);
        let outcome = SyncOutcome {
            synced: synced.len(),
            lagging,
            silent,
            late,
            awaited,
        };
        (outcome, grace_ends)
    }

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
            unanswered_since: None,
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

    fn departed(&self) -> MutexGuard<'_, BTreeMap<String, Departed>> {
        self.departed.lock().unwrap_or_else(|e| e.into_inner())
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
    /// Publishes whether the stream serves endpoints, its synced revision and since when it has owed
    /// an answer; wakes waiters if any changed.
    pub(crate) fn publish(
        &self,
        endpoints: bool,
        synced_revision: Option<u64>,
        unanswered_since: Option<Instant>,
    ) {
        let changed = match self.acks.lock().get_mut(&self.id) {
            Some(tracked)
                if tracked.endpoints != endpoints
                    || tracked.sync.synced_revision != synced_revision
                    || tracked.sync.unanswered_since != unanswered_since =>
            {
                tracked.endpoints = endpoints;
                tracked.sync.synced_revision = synced_revision;
                tracked.sync.unanswered_since = unanswered_since;
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
        if let Some(tracked) = removed.filter(|t| t.endpoints) {
            let now = Instant::now();
            let sync = tracked.sync;
            let proven = sync.synced_revision.is_some() && !sync.is_silent(now);
            let until = now + RECONNECT_GRACE;
            let mut departed = self.acks.departed();
            let entry = departed.entry(sync.node).or_insert(Departed {
                until,
                kind: sync.kind,
                proven,
            });
            // A remembered Envoy keeps the longer grace.
            entry.until = entry.until.max(until);
            entry.kind = sync.kind;
            entry.proven |= proven;
            drop(departed);
            self.acks.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: Duration = Duration::from_secs(10);

    fn acks() -> Arc<Acks> {
        Arc::new(Acks::default())
    }

    /// The outcome of a wait in which `synced` streams counted and all of them had ACKed.
    fn all_synced(synced: usize) -> SyncOutcome {
        SyncOutcome {
            synced,
            lagging: vec![],
            silent: vec![],
            late: vec![],
            awaited: vec![],
        }
    }

    #[tokio::test]
    async fn wait_synced_returns_at_once_without_streams() {
        let acks = acks();
        // A CDS-only stream does not count.
        let _cds = acks.register(1, "envoy".into(), StreamKind::Cds);
        let started = Instant::now();
        let outcome = acks.wait_synced(7, LONG).await;
        assert_eq!(outcome, all_synced(0));
        assert!(outcome.is_synced());
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(acks.streams().is_empty());
    }

    #[tokio::test]
    async fn wait_synced_times_out_listing_the_lagging_stream() {
        let acks = acks();
        let ahead = acks.register(1, "envoy-a".into(), StreamKind::Eds);
        ahead.publish(true, Some(5), None);
        let behind = acks.register(2, "envoy-b".into(), StreamKind::Ads);
        behind.publish(true, Some(4), None);
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
                unanswered_since: None,
            }]
        );
        assert_eq!(acks.streams().len(), 2);
    }

    #[tokio::test]
    async fn an_ack_releases_a_waiter() {
        let acks = acks();
        let stream = acks.register(1, "envoy".into(), StreamKind::Eds);
        stream.publish(true, Some(2), None);
        let waiter = acks.wait_synced(3, LONG);
        tokio::pin!(waiter);
        assert!(futures::poll!(waiter.as_mut()).is_pending());
        stream.publish(true, Some(3), None);
        let outcome = tokio::time::timeout(LONG, waiter).await.unwrap();
        assert_eq!(outcome, all_synced(1));
    }

    #[tokio::test(start_paused = true)]
    async fn an_envoy_whose_stream_closed_is_waited_for_until_the_grace_ends() {
        let acks = acks();
        let stream = acks.register(1, "envoy".into(), StreamKind::Eds);
        stream.publish(true, None, None);
        let waiter = acks.wait_synced(1, LONG);
        tokio::pin!(waiter);
        assert!(futures::poll!(waiter.as_mut()).is_pending());
        drop(stream);
        assert!(
            futures::poll!(waiter.as_mut()).is_pending(),
            "its next stream must ACK too"
        );
        let started = Instant::now();
        let outcome = tokio::time::timeout(LONG, waiter).await.unwrap();
        // Released when the grace ends, on the paused clock: not before, not at the timeout.
        assert_eq!(started.elapsed(), RECONNECT_GRACE);
        assert_eq!(
            outcome,
            SyncOutcome {
                awaited: vec!["envoy".into()],
                ..all_synced(0)
            }
        );
        assert!(acks.streams().is_empty());
    }

    #[tokio::test]
    async fn a_reconnected_envoy_releases_a_waiter_once_its_new_stream_acked() {
        let acks = acks();
        let old = acks.register(1, "envoy".into(), StreamKind::Eds);
        old.publish(true, Some(1), None);
        let waiter = acks.wait_synced(2, LONG);
        tokio::pin!(waiter);
        drop(old);
        let new = acks.register(2, "envoy".into(), StreamKind::Eds);
        new.publish(true, None, None);
        assert!(futures::poll!(waiter.as_mut()).is_pending());
        new.publish(true, Some(2), None);
        let outcome = tokio::time::timeout(Duration::from_millis(500), waiter)
            .await
            .expect("released by the ACK, not by the grace");
        assert_eq!(outcome.synced, 1);
        assert!(outcome.is_synced());
    }

    // The paused clock jumps over the grace instead of waiting it out.
    #[tokio::test(start_paused = true)]
    async fn a_departed_envoy_that_never_returns_is_listed_as_lagging_only_during_the_grace() {
        let acks = acks();
        drop({
            let stream = acks.register(1, "gone".into(), StreamKind::Ads);
            stream.publish(true, Some(1), None);
            stream
        });
        let outcome = acks.wait_synced(1, Duration::from_millis(10)).await;
        assert_eq!(outcome.lagging.len(), 1);
        assert_eq!(
            (outcome.lagging[0].node.as_str(), outcome.lagging[0].kind),
            ("gone", StreamKind::Ads)
        );
        tokio::time::sleep(RECONNECT_GRACE).await;
        assert!(
            acks.wait_synced(1, Duration::from_millis(10))
                .await
                .is_synced()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_remembered_envoy_is_waited_for_until_it_reconnects_and_acks_or_its_grace_ends() {
        let acks = acks();
        let grace = Duration::from_secs(10);
        acks.remember(
            [("envoy".to_owned(), StreamKind::Eds)],
            Instant::now() + grace,
        );
        // A supervisor that just started, with no stream yet: the drain waits for the Envoy.
        let waiter = acks.wait_synced(3, Duration::from_secs(60));
        tokio::pin!(waiter);
        assert!(futures::poll!(waiter.as_mut()).is_pending());
        tokio::time::advance(Duration::from_millis(300)).await;
        let stream = acks.register(1, "envoy".into(), StreamKind::Eds);
        stream.publish(true, None, Some(Instant::now()));
        assert!(
            futures::poll!(waiter.as_mut()).is_pending(),
            "connected is not enough: it must ACK"
        );
        // Late only a second after it first owed its answer, not after the wait began.
        tokio::time::advance(LATE_ANSWER - Duration::from_millis(100)).await;
        assert!(futures::poll!(waiter.as_mut()).is_pending());
        stream.publish(true, Some(3), None);
        let outcome = waiter.await;
        assert_eq!(
            outcome,
            SyncOutcome {
                awaited: vec!["envoy".into()],
                ..all_synced(1)
            }
        );
        // One that never comes back costs at most the grace, once.
        acks.remember(
            [("gone".to_owned(), StreamKind::Ads)],
            Instant::now() + grace,
        );
        let started = Instant::now();
        let outcome = acks.wait_synced(3, Duration::from_secs(60)).await;
        assert_eq!(started.elapsed(), grace);
        assert!(outcome.is_synced(), "{outcome:?}");
        assert_eq!(outcome.awaited, ["gone"]);
        let started = Instant::now();
        assert!(acks.wait_synced(3, LONG).await.is_synced());
        assert_eq!(started.elapsed(), Duration::ZERO);
        // What is proven: the connected Envoy that ACKed, not the one whose grace ended.
        assert_eq!(acks.proven(64).0, [("envoy".to_owned(), StreamKind::Eds)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_answers_each_push_late_costs_each_wait_at_most_the_late_bound() {
        let acks = acks();
        let envoy = acks.register(1, "envoy".into(), StreamKind::Eds);
        envoy.publish(true, Some(1), None);
        let slow = Arc::new(acks.register(2, "slow".into(), StreamKind::Eds));
        slow.publish(true, Some(1), None);
        let late_by = Duration::from_millis(4500);
        for revision in 2..6 {
            // A push: the Envoy ACKs it at once, the slow client 4.5 s later (never silent).
            let pushed = Instant::now();
            envoy.publish(true, Some(revision), None);
            slow.publish(true, Some(revision - 1), Some(pushed));
            let answer = tokio::spawn({
                let slow = slow.clone();
                async move {
                    tokio::time::sleep_until(pushed + late_by).await;
                    slow.publish(true, Some(revision), None);
                }
            });
            let outcome = acks.wait_synced(revision, Duration::from_secs(60)).await;
            assert_eq!(pushed.elapsed(), LATE_ANSWER, "revision {revision}");
            assert!(outcome.is_synced(), "{outcome:?}");
            assert_eq!(outcome.synced, 1);
            assert_eq!(outcome.late.len(), 1, "{outcome:?}");
            assert_eq!(outcome.late[0].node, "slow");
            assert!(outcome.silent.is_empty(), "answering late is not silent");
            answer.await.unwrap();
        }
        // An answer to an outdated response restarts the stream's clock, never the wait's.
        let pushed = Instant::now();
        envoy.publish(true, Some(6), None);
        slow.publish(true, Some(5), Some(pushed));
        let answer = tokio::spawn({
            let slow = slow.clone();
            async move {
                tokio::time::sleep(LATE_ANSWER / 2).await;
                slow.publish(true, Some(5), Some(Instant::now()));
            }
        });
        let outcome = acks.wait_synced(6, Duration::from_secs(60)).await;
        assert_eq!(pushed.elapsed(), LATE_ANSWER);
        assert_eq!(outcome.late.len(), 1, "{outcome:?}");
        answer.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_never_answers_stops_counting_after_the_silence_grace() {
        let acks = acks();
        let envoy = acks.register(1, "envoy".into(), StreamKind::Eds);
        envoy.publish(true, Some(1), None);
        let script = acks.register(2, "script".into(), StreamKind::Eds);
        script.publish(true, None, Some(Instant::now()));
        // The Envoy ACKs at once; the script never does: the wait ends when the script turns late,
        // not at the timeout.
        envoy.publish(true, Some(2), None);
        let started = Instant::now();
        let outcome = acks.wait_synced(2, Duration::from_secs(60)).await;
        assert_eq!(started.elapsed(), LATE_ANSWER);
        assert!(outcome.is_synced(), "{outcome:?}");
        assert_eq!(outcome.late.len(), 1);
        assert!(outcome.silent.is_empty());
        // Later it is silent.
        tokio::time::advance(SILENCE_GRACE - LATE_ANSWER).await;
        let outcome = acks.wait_synced(2, Duration::from_secs(60)).await;
        assert!(outcome.is_synced(), "{outcome:?}");
        assert_eq!(outcome.synced, 1);
        assert_eq!(outcome.silent.len(), 1);
        assert_eq!(outcome.silent[0].node, "script");
        // Once silent, it is not waited for at all.
        let started = Instant::now();
        assert!(acks.wait_synced(2, LONG).await.is_synced());
        assert_eq!(started.elapsed(), Duration::ZERO);
        // It counts again as soon as it answers.
        script.publish(true, Some(1), None);
        let outcome = acks.wait_synced(2, Duration::from_millis(10)).await;
        assert_eq!(outcome.lagging.len(), 1, "{outcome:?}");
    }
}
