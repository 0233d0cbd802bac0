//! The memory lines of `/proc/PID/status`: resident and peak resident size.

use super::{ProcError, parsed};

/// The memory fields of `/proc/PID/status` that the benchmarks read, in KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Status {
    /// `VmRSS`: resident memory now.
    pub rss_kib: u64,
    /// `VmHWM`: the peak of resident memory over the process's life ("high water mark").
    pub hwm_kib: u64,
}

impl Status {
    /// Parses the text of `/proc/PID/status`; `None` unless both `VmRSS` and `VmHWM` are there (a
    /// kernel thread or a zombie has neither).
    pub fn parse(text: &str) -> Option<Status> {
        let kib = |field: &str| {
            text.lines().find_map(|line| {
                line.strip_prefix(field)?
                    .strip_prefix(':')?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse()
                    .ok()
            })
        };
        Some(Status {
            rss_kib: kib("VmRSS")?,
            hwm_kib: kib("VmHWM")?,
        })
    }
}

/// Reads `/proc/PID/status`.
pub fn status(pid: u32) -> Result<Status, ProcError> {
    parsed(
        std::path::Path::new(&format!("/proc/{pid}/status")),
        Status::parse,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rss_and_its_peak() {
        let text =
            "Name:\tperegrine\nVmPeak:\t  900 kB\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\n";
        assert_eq!(
            Status::parse(text),
            Some(Status {
                rss_kib: 1024,
                hwm_kib: 2048
            })
        );
        assert_eq!(Status::parse("Name:\tkthreadd\n"), None);
        let me = status(std::process::id()).unwrap();
        assert!(me.rss_kib > 0 && me.hwm_kib >= me.rss_kib, "{me:?}");
    }
}
