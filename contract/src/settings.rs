//! What a worker learns from the environment its supervisor sets.
//!
//! The supervisor is the only writer of these variables; the names are the contract between the two.

use std::{collections::HashMap, path::PathBuf, time::Duration};

use crate::url::{BindUrl, UrlError};

/// The service (Envoy cluster) the worker belongs to.
pub const ENV_SERVICE: &str = "PEREGRINE_SERVICE";
/// The worker's slot within its service, `0..count`.
pub const ENV_INDEX: &str = "PEREGRINE_WORKER_INDEX";
/// The bind url (see [`BindUrl`]).
pub const ENV_URL: &str = "PEREGRINE_URL";
/// The path of the supervisor's registration socket.
pub const ENV_CONTROL: &str = "PEREGRINE_CONTROL_SOCKET";
/// The inherited file descriptor of the request counter region (see [`crate::counters`]); optional.
///
/// The worker keeps this descriptor open for as long as it lives: a supervisor that adopts the worker
/// after the one that started it has gone takes a duplicate of it with `pidfd_getfd(2)`, to go on reading
/// the worker's request counter.
pub const ENV_COUNTERS_FD: &str = "PEREGRINE_COUNTERS_FD";
/// The worker's lane in the request counter region (see [`crate::counters`]); set together with
/// [`ENV_COUNTERS_FD`].
pub const ENV_COUNTERS_LANE: &str = "PEREGRINE_COUNTERS_LANE";
/// How long, in milliseconds, the worker serves without an accepted registration (its supervisor gone
/// and no other one answering on the control socket) before it stops on its own; `0` means never.
/// Optional: [`DEFAULT_ORPHAN_TIMEOUT`] when unset.
pub const ENV_ORPHAN_TIMEOUT: &str = "PEREGRINE_ORPHAN_TIMEOUT_MS";

/// The lineage of the supervisor that started the worker: a random value kept in the owner-only lock
/// file beside the control socket. The worker never reads it; it only carries it, so that a later
/// supervisor of the same socket can tell its own workers from any other process before it adopts or
/// stops them.
pub const ENV_LINEAGE: &str = "PEREGRINE_LINEAGE";

/// The version of the agreement under which the supervisor started the worker ([`CONTRACT`]). The
/// worker never reads it; it only carries it, so that a later supervisor (after a crash, or an
/// upgrade in place) can tell whether it reads the worker as the one that started it did before it
/// adopts it. A worker without it was started before the agreement had a version (Peregrine 0.1.0).
pub const ENV_CONTRACT: &str = "PEREGRINE_CONTRACT";

/// The version of what a supervisor and the workers it starts agree on: these variables and what
/// they mean, the request counter region's layout ([`crate::counters`]), the registration messages
/// and the lineage. It goes up when a change would make a supervisor of one version misread, or
/// stop, a worker of another; a supervisor adopts the workers of the versions its adoption accepts
/// and asks for a restart (which drains) across the others.
pub const CONTRACT: u32 = 1;

/// The versions of the agreement whose workers a supervisor of this build adopts: its own, and
/// those of the releases before it that speak one it still reads (docs/upgrading.md). The start
/// only ever rises.
pub const ADOPTED: std::ops::RangeInclusive<u32> = 1..=CONTRACT;

/// The orphan timeout when [`ENV_ORPHAN_TIMEOUT`] is not set: one minute.
pub const DEFAULT_ORPHAN_TIMEOUT: Duration = Duration::from_secs(60);

/// A worker's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The service name.
    pub service: String,
    /// The worker's slot within its service, `0..count`.
    pub index: u32,
    /// Where to bind.
    pub url: BindUrl,
    /// The registration socket.
    pub control: PathBuf,
    /// Where to count requests for outside readers, if the supervisor provides a region.
    pub counters: Option<CounterLane>,
    /// How long to serve without a supervisor before stopping; [`Duration::ZERO`] means never (see
    /// [`ENV_ORPHAN_TIMEOUT`]).
    pub orphan_timeout: Duration,
}

/// A lane in an inherited request counter region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterLane {
    /// The inherited file descriptor number.
    pub fd: i32,
    /// The lane: the counter at byte `64 * lane`.
    pub lane: u32,
}

/// A missing or invalid setting.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A variable is not set.
    #[error("{0} is not set: a worker is started by `peregrine run`, which sets it")]
    Missing(&'static str),
    /// The index is not a number.
    #[error("{ENV_INDEX} must be a non-negative integer, got {0:?}")]
    Index(String),
    /// The url is invalid.
    #[error("{ENV_URL} is invalid")]
    Url(#[source] UrlError),
    /// The counter settings are invalid or incomplete.
    #[error(
        "{ENV_COUNTERS_FD} and {ENV_COUNTERS_LANE} must both be non-negative integers, got {0:?} and {1:?}"
    )]
    Counters(Option<String>, Option<String>),
    /// The orphan timeout is not a number of milliseconds.
    #[error(
        "{ENV_ORPHAN_TIMEOUT} must be a non-negative integer (milliseconds, 0 for never), got {0:?}"
    )]
    OrphanTimeout(String),
}

impl Settings {
    /// Reads the settings from the process environment.
    pub fn from_env() -> Result<Self, SettingsError> {
        Self::from_map(&std::env::vars().collect())
    }

    /// Reads the settings from a map of variables (tests pass one instead of mutating the environment).
    pub fn from_map(vars: &HashMap<String, String>) -> Result<Self, SettingsError> {
        let get = |k: &'static str| vars.get(k).ok_or(SettingsError::Missing(k));
        let index = get(ENV_INDEX)?;
        let counters = match (vars.get(ENV_COUNTERS_FD), vars.get(ENV_COUNTERS_LANE)) {
            (None, None) => None,
            (fd, lane) => {
                let bad = || SettingsError::Counters(fd.cloned(), lane.cloned());
                Some(CounterLane {
                    fd: fd
                        .and_then(|f| f.parse().ok())
                        .filter(|f| *f >= 0)
                        .ok_or_else(bad)?,
                    lane: lane.and_then(|s| s.parse().ok()).ok_or_else(bad)?,
                })
            }
        };
        let orphan_timeout = match vars.get(ENV_ORPHAN_TIMEOUT) {
            None => DEFAULT_ORPHAN_TIMEOUT,
            Some(ms) => ms
                .parse()
                .map(Duration::from_millis)
                .map_err(|_| SettingsError::OrphanTimeout(ms.clone()))?,
        };
        Ok(Settings {
            service: get(ENV_SERVICE)?.clone(),
            index: index
                .parse()
                .map_err(|_| SettingsError::Index(index.clone()))?,
            url: get(ENV_URL)?.parse().map_err(SettingsError::Url)?,
            control: get(ENV_CONTROL)?.into(),
            counters,
            orphan_timeout,
        })
    }

    /// The variables that make up these settings, for the supervisor to pass to a worker, with the
    /// version of the agreement ([`ENV_CONTRACT`]).
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            (ENV_CONTRACT, CONTRACT.to_string()),
            (ENV_SERVICE, self.service.clone()),
            (ENV_INDEX, self.index.to_string()),
            (ENV_URL, self.url.to_string()),
            (ENV_CONTROL, self.control.display().to_string()),
            (
                ENV_ORPHAN_TIMEOUT,
                self.orphan_timeout.as_millis().to_string(),
            ),
        ];
        if let Some(counters) = self.counters {
            env.push((ENV_COUNTERS_FD, counters.fd.to_string()));
            env.push((ENV_COUNTERS_LANE, counters.lane.to_string()));
        }
        env
    }
}

/// Another process's environment as `/proc/PID/environ` holds it (`NAME=value`, NUL-separated),
/// read for what a supervisor started it with: the one reading of it, for adoption and for the
/// processes a worker leaves behind. Every value is the process's own to write, so it is evidence
/// of nothing but itself (see the lineage).
#[derive(Debug)]
pub struct Environ<'a> {
    vars: HashMap<&'a [u8], &'a [u8]>,
}

impl<'a> Environ<'a> {
    /// Reads `environ`; a pair without `=` is skipped, and a later name wins over an earlier one.
    pub fn parse(environ: &'a [u8]) -> Environ<'a> {
        let vars = environ
            .split(|b| *b == 0)
            .filter_map(|pair| {
                let eq = pair.iter().position(|b| *b == b'=')?;
                Some((&pair[..eq], &pair[eq + 1..]))
            })
            .collect();
        Environ { vars }
    }

    /// The value of `name`, as bytes.
    pub fn bytes(&self, name: &str) -> Option<&'a [u8]> {
        self.vars.get(name.as_bytes()).copied()
    }

    /// The value of `name`, if it is UTF-8.
    pub fn text(&self, name: &str) -> Option<&'a str> {
        std::str::from_utf8(self.bytes(name)?).ok()
    }

    /// The slot it names: its service ([`ENV_SERVICE`]) and index ([`ENV_INDEX`]), when both are
    /// there and the index is a number.
    pub fn slot(&self) -> Option<(&'a str, u32)> {
        Some((self.text(ENV_SERVICE)?, self.text(ENV_INDEX)?.parse().ok()?))
    }

    /// Its counter descriptor and lane ([`ENV_COUNTERS_FD`], [`ENV_COUNTERS_LANE`]): `None` unless
    /// it has both, `Some(None)` when they are not both numbers.
    pub fn counter(&self) -> Option<Option<(i32, u32)>> {
        let (fd, lane) = (self.text(ENV_COUNTERS_FD)?, self.text(ENV_COUNTERS_LANE)?);
        Some(fd.parse().ok().zip(lane.parse().ok()))
    }

    /// The version of the agreement it was started under ([`ENV_CONTRACT`]); `None` without one
    /// (or with one that is not a number).
    pub fn contract(&self) -> Option<u32> {
        self.text(ENV_CONTRACT)?.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_a_worker_was_started_with_from_its_environ() {
        let environ = b"PATH=/bin\0PEREGRINE_SERVICE=web\0PEREGRINE_WORKER_INDEX=3\0\
                        PEREGRINE_COUNTERS_FD=5\0PEREGRINE_COUNTERS_LANE=17\0PEREGRINE_CONTRACT=1\0\
                        broken\0EMPTY=\0";
        let env = Environ::parse(environ);
        assert_eq!(env.slot(), Some(("web", 3)));
        assert_eq!(env.counter(), Some(Some((5, 17))));
        assert_eq!(env.contract(), Some(1));
        assert_eq!(env.text("EMPTY"), Some(""));
        assert_eq!(env.bytes("broken"), None);
        let bare = Environ::parse(
            b"PEREGRINE_SERVICE=web\0PEREGRINE_WORKER_INDEX=x\0PEREGRINE_COUNTERS_FD=5\0",
        );
        assert_eq!(bare.slot(), None, "an index that is not a number");
        assert_eq!(
            bare.counter(),
            None,
            "a descriptor without its lane: no counter"
        );
        assert_eq!(bare.contract(), None);
        let bad = Environ::parse(b"PEREGRINE_COUNTERS_FD=five\0PEREGRINE_COUNTERS_LANE=1\0");
        assert_eq!(bad.counter(), Some(None), "both, not both numbers");
    }

    #[test]
    fn round_trips_through_the_environment() {
        let settings = Settings {
            service: "cluster".into(),
            index: 3,
            url: "http://localhost:0".parse().unwrap(),
            control: "/run/peregrine.sock".into(),
            counters: Some(CounterLane { fd: 3, lane: 7 }),
            orphan_timeout: Duration::from_millis(1500),
        };
        let map = settings
            .to_env()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(Settings::from_map(&map).unwrap(), settings);
        assert_eq!(map.get(ENV_CONTRACT), Some(&CONTRACT.to_string()));
    }

    /// The variables every worker needs, and nothing optional.
    fn required() -> HashMap<String, String> {
        [
            (ENV_SERVICE, "a"),
            (ENV_INDEX, "0"),
            (ENV_URL, "http://localhost:0"),
            (ENV_CONTROL, "/c"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    #[test]
    fn the_orphan_timeout_is_in_milliseconds_and_defaults_to_a_minute() {
        let mut map = required();
        assert_eq!(
            Settings::from_map(&map).unwrap().orphan_timeout,
            DEFAULT_ORPHAN_TIMEOUT
        );
        assert_eq!(DEFAULT_ORPHAN_TIMEOUT, Duration::from_secs(60));
        map.insert(ENV_ORPHAN_TIMEOUT.into(), "250".into());
        assert_eq!(
            Settings::from_map(&map).unwrap().orphan_timeout,
            Duration::from_millis(250)
        );
        map.insert(ENV_ORPHAN_TIMEOUT.into(), "0".into());
        assert_eq!(
            Settings::from_map(&map).unwrap().orphan_timeout,
            Duration::ZERO,
            "0 means never give up"
        );
        for bad in ["", "-1", "1.5", "60s", "x"] {
            map.insert(ENV_ORPHAN_TIMEOUT.into(), bad.into());
            let err = Settings::from_map(&map).unwrap_err();
            assert!(
                matches!(&err, SettingsError::OrphanTimeout(got) if got == bad),
                "{bad:?}: {err:?}"
            );
            assert!(err.to_string().contains(ENV_ORPHAN_TIMEOUT), "{err}");
        }
    }

    #[test]
    fn counters_need_both_variables() {
        let mut map = required();
        assert_eq!(Settings::from_map(&map).unwrap().counters, None);
        map.insert(ENV_COUNTERS_FD.into(), "3".into());
        assert!(matches!(
            Settings::from_map(&map),
            Err(SettingsError::Counters(..))
        ));
        map.insert(ENV_COUNTERS_LANE.into(), "x".into());
        assert!(matches!(
            Settings::from_map(&map),
            Err(SettingsError::Counters(..))
        ));
    }

    #[test]
    fn names_the_missing_variable() {
        let err = Settings::from_map(&HashMap::new()).unwrap_err();
        assert!(err.to_string().contains("PEREGRINE_"), "{err}");
    }
}
