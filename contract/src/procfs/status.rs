//! `/proc/PID/status`: the one reader of its `Name:\tvalue` lines ([`StatusText`]), and the memory
//! lines the benchmarks read ([`Status`]).

use super::{ProcError, parsed, read};

/// The text of a `/proc/PID/status` file, its fields looked up by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusText(String);

impl StatusText {
    /// Reads `/proc/PID/status`.
    pub fn read(pid: u32) -> Result<StatusText, ProcError> {
        read(std::path::Path::new(&format!("/proc/{pid}/status"))).map(StatusText)
    }

    /// Reads `/proc/self/status`.
    pub fn read_self() -> Result<StatusText, ProcError> {
        read(std::path::Path::new("/proc/self/status")).map(StatusText)
    }

    /// The text of a status file read elsewhere.
    pub fn new(text: impl Into<String>) -> StatusText {
        StatusText(text.into())
    }

    /// The value of the line `name:`, trimmed (`None` when there is no such line).
    pub fn field(&self, name: &str) -> Option<&str> {
        self.0.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key == name).then(|| value.trim())
        })
    }

    /// The value of a `N kB` line, in KiB.
    pub fn kib(&self, name: &str) -> Option<u64> {
        self.field(name)?.strip_suffix("kB")?.trim().parse().ok()
    }

    /// The value of a line that is one decimal number (`Threads`, `NoNewPrivs`).
    pub fn number(&self, name: &str) -> Option<u64> {
        self.field(name)?.parse().ok()
    }

    /// The value of a line that is one hexadecimal number (`CapEff` and the other capability sets).
    pub fn hex(&self, name: &str) -> Option<u64> {
        u64::from_str_radix(self.field(name)?, 16).ok()
    }

    /// The memory lines; `None` unless both are there (a kernel thread or a zombie has neither).
    pub fn memory(&self) -> Option<Status> {
        Some(Status {
            rss_kib: self.kib("VmRSS")?,
            hwm_kib: self.kib("VmHWM")?,
        })
    }
}

/// The memory fields of `/proc/PID/status` that the benchmarks read, in KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Status {
    /// `VmRSS`: resident memory now.
    pub rss_kib: u64,
    /// `VmHWM`: the peak of resident memory over the process's life ("high water mark").
    pub hwm_kib: u64,
}

impl Status {
    /// Parses the text of `/proc/PID/status`; `None` unless both `VmRSS` and `VmHWM` are there.
    pub fn parse(text: &str) -> Option<Status> {
        StatusText::new(text).memory()
    }
}

/// Reads the memory lines of `/proc/PID/status`.
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

    #[test]
    fn reads_fields_by_their_whole_name() {
        let text = StatusText::new(
            "Name:\tsh\nThreads:\t3\nCapEff:\t000001ffffffffff\nVmRSS:\t  12 kB\n\
             Cpus_allowed_list:\t0-1\nNoNewPrivs:\t1\n",
        );
        assert_eq!(text.field("Cpus_allowed_list"), Some("0-1"));
        assert_eq!(text.number("Threads"), Some(3));
        assert_eq!(text.number("NoNewPrivs"), Some(1));
        assert_eq!(text.hex("CapEff"), Some(0x1ff_ffff_ffff));
        assert_eq!(text.kib("VmRSS"), Some(12));
        // A name is matched whole: `Cpus_allowed` is not `Cpus_allowed_list`.
        assert_eq!(text.field("Cpus_allowed"), None);
        assert_eq!(text.kib("Threads"), None, "not a kB line");
        let me = StatusText::read_self().unwrap();
        assert!(me.number("Threads").is_some_and(|n| n >= 1));
        assert_eq!(
            StatusText::read(std::process::id()).unwrap().field("Name"),
            me.field("Name")
        );
    }
}
