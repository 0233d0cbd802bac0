//! Whether this machine's CPUs are free: tests that measure how load is shared between cores (a hog
//! on one, workers pinned to each) mean nothing while other processes keep the cores busy; and the
//! hog itself ([`Hog`]).
//!
//! Such a test waits for quiet before it starts ([`two_free_cores_or_skip`]) and judges each window
//! of its load by how much of the machine *other* processes took while it ran
//! ([`passes_on_free_cores`]): a window that fails while others kept a core busy says nothing about
//! Peregrine and is measured again; if the machine never stays quiet, the test is skipped and says
//! why. Other work is told from the test's own by process tree ([`procfs::Busy`]): this test
//! process and everything it started (supervisor, workers, Envoy, etcd, the hog) are its own.
//!
//! A process started without a pin (a worker the supervisor spawns) is pinned afterwards with
//! [`pin_threads`], every thread of it, and checked with [`allowed_cpus`].

use std::{
    io,
    process::{Child, Command},
    time::{Duration, Instant},
};

use peregrine_contract::procfs::{self, Busy};
use rustix::{
    io::Errno,
    process::Pid,
    thread::{CpuSet, sched_getaffinity, sched_setaffinity},
};

/// The cores other processes may keep busy while a window of a core-sharing test runs: beyond this,
/// the core meant to be free is not.
pub const MAX_OTHERS: f64 = 0.15;

/// The share of all CPU time spent busy over the next `window` (0.0 to 1.0), from `/proc/stat`'s `cpu`
/// line. The sleep is the window measured, not a wait.
pub fn busy_share(window: Duration) -> f64 {
    let Ok(before) = procfs::cpu_stat() else {
        return 0.0;
    };
    std::thread::sleep(window);
    let Ok(after) = procfs::cpu_stat() else {
        return 0.0;
    };
    after.all.busy_since(before.all)
}

/// Waits, up to `within`, for a 1 s window in which the machine is at most `max_busy` busy; `Err`
/// with the last share seen if none comes.
pub fn wait_for_idle_cpus(max_busy: f64, within: Duration) -> Result<(), f64> {
    let deadline = Instant::now() + within;
    loop {
        let busy = busy_share(Duration::from_secs(1));
        if busy <= max_busy {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(busy);
        }
    }
}

/// Whether a test that compares a hogged core with a free one can run: the machine has two CPUs,
/// and other processes (a build, another test) leave them free within a minute. Says why when not.
pub fn two_free_cores_or_skip() -> bool {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        crate::skip(&crate::current_test(), "needs two CPUs");
        return false;
    }
    if let Err(busy) = wait_for_idle_cpus(0.25, Duration::from_secs(60)) {
        crate::skip(
            &crate::current_test(),
            format!(
                "the CPUs stayed {:.0}% busy with other processes for a minute; the hog \
                 comparison needs them free",
                busy * 100.0
            ),
        );
        return false;
    }
    true
}

/// Runs `window` (one window of a test's load, judged by its assertion: `Err` says what failed) up
/// to `attempts` times, until one passes. A window that fails while other processes kept more than
/// [`MAX_OTHERS`] cores busy does not count, nor do the first `settling` failures on a quiet
/// machine (weights still moving); a quiet failure beyond them fails the test. Returns whether a
/// window passed; `false`, having printed why, when every failure was on a busy machine.
///
/// # Panics
///
/// On a quiet window's failure beyond `settling`, with its message.
#[track_caller]
pub fn passes_on_free_cores(
    what: &str,
    attempts: u32,
    settling: u32,
    mut window: impl FnMut() -> anyhow::Result<()>,
) -> bool {
    let noisy = passes_in_windows(what, attempts, settling, || {
        let before = Busy::now_for_this_tree();
        let verdict = window();
        let others = before
            .and_then(|before| Ok(Busy::now_for_this_tree()?.since(before).1))
            .unwrap_or(0.0);
        (verdict, others)
    });
    match noisy {
        None => true,
        Some(noisy) => {
            crate::skip(
                &crate::current_test(),
                format!(
                    "{what} failed only while other processes kept {noisy:.2?} cores busy; the \
                     comparison needs a free core"
                ),
            );
            false
        }
    }
}

/// [`passes_on_free_cores`] over windows that say their verdict and the cores other processes took
/// while they ran: `None` when one passed, else the cores others took in each noisy window.
#[track_caller]
fn passes_in_windows(
    what: &str,
    attempts: u32,
    settling: u32,
    mut window: impl FnMut() -> (anyhow::Result<()>, f64),
) -> Option<Vec<f64>> {
    let mut quiet_failures = 0;
    let mut noisy = Vec::new();
    for _ in 0..attempts {
        let (verdict, others) = window();
        let failure = match verdict {
            Ok(()) => return None,
            Err(failure) => failure,
        };
        if others > MAX_OTHERS {
            eprintln!(
                "{what}: {failure:#}, while other processes kept {others:.2} cores busy: measuring again"
            );
            noisy.push(others);
            continue;
        }
        quiet_failures += 1;
        assert!(
            quiet_failures <= settling,
            "{what}: {failure:#} (other processes used {others:.2} cores meanwhile)"
        );
        eprintln!("{what}: {failure:#}: measuring again (settling)");
    }
    assert!(
        !noisy.is_empty(),
        "{what}: failed in all {attempts} windows"
    );
    Some(noisy)
}

/// The CPUs thread `tid` may run on, in order (a process's pid names its main thread; `0` is the
/// calling thread).
pub fn allowed_cpus(tid: u32) -> io::Result<Vec<usize>> {
    let set = sched_getaffinity(pid(tid)?)?;
    Ok((0..CpuSet::MAX_CPU)
        .filter(|&cpu| set.is_set(cpu))
        .collect())
}

/// Pins every thread of process `pid` to `cpu` (`sched_setaffinity` on each task in
/// `/proc/PID/task`), and returns how many it pinned. A thread started later inherits the affinity
/// of the thread that starts it, so a process that is not starting threads stays pinned. A thread
/// that ends meanwhile is skipped, and so is one the kernel keeps on its own CPUs (an io_uring
/// worker refuses with `EINVAL`); an error when the process is gone or no thread could be pinned.
pub fn pin_threads(pid: u32, cpu: usize) -> io::Result<usize> {
    let mut set = CpuSet::new();
    set.set(cpu);
    let mut pinned = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Some(tid) = entry?.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        match sched_setaffinity(self::pid(tid)?, &set) {
            Ok(()) => pinned += 1,
            Err(Errno::SRCH | Errno::INVAL) => {}
            Err(error) => return Err(error.into()),
        }
    }
    if pinned == 0 {
        return Err(io::Error::other(format!(
            "no thread of process {pid} could be pinned to CPU {cpu}"
        )));
    }
    Ok(pinned)
}

/// `tid` as rustix's `Pid`, `None` (the calling thread) for 0.
fn pid(tid: u32) -> io::Result<Option<Pid>> {
    match i32::try_from(tid) {
        Ok(0) => Ok(None),
        Ok(raw) => Ok(Pid::from_raw(raw)),
        Err(_) => Err(io::Error::other(format!("{tid} is not a thread id"))),
    }
}

/// A process spinning on `cpu`, killed on drop.
#[derive(Debug)]
pub struct Hog(Child);

impl Hog {
    /// Starts one, pinned to `cpu` with `taskset`.
    pub fn on(cpu: u32) -> Hog {
        Hog(Command::new("taskset")
            .args(["-c", &cpu.to_string(), "sh", "-c", "while :; do :; done"])
            .spawn()
            .expect("spawn a CPU hog"))
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Windows that give these verdicts and other processes' cores, in turn: whether one passed,
    /// and how many ran.
    fn run(settling: u32, windows: &[(bool, f64)]) -> (bool, usize) {
        let mut ran = 0;
        let noisy = passes_in_windows("the share", windows.len() as u32, settling, || {
            let (pass, others) = windows[ran];
            ran += 1;
            (
                if pass {
                    Ok(())
                } else {
                    Err(anyhow::anyhow!("too high"))
                },
                others,
            )
        });
        (noisy.is_none(), ran)
    }

    #[test]
    fn pins_every_thread_of_a_process() {
        let cpus = allowed_cpus(0).unwrap();
        let last = *cpus.last().unwrap();
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pinned = pin_threads(child.id(), last);
        let allowed = allowed_cpus(child.id());
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(pinned.unwrap(), 1, "sleep runs one thread");
        assert_eq!(allowed.unwrap(), vec![last]);
        assert!(
            pin_threads(child.id(), last).is_err(),
            "the process is gone"
        );
    }

    #[test]
    fn a_window_that_fails_on_a_busy_machine_is_measured_again() {
        assert_eq!(
            run(0, &[(false, 0.9), (false, 0.5), (true, 0.0)]),
            (true, 3)
        );
        // A pass counts even on a busy machine: other work only makes the goal harder.
        assert_eq!(run(0, &[(true, 1.0)]), (true, 1));
    }

    #[test]
    fn a_machine_that_never_stays_quiet_skips() {
        assert_eq!(run(0, &[(false, 0.9), (false, 0.9)]), (false, 2));
        assert_eq!(run(1, &[(false, 0.0), (false, 0.9)]), (false, 2));
    }

    #[test]
    #[should_panic(expected = "the share: too high (other processes used 0.05 cores meanwhile)")]
    fn a_quiet_failure_fails() {
        run(0, &[(false, 0.9), (false, 0.05), (true, 0.0)]);
    }

    #[test]
    fn quiet_failures_while_settling_are_measured_again() {
        assert_eq!(
            run(2, &[(false, 0.0), (false, 0.1), (true, 0.0)]),
            (true, 3)
        );
    }

    #[test]
    #[should_panic(expected = "failed in all 2 windows")]
    fn settling_that_never_ends_fails() {
        run(2, &[(false, 0.0), (false, 0.0)]);
    }
}
