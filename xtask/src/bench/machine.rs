//! The machine a benchmark runs on: its CPUs, how busy they are (and with whose work), and the lines
//! every report starts with.

use std::{fmt::Write as _, process::Command};

use anyhow::Context;
use peregrine_contract::procfs;

/// The CPUs this process may use (`available_parallelism`: its affinity, so a benchmark asks before it
/// pins itself).
pub(crate) fn online_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The CPUs process `pid` may run on (`Cpus_allowed_list` in `/proc/PID/status`).
pub(crate) fn cpus_allowed(pid: u32) -> anyhow::Result<String> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
        .map(|list| list.trim().to_owned())
        .with_context(|| format!("no Cpus_allowed_list in {path}"))
}

/// The CPU's model name and how many CPUs this process may use, as a report's `CPU:` line shows them.
pub(crate) fn cpu_line() -> anyhow::Result<String> {
    Ok(format!("{} ({} online)", cpu_model()?, online_cpus()))
}

/// The first `model name` of `/proc/cpuinfo`.
pub(crate) fn cpu_model() -> anyhow::Result<String> {
    let cpuinfo = read_trimmed("/proc/cpuinfo")?;
    Ok(cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name"))
        .and_then(|rest| rest.split_once(':'))
        .map_or("unknown", |(_, model)| model.trim())
        .to_owned())
}

/// A file's text without the surrounding white space.
pub(crate) fn read_trimmed(path: &str) -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(path)
        .with_context(|| format!("reading {path}"))?
        .trim()
        .to_owned())
}

/// The `Date:`, `Kernel:` and `CPU:` lines every benchmark report starts with, after its command.
pub(crate) fn machine_lines(report: &mut String, cpu: &str) -> anyhow::Result<()> {
    writeln!(report, "Date: {}", today()?)?;
    writeln!(
        report,
        "Kernel: {}",
        read_trimmed("/proc/sys/kernel/osrelease")?
    )?;
    writeln!(report, "CPU: {cpu}")?;
    Ok(())
}

/// Today's date in UTC (`date -u +%F`).
pub(crate) fn today() -> anyhow::Result<String> {
    let output = Command::new("date")
        .args(["-u", "+%F"])
        .output()
        .context("running date")?;
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Busy clock ticks of all cores together (`/proc/stat`).
pub(crate) fn machine_busy() -> anyhow::Result<u64> {
    Ok(procfs::cpu_stat()?
        .cpus
        .iter()
        .map(|(_, ticks)| ticks.busy())
        .sum())
}

/// Clock ticks of `pids` (all threads), with their children that were waited for; a process that is
/// gone counts nothing.
pub(crate) fn own_ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|&pid| procfs::stat(pid).ok())
        .map(|stat| stat.cpu_ticks_with_children())
        .sum()
}

/// `root` and every live process descended from it (by parent pid), from one pass over `/proc`.
pub(crate) fn descendants(root: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![root];
    };
    let parents: std::collections::BTreeMap<u32, u32> = entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            Some((pid, procfs::stat(pid).ok()?.ppid))
        })
        .collect();
    let mut children: std::collections::BTreeMap<u32, Vec<u32>> = Default::default();
    for (&pid, &ppid) in &parents {
        children.entry(ppid).or_default().push(pid);
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

/// The CPU time of the machine, and of one process tree, at one moment: what [`Busy::others_since`]
/// subtracts to tell how much of the machine other work took.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Busy {
    at: std::time::Instant,
    machine: u64,
    own: u64,
}

impl Busy {
    /// Now, for the tree of processes under `root` (with the children they waited for).
    pub(crate) fn now(root: u32) -> anyhow::Result<Busy> {
        Ok(Busy {
            at: std::time::Instant::now(),
            machine: machine_busy()?,
            own: own_ticks(&descendants(root)),
        })
    }

    /// Since `before`: the cores the whole machine was busy with, and those taken by processes outside
    /// the tree. Processes of the tree that ended without being waited for (killed workers, reaped by
    /// init) count as others'.
    pub(crate) fn since(self, before: Busy) -> (f64, f64) {
        let secs = self.at.duration_since(before.at).as_secs_f64().max(1e-9);
        let hz = procfs::clock_ticks_per_second() as f64;
        let machine = self.machine.saturating_sub(before.machine);
        let own = self.own.saturating_sub(before.own);
        (
            machine as f64 / hz / secs,
            machine.saturating_sub(own) as f64 / hz / secs,
        )
    }
}

/// The 1-, 5- and 15-minute load averages (`/proc/loadavg`).
pub(crate) fn load_average() -> anyhow::Result<[f64; 3]> {
    let text = read_trimmed("/proc/loadavg")?;
    let mut fields = text.split_whitespace().map(str::parse::<f64>);
    let mut next = || -> anyhow::Result<f64> {
        fields
            .next()
            .context("a short /proc/loadavg")?
            .context("a load average")
    };
    Ok([next()?, next()?, next()?])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_own_ticks() {
        let me = std::process::id();
        assert!(own_ticks(&[me]) >= procfs::stat(me).unwrap().cpu_ticks());
        assert_eq!(
            own_ticks(&[1 << 23]),
            0,
            "a process that is gone counts nothing"
        );
    }

    #[test]
    fn finds_its_children() {
        let mut child = Command::new("sleep").arg("5").spawn().unwrap();
        let found = descendants(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found[0], std::process::id());
        assert!(found.contains(&child.id()), "{found:?}");
    }

    #[test]
    fn reads_the_load_average() {
        let load = load_average().unwrap();
        assert!(load.iter().all(|l| *l >= 0.0), "{load:?}");
    }
}
