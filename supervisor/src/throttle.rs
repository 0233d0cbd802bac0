//! Rate limits for log lines that any peer can trigger over and over (a refused connection, an
//! accept that fails for want of descriptors): the first line is written, then at most one per period,
//! saying how many were held back.

use std::{
    collections::HashMap,
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

/// A [`Throttle`] per kind of line, each made on its first use: a flood of one kind holds back no
/// line of another.
#[derive(Debug)]
pub struct Throttles {
    period: Duration,
    kinds: Mutex<HashMap<&'static str, Throttle>>,
}

impl Throttles {
    /// One event per `period` for each kind.
    pub fn new(period: Duration) -> Self {
        Throttles {
            period,
            kinds: Mutex::new(HashMap::new()),
        }
    }

    /// [`Throttle::allow`] for the events of `kind`.
    pub fn allow(&self, kind: &'static str) -> Option<u64> {
        let mut kinds = self.kinds.lock().unwrap_or_else(|e| e.into_inner());
        kinds
            .entry(kind)
            .or_insert_with(|| Throttle::new(self.period))
            .allow()
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

    #[test]
    fn each_kind_has_a_throttle_of_its_own() {
        let throttles = Throttles::new(Duration::from_secs(10));
        assert_eq!(throttles.allow("refused"), Some(0));
        assert_eq!(throttles.allow("refused"), None);
        assert_eq!(throttles.allow("timeout"), Some(0), "another kind passes");
        assert_eq!(throttles.allow("timeout"), None);
    }
}
