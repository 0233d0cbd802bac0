//! Rate-limited logging for warnings a peer (or the system) can repeat at will.
//!
//! [`LogLimit`] decides, per occurrence, whether to log: the first occurrence is logged, the ones after
//! it within [`LogLimit::interval`] are only counted, and the first occurrence after that interval is
//! logged with how many were suppressed since the last line (`suppressed`, over `over_ms`). So a
//! warning that repeats every millisecond costs one line per interval, and the count is never lost.
//!
//! [`quiet_h2`] applies one such limit to the `h2` crate's own warnings (see [`QuietH2`]).
//!
//! Architecture Invariant: [`LogLimit`] is pure bookkeeping over a given clock reading; the caller logs.

use std::time::{Duration, Instant};

use tracing::{
    Dispatch, Event, Metadata,
    span::{Attributes, Id, Record},
    subscriber::Interest,
};

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

/// Runs `f` with `h2`'s own warnings rate-limited (see [`QuietH2`]): what it logs while it drives a
/// connection goes through a dispatcher that forwards everything else, unchanged, to the one in force.
pub(crate) fn quiet_h2<T>(f: impl FnOnce() -> T) -> T {
    thread_local! {
        static QUIET: Dispatch = tracing::dispatcher::get_default(|inner| {
            Dispatch::new(QuietH2::new(inner.clone(), DEFAULT_INTERVAL))
        });
    }
    QUIET.with(|quiet| tracing::dispatcher::with_default(quiet, f))
}

/// A subscriber that passes everything to `inner` but the warnings and errors of the `h2` crate, which
/// it rate-limits with one [`LogLimit`]: `h2` logs some peer mistakes at WARN once per frame (an
/// unsolicited PING acknowledgement, say), which any client could turn into a log flood.
pub(crate) struct QuietH2 {
    inner: Dispatch,
    limit: std::sync::Mutex<LogLimit>,
    max_level: tracing::level_filters::LevelFilter,
}

impl std::fmt::Debug for QuietH2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuietH2").finish_non_exhaustive()
    }
}

// === impl QuietH2 ===

impl QuietH2 {
    pub(crate) fn new(inner: Dispatch, interval: Duration) -> Self {
        QuietH2 {
            inner,
            limit: std::sync::Mutex::new(LogLimit::new(interval)),
            max_level: tracing::level_filters::LevelFilter::current(),
        }
    }

    fn limited(metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
            && (metadata.target() == "h2" || metadata.target().starts_with("h2::"))
    }
}

impl tracing::Subscriber for QuietH2 {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        self.inner.register_callsite(metadata)
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(self.max_level)
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        self.inner.enabled(metadata)
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        self.inner.new_span(span)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        self.inner.record(span, values);
    }

    fn record_follows_from(&self, span: &Id, follows: &Id) {
        self.inner.record_follows_from(span, follows);
    }

    fn event(&self, event: &Event<'_>) {
        if !Self::limited(event.metadata()) {
            return self.inner.event(event);
        }
        let verdict = match self.limit.lock() {
            Ok(mut limit) => limit.hit(Instant::now()),
            Err(_) => Verdict::Log {
                suppressed: 0,
                over: Duration::ZERO,
            },
        };
        if let Verdict::Log { suppressed, over } = verdict {
            self.inner.event(event);
            if suppressed > 0 {
                tracing::dispatcher::with_default(&self.inner, || {
                    tracing::warn!(
                        suppressed,
                        over_ms = over.as_millis() as u64,
                        "Suppressed repeated h2 warnings"
                    );
                });
            }
        }
    }

    fn enter(&self, span: &Id) {
        self.inner.enter(span);
    }

    fn exit(&self, span: &Id) {
        self.inner.exit(span);
    }

    fn clone_span(&self, id: &Id) -> Id {
        self.inner.clone_span(id)
    }

    fn try_close(&self, id: Id) -> bool {
        self.inner.try_close(id)
    }

    fn current_span(&self) -> tracing_core::span::Current {
        self.inner.current_span()
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
