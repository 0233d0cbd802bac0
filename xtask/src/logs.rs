//! What the supervisors log, read back as timed events (for `cargo xtask bench fleet` and `cargo
//! xtask demo fleet`): tracing's lines
//! (`2026-12-01T14:26:31.632931Z  INFO registration{...}: peregrine_supervisor::registration: Worker
//! registered service=web index=0 pid=6482 hostname=web-0-6482`), their UTC timestamps as
//! [`SystemTime`]s on the same clock the benchmark reads, and their `key=value` fields.
//!
//! The lines used: `Worker registered` (a worker's key is put right after), `Worker exited`, `Joined
//! the fleet` (the listing is in the registry), and the membership's debug line `Fleet view changed`
//! (a watch event changed the registry's view of the other hosts; `RUST_LOG` must enable
//! [`FLEET_DEBUG`]).

use std::{
    fs::File,
    io::{Read, Seek, SeekFrom},
    path::PathBuf,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context;

/// The `RUST_LOG` that adds the membership's `Fleet view changed` lines to the usual ones.
pub const FLEET_DEBUG: &str = "info,peregrine_supervisor::fleet=debug";
/// A worker registered (its key is put right after).
pub const REGISTERED: &str = "Worker registered";
/// A worker's exit was noticed (its key is deleted right after).
pub const EXITED: &str = "Worker exited";
/// The membership applied a watch event that changed the view of the other hosts.
pub const VIEW_CHANGED: &str = "Fleet view changed";
/// A session listed the fleet and watches it.
pub const JOINED: &str = "Joined the fleet";

/// One log line with a timestamp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Line<'a> {
    pub at: SystemTime,
    /// What follows the message: the event's fields.
    fields: &'a str,
}

impl<'a> Line<'a> {
    /// The value of the event's field `name` (`name=value`, up to the next space; quotes kept).
    pub fn field(&self, name: &str) -> Option<&'a str> {
        self.fields
            .split_ascii_whitespace()
            .find_map(|word| word.strip_prefix(name)?.strip_prefix('='))
    }

    /// Field `name` as a number.
    pub fn number(&self, name: &str) -> Option<u64> {
        self.field(name)?.parse().ok()
    }
}

/// The lines of `logs` that hold `message`, with their times, oldest first.
pub fn lines<'a>(logs: &'a str, message: &'a str) -> impl Iterator<Item = Line<'a>> + 'a {
    logs.lines().filter_map(move |text| {
        let (_, fields) = text.split_once(message)?;
        Some(Line {
            at: timestamp(text.split_ascii_whitespace().next()?)?,
            fields,
        })
    })
}

/// The first line of `logs` holding `message` at or after `after` whose fields satisfy `with`.
pub fn first_after<'a>(
    logs: &'a str,
    message: &'a str,
    after: SystemTime,
    with: impl Fn(&Line<'a>) -> bool,
) -> Option<Line<'a>> {
    lines(logs, message).find(|line| line.at >= after && with(line))
}

/// A log file read as it grows: each call returns the whole lines written since the last one.
#[derive(Debug)]
pub struct Tail {
    path: PathBuf,
    offset: u64,
    partial: String,
}

impl Tail {
    /// The file at `path`, from its start.
    pub fn new(path: PathBuf) -> Tail {
        Tail {
            path,
            offset: 0,
            partial: String::new(),
        }
    }

    /// The whole lines written since the last call (none if the file is not there yet).
    pub fn read(&mut self) -> anyhow::Result<String> {
        let mut file = match File::open(&self.path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(String::new()),
            Err(e) => return Err(e).with_context(|| format!("opening {}", self.path.display())),
        };
        file.seek(SeekFrom::Start(self.offset))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .with_context(|| format!("reading {}", self.path.display()))?;
        self.offset += bytes.len() as u64;
        self.partial.push_str(&String::from_utf8_lossy(&bytes));
        let whole = self.partial.rfind('\n').map_or(0, |i| i + 1);
        let rest = self.partial.split_off(whole);
        Ok(std::mem::replace(&mut self.partial, rest))
    }
}

/// tracing's `YYYY-MM-DDTHH:MM:SS.ffffffZ` as a time.
pub fn timestamp(stamp: &str) -> Option<SystemTime> {
    let stamp = stamp.strip_suffix('Z')?;
    let (date, time) = stamp.split_once('T')?;
    let mut ymd = date.split('-').map(str::parse::<i64>);
    let (Some(Ok(year)), Some(Ok(month)), Some(Ok(day)), None) =
        (ymd.next(), ymd.next(), ymd.next(), ymd.next())
    else {
        return None;
    };
    let mut hms = time.split(':');
    let (Some(h), Some(m), Some(s), None) = (hms.next(), hms.next(), hms.next(), hms.next()) else {
        return None;
    };
    let (h, m): (u64, u64) = (h.parse().ok()?, m.parse().ok()?);
    let (whole, fraction) = s.split_once('.').unwrap_or((s, ""));
    let whole: u64 = whole.parse().ok()?;
    let nanos: u32 = if fraction.is_empty() {
        0
    } else {
        let digits = fraction.len().min(9);
        fraction[..digits].parse::<u32>().ok()? * 10u32.pow(9 - digits as u32)
    };
    let days = u64::try_from(days_from_civil(year, month, day)).ok()?;
    let secs = days * 86_400 + h * 3600 + m * 60 + whole;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGS: &str = "\
2026-12-01T14:26:31.529429Z  INFO slot{service=web index=0}: peregrine_supervisor::manager::slot_task: Worker exited pid=6406 exit=signal 9 uptime=9.8s deregistered=true
2026-12-01T14:26:31.632931Z  INFO registration{pid=6482 uid=0}: peregrine_supervisor::registration: Worker registered service=web index=0 pid=6482 hostname=web-0-6482
2026-12-01T14:26:31.634391Z DEBUG peregrine_supervisor::fleet::membership: Fleet view changed hosts=1 workers=2
";

    #[test]
    fn tails_whole_lines() {
        let dir = tempfile::TempDir::new().unwrap();
        let path = dir.path().join("log");
        let mut tail = Tail::new(path.clone());
        assert_eq!(tail.read().unwrap(), "");
        std::fs::write(&path, "one\ntw").unwrap();
        assert_eq!(tail.read().unwrap(), "one\n");
        std::fs::write(&path, "one\ntwo\nthree\n").unwrap();
        assert_eq!(tail.read().unwrap(), "two\nthree\n");
        assert_eq!(tail.read().unwrap(), "");
    }

    #[test]
    fn reads_timestamps() {
        assert_eq!(timestamp("1970-01-01T00:00:00Z"), Some(UNIX_EPOCH));
        assert_eq!(
            timestamp("2026-12-01T14:26:31.632931Z"),
            Some(UNIX_EPOCH + Duration::new(1_796_135_191, 632_931_000))
        );
        assert_eq!(
            timestamp("2000-03-01T00:00:01.5Z"),
            Some(UNIX_EPOCH + Duration::new(951_868_801, 500_000_000))
        );
        assert_eq!(timestamp("2026-12-01 14:26:31Z"), None);
        assert_eq!(timestamp("INFO"), None);
    }

    #[test]
    fn finds_lines_and_fields() {
        let registered: Vec<_> = lines(LOGS, REGISTERED).collect();
        assert_eq!(registered.len(), 1);
        assert_eq!(registered[0].number("pid"), Some(6482));
        assert_eq!(registered[0].field("hostname"), Some("web-0-6482"));
        let exited = timestamp("2026-12-01T14:26:31.529429Z").unwrap();
        let changed = first_after(LOGS, VIEW_CHANGED, exited, |l| {
            l.number("workers") == Some(2)
        })
        .unwrap();
        assert_eq!(changed.number("hosts"), Some(1));
        assert!(
            first_after(
                LOGS,
                VIEW_CHANGED,
                changed.at + Duration::from_micros(1),
                |_| true
            )
            .is_none()
        );
    }
}
