//! What a worker leaves running when it exits: the rest of its process tree, found, stopped and
//! reaped.
//!
//! The supervisor is the *child subreaper* of everything it starts ([`become_subreaper`],
//! `PR_SET_CHILD_SUBREAPER`): a process whose parent exits is handed to the supervisor instead of to
//! init. So when a worker (the process the supervisor started, its tree's *root*) exits, whatever it
//! left running is a child of the supervisor that is no worker. That is a server that daemonizes
//! (forks and lets its parent exit: the supervisor would take the parent's exit for the server's),
//! or the children of a server that was killed. Each is told from another slot's by its environment,
//! the worker's, which it inherited; one whose environment carries no lineage at all (it cleared it),
//! or the lineage alone, is a leftover of whichever worker exits next. One that names another slot
//! is a leftover too, of the worker that exited, not of that slot: it is the supervisor's child, so
//! outside the tree of that slot's worker, and the log says which slot it names and whose exit it was
//! found at. The environment is the worker's to write, so it is evidence of nothing but itself: the
//! one process of the supervisor's children spared for its environment is its orphan watcher, known
//! by its pid ([`Children::is_helper`]), not by the lineage without a slot that it carries.
//! They are stopped as a worker is ([`stop`]):
//! SIGTERM, then SIGKILL after `stop_timeout`, again until none is left. The supervisor, their
//! parent now, reaps them ([`reap_orphans`]).
//!
//! A subreaper holds only while the supervisor lives. A worker adopted from an earlier supervisor is
//! not its child: what such a worker leaves goes to init. Those are found by their environment alone
//! (this socket's lineage and the slot), anywhere on the host ([`Scope::Host`]), as they are when the
//! supervisor stops ([`sweep`]).
//!
//! Finding the supervisor's children reads `/proc/self/task/*/children` (one small file per thread)
//! where the kernel has it, so the usual case, a worker that left nothing, costs no pass over
//! `/proc`; without it, and whenever something is left, every process's `stat` is read once.
//!
//! Invariant: a process is signalled only through a pidfd opened while it was known to be the
//! process found (its start time is read again once the pidfd is open), and never while it is a
//! live worker or inside a live worker's tree, nor while it is the supervisor's orphan watcher.

use std::{
    collections::{HashMap, HashSet},
    io,
    os::fd::OwnedFd,
    sync::Arc,
    time::Duration,
};

use peregrine_contract::{
    procfs::Stat,
    settings::{ENV_LINEAGE, Environ},
};
use rustix::process::{Pid, PidfdFlags, Signal};

use crate::{
    children::{Children, Slot},
    instance::Lineage,
};

/// How often the processes left are looked at again while they are being stopped.
const RECHECK: Duration = Duration::from_millis(50);
/// How long processes that were sent SIGKILL may take to go before the supervisor gives up on them.
const KILL_GRACE: Duration = Duration::from_secs(5);
/// How many times `/proc` is listed in one reading, for processes that appeared while it was read.
const LISTINGS: usize = 8;
/// How often orphans are reaped without a SIGCHLD (a worker's zombie may hide others for a moment).
const REAP_TICK: Duration = Duration::from_secs(1);

/// Makes this process the child subreaper of everything it starts.
pub fn become_subreaper() -> io::Result<()> {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))?;
    Ok(())
}

/// Whether this process is a child subreaper: only then is a child that is no worker an orphan
/// handed to it (else it is a child it started itself for another purpose, as a test does).
fn is_subreaper() -> bool {
    rustix::process::child_subreaper().is_ok_and(|pid| pid.is_some())
}

/// Where the processes a worker left may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Scope {
    /// The worker was this supervisor's child: what it left is this supervisor's too.
    Children,
    /// The worker was adopted: what it left went to init; found by its environment.
    Host,
}

/// A process of a finished worker's tree, still running when it was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Leftover {
    pid: u32,
    /// Its start time (`/proc/PID/stat` field 22): with the pid, it names one process for good.
    starttime: u64,
}

/// A process found at a worker's exit that names another slot than the worker's: the slot it names,
/// for the log, which must not blame that slot for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Foreign {
    /// The process.
    pub(super) pid: u32,
    /// The slot its environment names.
    pub(super) names: Slot,
}

/// The processes that `slot`'s worker left running, those whose environment carries no lineage,
/// the lineage alone, or another slot among them (see the module's doc); empty when there are none.
pub(super) fn find(
    slot: &Slot,
    lineage: &Lineage,
    children: &Children,
    scope: Scope,
) -> Vec<Leftover> {
    find_naming(slot, lineage, children, scope).0
}

/// [`find`], with those of the supervisor's children found that name another slot than `slot`.
pub(super) fn find_naming(
    slot: &Slot,
    lineage: &Lineage,
    children: &Children,
    scope: Scope,
) -> (Vec<Leftover>, Vec<Foreign>) {
    let own = std::process::id();
    // The cheap look first: no child of ours but workers and the watcher, and nothing to look for
    // elsewhere.
    if scope == Scope::Children
        && let Some(kids) = own_children()
        && kids
            .iter()
            .all(|pid| children.is_worker(*pid) || children.is_helper(*pid))
    {
        return (Vec::new(), Vec::new());
    }
    let subreaper = is_subreaper();
    let table = ProcTable::read();
    // Read after the table: a worker spawned meanwhile is in the process table by now (it is
    // locked across a spawn), so it is never taken for a leftover.
    let workers = children.pids();
    let in_live_tree = |pid: u32| table.has_ancestor_in(pid, &workers);
    let mut seeds = Vec::new();
    let mut foreign = Vec::new();
    for (&pid, proc) in &table.procs {
        if pid == own || proc.zombie || in_live_tree(pid) || children.is_helper(pid) {
            continue;
        }
        let ours = proc.ppid == own;
        if !ours && scope == Scope::Children {
            continue;
        }
        match judge(claim_of(pid, lineage), slot, ours && subreaper) {
            Verdict::Spared => {}
            Verdict::Left => seeds.push(pid),
            Verdict::LeftNaming(names) => {
                seeds.push(pid);
                foreign.push(Foreign { pid, names });
            }
        }
    }
    foreign.sort_by_key(|f| f.pid);
    (table.with_descendants(seeds), foreign)
}

/// What a process outside every live worker's tree is to the exit of `slot`'s worker.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Not its leftover.
    Spared,
    /// Its leftover.
    Left,
    /// Its leftover, though its environment names this other slot.
    LeftNaming(Slot),
}

/// Judges a process by what its environment claims and whether it is an `orphan` (a child of the
/// supervisor as their subreaper, which no worker's live tree holds): one that names `slot` is its
/// leftover wherever it is; an orphan is the leftover of the exit that handed it over, whatever its
/// environment says (it names another slot, the lineage alone, or nothing of ours); anything else
/// on the host is spared.
fn judge(claim: Claim, slot: &Slot, orphan: bool) -> Verdict {
    match claim {
        Claim::Slot(of) if &of == slot => Verdict::Left,
        Claim::Slot(names) if orphan => Verdict::LeftNaming(names),
        Claim::None | Claim::LineageOnly if orphan => Verdict::Left,
        _ => Verdict::Spared,
    }
}

/// Every process any worker left, when no worker runs any more (the supervisor is stopping): the
/// supervisor's children, and anything on the host carrying this lineage and a slot.
pub(super) fn sweep(lineage: &Lineage, children: &Children) -> Vec<Leftover> {
    let own = std::process::id();
    let subreaper = is_subreaper();
    let table = ProcTable::read();
    let workers = children.pids();
    let seeds = table
        .procs
        .iter()
        .filter(|(pid, proc)| {
            **pid != own
                && !proc.zombie
                && !table.has_ancestor_in(**pid, &workers)
                && !children.is_helper(**pid)
        })
        .filter(|(pid, proc)| match claim_of(**pid, lineage) {
            Claim::Slot(_) => true,
            Claim::None | Claim::LineageOnly => proc.ppid == own && subreaper,
        })
        .map(|(pid, _)| *pid)
        .collect();
    table.with_descendants(seeds)
}

/// Stops the processes `again` finds, `first` being its first answer: SIGTERM to each (and to any
/// that appears), SIGKILL to those left after `stop_timeout`, until none is left. Returns how many
/// processes were stopped in all.
pub(super) async fn stop<F>(first: Vec<Leftover>, stop_timeout: Duration, again: F) -> usize
where
    F: Fn() -> Vec<Leftover> + Clone + Send + 'static,
{
    let mut left = first;
    let mut stopped: HashSet<Leftover> = HashSet::new();
    let terminate_until = tokio::time::Instant::now() + stop_timeout;
    let mut kill_until = None;
    while !left.is_empty() {
        let now = tokio::time::Instant::now();
        let signal = if now < terminate_until {
            Signal::TERM
        } else {
            if kill_until.is_none() {
                let pids: Vec<u32> = left.iter().map(|l| l.pid).collect();
                tracing::warn!(?pids, timeout = ?stop_timeout, "Processes left by a worker did not stop in time; killing them");
                kill_until = Some(now + KILL_GRACE);
            }
            Signal::KILL
        };
        if kill_until.is_some_and(|until| now >= until) {
            let pids: Vec<u32> = left.iter().map(|l| l.pid).collect();
            tracing::error!(
                ?pids,
                "Processes left by a worker are still there after SIGKILL; leaving them"
            );
            break;
        }
        for leftover in &left {
            // SIGTERM once to each; SIGKILL to all that are still there.
            if stopped.insert(*leftover) || signal == Signal::KILL {
                leftover.signal(signal);
            }
        }
        tokio::time::sleep(RECHECK).await;
        let find = again.clone();
        left = tokio::task::spawn_blocking(find).await.unwrap_or_default();
    }
    stopped.len()
}

/// Reaps, for as long as the supervisor runs, every child of the supervisor that exits and is no
/// worker (a worker is reaped by its slot's task): what workers left, handed to the supervisor as
/// their subreaper.
pub async fn reap_orphans(children: Arc<Children>) {
    let mut sigchld = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()) {
        Ok(signal) => Some(signal),
        Err(error) => {
            tracing::warn!(%error, "Cannot watch SIGCHLD: orphans are reaped once a second");
            None
        }
    };
    let mut tick = tokio::time::interval(REAP_TICK);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            Some(()) = async {
                match sigchld.as_mut() {
                    Some(signal) => signal.recv().await,
                    None => std::future::pending().await,
                }
            } => {}
        }
        reap_exited(&children);
    }
}

/// Reaps the exited children that are no workers, until the next exited child (if any) is a worker.
fn reap_exited(children: &Children) {
    use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid, waitpid};
    loop {
        // A look that reaps nothing: the first exited child, whoever it is.
        let peek = waitid(
            Id::All,
            WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
        );
        let pid = match peek {
            Ok(WaitStatus::Exited(pid, _) | WaitStatus::Signaled(pid, _, _)) => pid,
            // None exited, no child at all, or an error: nothing to reap now.
            _ => return,
        };
        // A worker's zombie is its slot task's to reap; it goes within moments, and the tick looks
        // again.
        let reaped = children.unless_worker(pid.as_raw() as u32, || {
            waitpid(pid, Some(WaitPidFlag::WNOHANG))
        });
        match reaped {
            Some(Ok(status)) => tracing::debug!(?status, "Reaped a process a worker left"),
            Some(Err(_)) | None => return,
        }
    }
}

// === impl Leftover ===

impl Leftover {
    /// Its process id.
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends `signal` through a pidfd, if the pid still names the process found.
    fn signal(&self, signal: Signal) {
        let Some(pidfd) = self.pidfd() else {
            return;
        };
        if let Err(error) = rustix::process::pidfd_send_signal(&pidfd, signal) {
            tracing::debug!(pid = self.pid, %error, ?signal, "Cannot signal a process a worker left (it may have exited)");
        }
    }

    /// A pidfd of this very process: opened first, then its start time checked against the one
    /// found (a pid reused since would start later).
    fn pidfd(&self) -> Option<OwnedFd> {
        let pid = Pid::from_raw(i32::try_from(self.pid).ok()?)?;
        let pidfd = rustix::process::pidfd_open(pid, PidfdFlags::empty()).ok()?;
        let stat = peregrine_contract::procfs::stat(self.pid).ok()?;
        (stat.starttime == self.starttime).then_some(pidfd)
    }
}

impl std::fmt::Display for Leftover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.pid.fmt(f)
    }
}

/// What one process's environment says of whose it is.
#[derive(Debug, PartialEq, Eq)]
enum Claim {
    /// A worker's, of this lineage and that slot, or a process it started.
    Slot(Slot),
    /// Nothing of ours: it carries no lineage (or another, or it cannot be read).
    None,
    /// This lineage without a slot: what the orphan watcher carries, and what any process of a
    /// worker's can keep of its environment. Proof of nothing: the watcher is known by its pid.
    LineageOnly,
}

fn claim_of(pid: u32, lineage: &Lineage) -> Claim {
    match std::fs::read(format!("/proc/{pid}/environ")) {
        Ok(environ) => claim_in(&environ, lineage),
        Err(_) => Claim::None,
    }
}

/// Whose `environ` (NUL-separated `NAME=value`) says a process is.
fn claim_in(environ: &[u8], lineage: &Lineage) -> Claim {
    let env = Environ::parse(environ);
    if !env
        .bytes(ENV_LINEAGE)
        .is_some_and(|value| lineage.matches(value))
    {
        return Claim::None;
    }
    match env.slot() {
        Some((service, index)) => Claim::Slot(Slot {
            service: service.to_owned(),
            index,
        }),
        None => Claim::LineageOnly,
    }
}

/// This process's children, from `/proc/self/task/*/children`; `None` where the kernel has no
/// such file (built without `CONFIG_PROC_CHILDREN`).
fn own_children() -> Option<Vec<u32>> {
    children_of("self")
}

/// The children of process `pid` (a number, or `self`), from `/proc/PID/task/*/children`; `None`
/// where the kernel has no such file (built without `CONFIG_PROC_CHILDREN`) or the process is gone.
pub(super) fn children_of(pid: &str) -> Option<Vec<u32>> {
    let mut pids = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        match std::fs::read_to_string(task.path().join("children")) {
            Ok(text) => pids.extend(
                text.split_ascii_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            ),
            // A thread that ended meanwhile has no file any more; a kernel without them, none.
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                if task.path().exists() {
                    return None;
                }
            }
            Err(_) => return None,
        }
    }
    Some(pids)
}

/// One process as `/proc/PID/stat` describes it.
#[derive(Clone, Copy, Debug)]
struct Proc {
    ppid: u32,
    starttime: u64,
    zombie: bool,
}

/// Every process on the host, read in one pass over `/proc`.
#[derive(Debug, Default)]
struct ProcTable {
    procs: HashMap<u32, Proc>,
}

impl ProcTable {
    /// Reads `/proc`, then lists it again for processes that appeared meanwhile, until a listing
    /// shows none (at most [`LISTINGS`] times). A listing is taken at once, before the processes in
    /// it are read: a process that forks and exits meanwhile hands its new child to its parent, or to
    /// the supervisor, and the child is only in the next listing.
    fn read() -> Self {
        let mut procs = HashMap::new();
        let mut seen = HashSet::new();
        for _ in 0..LISTINGS {
            let Ok(entries) = std::fs::read_dir("/proc") else {
                break;
            };
            let listed: Vec<u32> = entries
                .flatten()
                .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
                .filter(|pid| seen.insert(*pid))
                .collect();
            if listed.is_empty() {
                break;
            }
            for pid in listed {
                if let Ok(stat) = peregrine_contract::procfs::stat(pid) {
                    procs.insert(pid, Proc::of(&stat));
                }
            }
        }
        ProcTable { procs }
    }

    /// Whether `pid`, or one of its ancestors, is in `roots`.
    fn has_ancestor_in(&self, pid: u32, roots: &HashSet<u32>) -> bool {
        let mut at = pid;
        // A chain longer than the table can only be a loop of reused pids read at different times.
        for _ in 0..=self.procs.len() {
            if roots.contains(&at) {
                return true;
            }
            match self.procs.get(&at) {
                Some(proc) if proc.ppid > 1 && proc.ppid != at => at = proc.ppid,
                _ => return false,
            }
        }
        false
    }

    /// `seeds` and every live process below them.
    fn with_descendants(&self, seeds: Vec<u32>) -> Vec<Leftover> {
        let mut below: HashMap<u32, Vec<u32>> = HashMap::new();
        for (&pid, proc) in &self.procs {
            below.entry(proc.ppid).or_default().push(pid);
        }
        let mut seen: HashSet<u32> = seeds.iter().copied().collect();
        let mut found = seeds;
        let mut next = 0;
        while next < found.len() {
            for &kid in below.get(&found[next]).into_iter().flatten() {
                if seen.insert(kid) {
                    found.push(kid);
                }
            }
            next += 1;
        }
        found
            .into_iter()
            .filter_map(|pid| {
                let proc = self.procs.get(&pid)?;
                (!proc.zombie).then_some(Leftover {
                    pid,
                    starttime: proc.starttime,
                })
            })
            .collect()
    }
}

impl Proc {
    fn of(stat: &Stat) -> Self {
        Proc {
            ppid: stat.ppid,
            starttime: stat.starttime,
            zombie: stat.state == 'Z' || stat.state == 'X',
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_contract::settings::{ENV_INDEX, ENV_SERVICE};

    fn environ(vars: &[(&str, &str)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, v) in vars {
            out.extend_from_slice(format!("{k}={v}").as_bytes());
            out.push(0);
        }
        out
    }

    #[test]
    fn a_process_is_claimed_by_the_slot_its_environment_names_under_this_lineage() {
        let lineage = Lineage::random().unwrap();
        let web = |index: &str| {
            environ(&[
                ("PATH", "/bin"),
                (ENV_LINEAGE, lineage.as_str()),
                (ENV_SERVICE, "web"),
                (ENV_INDEX, index),
            ])
        };
        assert_eq!(
            claim_in(&web("2"), &lineage),
            Claim::Slot(Slot {
                service: "web".into(),
                index: 2
            })
        );
        let other = Lineage::random().unwrap();
        assert_eq!(claim_in(&web("2"), &other), Claim::None, "another socket's");
        assert_eq!(
            claim_in(b"", &lineage),
            Claim::None,
            "a cleared environment"
        );
        assert_eq!(
            claim_in(&environ(&[(ENV_LINEAGE, lineage.as_str())]), &lineage),
            Claim::LineageOnly
        );
    }

    #[test]
    fn an_orphan_is_the_exiting_workers_whatever_its_environment_names() {
        let slot = |service: &str| Slot {
            service: service.into(),
            index: 0,
        };
        let web = slot("web");
        // Its own slot's, wherever it is.
        assert_eq!(judge(Claim::Slot(web.clone()), &web, false), Verdict::Left);
        assert_eq!(judge(Claim::Slot(web.clone()), &web, true), Verdict::Left);
        // The lineage alone, as the orphan watcher has it, proves nothing: an orphan handed over at
        // this exit is this exit's, as one that cleared its environment is.
        assert_eq!(judge(Claim::LineageOnly, &web, true), Verdict::Left);
        assert_eq!(judge(Claim::None, &web, true), Verdict::Left);
        // Naming another slot, it is still this exit's, and says which slot it names.
        assert_eq!(
            judge(Claim::Slot(slot("api")), &web, true),
            Verdict::LeftNaming(slot("api"))
        );
        // Elsewhere on the host (not handed to the supervisor), only its own slot's are taken.
        assert_eq!(
            judge(Claim::Slot(slot("api")), &web, false),
            Verdict::Spared
        );
        assert_eq!(judge(Claim::LineageOnly, &web, false), Verdict::Spared);
        assert_eq!(judge(Claim::None, &web, false), Verdict::Spared);
    }

    #[test]
    fn only_the_marked_watcher_is_the_supervisors_helper() {
        let children = Children::default();
        assert!(!children.is_helper(42));
        children.set_helper(Some(42));
        assert!(children.is_helper(42));
        assert!(!children.is_helper(43));
        children.set_helper(None);
        assert!(!children.is_helper(42));
    }

    fn table(rows: &[(u32, u32, bool)]) -> ProcTable {
        ProcTable {
            procs: rows
                .iter()
                .map(|&(pid, ppid, zombie)| {
                    (
                        pid,
                        Proc {
                            ppid,
                            starttime: u64::from(pid) * 10,
                            zombie,
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn a_tree_is_followed_down_from_its_seeds_and_up_to_a_live_root() {
        // 100 is the supervisor; 200 a live worker with a child 201 and grandchild 202; 300 left by
        // a worker that exited, with 301 below it and 302 a zombie.
        let table = table(&[
            (100, 1, false),
            (200, 100, false),
            (201, 200, false),
            (202, 201, false),
            (300, 100, false),
            (301, 300, false),
            (302, 300, true),
        ]);
        let workers: HashSet<u32> = [200].into();
        assert!(table.has_ancestor_in(202, &workers));
        assert!(!table.has_ancestor_in(301, &workers));
        let mut found: Vec<u32> = table
            .with_descendants(vec![300])
            .iter()
            .map(|l| l.pid)
            .collect();
        found.sort();
        assert_eq!(found, [300, 301], "the zombie is reaped, not stopped");
        assert_eq!(
            table.with_descendants(vec![300])[0].starttime,
            3000,
            "each is named with its start time"
        );
    }

    #[test]
    fn own_children_are_listed_where_the_kernel_can() {
        // Where the kernel has the files, a child of this test shows up in them.
        let mut child = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        if let Some(kids) = own_children() {
            assert!(kids.contains(&child.id()), "{kids:?}");
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
