//! Loading, attaching and reading the kernel program.

use std::{
    io,
    mem::offset_of,
    os::fd::{AsFd, BorrowedFd},
    sync::atomic::Ordering,
};

use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{HashMap, Map, MapData, MapError},
    programs::{BtfTracePoint, ProgramError},
};
use peregrine_contract::shm::{Access, SharedMemory, ShmError};

use crate::layout::{Cell, LINE};

/// The programs and the scheduler tracepoints they attach to.
const PROGRAMS: [(&str, &str); 4] = [
    ("on_runtime", "sched_stat_runtime"),
    ("on_wakeup", "sched_wakeup"),
    ("on_wakeup_new", "sched_wakeup_new"),
    ("on_switch", "sched_switch"),
];

/// Why the sampler could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// This build has no kernel program (clang or libbpf-dev was missing when it was built).
    #[error("the eBPF program was not built: {0}")]
    NotBuilt(&'static str),
    /// The kernel has no BTF (`/sys/kernel/btf/vmlinux`), which CO-RE and tp_btf need.
    #[error("cannot read the kernel's BTF (/sys/kernel/btf/vmlinux)")]
    Btf(#[source] aya::BtfError),
    /// The object or its maps could not be loaded (typically EPERM: no CAP_BPF and CAP_PERFMON).
    #[error("cannot load the eBPF object (needs root or CAP_BPF + CAP_PERFMON)")]
    Load(#[source] aya::EbpfError),
    /// A program was rejected or could not attach.
    #[error("cannot load or attach {program} to {tracepoint}")]
    Program {
        /// The program.
        program: &'static str,
        /// Its tracepoint.
        tracepoint: &'static str,
        /// The cause.
        #[source]
        source: ProgramError,
    },
    /// A map is missing or has the wrong type.
    #[error("eBPF map {name}")]
    Map {
        /// The map.
        name: &'static str,
        /// The cause.
        #[source]
        source: MapError,
    },
    /// A map the object should define as an array is something else.
    #[error("eBPF map {0} is not an array")]
    NotAnArray(&'static str),
    /// A map could not be memory-mapped.
    #[error("cannot mmap eBPF map {name}")]
    Mmap {
        /// The map.
        name: &'static str,
        /// The cause.
        #[source]
        source: ShmError,
    },
    /// The number of possible CPUs could not be read.
    #[error("cannot read the number of possible CPUs")]
    Cpus(#[source] io::Error),
    /// This process runs in a nested pid namespace (a container), where its pids are not the
    /// kernel's that the programs see.
    #[error(
        "this process runs in a nested pid namespace: the eBPF programs see the host's pids, not these"
    )]
    PidNamespace,
    /// A lane outside `0..lanes`.
    #[error("lane {lane} is out of range 0..{lanes}")]
    LaneOutOfRange {
        /// The lane.
        lane: u32,
        /// How many there are.
        lanes: u32,
    },
}

/// Cumulative scheduler time of one process (all its threads) since it was first seen in its lane.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedTotals {
    /// Nanoseconds on a CPU.
    pub on_cpu_ns: u64,
    /// Nanoseconds runnable but waiting for a CPU.
    pub runq_wait_ns: u64,
}

/// The loaded and attached sampler. Dropping it detaches the programs and frees the maps (workers
/// that mapped the counters keep their mapping until they exit).
#[derive(Debug)]
pub struct Probe {
    /// Owns the programs and their links.
    _ebpf: Ebpf,
    tracked: HashMap<MapData, u32, u32>,
    runnable: HashMap<MapData, u32, u64>,
    cells: SharedMemory,
    counters: MapData,
    lanes: u32,
    cpus: u32,
}

impl Probe {
    /// Loads the program for `lanes` worker lanes and attaches it to the scheduler's tracepoints.
    pub fn load(lanes: u32) -> Result<Probe, Error> {
        let object = crate::object().map_err(Error::NotBuilt)?;
        // The programs see the kernel's (initial namespace) pids; pids tracked from a nested pid
        // namespace would never match, and every worker would read as idle.
        if nested_pid_namespace() {
            return Err(Error::PidNamespace);
        }
        let lanes = lanes.max(1);
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| Error::Cpus(e))? as u32;
        let btf = Btf::from_sys_fs().map_err(Error::Btf)?;
        let mut ebpf = EbpfLoader::new()
            .btf(Some(&btf))
            .override_global("lanes", &lanes, true)
            .override_global("nr_cpus", &cpus, true)
            // Room for a departing and an arriving process per lane.
            .map_max_entries("tracked", lanes * 2)
            .map_max_entries("cells", cpus * lanes)
            .map_max_entries("counters", lanes)
            .load(object)
            .map_err(Error::Load)?;
        for (program, tracepoint) in PROGRAMS {
            let err = |source| Error::Program {
                program,
                tracepoint,
                source,
            };
            let prog: &mut BtfTracePoint = ebpf
                .program_mut(program)
                .ok_or(Error::Program {
                    program,
                    tracepoint,
                    source: ProgramError::NotLoaded,
                })?
                .try_into()
                .map_err(err)?;
            prog.load(tracepoint, &btf).map_err(err)?;
            prog.attach().map_err(err)?;
        }
        let tracked =
            HashMap::try_from(take_map(&mut ebpf, "tracked")?).map_err(|source| Error::Map {
                name: "tracked",
                source,
            })?;
        let runnable =
            HashMap::try_from(take_map(&mut ebpf, "runnable")?).map_err(|source| Error::Map {
                name: "runnable",
                source,
            })?;
        let cells = array_data(take_map(&mut ebpf, "cells")?, "cells")?;
        let cells = SharedMemory::map(
            cells.fd().as_fd(),
            (cpus * lanes) as usize * LINE,
            Access::ReadOnly,
        )
        .map_err(|source| Error::Mmap {
            name: "cells",
            source,
        })?;
        let counters = array_data(take_map(&mut ebpf, "counters")?, "counters")?;
        Ok(Probe {
            _ebpf: ebpf,
            tracked,
            runnable,
            cells,
            counters,
            lanes,
            cpus,
        })
    }

    /// The request counters' map (BPF_F_MMAPABLE, one [`crate::Counter`] per lane): hand it to the
    /// workers, and map it to read their counts.
    pub fn counters(&self) -> BorrowedFd<'_> {
        self.counters.fd().as_fd()
    }

    /// How many lanes the probe was loaded for.
    pub fn lanes(&self) -> u32 {
        self.lanes
    }

    /// Starts accounting process `pid` (all its threads) to `lane`.
    pub fn track(&mut self, lane: u32, pid: u32) -> Result<(), Error> {
        if lane >= self.lanes {
            return Err(Error::LaneOutOfRange {
                lane,
                lanes: self.lanes,
            });
        }
        self.tracked
            .insert(pid, lane, 0)
            .map_err(|source| Error::Map {
                name: "tracked",
                source,
            })
    }

    /// Stops accounting process `pid`; a pid that is not tracked is not an error.
    pub fn untrack(&mut self, pid: u32) -> Result<(), Error> {
        match self.tracked.remove(&pid) {
            Ok(()) => Ok(()),
            Err(MapError::KeyNotFound) => Ok(()),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc_enoent()) => {
                Ok(())
            }
            Err(source) => Err(Error::Map {
                name: "tracked",
                source,
            }),
        }
    }

    /// The pids being tracked now (one syscall per entry: for tests and diagnostics, not sampling).
    pub fn tracked(&self) -> Result<Vec<u32>, Error> {
        self.tracked
            .keys()
            .collect::<Result<_, _>>()
            .map_err(|source| Error::Map {
                name: "tracked",
                source,
            })
    }

    /// How many threads of tracked processes are runnable and waiting for a CPU right now (one syscall
    /// per entry: for tests and diagnostics).
    pub fn waiting_threads(&self) -> Result<usize, Error> {
        let mut n = 0;
        for key in self.runnable.keys() {
            key.map_err(|source| Error::Map {
                name: "runnable",
                source,
            })?;
            n += 1;
        }
        Ok(n)
    }

    /// The totals of process `pid` in `lane`, summed over CPUs. Reads shared memory only: no syscall.
    /// CPUs that have not run the process since it entered the lane contribute nothing.
    pub fn read(&self, lane: u32, pid: u32) -> SchedTotals {
        let mut totals = SchedTotals::default();
        if lane >= self.lanes {
            return totals;
        }
        for cpu in 0..self.cpus {
            let cell = (cpu * self.lanes + lane) as usize * LINE;
            let tgid = |order| self.cells.load_u32(cell + offset_of!(Cell, tgid), order);
            if tgid(Ordering::Acquire) != pid {
                continue;
            }
            let on_cpu = self
                .cells
                .load_u64(cell + offset_of!(Cell, on_cpu_ns), Ordering::Relaxed);
            let waiting = self
                .cells
                .load_u64(cell + offset_of!(Cell, runq_wait_ns), Ordering::Relaxed);
            // The cell was reset for another process while it was read: it is no longer this one's.
            // (The fence keeps the loads above from moving after this second look at the tag.)
            std::sync::atomic::fence(Ordering::Acquire);
            if tgid(Ordering::Relaxed) != pid {
                continue;
            }
            totals.on_cpu_ns += on_cpu;
            totals.runq_wait_ns += waiting;
        }
        totals
    }
}

/// Whether `/proc/self/status` lists more than one pid in `NSpid` (a pid namespace below the initial
/// one). An unreadable status counts as not nested.
fn nested_pid_namespace() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("NSpid:"))
                .map(|pids| pids.split_whitespace().count() > 1)
        })
        .unwrap_or(false)
}

fn libc_enoent() -> i32 {
    rustix::io::Errno::NOENT.raw_os_error()
}

fn take_map(ebpf: &mut Ebpf, name: &'static str) -> Result<Map, Error> {
    ebpf.take_map(name).ok_or(Error::Map {
        name,
        source: MapError::InvalidName { name: name.into() },
    })
}

fn array_data(map: Map, name: &'static str) -> Result<MapData, Error> {
    match map {
        Map::Array(data) => Ok(data),
        _ => Err(Error::NotAnArray(name)),
    }
}
