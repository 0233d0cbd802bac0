//! Rapid-reset accounting: the connection's streams, those the peer reset before their response
//! completed, and those that completed, over a sliding window.
//!
//! Invariant: a reset counts against the peer only relative to completed streams in the same window,
//! so a proxy whose clients cancel in bursts while this thread is busy is not mistaken for a flood.

use std::{cell::Cell, time::Duration};

use tokio::time::Instant;

use super::ConnectionError;

/// Counts the connection's streams, those the peer reset before their response completed and those
/// that completed, the last two also over a sliding window (see
/// [`super::Limits::premature_reset_min_streams`]).
#[derive(Debug)]
pub(super) struct Resets {
    pub(super) streams: Cell<u64>,
    pub(super) resets: Cell<u64>,
    /// Set by every reset, taken by the check.
    pub(super) changed: Cell<bool>,
    recent: Cell<Recent>,
}

/// Resets and completions in the current window and the one before it.
#[derive(Debug, Clone, Copy)]
struct Recent {
    window: Duration,
    start: Instant,
    resets: [u64; 2],
    completed: [u64; 2],
}

// === impl Recent ===

impl Recent {
    /// Moves the window on to `now`.
    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.start);
        if elapsed < self.window {
            return;
        }
        if elapsed < 2 * self.window {
            self.resets = [self.resets[1], 0];
            self.completed = [self.completed[1], 0];
            self.start += self.window;
        } else {
            self.resets = [0, 0];
            self.completed = [0, 0];
            self.start = now;
        }
    }

    /// The count over the last window: all of the current one and the part of the previous one the
    /// window still covers.
    fn estimate(&self, counts: [u64; 2], now: Instant) -> f64 {
        let into =
            now.saturating_duration_since(self.start).as_secs_f64() / self.window.as_secs_f64();
        counts[1] as f64 + counts[0] as f64 * (1.0 - into.min(1.0))
    }
}

// === impl Resets ===

impl Resets {
    pub(super) fn new(window: Duration, now: Instant) -> Self {
        Resets {
            streams: Cell::new(0),
            resets: Cell::new(0),
            changed: Cell::new(false),
            recent: Cell::new(Recent {
                window: window.max(Duration::from_millis(1)),
                start: now,
                resets: [0, 0],
                completed: [0, 0],
            }),
        }
    }

    fn update(&self, now: Instant, f: impl FnOnce(&mut Recent)) {
        let mut recent = self.recent.get();
        recent.roll(now);
        f(&mut recent);
        self.recent.set(recent);
    }

    /// A stream reset by the peer before its response completed.
    pub(super) fn record(&self, now: Instant) {
        self.resets.set(self.resets.get() + 1);
        self.changed.set(true);
        self.update(now, |r| r.resets[1] += 1);
    }

    /// A stream whose response completed.
    pub(super) fn completed(&self, now: Instant) {
        self.update(now, |r| r.completed[1] += 1);
    }

    /// Whether the last window saw at least `min_resets` premature resets, and more of them than
    /// completed streams: a client that cancels now and then, or a proxy whose clients cancel while
    /// this thread is busy, stays well below; a rapid-reset flood reaches it within `min_resets`.
    pub(super) fn too_many(&self, min_resets: u64, now: Instant) -> bool {
        let mut recent = self.recent.get();
        recent.roll(now);
        self.recent.set(recent);
        let resets = recent.estimate(recent.resets, now);
        let completed = recent.estimate(recent.completed, now);
        resets >= min_resets as f64 && resets > completed
    }

    pub(super) fn error(&self) -> ConnectionError {
        ConnectionError::TooManyResets {
            resets: self.resets.get(),
            streams: self.streams.get(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn premature_resets_count_after_the_minimum_within_the_window() {
        let start = Instant::now();
        let window = Duration::from_secs(10);
        let resets = Resets::new(window, start);
        for _ in 0..99 {
            resets.record(start);
        }
        assert!(!resets.too_many(100, start), "below the minimum");
        resets.record(start);
        assert!(resets.too_many(100, start));
        // As many completions: a client that cancels half of what it asks for.
        for _ in 0..100 {
            resets.completed(start);
        }
        assert!(!resets.too_many(100, start));
    }

    #[test]
    fn old_resets_leave_the_window() {
        let start = Instant::now();
        let window = Duration::from_secs(10);
        let resets = Resets::new(window, start);
        // 45 cancellations every 10 s, for a minute, with nothing completed (a busy thread): never
        // 100 within one window.
        for tick in 0..6u32 {
            let at = start + window * tick + Duration::from_millis(1);
            for _ in 0..45 {
                resets.record(at);
            }
            assert!(!resets.too_many(100, at), "tick {tick}");
        }
        // Half a window later, the previous window counts half.
        let later = start + window * 6 + window / 2;
        resets.record(later);
        assert!(!resets.too_many(100, later));
        // Long after, a burst of 100 is caught at once, however much came before.
        let much_later = later + window * 5;
        for _ in 0..100 {
            resets.record(much_later);
        }
        assert!(resets.too_many(100, much_later));
    }
}
