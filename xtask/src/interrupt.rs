//! Ctrl-C (SIGINT), SIGTERM and SIGHUP while a long command runs (`cargo xtask bench fleet`, `cargo
//! xtask demo fleet`): the first one makes the command's next wait fail with "interrupted", so the
//! error unwinds through the guards that own every process it started (etcd, Envoys, supervisors and
//! their workers, network namespaces) and each is killed or removed; a second one ends the process
//! at once.
//!
//! Every wait of such a command goes through [`wait_until`] or [`sleep`], which check the flag at
//! least every `CHECK`.

use std::{
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

/// The longest a wait goes without looking at the flag.
const CHECK: Duration = Duration::from_millis(20);

static INTERRUPTED: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Installs the handlers (once per process).
pub fn install() -> anyhow::Result<()> {
    if INTERRUPTED.get().is_some() {
        return Ok(());
    }
    let flag = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM, SIGHUP] {
        // The first signal sets the flag; one that finds it set exits (130: killed by SIGINT).
        signal_hook::flag::register_conditional_shutdown(signal, 130, Arc::clone(&flag))
            .context("installing a signal handler")?;
        signal_hook::flag::register(signal, Arc::clone(&flag))
            .context("installing a signal handler")?;
    }
    let _ = INTERRUPTED.set(flag);
    Ok(())
}

/// An error once a signal came.
pub fn check() -> anyhow::Result<()> {
    if INTERRUPTED
        .get()
        .is_some_and(|flag| flag.load(Ordering::Relaxed))
    {
        bail!("interrupted: stopping everything that was started");
    }
    Ok(())
}

/// Sleeps for `duration`, or fails as soon as a signal comes.
pub fn sleep(duration: Duration) -> anyhow::Result<()> {
    let until = Instant::now() + duration;
    loop {
        check()?;
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(left.min(CHECK));
    }
}

/// Calls `f` every `every` until it returns `Some`; an error when `deadline` passes first (naming
/// `what`), when `f` fails, or when a signal comes.
pub fn wait_until<T>(
    deadline: Duration,
    every: Duration,
    what: &str,
    mut f: impl FnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let start = Instant::now();
    loop {
        check()?;
        let polled = Instant::now();
        if let Some(value) = f()? {
            return Ok(value);
        }
        if start.elapsed() >= deadline {
            bail!("timed out after {:.2?} waiting for {what}", start.elapsed());
        }
        sleep(every.saturating_sub(polled.elapsed()))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_and_times_out() {
        let mut calls = 0;
        let value = wait_until(
            Duration::from_secs(5),
            Duration::ZERO,
            "three calls",
            || {
                calls += 1;
                Ok((calls == 3).then_some(calls))
            },
        )
        .unwrap();
        assert_eq!(value, 3);
        let error = wait_until(
            Duration::from_millis(30),
            Duration::from_millis(5),
            "nothing",
            || Ok(None::<()>),
        )
        .unwrap_err();
        assert!(error.to_string().contains("waiting for nothing"), "{error}");
    }
}
