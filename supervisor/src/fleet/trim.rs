//! Memory given back to the system after the fleet's view shrinks a lot.
//!
//! A view of 25,000 other workers costs the supervisor about 90 MB: the range as listed, the view,
//! the registry's snapshots and the xDS cache's endpoints built from them. When those workers leave,
//! all of it is freed, but glibc's allocator keeps freed memory in its arenas (one per thread that
//! allocated, and the runtime's threads all did) and returns to the system only the top of the main
//! heap: the supervisor stayed at 108 MB of 119 after 25,000 workers left, from 28 before they came.
//! `malloc_trim(0)` returns every arena's free pages (a thread arena's free top goes back as it is
//! freed, see [`crate::trim`]). It is called once the view has shrunk by
//! [`SHRINK`] workers from its largest, [`DELAY`] after the last such shrink, so that the xDS cache
//! has rebuilt its snapshots and dropped the old ones, and once more [`AGAIN`] later.
//!
//! Invariant: only a large shrink trims, and shrinks in a row make one trim: trimming walks every
//! arena.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::time::Instant;

use crate::trim::trim;

/// How many workers fewer than the largest view make a trim worth it (about 3.5 MB of view).
pub const SHRINK: usize = 1000;

/// How long after the shrink the trim runs.
pub const DELAY: Duration = Duration::from_secs(2);

/// How long after the trim it runs once more.
pub const AGAIN: Duration = Duration::from_secs(5);

/// Watches the view's size and trims after a large shrink.
#[derive(Debug, Default)]
pub struct Trimmer {
    /// The largest view (other hosts' workers) since the last large shrink.
    peak: usize,
    /// When the due trim runs, if one is due: pushed back by every large shrink until then, so
    /// that a fleet leaving host by host is trimmed once, after the last.
    due: Arc<Mutex<Option<Instant>>>,
}

impl Trimmer {
    /// The view now holds `workers` other workers: schedules a trim [`DELAY`] from now if it shrank
    /// by [`SHRINK`] from its largest. Returns whether it did. Must be called within a tokio
    /// runtime.
    pub fn observe(&mut self, workers: usize) -> bool {
        self.peak = self.peak.max(workers);
        if self.peak - workers < SHRINK {
            return false;
        }
        self.peak = workers;
        let at = Instant::now() + DELAY;
        let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        if due.replace(at).is_some() {
            // The task that waits runs at the new time.
            return true;
        }
        drop(due);
        let due = Arc::clone(&self.due);
        tokio::spawn(async move {
            loop {
                let at = *due.lock().unwrap_or_else(|e| e.into_inner());
                let Some(at) = at.filter(|at| *at > Instant::now()) else {
                    break;
                };
                tokio::time::sleep_until(at).await;
            }
            *due.lock().unwrap_or_else(|e| e.into_inner()) = None;
            // What the allocator holds, to tell memory still in use from free memory kept.
            let (free, in_use) = crate::trim::allocator().unwrap_or_default();
            let returned = trim();
            tracing::debug!(
                free_mib = free >> 20,
                in_use_mib = in_use >> 20,
                returned,
                "Gave freed memory back after the fleet's view shrank"
            );
            // What the streams and the cache held a little longer (an Envoy slow to take the new
            // endpoints keeps the old ones alive until it has them) is given back a while later.
            tokio::time::sleep(AGAIN).await;
            trim();
        });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn only_a_large_shrink_trims_after_the_last_in_a_row() {
        let mut trimmer = Trimmer::default();
        assert!(!trimmer.observe(25_000), "growing");
        assert!(!trimmer.observe(24_500), "a small shrink");
        assert!(trimmer.observe(12_500), "a large one");
        let first = trimmer.due.lock().unwrap().expect("a trim is due");
        tokio::time::sleep(DELAY / 2).await;
        assert!(trimmer.observe(0), "another, before the trim");
        let second = trimmer.due.lock().unwrap().expect("a trim is due");
        assert!(second > first, "the trim waits for the last shrink");
        tokio::time::sleep(DELAY * 2).await;
        assert_eq!(*trimmer.due.lock().unwrap(), None, "and ran");
        assert!(!trimmer.observe(500), "from the size at the last shrink");
    }
}
