//! How long one stream's Envoy takes to converge on a registry change: from the moment the registry
//! made the revision to the ACK that brings the stream's synced revision to it
//! (`peregrine_xds_convergence_seconds`, istiod's proxy convergence time, measured to the ACK rather
//! than to the send).
//!
//! Only the changes a stream had to send count: a revision that changed nothing this stream serves
//! is synced at once and is not a convergence. A stream's first answer to a new subscription is not
//! one either (no change started it). Changes that arrive while the stream is busy may be coalesced by
//! the cache's watch channel; the revision answered is the one timed.
//!
//! Invariant: pure bookkeeping over revisions and instants; the driver observes what it returns.

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

/// How many changes one stream keeps awaiting its ACK: a client this far behind (it never ACKs) is
/// timed on its oldest changes only, so a silent stream cannot grow without bound.
const MAX_OWED: usize = 64;

/// The registry changes a stream has sent its client and not yet had ACKed, oldest first.
#[derive(Debug, Default)]
pub struct Convergence {
    owed: VecDeque<(u64, Instant)>,
}

impl Convergence {
    /// The stream sent its client the change of `revision`, made at `changed_at`, and is not yet
    /// synced at it.
    pub fn sent(&mut self, revision: u64, changed_at: Instant) {
        let newer = self.owed.back().is_none_or(|(last, _)| revision > *last);
        if newer && self.owed.len() < MAX_OWED {
            self.owed.push_back((revision, changed_at));
        }
    }

    /// The stream is now synced at `synced`: how long each change it covers took to converge, by
    /// `now`.
    pub fn synced(&mut self, synced: Option<u64>, now: Instant) -> Vec<Duration> {
        let Some(synced) = synced else {
            return Vec::new();
        };
        let covered = self
            .owed
            .partition_point(|(revision, _)| *revision <= synced);
        self.owed
            .drain(..covered)
            .map(|(_, changed_at)| now.saturating_duration_since(changed_at))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_each_change_from_when_it_was_made_to_the_ack_that_covers_it() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut convergence = Convergence::default();
        convergence.sent(3, t0);
        convergence.sent(5, t0 + ms(10));
        // Not yet ACKed, or ACKed below the first change: nothing converged.
        assert!(convergence.synced(None, t0 + ms(20)).is_empty());
        assert!(convergence.synced(Some(2), t0 + ms(20)).is_empty());
        // The ACK of revision 3 covers the first change only.
        assert_eq!(convergence.synced(Some(3), t0 + ms(30)), [ms(30)]);
        // Sent again (an outdated revision, or the same one): counted once.
        convergence.sent(5, t0 + ms(40));
        convergence.sent(4, t0 + ms(40));
        assert_eq!(convergence.synced(Some(7), t0 + ms(50)), [ms(40)]);
        assert!(convergence.synced(Some(7), t0 + ms(60)).is_empty());
    }

    #[test]
    fn a_client_that_never_acks_is_timed_on_its_oldest_changes_only() {
        let t0 = Instant::now();
        let mut convergence = Convergence::default();
        for revision in 1..=1000 {
            convergence.sent(revision, t0);
        }
        assert_eq!(convergence.owed.len(), MAX_OWED);
        assert_eq!(convergence.synced(Some(1000), t0).len(), MAX_OWED);
    }
}
