//! Rate-limited logging for warnings a peer (or the system) can repeat at will.
//!
//! [`LogLimit`] decides, per occurrence, whether to log: the first occurrence is logged, the ones after
//! it within [`LogLimit::interval`] are only counted, and the first occurrence after that interval is
//! logged with how many were suppressed since the last line (`suppressed`, over `over_ms`). So a
//! warning that repeats every millisecond costs one line per interval, and the count is never lost.
//!
//! Architecture Invariant: pure bookkeeping over a given clock reading; the caller logs.

use std::time::{Duration, Instant};

/// The interval repeated warnings are summarised over, unless told otherwise: 5 seconds.
pub(crate) const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// Whether to log one occurrence; see the module docs.
#[derive(Debug)]
pub(crate) struct LogLimit {
    interval: Duration,
    last_logged: Option<Instant>,
    suppressed: u64,
}

/// What to do with one occurrence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Log it, saying that `suppressed` occurrences were not logged in the `over` before it.
    Log {
        /// Occurrences counted but not logged since the last line.
        suppressed: u64,
        /// The time since the last line (zero for the first).
        over: Duration,
    },
    /// Count it only.
    Suppress,
}

// === impl LogLimit ===

impl LogLimit {
    /// At most one line per `interval`.
    pub(crate) const fn new(interval: Duration) -> Self {
        LogLimit {
            interval,
            last_logged: None,
            suppressed: 0,
        }
    }

    /// The interval lines are at least apart.
    #[cfg(test)]
    pub(crate) fn interval(&self) -> Duration {
        self.interval
    }

    /// Records one occurrence at `now`.
    pub(crate) fn hit(&mut self, now: Instant) -> Verdict {
        match self.last_logged {
            Some(last) if now.saturating_duration_since(last) < self.interval => {
                self.suppressed += 1;
                Verdict::Suppress
            }
            last => {
                self.last_logged = Some(now);
                Verdict::Log {
                    suppressed: std::mem::take(&mut self.suppressed),
                    over: last.map_or(Duration::ZERO, |last| now.saturating_duration_since(last)),
                }
            }
        }
    }
}

impl Default for LogLimit {
    fn default() -> Self {
        Self::new(DEFAULT_INTERVAL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_the_first_then_one_summary_per_interval() {
        let start = Instant::now();
        let mut limit = LogLimit::new(Duration::from_secs(5));
        assert_eq!(limit.interval(), Duration::from_secs(5));
        assert_eq!(
            limit.hit(start),
            Verdict::Log {
                suppressed: 0,
                over: Duration::ZERO
            }
        );
        // Every 50 ms for 5 s: counted, not logged.
        let mut at = start;
        for _ in 0..99 {
            at += Duration::from_millis(50);
            assert_eq!(limit.hit(at), Verdict::Suppress);
        }
        at += Duration::from_millis(50);
        assert_eq!(
            limit.hit(at),
            Verdict::Log {
                suppressed: 99,
                over: Duration::from_secs(5)
            }
        );
        // A lone occurrence much later says nothing was suppressed.
        assert_eq!(
            limit.hit(at + Duration::from_secs(60)),
            Verdict::Log {
                suppressed: 0,
                over: Duration::from_secs(60)
            }
        );
    }
}
