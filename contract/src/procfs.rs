//! The kernel's accounting of a process as procfs shows it: `/proc/PID/stat`, the threads'
//! `schedstat`, the memory lines of `/proc/PID/status`, and the per-CPU lines of `/proc/stat`; and
//! from them ([`Busy`]), how much of the machine processes outside one tree took.
//!
//! Every part reads these numbers the same way: the supervisor's procfs sampler, adoption, admission
//! and metrics, the stall check, the eBPF loader, the test harness and tests, the package test and the
//! benchmarks (which check the eBPF sampler against them). One parser each, here, so that the fields
//! are counted the same way everywhere (`proc_pid_stat(5)`, `proc_pid_status(5)`).
//!
//! Written by hand rather than with the `procfs` crate: the sampler reads these files for every worker
//! on every pass, and needs only a handful of fields; a parse here allocates nothing but the text.

mod busy;
mod status;

use std::{
    io,
    path::{Path, PathBuf},
};

pub use self::busy::{Busy, descendants, machine_busy, own_ticks};
pub use self::status::{Status, StatusText, status};

/// The fields of `/proc/PID/stat` that Peregrine reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    /// Field 3: the scheduler state letter (`R`, `S`, `D`, `T`, `t`, `Z`, ...).
    pub state: char,
    /// Field 4: the parent's pid.
    pub ppid: u32,
    /// Field 14: user CPU time, in clock ticks.
    pub utime: u64,
    /// Field 15: system CPU time, in clock ticks.
    pub stime: u64,
    /// Field 16: user CPU time of waited-for children, in clock ticks.
    pub cutime: u64,
    /// Field 17: system CPU time of waited-for children, in clock ticks.
    pub cstime: u64,
    /// Field 22: the start time after boot, in clock ticks.
    pub starttime: u64,
}

impl Stat {
    /// Parses a `/proc/PID/stat` line. The command name (field 2) is in parentheses and may itself
    /// hold spaces and parentheses, so fields are counted after its last `)`.
    pub fn parse(text: &str) -> Option<Stat> {
        let (_, rest) = text.rsplit_once(')')?;
        let mut fields = rest.split_ascii_whitespace();
        // `rest` starts at field 3.
        let state = fields.next()?.chars().next()?;
        // Some fields between the ones read are signed (tpgid, priority, nice): skipped unparsed.
        let mut field = |skip: usize| fields.nth(skip)?.parse::<u64>().ok();
        let ppid = u32::try_from(field(0)?).ok()?;
        // Fields 5 to 13 skipped; then 14 to 17.
        let (utime, stime, cutime, cstime) = (field(9)?, field(0)?, field(0)?, field(0)?);
        Some(Stat {
            state,
            ppid,
            utime,
            stime,
            cutime,
            cstime,
            // Fields 18 to 21 skipped; then 22.
            starttime: field(4)?,
        })
    }

    /// `utime + stime`: the process's own CPU time, in clock ticks.
    pub fn cpu_ticks(&self) -> u64 {
        self.utime + self.stime
    }

    /// `utime + stime + cutime + cstime`: with the children it has waited for, in clock ticks.
    pub fn cpu_ticks_with_children(&self) -> u64 {
        self.cpu_ticks() + self.cutime + self.cstime
    }
}

/// The unit of the CPU times in `/proc/PID/stat` and `/proc/stat`: clock ticks per second (`USER_HZ`,
/// what `getconf CLK_TCK` prints; from the process's auxiliary vector).
pub fn clock_ticks_per_second() -> u64 {
    rustix::param::clock_ticks_per_second()
}

/// Why a procfs file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// The file could not be read (for a process or thread that exited: `NotFound`, or `ESRCH`; see
    /// [`ProcError::is_gone`]).
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The file does not hold what the kernel writes there.
    #[error("unexpected content in {path}: {content:?}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// Its first 100 characters.
        content: String,
    },
}

impl ProcError {
    /// Whether the process or thread the file belonged to has exited (its directory is gone, or it
    /// exited after the file was opened).
    pub fn is_gone(&self) -> bool {
        match self {
            ProcError::Io { source, .. } => {
                source.kind() == io::ErrorKind::NotFound
                    || source.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error())
            }
            ProcError::Malformed { .. } => false,
        }
    }
}

fn read(path: &Path) -> Result<String, ProcError> {
    std::fs::read_to_string(path).map_err(|source| ProcError::Io {
        path: path.to_owned(),
        source,
    })
}

fn parsed<T>(path: &Path, parse: impl FnOnce(&str) -> Option<T>) -> Result<T, ProcError> {
    let text = read(path)?;
    parse(&text).ok_or_else(|| ProcError::Malformed {
        path: path.to_owned(),
        content: text.chars().take(100).collect(),
    })
}

/// Reads `/proc/PID/stat`.
pub fn stat(pid: u32) -> Result<Stat, ProcError> {
    parsed(Path::new(&format!("/proc/{pid}/stat")), Stat::parse)
}

/// Whether process `pid` has exited: no `/proc/PID`, or a zombie (its parent has not reaped it yet).
pub fn gone(pid: u32) -> bool {
    stat(pid).map_or(true, |stat| stat.state == 'Z')
}

/// One thread's (or a sum of threads') scheduler totals, in nanoseconds, from `schedstat`
/// (`Documentation/scheduler/sched-stats.rst`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Schedstat {
    /// Time on a CPU.
    pub on_cpu_ns: u64,
    /// Time runnable, waiting on a run queue.
    pub runq_wait_ns: u64,
}

impl Schedstat {
    /// Parses `"<on-cpu ns> <run-queue ns> <timeslices>\n"`.
    pub fn parse(text: &str) -> Option<Schedstat> {
        let mut fields = text.split_ascii_whitespace().map(str::parse::<u64>);
        Some(Schedstat {
            on_cpu_ns: fields.next()?.ok()?,
            runq_wait_ns: fields.next()?.ok()?,
        })
    }

    /// The two totals added field by field.
    pub fn plus(self, other: Schedstat) -> Schedstat {
        Schedstat {
            on_cpu_ns: self.on_cpu_ns + other.on_cpu_ns,
            runq_wait_ns: self.runq_wait_ns + other.runq_wait_ns,
        }
    }
}

/// Reads one `schedstat` file (a thread's, or `/proc/PID/schedstat`: the main thread's only).
pub fn read_schedstat(path: &Path) -> Result<Schedstat, ProcError> {
    parsed(path, Schedstat::parse)
}

/// The schedstat of every live thread of `pid`, summed. Threads that have exited are missing from the
/// sum; a reader that must never see the sum shrink keeps their last numbers itself.
pub fn process_schedstat(pid: u32) -> Result<Schedstat, ProcError> {
    let dir = PathBuf::from(format!("/proc/{pid}/task"));
    let entries = std::fs::read_dir(&dir).map_err(|source| ProcError::Io {
        path: dir.clone(),
        source,
    })?;
    let mut sum = Schedstat::default();
    for entry in entries.flatten() {
        match read_schedstat(&entry.path().join("schedstat")) {
            Ok(thread) => sum = sum.plus(thread),
            // A thread that exited between the listing and the read.
            Err(error) if error.is_gone() => {}
            Err(error) => return Err(error),
        }
    }
    Ok(sum)
}

/// One CPU's time from `/proc/stat`, in clock ticks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTicks {
    /// Every state but guest (user, nice, system, idle, iowait, irq, softirq, steal; guest time is
    /// already counted in user and nice).
    pub total: u64,
    /// Idle and iowait.
    pub idle: u64,
    /// Steal: time a virtual machine's CPU was runnable but its hypervisor ran something else.
    pub steal: u64,
}

impl CpuTicks {
    /// Ticks spent in any state but idle and iowait.
    pub fn busy(self) -> u64 {
        self.total.saturating_sub(self.idle)
    }

    /// The fraction of the time since `before` that the CPU (or CPUs) was busy, 0.0 to 1.0.
    pub fn busy_since(self, before: CpuTicks) -> f64 {
        let total = self.total.saturating_sub(before.total);
        let idle = self.idle.saturating_sub(before.idle);
        if total == 0 {
            return 0.0;
        }
        total.saturating_sub(idle) as f64 / total as f64
    }
}

/// The CPU lines of `/proc/stat`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuStat {
    /// The `cpu` line: all CPUs together.
    pub all: CpuTicks,
    /// The `cpuN` lines, as `(N, ticks)`.
    pub cpus: Vec<(u32, CpuTicks)>,
}

impl CpuStat {
    /// Parses the text of `/proc/stat`; `None` if it has no `cpu` line or a malformed CPU line.
    pub fn parse(text: &str) -> Option<CpuStat> {
        let mut all = None;
        let mut cpus = Vec::new();
        for line in text.lines() {
            let mut words = line.split_ascii_whitespace();
            let Some(name) = words.next().and_then(|w| w.strip_prefix("cpu")) else {
                continue;
            };
            let ticks: Vec<u64> = words
                .take(8)
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?;
            if ticks.len() < 5 {
                return None;
            }
            let ticks = CpuTicks {
                total: ticks.iter().sum(),
                idle: ticks[3] + ticks[4],
                steal: ticks.get(7).copied().unwrap_or(0),
            };
            if name.is_empty() {
                all = Some(ticks);
            } else {
                cpus.push((name.parse().ok()?, ticks));
            }
        }
        Some(CpuStat { all: all?, cpus })
    }
}

/// Reads `/proc/stat`'s CPU lines.
pub fn cpu_stat() -> Result<CpuStat, ProcError> {
    parsed(Path::new("/proc/stat"), CpuStat::parse)
}

/// The boot time in `/proc/stat`'s text (`btime`, seconds since the Unix epoch).
pub fn parse_boot_time(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// When this machine booted, in seconds since the Unix epoch (`btime` of `/proc/stat`).
pub fn boot_time() -> Result<u64, ProcError> {
    parsed(Path::new("/proc/stat"), parse_boot_time)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_boot_time() {
        assert_eq!(
            parse_boot_time("cpu  1 2 3 4 5\nctxt 99\nbtime 1764720000\nprocesses 7\n"),
            Some(1_764_720_000)
        );
        assert_eq!(parse_boot_time("cpu  1 2 3 4 5\n"), None);
        assert!(boot_time().unwrap() > 1_000_000_000);
    }

    #[test]
    fn stat_fields_are_counted_after_the_last_parenthesis() {
        let line = "4242 (a (b) c) S 17 4242 4242 0 -1 4194560 1 0 0 0 \
                    31 12 5 6 20 0 1 0 987654 1 2 3";
        let stat = Stat::parse(line).unwrap();
        assert_eq!(
            stat,
            Stat {
                state: 'S',
                ppid: 17,
                utime: 31,
                stime: 12,
                cutime: 5,
                cstime: 6,
                starttime: 987654,
            }
        );
        assert_eq!(stat.cpu_ticks(), 43);
        assert_eq!(stat.cpu_ticks_with_children(), 54);
        assert_eq!(Stat::parse("4242 (x) S 1 2"), None, "short");
        assert_eq!(Stat::parse("no parenthesis"), None);
    }

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        let stat = stat(me).unwrap();
        assert!("RS".contains(stat.state), "{stat:?}");
        assert!(stat.starttime > 0);
        assert!(!gone(me));
        let sched = process_schedstat(me).unwrap();
        assert!(sched.on_cpu_ns > 0);
        assert!(clock_ticks_per_second() > 0);
    }

    #[test]
    fn a_missing_process_is_gone() {
        // Above the kernel's pid_max limit (2^22), so never a live pid.
        let pid = 1 << 23;
        assert!(gone(pid));
        assert!(stat(pid).unwrap_err().is_gone());
        assert!(process_schedstat(pid).unwrap_err().is_gone());
    }

    #[test]
    fn parses_schedstat() {
        assert_eq!(
            Schedstat::parse("192990058 196080674 118\n"),
            Some(Schedstat {
                on_cpu_ns: 192990058,
                runq_wait_ns: 196080674
            })
        );
        assert_eq!(Schedstat::parse("12\n"), None);
        assert_eq!(Schedstat::parse("a b c\n"), None);
        assert_eq!(Schedstat::parse(""), None);
    }

    #[test]
    fn parses_the_cpu_lines_of_proc_stat() {
        let text = "cpu  10 0 5 100 3 0 1 2 7 0\n\
                    cpu0 6 0 3 50 1 0 1 2 7 0\n\
                    cpu1 4 0 2 50 2 0 0 0 0 0\n\
                    intr 12345\n";
        let stat = CpuStat::parse(text).unwrap();
        assert_eq!(
            stat.all,
            CpuTicks {
                total: 121,
                idle: 103,
                steal: 2,
            }
        );
        assert_eq!(stat.cpus.len(), 2);
        assert_eq!(stat.cpus[1].0, 1);
        assert_eq!(stat.cpus[0].1.busy(), 12);
        let later = CpuTicks {
            total: 221,
            idle: 153,
            steal: 2,
        };
        assert!((later.busy_since(stat.all) - 0.5).abs() < 1e-9);
        assert_eq!(CpuStat::parse("intr 1\n"), None, "no cpu line");
        assert!(!cpu_stat().unwrap().cpus.is_empty());
    }
}
