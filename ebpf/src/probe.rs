//! Loading, attaching and reading the kernel program.

use std::{
    io,
    mem::{offset_of, size_of},
    os::fd::{AsFd, BorrowedFd},
    sync::{Arc, atomic::Ordering},
};

use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{Array, HashMap, Map, MapData, MapError},
    programs::{BtfTracePoint, FExit, ProgramError},
};
use peregrine_contract::shm::{Access, SharedMemory, ShmError};

use crate::layout::{Cell, Descendants, LINE, Tracked};

/// The programs and the tracepoints they attach to.
const PROGRAMS: [(&str, &str); 6] = [
    ("on_runtime", "sched_stat_runtime"),
    ("on_wakeup", "sched_wakeup"),
    ("on_wakeup_new", "sched_wakeup_new"),
    ("on_switch", "sched_switch"),
    ("on_fork", "sched_process_fork"),
    ("on_exit", "sched_process_exit"),
];

/// Where the kernel program counts the sends of servers on passed listeners
/// ([`Probe::count_sends`]), in the order [`Probe::load`] tries them: the first that the kernel
/// loads and attaches is the only one attached, so that no send counts twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendHook {
    /// The `sock_send_length` tracepoint, after every socket send (Linux 6.3 and later).
    SockSendLength,
    /// The return of `tcp_sendmsg` (an fexit program), for kernels without the tracepoint (Debian
    /// 12's 6.1): every TCP send but `splice` and `sendfile` before Linux 6.5, which went through
    /// `tcp_sendpage`.
    TcpSendmsg,
}

impl SendHook {
    /// Every hook, in the order tried.
    pub const ALL: [SendHook; 2] = [SendHook::SockSendLength, SendHook::TcpSendmsg];

    /// The program and the kernel function or tracepoint it attaches to.
    fn program(self) -> (&'static str, &'static str) {
        match self {
            SendHook::SockSendLength => ("on_send", "sock_send_length"),
            SendHook::TcpSendmsg => ("on_tcp_sendmsg", "tcp_sendmsg"),
        }
    }
}

impl std::fmt::Display for SendHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SendHook::SockSendLength => "the sock_send_length tracepoint",
            SendHook::TcpSendmsg => "the return of tcp_sendmsg",
        })
    }
}

/// How many processes forked by tracked processes (at any depth, alive at once) are counted with
/// their roots, over all lanes. A child forked past it is simply not counted: its time is missing
/// from its root's totals (and its sends from its lane's requests). It is a budget of its own, so
/// the descendants never take the room of the roots the supervisor tracks.
pub const MAX_DESCENDANTS: u32 = 4096;

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
    /// The kernel would load and attach none of the programs that count sends ([`SendHook`]); the
    /// scheduler programs work without them.
    #[error("cannot count sends in the kernel")]
    SendsUnavailable(#[source] Arc<SendsError>),
    /// A lane outside `0..lanes`.
    #[error("lane {lane} is out of range 0..{lanes}")]
    LaneOutOfRange {
        /// The lane.
        lane: u32,
        /// How many there are.
        lanes: u32,
    },
}

/// Cumulative scheduler time of one process (all its threads) and the processes it forked (theirs
/// while they were alive), since it was first seen in its lane.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedTotals {
    /// Nanoseconds on a CPU.
    pub on_cpu_ns: u64,
    /// Nanoseconds runnable but waiting for a CPU.
    pub runq_wait_ns: u64,
}

/// Map `ports` (lane -> listening port), which aya's `Array` does not print.
struct Ports(Array<MapData, u16>);

impl std::fmt::Debug for Ports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ports")
    }
}

/// The loaded and attached sampler. Dropping it detaches the programs and frees the maps (workers
/// that mapped the counters keep their mapping until they exit).
#[derive(Debug)]
pub struct Probe {
    /// Owns the programs and their links.
    _ebpf: Ebpf,
    tracked: HashMap<MapData, u32, Tracked>,
    runnable: HashMap<MapData, u32, u64>,
    ports: Ports,
    /// `struct peregrine_descendants`, written: user space gives back the places it frees.
    descendants: SharedMemory,
    /// Where sends are counted, or why nowhere.
    sends: Result<SendHook, Arc<SendsError>>,
    /// The descendants' budget (entries of `tracked` that are not roots).
    max_descendants: u32,
    cells: SharedMemory,
    counters: MapData,
    lanes: u32,
    cpus: u32,
}

impl Probe {
    /// Loads the program for `lanes` worker lanes and attaches it to the scheduler's tracepoints, with
    /// room for [`MAX_DESCENDANTS`] descendants.
    pub fn load(lanes: u32) -> Result<Probe, Error> {
        Probe::load_with_budget(lanes, MAX_DESCENDANTS)
    }

    /// [`load`](Probe::load), with room for `max_descendants` descendants instead.
    pub fn load_with_budget(lanes: u32, max_descendants: u32) -> Result<Probe, Error> {
        Probe::load_with(lanes, max_descendants, &SendHook::ALL)
    }

    /// [`load_with_budget`](Probe::load_with_budget), counting sends at the first of `send_hooks`
    /// that the kernel takes (none: sends are not counted).
    pub fn load_with(
        lanes: u32,
        max_descendants: u32,
        send_hooks: &[SendHook],
    ) -> Result<Probe, Error> {
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
            .override_global("max_descendants", &u64::from(max_descendants), true)
            // Room for a departing and an arriving root per lane, and the descendants' budget.
            .map_max_entries("tracked", (lanes * 2).saturating_add(max_descendants))
            .map_max_entries("cells", cpus * lanes)
            .map_max_entries("counters", lanes)
            .map_max_entries("ports", lanes)
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
        let sends = attach_sends(&mut ebpf, &btf, send_hooks).map_err(Arc::new);
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
        let ports = Ports(
            Array::try_from(take_map(&mut ebpf, "ports")?).map_err(|source| Error::Map {
                name: "ports",
                source,
            })?,
        );
        let descendants = array_data(take_map(&mut ebpf, "descendants")?, "descendants")?;
        let descendants = SharedMemory::map(
            descendants.fd().as_fd(),
            size_of::<Descendants>(),
            Access::ReadWrite,
        )
        .map_err(|source| Error::Mmap {
            name: "descendants",
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
            ports,
            descendants,
            sends,
            max_descendants,
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

    /// Starts accounting process `pid` (all its threads) to `lane`, as a *root*: the processes it
    /// forks from now on (and theirs) are accounted to it too, each until its last thread exits.
    pub fn track(&mut self, lane: u32, pid: u32) -> Result<(), Error> {
        self.check_lane(lane)?;
        // A pid that is some root's descendant becomes a root of its own: its place in the
        // descendants' budget is given back.
        if let Some(entry) = self.entry(pid)?
            && entry.root != pid
        {
            self.forget_descendant(pid)?;
        }
        self.tracked
            .insert(pid, Tracked { lane, root: pid }, 0)
            .map_err(|source| Error::Map {
                name: "tracked",
                source,
            })?;
        // Processes it forked before now (a server forks its workers at once, before the
        // supervisor, which tracks it once it is ready, gets to it) join it here; later ones the fork
        // program adds.
        for child in peregrine_contract::procfs::descendants(pid) {
            if child != pid {
                self.add_descendant(child, Tracked { lane, root: pid })?;
            }
        }
        Ok(())
    }

    /// Adds `pid` as a descendant `entry`, within the budget; a pid that has an entry already (the
    /// fork program was first) is left as it is.
    fn add_descendant(&mut self, pid: u32, entry: Tracked) -> Result<(), Error> {
        let entries = self.descendants.u64_at(offset_of!(Descendants, entries));
        if entries.fetch_add(1, Ordering::SeqCst) >= u64::from(self.max_descendants) {
            entries.fetch_sub(1, Ordering::SeqCst);
            return Ok(());
        }
        // BPF_NOEXIST.
        if self.tracked.insert(pid, entry, 1).is_err() {
            entries.fetch_sub(1, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Stops accounting process `pid`; a pid that is not tracked is not an error. For a root, its
    /// descendants' entries go too, and its lane's sends stop being counted
    /// ([`stop_counting`](Probe::stop_counting)).
    pub fn untrack(&mut self, pid: u32) -> Result<(), Error> {
        let Some(entry) = self.entry(pid)? else {
            return Ok(());
        };
        if entry.root != pid {
            return self.forget_descendant(pid);
        }
        // The root first: from then on the kernel sees its descendants as stale (a fork racing this
        // adds one the listing below may miss; it counts nothing and goes when found or when it
        // exits).
        self.remove(pid)?;
        for (tgid, _) in self.descendants_of(Some(pid))? {
            self.forget_descendant(tgid)?;
        }
        self.stop_counting(entry.lane)
    }

    /// The roots being tracked now, the pids [`track`](Probe::track) was given (one syscall per
    /// entry: for tests, diagnostics and reconciliation, not sampling).
    pub fn tracked(&self) -> Result<Vec<u32>, Error> {
        let mut roots = Vec::new();
        for item in self.tracked.iter() {
            let (tgid, entry) = item.map_err(|source| Error::Map {
                name: "tracked",
                source,
            })?;
            if entry.root == tgid {
                roots.push(tgid);
            }
        }
        Ok(roots)
    }

    /// The descendants being accounted now, each with its entry (its lane and root), for tests and
    /// diagnostics.
    pub fn descendants(&self) -> Result<Vec<(u32, Tracked)>, Error> {
        self.descendants_of(None)
    }

    /// How many descendants' entries the budget counts now (shared memory: no syscall).
    pub fn descendant_entries(&self) -> u64 {
        self.descendants
            .load_u64(offset_of!(Descendants, entries), Ordering::Acquire)
    }

    /// Whether a send program is attached, so that [`count_sends`](Self::count_sends) can count.
    pub fn counts_sends(&self) -> bool {
        self.sends.is_ok()
    }

    /// Where sends are counted: the first [`SendHook`] the kernel took, or why none.
    pub fn send_hook(&self) -> Result<SendHook, Arc<SendsError>> {
        self.sends.clone()
    }

    /// Counts, in `counters[lane].requests`, every send call that sent bytes (`send`, `sendto`,
    /// `sendmsg`, each of `sendmmsg`'s messages, `write` on a socket, io_uring's sends, `sendfile` and
    /// `splice` to a socket) that a process of the lane (its root or a descendant) makes on a TCP
    /// socket whose local port is `port`: for a server on a listener it was passed, a send on a
    /// connection that listener accepted. Its own outgoing connections (ephemeral local ports) do not
    /// count. One send, one count: a response written in two sends counts two, so the count is the
    /// lane's requests times the server's sends per response, which scales the same way on every
    /// worker of a service (all that a rate compared with utilization needs). The kernel adds
    /// atomically; a worker that counts its own requests must not be given a port. `port` 0 stops
    /// counting. The lane's root must be tracked first: untracking it stops the counting.
    pub fn count_sends(&mut self, lane: u32, port: u16) -> Result<(), Error> {
        self.check_lane(lane)?;
        if port != 0
            && let Err(why) = &self.sends
        {
            return Err(Error::SendsUnavailable(Arc::clone(why)));
        }
        self.ports
            .0
            .set(lane, port, 0)
            .map_err(|source| Error::Map {
                name: "ports",
                source,
            })
    }

    /// Stops counting `lane`'s sends (see [`count_sends`](Probe::count_sends)).
    pub fn stop_counting(&mut self, lane: u32) -> Result<(), Error> {
        self.count_sends(lane, 0)
    }

    /// The listening port whose sends `lane` counts, if any.
    pub fn counted_port(&self, lane: u32) -> Result<Option<u16>, Error> {
        self.check_lane(lane)?;
        let port = self.ports.0.get(&lane, 0).map_err(|source| Error::Map {
            name: "ports",
            source,
        })?;
        Ok((port != 0).then_some(port))
    }

    fn check_lane(&self, lane: u32) -> Result<(), Error> {
        if lane >= self.lanes {
            return Err(Error::LaneOutOfRange {
                lane,
                lanes: self.lanes,
            });
        }
        Ok(())
    }

    /// `pid`'s entry in `tracked`, if it has one.
    fn entry(&self, pid: u32) -> Result<Option<Tracked>, Error> {
        match self.tracked.get(&pid, 0) {
            Ok(entry) => Ok(Some(entry)),
            Err(e) if not_found(&e) => Ok(None),
            Err(source) => Err(Error::Map {
                name: "tracked",
                source,
            }),
        }
    }

    /// Removes `pid`'s entry; whether it was there.
    fn remove(&mut self, pid: u32) -> Result<bool, Error> {
        match self.tracked.remove(&pid) {
            Ok(()) => Ok(true),
            Err(e) if not_found(&e) => Ok(false),
            Err(source) => Err(Error::Map {
                name: "tracked",
                source,
            }),
        }
    }

    /// Removes descendant `pid`'s entry and, if this removed it (not the kernel first), gives its
    /// place back to the budget.
    fn forget_descendant(&mut self, pid: u32) -> Result<(), Error> {
        if self.remove(pid)? {
            self.descendants
                .u64_at(offset_of!(Descendants, entries))
                .fetch_sub(1, Ordering::SeqCst);
        }
        Ok(())
    }

    /// The descendants' entries (of `root` only, if given). Listed before any is removed: a hash
    /// map's iteration restarts when its current key goes.
    fn descendants_of(&self, root: Option<u32>) -> Result<Vec<(u32, Tracked)>, Error> {
        let mut found = Vec::new();
        for item in self.tracked.iter() {
            let (tgid, entry) = item.map_err(|source| Error::Map {
                name: "tracked",
                source,
            })?;
            if entry.root != tgid && root.is_none_or(|root| entry.root == root) {
                found.push((tgid, entry));
            }
        }
        Ok(found)
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
    peregrine_contract::procfs::StatusText::read_self()
        .ok()
        .and_then(|status| Some(status.field("NSpid")?.split_whitespace().count() > 1))
        .unwrap_or(false)
}

/// Whether a map operation failed because the key is not there.
fn not_found(error: &MapError) -> bool {
    match error {
        MapError::KeyNotFound => true,
        MapError::SyscallError(e) => {
            e.io_error.raw_os_error() == Some(rustix::io::Errno::NOENT.raw_os_error())
        }
        _ => false,
    }
}

/// Why no program that counts sends is attached.
#[derive(Debug, thiserror::Error)]
pub enum SendsError {
    /// None was asked for.
    #[error("no way of counting sends was asked for")]
    NoneAsked,
    /// The object has no such program.
    #[error("{0} is not in the object")]
    Missing(&'static str),
    /// The program is not of the type its hook needs.
    #[error("{program} is not a program of its hook's type")]
    WrongType {
        /// The program.
        program: &'static str,
        /// The cause.
        #[source]
        source: ProgramError,
    },
    /// The kernel would not load or attach it (`sock_send_length` is in Linux 6.3 and later).
    #[error("cannot load or attach {program} to {target}")]
    Attach {
        /// The program.
        program: &'static str,
        /// Its tracepoint or kernel function.
        target: &'static str,
        /// The cause.
        #[source]
        source: ProgramError,
    },
    /// Neither of two hooks: the first's reason, then the rest's.
    #[error("{first}; {rest}")]
    Neither {
        /// Why the first was not attached.
        first: Box<SendsError>,
        /// Why the rest were not.
        rest: Box<SendsError>,
    },
}

/// Loads and attaches the program of the first of `hooks` that the kernel takes; why none, if it
/// takes none (the sampler works without them).
fn attach_sends(ebpf: &mut Ebpf, btf: &Btf, hooks: &[SendHook]) -> Result<SendHook, SendsError> {
    let Some((&hook, rest)) = hooks.split_first() else {
        return Err(SendsError::NoneAsked);
    };
    let (program, target) = hook.program();
    let attach = |source| SendsError::Attach {
        program,
        target,
        source,
    };
    let wrong_type = |source| SendsError::WrongType { program, source };
    let prog = ebpf
        .program_mut(program)
        .ok_or(SendsError::Missing(program))?;
    let attached = match hook {
        SendHook::SockSendLength => {
            let prog: &mut BtfTracePoint = prog.try_into().map_err(wrong_type)?;
            prog.load(target, btf)
                .and_then(|()| prog.attach().map(drop))
                .map_err(attach)
        }
        SendHook::TcpSendmsg => {
            let prog: &mut FExit = prog.try_into().map_err(wrong_type)?;
            prog.load(target, btf)
                .and_then(|()| prog.attach().map(drop))
                .map_err(attach)
        }
    };
    match attached {
        Ok(()) => Ok(hook),
        Err(first) if !rest.is_empty() => {
            attach_sends(ebpf, btf, rest).map_err(|rest| SendsError::Neither {
                first: Box::new(first),
                rest: Box::new(rest),
            })
        }
        Err(first) => Err(first),
    }
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
