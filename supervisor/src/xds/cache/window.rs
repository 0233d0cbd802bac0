//! When the cache publishes a registry change: a lone change at once, a burst in a few pushes.
//!
//! A change that comes after a quiet spell is published at once: a worker that dies or is added
//! reaches every stream without waiting for anything. Changes that follow it within [`QUIET`] are
//! held, and published together once the registry has been quiet for [`QUIET`], or [`MAX_HOLD`] after
//! the last publication if they keep coming. So 100 workers restarting within a second cost every
//! stream two or three pushes, not one per change, and the cache builds as often.
//!
//! Why these lengths: [`QUIET`] is shorter than anything that separates the changes of one worker's
//! life (a restart waits 100 ms before the replacement starts; a drain waits for every Envoy's ACK),
//! so those are never held, yet longer than the gaps inside a burst (100 changes in a second are 10 ms
//! apart). [`MAX_HOLD`] bounds how stale the served state gets while a burst lasts; Istio's debounce
//! holds changes for 100 ms after each one and up to 10 s.
//!
//! Invariant: a held change is always published, within [`MAX_HOLD`] of the publication before it or
//! [`QUIET`] after the last change, whichever comes first.

use std::time::Duration;

use tokio::time::Instant;

/// How long the registry must be quiet before changes held during a burst are published.
pub(super) const QUIET: Duration = Duration::from_millis(20);

/// The longest a change is held while changes keep coming.
pub(super) const MAX_HOLD: Duration = Duration::from_secs(1);

/// The publication window: idle, or holding since the last publication.
#[derive(Debug, Default)]
pub(super) struct Window {
    hold: Option<Hold>,
}

/// A window open since a publication.
#[derive(Clone, Copy, Debug)]
struct Hold {
    /// When the last publication was.
    published: Instant,
    /// When the registry last changed.
    changed: Instant,
    /// Whether a change is held (not yet published).
    pending: bool,
}

impl Window {
    /// The registry changed at `now`: whether to publish at once (otherwise it is held).
    pub(super) fn changed(&mut self, now: Instant) -> bool {
        match &mut self.hold {
            None => {
                self.hold = Some(Hold {
                    published: now,
                    changed: now,
                    pending: false,
                });
                true
            }
            Some(hold) => {
                hold.changed = now;
                hold.pending = true;
                false
            }
        }
    }

    /// When to look at the window again; `None` while idle.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.hold.map(|hold| {
            let quiet = hold.changed + QUIET;
            if hold.pending {
                quiet.min(hold.published + MAX_HOLD)
            } else {
                quiet
            }
        })
    }

    /// The deadline passed at `now`: whether to publish what is held. The window stays open after a
    /// publication, and closes once a quiet spell passes with nothing held.
    pub(super) fn elapsed(&mut self, now: Instant) -> bool {
        match &mut self.hold {
            Some(hold) if hold.pending => {
                hold.published = now;
                hold.pending = false;
                true
            }
            _ => {
                self.hold = None;
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds changes at the given offsets (ms) through a window, firing its deadlines in between as
    /// the cache's loop does; returns the offsets of the publications.
    fn publications(changes: &[u64]) -> Vec<u64> {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut window = Window::default();
        let mut published = Vec::new();
        let mut changes = changes.iter().copied().peekable();
        loop {
            let next_change = changes.peek().map(|&ms| at(ms));
            match (window.deadline(), next_change) {
                (Some(deadline), change) if change.is_none_or(|c| deadline < c) => {
                    if window.elapsed(deadline) {
                        published.push((deadline - start).as_millis() as u64);
                    }
                }
                (_, Some(change)) => {
                    changes.next();
                    if window.changed(change) {
                        published.push((change - start).as_millis() as u64);
                    }
                }
                (None, None) => return published,
                (Some(_), None) => unreachable!("matched above"),
            }
        }
    }

    #[test]
    fn a_lone_change_is_published_at_once() {
        assert_eq!(publications(&[0]), [0]);
        // Changes further apart than the quiet spell: each at once.
        assert_eq!(publications(&[0, 100, 250]), [0, 100, 250]);
    }

    #[test]
    fn changes_close_together_are_published_once_quiet() {
        // The first at once, the next two together 20 ms after the last.
        assert_eq!(publications(&[0, 5, 12]), [0, 32]);
    }

    #[test]
    fn a_burst_of_a_hundred_changes_in_a_second_is_two_or_three_publications() {
        let burst = (0..100).map(|i| i * 10).collect::<Vec<_>>();
        let published = publications(&burst);
        assert_eq!(published, [0, 1000], "{published:?}");
        // An endless stream of changes is still published every MAX_HOLD.
        let endless = (0..350).map(|i| i * 10).collect::<Vec<_>>();
        assert_eq!(publications(&endless), [0, 1000, 2000, 3000, 3510]);
    }
}
