//! Whose work keeps the machine busy: the CPU time of all cores together and of one process tree (a
//! test or a benchmark and everything it started), so that two readings tell how much of the machine
//! *other* processes took in between. The machine may be shared (a build, another job): a figure that
//! assumes free cores is only worth what this says.

use std::{collections::BTreeMap, time::Instant};

use super::{ProcError, clock_ticks_per_second, cpu_stat, stat};

/// Busy clock ticks of all cores together (`/proc/stat`), hypervisor steal included: a core the
/// hypervisor gave away was not free either.
pub fn machine_busy() -> Result<u64, ProcError> {
    Ok(cpu_stat()?.cpus.iter().map(|(_, ticks)| ticks.busy()).sum())
}

/// Clock ticks of `pids` (all threads), with their children that were waited for; a process that is
/// gone counts nothing.
pub fn own_ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|&pid| stat(pid).ok())
        .map(|stat| stat.cpu_ticks_with_children())
        .sum()
}

/// `root` and every live process descended from it (by parent pid), from one pass over `/proc`.
pub fn descendants(root: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![root];
    };
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if let Ok(stat) = stat(pid) {
            children.entry(stat.ppid).or_default().push(pid);
        }
    }
    let mut found = vec![root];
    let mut next = 0;
    while next < found.len() {
        if let Some(kids) = children.get(&found[next]) {
            found.extend(kids);
        }
        next += 1;
    }
    found
}

/// The CPU time of the machine, and of one process tree, at one moment: what [`Busy::since`]
/// subtracts to tell how much of the machine other work took.
#[derive(Clone, Copy, Debug)]
pub struct Busy {
    at: Instant,
    machine: u64,
    own: u64,
}

impl Busy {
    /// Now, for the tree of processes under `root` (with the children they waited for).
    pub fn now(root: u32) -> Result<Busy, ProcError> {
        Ok(Busy {
            at: Instant::now(),
            machine: machine_busy()?,
            own: own_ticks(&descendants(root)),
        })
    }

    /// Now, for this process's tree.
    pub fn now_for_this_tree() -> Result<Busy, ProcError> {
        Busy::now(std::process::id())
    }

    /// Since `before`: the cores the whole machine was busy with, and those taken by processes outside
    /// the tree. Processes of the tree that ended without being waited for (killed workers, reaped by
    /// init) count as others'.
    pub fn since(self, before: Busy) -> (f64, f64) {
        let secs = self.at.duration_since(before.at).as_secs_f64().max(1e-9);
        let hz = clock_ticks_per_second() as f64;
        let machine = self.machine.saturating_sub(before.machine);
        let own = self.own.saturating_sub(before.own);
        (
            machine as f64 / hz / secs,
            machine.saturating_sub(own) as f64 / hz / secs,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_own_ticks() {
        let me = std::process::id();
        // Read in the order that makes `>=` hold while other tests' threads burn CPU meanwhile.
        let before = stat(me).unwrap().cpu_ticks();
        assert!(own_ticks(&[me]) >= before);
        assert_eq!(
            own_ticks(&[1 << 23]),
            0,
            "a process that is gone counts nothing"
        );
    }

    #[test]
    fn finds_its_children() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let found = descendants(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found[0], std::process::id());
        assert!(found.contains(&child.id()), "{found:?}");
    }

    #[test]
    fn a_process_outside_the_tree_is_counted_as_others() {
        let before = Busy::now_for_this_tree().unwrap();
        // The spinner's parent shell exits at once, so it is reparented away from this tree.
        let status = std::process::Command::new("sh")
            .args(["-c", "(timeout 0.5 sh -c 'while :; do :; done' &)"])
            .status()
            .unwrap();
        assert!(status.success());
        std::thread::sleep(std::time::Duration::from_millis(600));
        let (machine, others) = Busy::now_for_this_tree().unwrap().since(before);
        assert!(others > 0.3, "others {others:.2} of {machine:.2} cores");
    }

    #[test]
    fn work_of_this_tree_is_not_counted_as_others() {
        let before = Busy::now_for_this_tree().unwrap();
        let spin_until = Instant::now() + std::time::Duration::from_millis(300);
        while Instant::now() < spin_until {
            std::hint::black_box(0u64);
        }
        let (machine, others) = Busy::now_for_this_tree().unwrap().since(before);
        assert!(machine >= others, "{machine} {others}");
        // This process kept one core busy; others can only have added to the machine's figure.
        assert!(machine - others > 0.3, "own {:.2} cores", machine - others);
    }
}
