//! Adoption: the workers of an earlier supervisor on the same control socket, still serving after it
//! died, are taken over instead of started again.
//!
//! Workers outlive their supervisor (they are started in their own process group, with no parent-death
//! signal) and keep reconnecting to the control socket. A supervisor that starts finds them before it
//! accepts registrations: every process of its own user whose environment names its control socket
//! (`PEREGRINE_CONTROL_SOCKET`) is a worker of an earlier supervisor, and the environment also says its
//! service, slot and request counter. For each slot of the config it keeps one such worker (the newest,
//! if a restart was under way), watched through a pidfd; it takes a duplicate of the worker's counter
//! descriptor with `pidfd_getfd(2)` so that its requests are still counted. Workers with no slot in the
//! config, and the older of two in one slot, are stopped.
//!
//! Invariant: adoption never admits a process another user runs, nor one that was not started as a
//! worker of this control socket.

use std::{
    collections::HashMap,
    ffi::OsStr,
    os::{fd::OwnedFd, unix::ffi::OsStrExt, unix::fs::MetadataExt},
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use peregrine_worker::{
    counter::CounterRegion,
    settings::{ENV_CONTROL, ENV_COUNTERS_FD, ENV_COUNTERS_SLOT, ENV_INDEX, ENV_SERVICE},
};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags, Signal};

use crate::{
    config::Config,
    manager::{Adopted, Children, CounterRef, Slot},
    registry::Registry,
    sampler::Counters,
};

/// A worker of an earlier supervisor, as its environment describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// Its process id.
    pub pid: u32,
    /// Its slot.
    pub slot: Slot,
    /// Its counter descriptor number and slot, if it has a counter.
    pub counter: Option<(i32, usize)>,
    /// When it started, in clock ticks after boot (`/proc/PID/stat` field 22): the newest wins a slot.
    pub started: u64,
}

/// Finds the workers of an earlier supervisor on `config`'s control socket and takes over those with a
/// slot in `config`; stops the others.
pub fn find(config: &Config) -> HashMap<Slot, Adopted> {
    let found = scan(&config.supervisor.control);
    let mut by_slot: HashMap<Slot, Found> = HashMap::new();
    let mut unwanted = Vec::new();
    for worker in found {
        let wanted = config
            .services
            .get(&worker.slot.service)
            .is_some_and(|s| worker.slot.index < s.count);
        if !wanted {
            unwanted.push(worker);
            continue;
        }
        match by_slot.remove(&worker.slot) {
            Some(other) if other.started > worker.started => {
                unwanted.push(worker);
                by_slot.insert(other.slot.clone(), other);
            }
            Some(other) => {
                unwanted.push(other);
                by_slot.insert(worker.slot.clone(), worker);
            }
            None => {
                by_slot.insert(worker.slot.clone(), worker);
            }
        }
    }
    for worker in unwanted {
        tracing::warn!(pid = worker.pid, slot = %worker.slot, "A worker of an earlier supervisor has no slot here (or a newer one took it): stopping it");
        if let Ok(pidfd) = open(worker.pid) {
            let _ = rustix::process::pidfd_send_signal(&pidfd, Signal::TERM);
        }
    }
    let mut adopted = HashMap::new();
    for (slot, worker) in by_slot {
        let pidfd = match open(worker.pid) {
            Ok(pidfd) => pidfd,
            Err(error) => {
                tracing::debug!(pid = worker.pid, %error, "The worker exited before it could be adopted");
                continue;
            }
        };
        let counter = worker.counter.and_then(|(fd, index)| {
            counter_of(&pidfd, fd, index)
                .inspect_err(|error| {
                    tracing::warn!(pid = worker.pid, %error, "Cannot take the adopted worker's request counter: its requests go uncounted")
                })
                .ok()
        });
        tracing::info!(pid = worker.pid, %slot, counted = counter.is_some(), "Adopting a worker of an earlier supervisor");
        adopted.insert(
            slot,
            Adopted {
                pid: worker.pid,
                pidfd,
                counter,
            },
        );
    }
    adopted
}

/// Every process of this user whose environment names `control` as its control socket.
pub fn scan(control: &Path) -> Vec<Found> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let uid = rustix::process::geteuid().as_raw();
    let own = std::process::id();
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            if pid == own || entry.metadata().ok()?.uid() != uid {
                return None;
            }
            // A process may exit or deny access at any step: it is then not a worker to adopt.
            let environ = std::fs::read(entry.path().join("environ")).ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            parse(pid, &environ, &stat, control)
        })
        .collect()
}

/// A worker of `control` from its environment (`environ`, NUL-separated) and `/proc/PID/stat`.
fn parse(pid: u32, environ: &[u8], stat: &str, control: &Path) -> Option<Found> {
    let vars: HashMap<&[u8], &[u8]> = environ
        .split(|b| *b == 0)
        .filter_map(|pair| {
            let eq = pair.iter().position(|b| *b == b'=')?;
            Some((&pair[..eq], &pair[eq + 1..]))
        })
        .collect();
    let get = |name: &str| vars.get(name.as_bytes()).copied();
    if Path::new(OsStr::from_bytes(get(ENV_CONTROL)?)) != control {
        return None;
    }
    let text = |name: &str| std::str::from_utf8(get(name)?).ok();
    let service = text(ENV_SERVICE)?.to_owned();
    let index = text(ENV_INDEX)?.parse().ok()?;
    let counter = match (text(ENV_COUNTERS_FD), text(ENV_COUNTERS_SLOT)) {
        (Some(fd), Some(slot)) => Some((fd.parse().ok()?, slot.parse().ok()?)),
        _ => None,
    };
    // The command name (field 2) is in parentheses and may hold spaces: count fields after it.
    let after_name = &stat[stat.rfind(')')? + 1..];
    let started = after_name.split_whitespace().nth(19)?.parse().ok()?;
    Some(Found {
        pid,
        slot: Slot { service, index },
        counter,
        started,
    })
}

/// Waits until every worker of `pids` still alive has registered (at most `timeout`); returns how long
/// it took. A worker that exits meanwhile is not waited for.
pub async fn await_registrations(
    registry: &Registry,
    children: &Children,
    pids: &[u32],
    timeout: Duration,
) -> Duration {
    let begun = Instant::now();
    let mut snapshots = registry.subscribe();
    loop {
        let missing: Vec<u32> = {
            let snapshot = snapshots.borrow_and_update();
            let registered: std::collections::HashSet<u32> = snapshot
                .services
                .values()
                .flat_map(|view| view.workers.keys().map(|key| key.pid))
                .collect();
            pids.iter()
                .copied()
                .filter(|pid| !registered.contains(pid) && children.slot_of(*pid).is_some())
                .collect()
        };
        if missing.is_empty() {
            tracing::info!(workers = pids.len(), took = ?begun.elapsed(), "Adopted workers registered again");
            return begun.elapsed();
        }
        let left = timeout.saturating_sub(begun.elapsed());
        if left.is_zero() {
            tracing::warn!(
                ?missing,
                ?timeout,
                "Adopted workers did not register again in time; serving xDS without them"
            );
            return begun.elapsed();
        }
        // A worker that exits changes no snapshot: look again at least every 100 ms.
        let _ =
            tokio::time::timeout(left.min(Duration::from_millis(100)), snapshots.changed()).await;
    }
}

fn open(pid: u32) -> std::io::Result<OwnedFd> {
    let pid = Pid::from_raw(pid as i32).ok_or_else(|| std::io::Error::other("pid 0"))?;
    Ok(rustix::process::pidfd_open(pid, PidfdFlags::empty())?)
}

/// Maps counter `index` of the region behind the worker's descriptor `fd`.
fn counter_of(pidfd: &OwnedFd, fd: i32, index: usize) -> std::io::Result<CounterRef> {
    let duplicate = rustix::process::pidfd_getfd(pidfd, fd, PidfdGetfdFlags::empty())?;
    let region = CounterRegion::map(std::os::fd::AsFd::as_fd(&duplicate), index + 1)?;
    Ok(CounterRef::new(
        Arc::new(Counters::new(duplicate, region)),
        index,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str =
        "4242 (peregrine worker) S 1 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 987654 1 2 3";

    fn environ(vars: &[(&str, &str)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, v) in vars {
            out.extend_from_slice(format!("{k}={v}").as_bytes());
            out.push(0);
        }
        out
    }

    #[test]
    fn reads_a_worker_of_this_control_socket_from_its_environment() {
        let env = environ(&[
            ("PATH", "/bin"),
            (ENV_CONTROL, "/run/peregrine.sock"),
            (ENV_SERVICE, "web"),
            (ENV_INDEX, "3"),
            (ENV_COUNTERS_FD, "5"),
            (ENV_COUNTERS_SLOT, "17"),
        ]);
        let found = parse(4242, &env, STAT, Path::new("/run/peregrine.sock")).unwrap();
        assert_eq!(
            found,
            Found {
                pid: 4242,
                slot: Slot {
                    service: "web".into(),
                    index: 3
                },
                counter: Some((5, 17)),
                started: 987654,
            }
        );
        assert_eq!(
            parse(4242, &env, STAT, Path::new("/run/other.sock")),
            None,
            "another supervisor's worker"
        );
        let no_index = environ(&[(ENV_CONTROL, "/run/peregrine.sock"), (ENV_SERVICE, "web")]);
        assert_eq!(
            parse(1, &no_index, STAT, Path::new("/run/peregrine.sock")),
            None
        );
    }

    #[test]
    fn finds_a_child_started_as_a_worker() {
        let dir = tempfile::tempdir().unwrap();
        let control = dir.path().join("control.sock");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env(ENV_CONTROL, &control)
            .env(ENV_SERVICE, "web")
            .env(ENV_INDEX, "1")
            .spawn()
            .unwrap();
        // `spawn` returns once the exec has begun, before the new environment is in place: look
        // again until it is (bounded).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let found = loop {
            let found = scan(&control);
            if !found.is_empty() || std::time::Instant::now() > deadline {
                break found;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].pid, child.id());
        assert_eq!(found[0].counter, None);
    }
}
