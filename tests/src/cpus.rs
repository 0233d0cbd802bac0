//! Whether this machine's CPUs are free: tests that measure how load is shared between cores (a hog
//! on one, workers pinned to each) mean nothing while other processes keep the cores busy; and the
//! hog itself ([`Hog`]).

use std::{
    process::{Child, Command},
    time::{Duration, Instant},
};

use peregrine_contract::procfs;

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
        eprintln!("skipped: needs two CPUs");
        return false;
    }
    if let Err(busy) = wait_for_idle_cpus(0.25, Duration::from_secs(60)) {
        eprintln!(
            "skipped: the CPUs stayed {:.0}% busy with other processes for a minute; the hog \
             comparison needs them free",
            busy * 100.0
        );
        return false;
    }
    true
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
