//! What a drain waits on in a fleet: the other hosts' Envoys, which learn that a worker drains from
//! their own supervisors, through etcd.
//!
//! A worker is stopped only once every Envoy that may send it requests has it as draining. This
//! host's Envoys are [`Acks`](crate::xds::acks::Acks)'s business; the other hosts' Envoys are seen
//! through etcd: the membership task records here at which etcd revision it published each registry
//! revision of this host's workers, and every other live host's `acks/<host>` revision (the newest
//! revision of the fleet that every endpoint stream of that host has ACKed). A drain published at
//! etcd revision `R` is fleet-wide once every live host's acks reach `R`.
//!
//! A drain waits for the etcd revision that first held its registry revision, not for the newest:
//! the other hosts ack only drains, so a later publication that drains nothing (a worker's record
//! deleted after it exited) is never acked, and a drain that took it for its own waited for its
//! timeout. So the publications are kept, the last [`PUBLICATIONS`] of them.
//!
//! Invariant: a drain never waits for what cannot come. A host that leaves the fleet (its lease ends)
//! stops counting at once; while etcd is away there is no fleet to wait for (the other hosts cannot
//! learn of the drain either), so the drain says so and goes on; every wait is bounded by its
//! timeout.

use std::{
    collections::{BTreeMap, VecDeque},
    time::Duration,
};

use tokio::{sync::watch, time::Instant};

/// How far this host's records are in etcd, and how far the other hosts have ACKed the fleet. Share
/// it as `Arc<FleetDrains>`: the membership task writes it, drains read it.
#[derive(Debug)]
pub struct FleetDrains {
    state: watch::Sender<DrainState>,
}

/// What the membership task last told.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct DrainState {
    /// Whether a session with etcd is up.
    connected: bool,
    /// The publications of this host's records, oldest first: each registry revision published
    /// and the etcd revision that first held it (a publication that wrote nothing shares the etcd
    /// revision of the one before, and takes its place).
    publications: VecDeque<(u64, i64)>,
    /// Every other live host (one with a host record) and its acks revision, if it has written one.
    hosts: BTreeMap<String, Option<i64>>,
}

/// What [`FleetDrains::wait`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FleetOutcome {
    /// Every other live host's Envoys have the worker as draining.
    Synced {
        /// How many other hosts were waited for.
        hosts: usize,
        /// The etcd revision the drain was published at.
        revision: i64,
    },
    /// The timeout ended first; these hosts had not ACKed (`None`: never published the drain).
    Lagging {
        /// The hosts that had not.
        hosts: Vec<String>,
        /// The etcd revision the drain was published at, if it was.
        revision: Option<i64>,
    },
    /// No session with etcd: the other hosts cannot learn of the drain, so there was nothing to
    /// wait for.
    Away,
}

/// How many publications are kept: a drain is looked up among them, and one waits for at most its
/// timeout while the registry changes (a burst of 100 workers is about as many publications).
const PUBLICATIONS: usize = 4096;

impl Default for FleetDrains {
    fn default() -> Self {
        FleetDrains {
            state: watch::Sender::new(DrainState::default()),
        }
    }
}

// === impl FleetDrains ===

impl FleetDrains {
    /// Whether a session with etcd is up; when it goes down, the other hosts are forgotten (the next
    /// session lists them again).
    pub fn set_connected(&self, connected: bool) {
        self.state.send_if_modified(|state| {
            let changed = state.connected != connected;
            state.connected = connected;
            if !connected {
                state.publications.clear();
                state.hosts.clear();
            }
            changed
        });
    }

    /// This host's records as of registry revision `registry` are in etcd at revision `etcd`.
    pub fn set_published(&self, registry: u64, etcd: i64) {
        self.state.send_if_modified(|state| {
            let publications = &mut state.publications;
            match publications.back_mut() {
                Some(last) if *last == (registry, etcd) => return false,
                // Nothing written since: the same etcd revision holds the newer registry revision.
                Some(last) if last.1 == etcd => last.0 = last.0.max(registry),
                _ => {
                    if publications.len() == PUBLICATIONS {
                        publications.pop_front();
                    }
                    publications.push_back((registry, etcd));
                }
            }
            true
        });
    }

    /// The other live hosts and their acks revisions.
    pub fn set_hosts(&self, hosts: BTreeMap<String, Option<i64>>) {
        self.state.send_if_modified(|state| {
            let changed = state.hosts != hosts;
            state.hosts = hosts;
            changed
        });
    }

    /// Waits until every other live host has ACKed this host's records as of registry revision
    /// `revision` (or later), or `timeout` ends. Returns at once when etcd is away.
    pub async fn wait(&self, revision: u64, timeout: Duration) -> FleetOutcome {
        let deadline = Instant::now() + timeout;
        let mut state = self.state.subscribe();
        // The etcd revision of the drain, once it is published.
        let mut at: Option<i64> = None;
        loop {
            let outcome = {
                let current = state.borrow_and_update();
                if !current.connected {
                    return FleetOutcome::Away;
                }
                if at.is_none() {
                    // The first publication that holds the drain, not the newest one.
                    at = current
                        .publications
                        .iter()
                        .find(|&&(registry, _)| registry >= revision)
                        .map(|&(_, etcd)| etcd);
                }
                let lagging = current
                    .hosts
                    .iter()
                    .filter(|(_, acked)| at.is_none_or(|at| acked.is_none_or(|a| a < at)))
                    .map(|(host, _)| host.clone())
                    .collect::<Vec<_>>();
                match at {
                    Some(revision) if lagging.is_empty() => FleetOutcome::Synced {
                        hosts: current.hosts.len(),
                        revision,
                    },
                    revision => FleetOutcome::Lagging {
                        hosts: lagging,
                        revision,
                    },
                }
            };
            if matches!(outcome, FleetOutcome::Synced { .. }) {
                return outcome;
            }
            match tokio::time::timeout_at(deadline, state.changed()).await {
                Ok(Ok(())) => {}
                // The membership task is gone: nothing more will come.
                Ok(Err(_)) => return FleetOutcome::Away,
                Err(_) => return outcome,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn hosts(acks: &[(&str, Option<i64>)]) -> BTreeMap<String, Option<i64>> {
        acks.iter().map(|&(h, a)| (h.to_string(), a)).collect()
    }

    #[tokio::test]
    async fn away_from_etcd_there_is_nothing_to_wait_for() {
        let drains = FleetDrains::default();
        let outcome = drains.wait(1, Duration::from_secs(60)).await;
        assert_eq!(outcome, FleetOutcome::Away);
    }

    #[tokio::test]
    async fn a_drain_waits_until_every_live_host_acked_its_revision() {
        let drains = Arc::new(FleetDrains::default());
        drains.set_connected(true);
        drains.set_published(4, 100);
        drains.set_hosts(hosts(&[("b", Some(100)), ("c", None)]));
        let waiting = tokio::spawn({
            let drains = drains.clone();
            async move { drains.wait(5, Duration::from_secs(60)).await }
        });
        // Registry revision 5 is published at etcd revision 107; b acks it, c acks something older,
        // then newer.
        tokio::task::yield_now().await;
        drains.set_published(5, 107);
        drains.set_hosts(hosts(&[("b", Some(107)), ("c", Some(101))]));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drains.set_hosts(hosts(&[("b", Some(107)), ("c", Some(110))]));
        let outcome = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            outcome,
            FleetOutcome::Synced {
                hosts: 2,
                revision: 107
            }
        );
    }

    #[tokio::test]
    async fn a_drain_waits_for_its_own_publication_not_a_later_one() {
        let drains = FleetDrains::default();
        drains.set_connected(true);
        // Registry revision 6 (the drain) is published at etcd revision 10, with nothing new at 7
        // (another worker's load); at 8 another worker's record is deleted, which no host acks.
        drains.set_published(5, 9);
        drains.set_published(6, 10);
        drains.set_published(7, 10);
        drains.set_published(8, 13);
        drains.set_hosts(hosts(&[("b", Some(11))]));
        let synced = |revision| FleetOutcome::Synced { hosts: 1, revision };
        let wait = Duration::from_secs(5);
        assert_eq!(drains.wait(6, wait).await, synced(10));
        assert_eq!(drains.wait(7, wait).await, synced(10));
        assert_eq!(drains.wait(5, wait).await, synced(9));
    }

    #[test]
    fn publications_are_bounded() {
        let drains = FleetDrains::default();
        drains.set_connected(true);
        for revision in 0..PUBLICATIONS as u64 + 10 {
            drains.set_published(revision, revision as i64);
        }
        let state = drains.state.borrow();
        assert_eq!(state.publications.len(), PUBLICATIONS);
        assert_eq!(state.publications.front(), Some(&(10, 10)));
    }

    #[tokio::test]
    async fn a_host_that_leaves_stops_counting() {
        let drains = Arc::new(FleetDrains::default());
        drains.set_connected(true);
        drains.set_published(5, 50);
        drains.set_hosts(hosts(&[("b", Some(40))]));
        let waiting = tokio::spawn({
            let drains = drains.clone();
            async move { drains.wait(5, Duration::from_secs(60)).await }
        });
        tokio::task::yield_now().await;
        drains.set_hosts(BTreeMap::new());
        let outcome = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            outcome,
            FleetOutcome::Synced {
                hosts: 0,
                revision: 50
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_timeout_names_the_hosts_that_lag() {
        let drains = FleetDrains::default();
        drains.set_connected(true);
        drains.set_published(5, 50);
        drains.set_hosts(hosts(&[("b", Some(50)), ("c", Some(49)), ("d", None)]));
        let outcome = drains.wait(5, Duration::from_secs(3)).await;
        assert_eq!(
            outcome,
            FleetOutcome::Lagging {
                hosts: vec!["c".into(), "d".into()],
                revision: Some(50)
            }
        );
        // Not published yet: every host lags.
        let outcome = drains.wait(6, Duration::from_secs(3)).await;
        assert_eq!(
            outcome,
            FleetOutcome::Lagging {
                hosts: vec!["b".into(), "c".into(), "d".into()],
                revision: None
            }
        );
    }
}
