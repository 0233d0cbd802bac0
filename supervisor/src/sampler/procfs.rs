//! The procfs scheduler source: `/proc/<pid>/task/*/schedstat`, summed over a worker's threads.
//!
//! Each thread's `schedstat` holds three numbers: nanoseconds on a CPU, nanoseconds waiting on a run
//! queue, and timeslices run (`Documentation/scheduler/sched-stats.rst`). `/proc/<pid>/schedstat` alone
//! would count only the main thread, so this source sums the threads.
//!
//! A thread that exits takes its numbers out of procfs. To keep a process's sum from shrinking, the
//! source remembers each thread's last numbers and, once the thread is gone, keeps them as "retired";
//! only what a thread ran between its last sample and its exit is lost. (The eBPF source has no such
//! gap.)

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use peregrine_contract::procfs::{self, ProcError};

use super::{SampleError, SamplerKind, SchedSource, SchedTotals};

/// Reads scheduler time from procfs.
#[derive(Debug)]
pub struct ProcfsSource {
    root: PathBuf,
    tracked: HashMap<usize, Process>,
}

/// A followed process: its threads' last numbers, and the sum of its threads that exited.
#[derive(Debug)]
struct Process {
    pid: u32,
    threads: HashMap<u32, SchedTotals>,
    retired: SchedTotals,
}

impl Default for ProcfsSource {
    fn default() -> Self {
        ProcfsSource::new()
    }
}

impl ProcfsSource {
    /// A source reading `/proc`.
    pub fn new() -> Self {
        ProcfsSource::with_root("/proc")
    }

    /// A source reading a procfs mounted (or imitated) at `root`.
    pub fn with_root(root: impl Into<PathBuf>) -> Self {
        ProcfsSource {
            root: root.into(),
            tracked: HashMap::new(),
        }
    }

    /// Whether this machine's procfs has per-thread `schedstat` (a kernel built with
    /// `CONFIG_SCHED_INFO`, which every mainstream distribution's is).
    pub fn available(&self) -> Result<(), SampleError> {
        let path = self.root.join("self/schedstat");
        read_schedstat(&path).map(drop).map_err(SampleError::from)
    }

    /// The current numbers of every thread of `pid`.
    fn threads(&self, pid: u32) -> Result<HashMap<u32, SchedTotals>, SampleError> {
        let dir = self.root.join(pid.to_string()).join("task");
        let io_error = |source| ProcError::Io {
            path: dir.clone(),
            source,
        };
        let entries = match std::fs::read_dir(&dir).map_err(io_error) {
            Ok(entries) => entries,
            Err(error) if error.is_gone() => return Err(SampleError::Gone { pid }),
            Err(error) => return Err(error.into()),
        };
        let mut threads = HashMap::new();
        for entry in entries {
            let entry = entry.map_err(io_error)?;
            let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse().ok()) else {
                continue;
            };
            match read_schedstat(&entry.path().join("schedstat")) {
                Ok(totals) => {
                    threads.insert(tid, totals);
                }
                // The thread exited between the listing and the read.
                Err(error) if error.is_gone() => {}
                Err(error) => return Err(error.into()),
            }
        }
        if threads.is_empty() {
            // Every thread exited after the listing: the process is gone.
            return Err(SampleError::Gone { pid });
        }
        Ok(threads)
    }
}

impl SchedSource for ProcfsSource {
    fn kind(&self) -> SamplerKind {
        SamplerKind::Procfs
    }

    fn track(&mut self, lane: usize, pid: u32) -> Result<(), SampleError> {
        let threads = self.threads(pid)?;
        self.tracked.insert(
            lane,
            Process {
                pid,
                threads,
                retired: SchedTotals::default(),
            },
        );
        Ok(())
    }

    fn untrack(&mut self, lane: usize, pid: u32) {
        if self.tracked.get(&lane).is_some_and(|p| p.pid == pid) {
            self.tracked.remove(&lane);
        }
    }

    fn read(&mut self, lane: usize, pid: u32) -> Result<SchedTotals, SampleError> {
        if self.tracked.get(&lane).is_none_or(|p| p.pid != pid) {
            return Err(SampleError::NotTracked { lane, pid });
        }
        let now = self.threads(pid)?;
        let process = self.tracked.get_mut(&lane).expect("checked above");
        Ok(process.update(now))
    }
}

impl Process {
    /// Takes the threads' current numbers; returns the process's sum, retired threads included.
    fn update(&mut self, now: HashMap<u32, SchedTotals>) -> SchedTotals {
        for (tid, last) in &self.threads {
            match now.get(tid) {
                // Still the same thread: its numbers only grow.
                Some(current) if current.on_cpu_ns >= last.on_cpu_ns => {}
                // Gone, or a new thread that reused the id: keep what the old one ran.
                _ => self.retired = self.retired.saturating_add(*last),
            }
        }
        self.threads = now;
        self.threads
            .values()
            .fold(self.retired, |sum, t| sum.saturating_add(*t))
    }
}

/// Reads one `schedstat` file: on-CPU and run-queue nanoseconds.
fn read_schedstat(path: &Path) -> Result<SchedTotals, ProcError> {
    let read = procfs::read_schedstat(path)?;
    Ok(SchedTotals {
        on_cpu_ns: read.on_cpu_ns,
        runq_wait_ns: read.runq_wait_ns,
    })
}

#[cfg(test)]
mod tests {
    use std::{
        process::Command,
        sync::mpsc,
        time::{Duration, Instant},
    };

    use super::*;

    /// Spins on this thread for `duration` of wall time (it may be preempted; it keeps asking).
    fn burn(duration: Duration) {
        let start = Instant::now();
        let mut x = 0u64;
        while start.elapsed() < duration {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }

    #[test]
    fn on_cpu_time_of_this_process_grows_while_it_burns_cpu() {
        let mut source = ProcfsSource::new();
        source
            .available()
            .expect("procfs schedstat on this machine");
        let pid = std::process::id();
        source.track(3, pid).unwrap();
        let before = source.read(3, pid).unwrap();
        let cpu = || {
            let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
            Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
        };
        let cpu_start = cpu();
        burn(Duration::from_millis(100));
        let cpu_end = cpu();
        let after = source.read(3, pid).unwrap();
        let grew = after.on_cpu_ns - before.on_cpu_ns;
        // This thread's own CPU clock says how much it ran. The sum over the process's threads grew at
        // least that much (other test threads only add to it), but for the scheduler's accounting lag.
        let ran = (cpu_end - cpu_start).as_nanos() as u64;
        assert!(ran >= 10_000_000, "the burn ran {ran} ns on a CPU");
        assert!(
            grew >= ran / 2,
            "schedstat grew by {grew} ns while this thread ran {ran} ns"
        );
        assert!(after.runq_wait_ns >= before.runq_wait_ns);
    }

    #[test]
    fn an_exited_thread_keeps_its_time() {
        let mut source = ProcfsSource::new();
        let pid = std::process::id();
        source.track(0, pid).unwrap();
        let (ready_tx, ready_rx) = mpsc::channel();
        let (exit_tx, exit_rx) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            burn(Duration::from_millis(50));
            ready_tx.send(()).unwrap();
            let _ = exit_rx.recv();
        });
        ready_rx.recv().unwrap();
        let with_thread = source.read(0, pid).unwrap();
        drop(exit_tx);
        thread.join().unwrap();
        let without = source.read(0, pid).unwrap();
        assert!(
            without.on_cpu_ns >= with_thread.on_cpu_ns,
            "{without:?} < {with_thread:?}"
        );
    }

    #[test]
    fn a_process_that_exited_is_gone() {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        let mut source = ProcfsSource::new();
        // Tracking may find it alive or already a zombie; once reaped it is gone.
        let _ = source.track(1, pid);
        child.wait().unwrap();
        assert!(matches!(
            source.threads(pid),
            Err(SampleError::Gone { pid: p }) if p == pid
        ));
        assert!(matches!(
            source.read(2, pid),
            Err(SampleError::NotTracked { .. })
        ));
    }

    #[test]
    fn sums_threads_and_retires_those_that_exit() {
        let ns = |on_cpu_ns, runq_wait_ns| SchedTotals {
            on_cpu_ns,
            runq_wait_ns,
        };
        let mut process = Process {
            pid: 1,
            threads: HashMap::new(),
            retired: SchedTotals::default(),
        };
        assert_eq!(
            process.update(HashMap::from([(1, ns(10, 1)), (2, ns(20, 2))])),
            ns(30, 3)
        );
        // Thread 2 exited, thread 3 started.
        assert_eq!(
            process.update(HashMap::from([(1, ns(15, 1)), (3, ns(5, 5))])),
            ns(40, 8)
        );
        // Thread id 3 was reused by a new thread with less time.
        assert_eq!(
            process.update(HashMap::from([(1, ns(15, 1)), (3, ns(1, 0))])),
            ns(41, 8)
        );
    }
}
