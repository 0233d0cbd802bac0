//! The pause between two failed etcd sessions: exponential, with jitter, up to a cap the caller
//! gives for each pause.
//!
//! Jitter keeps the hosts of a fleet that lost etcd together from coming back in step (each session
//! lists the whole range, so a fleet that reconnects at once is a burst on etcd). It needs no
//! cryptographic randomness: a xorshift seeded from the clock and the host's name is enough.

use std::time::{Duration, SystemTime};

/// The first pause after a failed session.
pub const FIRST: Duration = Duration::from_millis(100);

/// Pauses that double from [`FIRST`], each drawn between half and all of its nominal length.
#[derive(Debug)]
pub struct Backoff {
    /// The nominal length of the next pause.
    next: Duration,
    /// The jitter's state (never 0).
    state: u64,
}

impl Backoff {
    /// Pauses for the host whose name hashes to `seed`.
    pub fn new(seed: u64) -> Backoff {
        let clock = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Backoff {
            next: FIRST,
            state: (seed ^ clock) | 1,
        }
    }

    /// Starts again from [`FIRST`] (after a session that joined the fleet).
    pub fn reset(&mut self) {
        self.next = FIRST;
    }

    /// The next pause, at most `cap`; the one after is twice as long nominally.
    pub fn next(&mut self, cap: Duration) -> Duration {
        let nominal = self.next.min(cap);
        self.next = (self.next * 2).min(cap.max(FIRST));
        // Between half and all of it.
        let half = nominal / 2;
        let spread = half.as_micros() as u64 + 1;
        half + Duration::from_micros(self.random() % spread)
    }

    /// xorshift64.
    fn random(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.state = x;
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_the_cap_with_jitter_and_start_again() {
        let mut backoff = Backoff::new(42);
        let cap = Duration::from_secs(10);
        let mut nominal = FIRST;
        for _ in 0..12 {
            let pause = backoff.next(cap);
            assert!(
                pause >= nominal / 2 && pause <= nominal,
                "{pause:?} for {nominal:?}"
            );
            nominal = (nominal * 2).min(cap);
        }
        assert_eq!(nominal, cap, "reached the cap");
        // A lower cap (a lease to keep) holds at once.
        let held = backoff.next(Duration::from_secs(1));
        assert!(held <= Duration::from_secs(1), "{held:?}");
        backoff.reset();
        assert!(backoff.next(cap) <= FIRST);
    }

    #[test]
    fn hosts_do_not_pause_in_step() {
        let pauses = |seed| {
            let mut backoff = Backoff::new(seed);
            (0..8)
                .map(|_| backoff.next(Duration::from_secs(10)))
                .collect::<Vec<_>>()
        };
        assert_ne!(pauses(1), pauses(2));
    }
}
