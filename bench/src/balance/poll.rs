//! Waiting for a condition with a deadline, checked at a fixed step: the set-up's waits (`run`,
//! every 250 ms) and the timeline's (every 10 ms) alike.

use std::{
    thread,
    time::{Duration, Instant},
};

use anyhow::bail;

/// Polls `f` every `step` until it returns `Some` or `deadline` passes; fails at once on Ctrl-C
/// where the run installed [`xtask::interrupt`], so that its guards stop what it started.
pub(super) fn poll_every<T>(
    step: Duration,
    deadline: Instant,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    loop {
        if let Some(value) = f() {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("timed out waiting for {what}");
        }
        xtask::interrupt::check()?;
        thread::sleep(step);
    }
}
