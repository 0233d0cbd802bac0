//! The client side of `peregrine upgrade`: asks for the upgrade, then waits, within a deadline,
//! until the supervisor answers from its new image with its workers registered again.
//!
//! The new image is told from the old by `Status.supervisor.started_unix_ms`; the pid must stay the
//! same (another pid is a supervisor started again, not upgraded). [`judge`] is the pure part.

use std::{
    collections::BTreeSet,
    fmt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use peregrine_proto::v1;

use crate::status::{self, StatusError};

/// How often the client asks for the status while it waits.
const POLL: Duration = Duration::from_millis(100);
/// How long each status request may take while the client waits (the new image may be starting).
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// Why `peregrine upgrade` did not see an upgrade through.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// The supervisor could not be asked.
    #[error(transparent)]
    Ask(#[from] StatusError),
    /// The supervisor is of a version that does not say which image it runs.
    #[error(
        "the supervisor on {path} does not report its image: it predates `peregrine upgrade`; \
         restart it instead (`systemctl restart peregrine` drains and replaces its workers)"
    )]
    Unsupported {
        /// The control socket.
        path: PathBuf,
    },
    /// Its workers run under a version of the agreement between supervisor and workers older than
    /// any this program adopts: an upgrade in place would replace them without a drain.
    #[error(
        "cannot upgrade in place: {foreign}: {}",
        crate::adopt::RESTART_INSTEAD
    )]
    Foreign {
        /// Those workers.
        foreign: crate::adopt::Foreign,
    },
    /// The supervisor refused the upgrade; it runs on as it was.
    #[error("{summary}{}", failures.iter().map(|f| format!("\n  {f}")).collect::<String>())]
    Refused {
        /// Its summary.
        summary: String,
        /// Each failure.
        failures: Vec<String>,
    },
    /// The supervisor began the upgrade, and it did not end as it should.
    #[error("{0}")]
    Failed(String),
    /// The deadline passed.
    #[error(
        "the upgrade did not complete within {} s: {last}; see the supervisor's log \
         (journalctl -u peregrine)",
        .timeout.as_secs()
    )]
    Timeout {
        /// The deadline.
        timeout: Duration,
        /// What was still awaited.
        last: String,
    },
}

impl UpgradeError {
    /// Whether no supervisor answers, or the one that does cannot upgrade in place: restarting it
    /// is then the way to a new binary. Not so when it refused the new program, or began and did
    /// not finish: a restart would not do better.
    pub fn cannot_upgrade_in_place(&self) -> bool {
        matches!(
            self,
            UpgradeError::Unsupported { .. }
                | UpgradeError::Foreign { .. }
                | UpgradeError::Ask(StatusError::NotRunning { .. })
        )
    }
}

/// What an upgrade did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The supervisor's pid, the same before and after.
    pub pid: u32,
    /// The version before.
    pub old_version: String,
    /// The version after.
    pub new_version: String,
    /// Worker pids that serve on under the new image.
    pub kept: BTreeSet<u32>,
    /// Worker pids that are new (a worker replaced meanwhile).
    pub new: BTreeSet<u32>,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |pids: &BTreeSet<u32>| {
            pids.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        };
        write!(
            f,
            "upgraded in place: pid {}, {} -> {}; {} workers kept",
            self.pid,
            self.old_version,
            self.new_version,
            self.kept.len()
        )?;
        if !self.kept.is_empty() {
            write!(f, " ({})", list(&self.kept))?;
        }
        if !self.new.is_empty() {
            write!(f, ", {} new ({})", self.new.len(), list(&self.new))?;
        }
        Ok(())
    }
}

/// Where an upgrade stands, judged from the status before it and a status now.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    /// Not done yet: what is awaited.
    Waiting(String),
    /// Done.
    Done(Outcome),
    /// It went wrong and will not come right.
    Failed(String),
}

/// Whether `now` is the upgraded supervisor of `before`, its workers registered.
pub fn judge(before: &v1::Supervisor, before_pids: &BTreeSet<u32>, now: &v1::Status) -> Progress {
    let Some(supervisor) = &now.supervisor else {
        return Progress::Failed("the supervisor no longer reports its image".into());
    };
    if supervisor.pid != before.pid {
        return Progress::Failed(format!(
            "the supervisor now runs as pid {}, not {}: it was started again, not upgraded in \
             place (its workers were adopted or replaced); see its log",
            supervisor.pid, before.pid
        ));
    }
    if supervisor.started_unix_ms == before.started_unix_ms {
        return Progress::Waiting("the old image still answers".into());
    }
    let missing: Vec<String> = local_rows(now)
        .filter(|w| w.pid.is_none())
        .map(|w| format!("{}[{}]", w.service, w.index))
        .collect();
    if !missing.is_empty() {
        return Progress::Waiting(format!(
            "workers not registered again: {}",
            missing.join(", ")
        ));
    }
    let pids = local_pids(now);
    // A worker may exit and be replaced during an upgrade, but a new image that kept none of them
    // could not adopt them: the upgrade ran the new program and lost what they held.
    if !before_pids.is_empty() && pids.is_disjoint(before_pids) {
        return Progress::Failed(format!(
            "the new image ({}) runs, but adopted none of the {} workers: it replaced them, and \
             requests they held may have been lost; see its log (journalctl -u peregrine)",
            supervisor.version,
            before_pids.len()
        ));
    }
    Progress::Done(Outcome {
        pid: supervisor.pid,
        old_version: before.version.clone(),
        new_version: supervisor.version.clone(),
        kept: pids.intersection(before_pids).copied().collect(),
        new: pids.difference(before_pids).copied().collect(),
    })
}

/// The rows of this host's own workers: on a single host every row, in a fleet those of its host.
fn local_rows(status: &v1::Status) -> impl Iterator<Item = &v1::WorkerStatus> {
    let own = status
        .fleet
        .as_ref()
        .map_or("", |fleet| fleet.host.as_str());
    status.workers.iter().filter(move |w| w.host == own)
}

/// The pids of this host's registered workers.
fn local_pids(status: &v1::Status) -> BTreeSet<u32> {
    local_rows(status).filter_map(|w| w.pid).collect()
}

/// Asks the supervisor on `socket` to upgrade in place and waits at most `timeout` for it.
pub fn upgrade(socket: &Path, timeout: Duration) -> Result<Outcome, UpgradeError> {
    let begun = Instant::now();
    let before = status::query(socket)?;
    // The supervisor's workers older than any version this program adopts, which no newer program
    // adopts either: asked here, where the program is (as a package's upgrade runs it) the one the
    // supervisor would exec. Workers of a newer version are the new program's own check to refuse.
    let foreign = crate::adopt::foreign_among(local_rows(&before).filter_map(|row| {
        let slot = crate::children::Slot {
            service: row.service.clone(),
            index: row.index,
        };
        Some((slot, row.pid?))
    }))
    .older();
    if !foreign.is_empty() {
        return Err(UpgradeError::Foreign { foreign });
    }
    let Some(image) = before.supervisor.clone() else {
        return Err(UpgradeError::Unsupported {
            path: socket.to_owned(),
        });
    };
    let before_pids = local_pids(&before);
    let request = v1::ControlRequest {
        action: Some(v1::control_request::Action::Upgrade(v1::Upgrade {})),
    };
    let reply = status::control(socket, request)?;
    if !reply.ok {
        return Err(UpgradeError::Refused {
            summary: reply.summary,
            failures: reply.failures,
        });
    }
    tracing::debug!(summary = %reply.summary, "Upgrade begun");
    loop {
        let last = match status::client::query_within(socket, ASK_TIMEOUT) {
            Ok(now) => match judge(&image, &before_pids, &now) {
                Progress::Done(outcome) => return Ok(outcome),
                Progress::Failed(why) => return Err(UpgradeError::Failed(why)),
                Progress::Waiting(what) => what,
            },
            Err(error) => crate::sampler::ErrorChain(&error).to_string(),
        };
        if begun.elapsed() >= timeout {
            return Err(UpgradeError::Timeout { timeout, last });
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(pid: u32, started: u64, version: &str) -> v1::Supervisor {
        v1::Supervisor {
            pid,
            version: version.into(),
            started_unix_ms: started,
        }
    }

    fn row(index: u32, pid: Option<u32>) -> v1::WorkerStatus {
        v1::WorkerStatus {
            service: "web".into(),
            index,
            pid,
            ..Default::default()
        }
    }

    fn status(supervisor: v1::Supervisor, workers: Vec<v1::WorkerStatus>) -> v1::Status {
        v1::Status {
            supervisor: Some(supervisor),
            workers,
            ..Default::default()
        }
    }

    #[test]
    fn done_once_a_new_image_of_the_same_pid_has_every_worker_registered() {
        let before = image(100, 1_000, "0.1.0 (aaa)");
        let pids = BTreeSet::from([11, 12]);
        let old = status(before.clone(), vec![row(0, Some(11)), row(1, Some(12))]);
        assert_eq!(
            judge(&before, &pids, &old),
            Progress::Waiting("the old image still answers".into())
        );
        let starting = status(
            image(100, 2_000, "0.2.0 (bbb)"),
            vec![row(0, Some(11)), row(1, None)],
        );
        assert_eq!(
            judge(&before, &pids, &starting),
            Progress::Waiting("workers not registered again: web[1]".into())
        );
        let done = status(
            image(100, 2_000, "0.2.0 (bbb)"),
            vec![row(0, Some(11)), row(1, Some(13))],
        );
        let Progress::Done(outcome) = judge(&before, &pids, &done) else {
            panic!("not done");
        };
        assert_eq!(
            outcome.to_string(),
            "upgraded in place: pid 100, 0.1.0 (aaa) -> 0.2.0 (bbb); 1 workers kept (11), 1 new (13)"
        );
    }

    #[test]
    fn in_a_fleet_only_this_hosts_workers_count() {
        let before = image(100, 1_000, "0.1.0");
        let mine = |index, pid| v1::WorkerStatus {
            host: "a".into(),
            ..row(index, pid)
        };
        let theirs = v1::WorkerStatus {
            host: "b".into(),
            ..row(0, Some(77))
        };
        let mut now = status(
            image(100, 2_000, "0.1.0"),
            vec![mine(0, None), theirs.clone()],
        );
        now.fleet = Some(v1::Fleet {
            host: "a".into(),
            ..Default::default()
        });
        assert_eq!(
            judge(&before, &BTreeSet::from([11]), &now),
            Progress::Waiting("workers not registered again: web[0]".into())
        );
        now.workers = vec![mine(0, Some(11)), theirs];
        let Progress::Done(outcome) = judge(&before, &BTreeSet::from([11]), &now) else {
            panic!("not done");
        };
        assert_eq!(outcome.kept, BTreeSet::from([11]));
        assert!(outcome.new.is_empty(), "{outcome:?}");
    }

    #[test]
    fn a_new_image_that_kept_no_worker_failed() {
        let before = image(100, 1_000, "0.1.0");
        let now = status(
            image(100, 2_000, "0.1.0"),
            vec![row(0, Some(21)), row(1, Some(22))],
        );
        assert!(matches!(
            judge(&before, &BTreeSet::from([11, 12]), &now),
            Progress::Failed(why) if why.contains("adopted none of the 2 workers")
        ));
        // No worker before: nothing to keep.
        assert!(matches!(
            judge(&before, &BTreeSet::new(), &now),
            Progress::Done(_)
        ));
    }

    #[test]
    fn another_pid_is_a_failure_not_an_upgrade() {
        let before = image(100, 1_000, "0.1.0");
        let now = status(image(200, 2_000, "0.1.0"), vec![row(0, Some(11))]);
        assert!(matches!(
            judge(&before, &BTreeSet::new(), &now),
            Progress::Failed(why) if why.contains("pid 200, not 100")
        ));
    }
}
