//! The machine a benchmark runs on: its CPUs, how busy they are (and with whose work), and the lines
//! every report starts with.

use std::{fmt::Write as _, process::Command};

use anyhow::Context;

/// The CPUs this process may use (`available_parallelism`: its affinity, so a benchmark asks before it
/// pins itself).
pub(crate) fn online_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The CPUs process `pid` may run on (`Cpus_allowed_list` in `/proc/PID/status`).
pub(crate) fn cpus_allowed(pid: u32) -> anyhow::Result<String> {
    let status = peregrine_contract::procfs::StatusText::read(pid)?;
    status
        .field("Cpus_allowed_list")
        .map(str::to_owned)
        .with_context(|| format!("no Cpus_allowed_list in /proc/{pid}/status"))
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

pub(crate) use peregrine_contract::procfs::{Busy, machine_busy, own_ticks};

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
    fn reads_the_load_average() {
        let load = load_average().unwrap();
        assert!(load.iter().all(|l| *l >= 0.0), "{load:?}");
    }
}
