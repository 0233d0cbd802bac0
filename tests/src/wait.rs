//! Waiting for a condition with a deadline instead of sleeping for a fixed time.

use std::time::{Duration, Instant};

/// How often [`wait_until`] and [`try_wait_until`] poll their condition.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Polls `f` every [`POLL_INTERVAL`] until it returns `Some`, and returns that value.
///
/// # Panics
///
/// When `deadline` passes first; the message names `what` and the time waited.
#[track_caller]
pub fn wait_until<T>(deadline: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    match try_wait_until(deadline, what, f) {
        Ok(value) => value,
        Err(error) => panic!("{error}"),
    }
}

/// Like [`wait_until`], but returns an error on timeout instead of panicking (for callers that must clean
/// up, such as `cargo xtask demo`).
pub fn try_wait_until<T>(
    deadline: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let start = Instant::now();
    loop {
        if let Some(value) = f() {
            return Ok(value);
        }
        let elapsed = start.elapsed();
        if elapsed >= deadline {
            anyhow::bail!("timed out after {elapsed:.2?} waiting for {what}");
        }
        std::thread::sleep(POLL_INTERVAL.min(deadline - elapsed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_the_first_value() {
        let mut calls = 0;
        let value = wait_until(Duration::from_secs(5), "three calls", || {
            calls += 1;
            (calls == 3).then_some(calls * 10)
        });
        assert_eq!(value, 30);
        assert_eq!(calls, 3);
    }

    #[test]
    fn times_out_with_what_and_elapsed() {
        let start = Instant::now();
        let error = try_wait_until(Duration::from_millis(100), "the impossible", || None::<()>)
            .unwrap_err()
            .to_string();
        assert!(start.elapsed() >= Duration::from_millis(100));
        assert!(error.contains("the impossible"), "{error}");
        assert!(error.contains("timed out after"), "{error}");
    }

    #[test]
    fn wait_until_panics_on_timeout() {
        let panic = std::panic::catch_unwind(|| {
            wait_until(Duration::from_millis(30), "nothing", || None::<()>)
        })
        .unwrap_err();
        let message = panic
            .downcast_ref::<String>()
            .expect("a formatted panic message");
        assert!(message.contains("waiting for nothing"), "{message}");
    }
}
