//! Rate limits for log lines that any peer can trigger over and over (a refused connection, an
//! accept that fails for want of descriptors): the first line is written, then at most one per period,
//! saying how many were held back.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

/// Lets one event through per `period`, counting the rest.
#[derive(Debug)]
pub struct Throttle {
    period: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    last: Option<Instant>,
    held_back: u64,
}

impl Throttle {
    /// A throttle that lets one event through per `period`.
    pub const fn new(period: Duration) -> Self {
        Throttle {
            period,
            state: Mutex::new(State {
                last: None,
                held_back: 0,
            }),
        }
    }

    /// Whether an event at `now` may be logged; if so, how many were held back since the last one.
    pub fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match state.last {
            Some(last) if now.saturating_duration_since(last) < self.period => {
                state.held_back += 1;
                None
            }
            _ => {
                state.last = Some(now);
                Some(std::mem::take(&mut state.held_back))
            }
        }
    }

    /// [`Throttle::allow_at`] now.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_period_passes_and_the_rest_are_counted() {
        let throttle = Throttle::new(Duration::from_secs(10));
        let start = Instant::now();
        assert_eq!(throttle.allow_at(start), Some(0));
        for ms in 1..=960 {
            assert_eq!(throttle.allow_at(start + Duration::from_millis(ms)), None);
        }
        assert_eq!(
            throttle.allow_at(start + Duration::from_secs(10)),
            Some(960),
            "the next line says how many were held back"
        );
        assert_eq!(throttle.allow_at(start + Duration::from_secs(11)), None);
        assert_eq!(throttle.allow_at(start + Duration::from_secs(30)), Some(1));
    }
}
