//! Adoption: the workers of an earlier supervisor on the same control socket, still serving after it
//! died, are taken over instead of started again.
//!
//! Workers outlive their supervisor (they are started in their own process group, with no parent-death
//! signal) and keep reconnecting to the control socket (or, for a service with a `user`, to its
//! worker socket beside it). A supervisor that starts finds them before it accepts registrations: a
//! process of its own user, or of a user a service of the config names, is a worker of an earlier
//! supervisor of this socket when its environment carries both the socket's canonical path
//! (`PEREGRINE_CONTROL_SOCKET`, or its service's worker socket) and the socket's lineage
//! (`PEREGRINE_LINEAGE`, a random value from the owner-only lock file, see [`crate::instance`]); the
//! environment also says its service, slot and request counter. The path alone is not enough: two
//! supervisors in different directories may use the same relative socket name, and any process can
//! put any text in its environment, its lineage included once it ran as a worker. So a worker is
//! taken for its slot only when it runs as the user its service names (the supervisor's own without
//! `user`): a worker of one service's user never passes for a worker of a service of another. For
//! each slot of the config it keeps one such worker (the newest, if a restart was under way), watched
//! through a pidfd; it takes a duplicate of the worker's counter descriptor with `pidfd_getfd(2)` so
//! that its requests are still counted.
//! Workers with no slot in the config, and the older of two in one slot, are stopped.
//!
//! A worker is adopted only when the version of the agreement it was started under
//! ([`ENV_CONTRACT`], absent before Peregrine 0.2.0) is one this supervisor reads ([`ADOPTED`]).
//! One of another version is stopped, with an error that says why: `check` and `peregrine upgrade`
//! find such workers first ([`foreign`]) and ask for a restart, which drains them, instead.
//!
//! Each candidate's pidfd is opened *before* its `/proc` files are read, and the process is checked to
//! be still alive after: the pid then named the same process throughout, so a process that exited and
//! whose pid was reused is never taken for a worker, nor signalled.
//!
//! Invariant: adoption never admits or signals a process of a user that neither the supervisor runs
//! as nor a service names, nor one that does not carry this socket's lineage; it admits a worker into
//! a slot only when it runs as that slot's service's user.

use std::{
    collections::{HashMap, HashSet},
    ffi::OsStr,
    fmt,
    os::{
        fd::{AsFd, OwnedFd},
        unix::ffi::OsStrExt,
        unix::fs::MetadataExt,
    },
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use peregrine_contract::{
    ErrorChain,
    counters::CounterRegion,
    procfs::Stat,
    settings::{ADOPTED, ENV_CONTROL, ENV_LINEAGE, ENV_URL, Environ},
    shm::ShmError,
    url::BindUrl,
};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags, Signal};

use crate::{
    children::{Children, CounterRef, Counters, Slot},
    config::{Config, worker_socket},
    instance::Lineage,
    manager::Adopted,
    registry::{Address, Registry},
};

/// What a worker's environment and `/proc/PID/stat` say about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Described {
    /// Its slot.
    pub slot: Slot,
    /// The version of the agreement it was started under; `None` before it had one (0.1.0), or
    /// when its value is not a number.
    pub contract: Option<u32>,
    /// Its counter descriptor number and slot, if it has a counter.
    pub counter: Option<(i32, usize)>,
    /// When it started, in clock ticks after boot (`/proc/PID/stat` field 22): the newest wins a slot.
    pub started: u64,
    /// Its parent (`/proc/PID/stat` field 4): a process whose parent is a worker too is part of
    /// that worker (a server's own children, as gunicorn's), not a worker of its own.
    pub ppid: u32,
    /// Where it listens, as its environment says (`PEREGRINE_URL`): for a worker whose listener the
    /// supervisor passed, the address it was bound to.
    pub url: Option<BindUrl>,
}

/// A worker of an earlier supervisor of this socket, held by a pidfd.
#[derive(Debug)]
pub struct Found {
    /// Its process id.
    pub pid: u32,
    /// A pidfd of it, opened before its environment was read.
    pub pidfd: OwnedFd,
    /// The user it runs as.
    pub uid: u32,
    /// What its environment says.
    pub described: Described,
}

/// Finds the workers of an earlier supervisor of `config`'s control socket (those carrying `lineage`)
/// and takes over those with a slot in `config`; stops the others.
pub fn find(config: &Config, lineage: &Lineage) -> HashMap<Slot, Adopted> {
    let users = Users::of(config);
    let found = roots(scan(&config.supervisor.control, &users.uids, lineage));
    let mut by_slot: HashMap<Slot, Found> = HashMap::new();
    let mut unwanted = Vec::new();
    let mut foreign = Vec::new();
    for worker in found {
        let slot = &worker.described.slot;
        if !users.may_be(&worker) {
            // Its lineage says ours, its user says not this service's (the config changed its
            // `user`, or a worker of another service's user is posing as one): left alone. A worker
            // of ours stops once no supervisor takes its registration.
            tracing::warn!(pid = worker.pid, uid = worker.uid, %slot, "A process carrying this socket's lineage runs as another user than its service names: not adopted");
            continue;
        }
        if !worker.described.adoptable() {
            foreign.push(worker);
            continue;
        }
        let wanted = config
            .services
            .get(&slot.service)
            .is_some_and(|s| slot.index < s.count);
        if !wanted {
            unwanted.push(worker);
            continue;
        }
        match by_slot.remove(slot) {
            Some(other) if other.described.started > worker.described.started => {
                unwanted.push(worker);
                by_slot.insert(other.described.slot.clone(), other);
            }
            Some(other) => {
                unwanted.push(other);
                by_slot.insert(worker.described.slot.clone(), worker);
            }
            None => {
                by_slot.insert(worker.described.slot.clone(), worker);
            }
        }
    }
    for worker in unwanted {
        tracing::warn!(pid = worker.pid, slot = %worker.described.slot, "A worker of an earlier supervisor of this socket has no slot here (or a newer one took it): stopping it");
        let _ = rustix::process::pidfd_send_signal(&worker.pidfd, Signal::TERM);
    }
    if !foreign.is_empty() {
        let list = Foreign(foreign.iter().map(Found::foreign).collect());
        tracing::error!("{list}: {STOPPED_AT_START}");
        for worker in foreign {
            let _ = rustix::process::pidfd_send_signal(&worker.pidfd, Signal::TERM);
        }
    }
    let mut adopted = HashMap::new();
    for (slot, worker) in by_slot {
        let counter = worker.described.counter.and_then(|(fd, index)| {
            counter_of(&worker.pidfd, fd, index)
                .inspect_err(|error| {
                    tracing::warn!(pid = worker.pid, error = %ErrorChain(error), "Cannot take the adopted worker's request counter: its requests go uncounted")
                })
                .ok()
        });
        // A server on a passed listener never registers itself: it is probed again where it
        // listens.
        let passed = config
            .services
            .get(&slot.service)
            .filter(|service| service.pass_socket)
            .and_then(|_| worker.described.url.as_ref().and_then(passed_address));
        tracing::info!(pid = worker.pid, %slot, counted = counter.is_some(), passed = ?passed, "Adopting a worker of an earlier supervisor");
        adopted.insert(
            slot,
            Adopted {
                pid: worker.pid,
                pidfd: worker.pidfd,
                uid: worker.uid,
                counter,
                passed,
            },
        );
    }
    adopted
}

/// The users whose processes may be workers of a config: this process's and each service's.
struct Users {
    /// Every one of them.
    uids: HashSet<u32>,
    /// Each service's.
    of_service: HashMap<String, u32>,
}

impl Users {
    fn of(config: &Config) -> Users {
        let own = rustix::process::geteuid().as_raw();
        let of_service: HashMap<String, u32> = config
            .services
            .values()
            .map(|service| {
                let uid = service.account.as_ref().map_or(own, |account| account.uid);
                (service.name.clone(), uid)
            })
            .collect();
        let uids = of_service.values().copied().chain([own]).collect();
        Users { uids, of_service }
    }

    /// Whether `worker` runs as the user its slot's service names (a slot of no service: any of
    /// the users).
    fn may_be(&self, worker: &Found) -> bool {
        self.of_service
            .get(&worker.described.slot.service)
            .is_none_or(|uid| *uid == worker.uid)
    }
}

/// Every live process of one of `uids` whose environment names `control` (or its service's worker
/// socket beside it) as its control socket and carries `lineage`.
pub fn scan(control: &Path, uids: &HashSet<u32>, lineage: &Lineage) -> Vec<Found> {
    scan_where(control, |uid| uids.contains(&uid), lineage)
}

/// The workers among `found`: a worker's own children carry its environment, and go with it,
/// adopted or stopped.
fn roots(found: Vec<Found>) -> impl Iterator<Item = Found> {
    let pids: HashSet<u32> = found.iter().map(|w| w.pid).collect();
    found
        .into_iter()
        .filter(move |w| !pids.contains(&w.described.ppid))
}

/// [`scan`], for the processes whose owner passes `of_user`.
fn scan_where(control: &Path, of_user: impl Fn(u32) -> bool, lineage: &Lineage) -> Vec<Found> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let own = std::process::id();
    // Processes of a service's user (not this process's) whose environment it may not read: without
    // CAP_DAC_READ_SEARCH (or CAP_DAC_OVERRIDE), another user's `environ` (mode 0400) is closed to
    // root too. Said once, after the scan: they cannot be told to be workers, so none is adopted.
    let mut denied = Vec::new();
    let own_uid = rustix::process::geteuid().as_raw();
    let found = entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            // Other users' processes are passed over without a pidfd.
            let uid = entry.metadata().ok()?.uid();
            if pid == own || !of_user(uid) {
                return None;
            }
            // The pidfd first: whatever is read below is then known to be of this very process if
            // it is still alive afterwards (its owner is looked at again: the pid may have been
            // reused since). A process may exit or deny access at any step: it is then not a
            // worker to adopt.
            let pidfd = open(pid).ok()?;
            if entry.metadata().ok()?.uid() != uid {
                return None;
            }
            let environ = match std::fs::read(entry.path().join("environ")) {
                Ok(environ) => environ,
                Err(error) => {
                    if error.kind() == std::io::ErrorKind::PermissionDenied && uid != own_uid {
                        denied.push((pid, uid));
                    }
                    return None;
                }
            };
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let described = parse(&environ, &stat, control, lineage)?;
            alive(&pidfd).then_some(Found {
                pid,
                pidfd,
                uid,
                described,
            })
        })
        .collect();
    if !denied.is_empty() {
        tracing::warn!(
            processes = ?denied,
            "Cannot read the environment of processes of a service's user (pid, uid): any worker among them is not adopted, but replaced; the supervisor needs CAP_DAC_READ_SEARCH (the package's unit grants it)"
        );
    }
    found
}

/// A worker of `control` and `lineage` from its environment (`environ`, NUL-separated) and
/// `/proc/PID/stat`.
fn parse(environ: &[u8], stat: &str, control: &Path, lineage: &Lineage) -> Option<Described> {
    let env = Environ::parse(environ);
    if !lineage.matches(env.bytes(ENV_LINEAGE)?) {
        return None;
    }
    let (service, index) = env.slot()?;
    let named = Path::new(OsStr::from_bytes(env.bytes(ENV_CONTROL)?));
    if named != control && named != worker_socket(control, service) {
        return None;
    }
    let counter = match env.counter() {
        None => None,
        Some(lane) => Some(lane.map(|(fd, lane)| (fd, lane as usize))?),
    };
    let stat = Stat::parse(stat)?;
    Some(Described {
        slot: Slot {
            service: service.to_owned(),
            index,
        },
        contract: env.contract(),
        counter,
        started: stat.starttime,
        ppid: stat.ppid,
        url: env.text(ENV_URL).and_then(|url| url.parse().ok()),
    })
}

impl Described {
    /// Whether this supervisor reads the worker as the one that started it did.
    pub fn adoptable(&self) -> bool {
        self.contract
            .is_some_and(|contract| ADOPTED.contains(&contract))
    }
}

impl Found {
    fn foreign(&self) -> ForeignWorker {
        ForeignWorker {
            pid: self.pid,
            slot: self.described.slot.clone(),
            contract: self.described.contract,
        }
    }
}

/// A worker of an earlier supervisor of this socket that this one would not adopt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForeignWorker {
    /// Its process id.
    pub pid: u32,
    /// Its slot.
    pub slot: Slot,
    /// The version of the agreement it was started under (`None`: before it had one).
    pub contract: Option<u32>,
}

/// What to do about [`Foreign`] workers while their supervisor runs.
pub const RESTART_INSTEAD: &str = "drain them with a restart instead of upgrading in place \
     (`systemctl restart peregrine` drains every worker, then starts them under this version)";

/// What a start does with [`Foreign`] workers whose supervisor is gone.
pub const STOPPED_AT_START: &str = "a start stops them without a drain (requests they hold may \
     be cut), and starts this version's in their place";

/// Workers of an earlier supervisor of this socket that this one would not adopt; its `Display`
/// says so.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Foreign(pub Vec<ForeignWorker>);

impl Foreign {
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Those of them started under a version older than any this supervisor adopts, or under none:
    /// what a newer program, whose adoption starts no lower, would not adopt either.
    pub fn older(&self) -> Foreign {
        Foreign(
            self.0
                .iter()
                .filter(|w| w.contract.is_none_or(|c| c < *ADOPTED.start()))
                .cloned()
                .collect(),
        )
    }
}

impl fmt::Display for Foreign {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut versions: Vec<Option<u32>> = self.0.iter().map(|w| w.contract).collect();
        versions.sort_unstable();
        versions.dedup();
        let versions = versions
            .iter()
            .map(|v| match v {
                None => "none (started by Peregrine 0.1.0)".to_owned(),
                Some(v) => v.to_string(),
            })
            .collect::<Vec<_>>()
            .join(", ");
        let workers = self
            .0
            .iter()
            .map(|w| format!("{} ({})", w.pid, w.slot))
            .collect::<Vec<_>>()
            .join(", ");
        let (start, end) = (ADOPTED.start(), ADOPTED.end());
        let adopted = if start == end {
            format!("{start}")
        } else {
            format!("{start} to {end}")
        };
        write!(
            f,
            "workers {workers} of this control socket run under version {versions} of the \
             agreement between supervisor and workers, which this version of Peregrine cannot \
             adopt (it adopts {adopted})"
        )
    }
}

/// The workers of an earlier supervisor of `config`'s control socket that this supervisor would
/// not adopt for their agreement's version, found as a start would find them (the same users, the
/// same lineage). Empty when the socket's lock file (the lineage) cannot be read: this user is
/// then not the one to adopt them either. Only the users whose environment this process may read
/// are looked at.
pub fn foreign(config: &Config) -> Foreign {
    let control = &config.supervisor.control;
    let Some(lineage) = crate::instance::peek_lineage(control) else {
        return Foreign::default();
    };
    let users = Users::of(config);
    let everyone = crate::config::can_read_other_users_files();
    let own = rustix::process::geteuid().as_raw();
    Foreign(
        roots(scan_where(
            control,
            |uid| users.uids.contains(&uid) && (everyone || uid == own),
            &lineage,
        ))
        .filter(|worker| users.may_be(worker) && !worker.described.adoptable())
        .map(|worker| worker.foreign())
        .collect(),
    )
}

/// Of the workers a running supervisor reports (`slot` and `pid` each), those started under a
/// version of the agreement this one does not adopt, from their environment; a worker whose
/// environment this user may not read is passed over.
pub fn foreign_among(workers: impl IntoIterator<Item = (Slot, u32)>) -> Foreign {
    Foreign(
        workers
            .into_iter()
            .filter_map(|(slot, pid)| {
                let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
                let contract = Environ::parse(&environ).contract();
                let adoptable = contract.is_some_and(|contract| ADOPTED.contains(&contract));
                (!adoptable).then_some(ForeignWorker {
                    pid,
                    slot,
                    contract,
                })
            })
            .collect(),
    )
}

/// The address of a listener the supervisor bound: an IP and a port, or a Unix path.
fn passed_address(url: &BindUrl) -> Option<Address> {
    match url {
        BindUrl::Tcp { host, port } if *port != 0 => Some(Address::Tcp(
            (host.parse::<std::net::IpAddr>().ok()?, *port).into(),
        )),
        BindUrl::Tcp { .. } => None,
        BindUrl::Unix { path } => Some(Address::Unix(path.clone())),
    }
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

/// Whether the process behind `pidfd` has not exited (a pidfd turns readable when it does).
fn alive(pidfd: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    matches!(
        rustix::event::poll(&mut fds, Some(&rustix::time::Timespec::default())),
        Ok(0)
    )
}

/// Maps counter `index` of the region behind the worker's descriptor `fd`, once it is known to be a
/// region that holds that line and that can never shrink ([`CounterRegion::map_fixed`] checks): the
/// descriptor is named by another process's environment, and an access past a region's end ends in
/// SIGBUS, not in an error. A region this supervisor's kind made is sealed; a worker that swapped in
/// a memfd of its own could truncate it after the check, so an unsealed one is refused.
fn counter_of(pidfd: &OwnedFd, fd: i32, index: usize) -> Result<CounterRef, ShmError> {
    let duplicate = rustix::process::pidfd_getfd(pidfd, fd, PidfdGetfdFlags::empty())
        .map_err(std::io::Error::from)?;
    let region = CounterRegion::map_fixed(duplicate.as_fd(), index + 1)?;
    Ok(CounterRef::new(
        Arc::new(Counters::new(duplicate, region)),
        index,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_contract::settings::{
        CONTRACT, ENV_CONTRACT, ENV_COUNTERS_FD, ENV_COUNTERS_LANE, ENV_INDEX, ENV_SERVICE,
    };

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
    fn reads_a_worker_of_this_control_socket_and_lineage_from_its_environment() {
        let lineage = Lineage::random().unwrap();
        let env = environ(&[
            ("PATH", "/bin"),
            (ENV_CONTROL, "/run/peregrine.sock"),
            (ENV_LINEAGE, lineage.as_str()),
            (ENV_SERVICE, "web"),
            (ENV_INDEX, "3"),
            (ENV_COUNTERS_FD, "5"),
            (ENV_COUNTERS_LANE, "17"),
        ]);
        let control = Path::new("/run/peregrine.sock");
        assert_eq!(
            parse(&env, STAT, control, &lineage),
            Some(Described {
                slot: Slot {
                    service: "web".into(),
                    index: 3
                },
                contract: None,
                counter: Some((5, 17)),
                started: 987654,
                ppid: 1,
                url: None,
            })
        );
        assert_eq!(
            parse(&env, STAT, Path::new("/run/other.sock"), &lineage),
            None,
            "another supervisor's worker"
        );
        let other = Lineage::random().unwrap();
        assert_eq!(
            parse(&env, STAT, control, &other),
            None,
            "the same socket path, but another lineage: another directory's supervisor, or a \
             process that only names the socket"
        );
        let no_lineage = environ(&[
            (ENV_CONTROL, "/run/peregrine.sock"),
            (ENV_SERVICE, "web"),
            (ENV_INDEX, "3"),
        ]);
        assert_eq!(parse(&no_lineage, STAT, control, &lineage), None);
        let no_index = environ(&[
            (ENV_CONTROL, "/run/peregrine.sock"),
            (ENV_LINEAGE, lineage.as_str()),
            (ENV_SERVICE, "web"),
        ]);
        assert_eq!(parse(&no_index, STAT, control, &lineage), None);
    }

    #[test]
    fn only_workers_of_an_adopted_version_of_the_agreement_are_adoptable() {
        let lineage = Lineage::random().unwrap();
        let control = Path::new("/run/peregrine.sock");
        let described = |contract: Option<&str>| {
            let mut vars = vec![
                (ENV_CONTROL, "/run/peregrine.sock"),
                (ENV_LINEAGE, lineage.as_str()),
                (ENV_SERVICE, "web"),
                (ENV_INDEX, "0"),
            ];
            vars.extend(contract.map(|c| (ENV_CONTRACT, c)));
            parse(&environ(&vars), STAT, control, &lineage).unwrap()
        };
        let current = described(Some(&CONTRACT.to_string()));
        assert_eq!(current.contract, Some(CONTRACT));
        assert!(current.adoptable());
        for (contract, why) in [
            (None, "before the agreement had a version"),
            (Some("0"), "a version before any adopted"),
            (Some("x"), "not a version"),
        ] {
            assert!(!described(contract).adoptable(), "{why}");
        }
        let newer = (CONTRACT + 1).to_string();
        assert!(
            !described(Some(&newer)).adoptable(),
            "a newer version (a downgrade)"
        );

        // The words for them, and which a newer program would refuse too.
        let worker = |pid, contract| ForeignWorker {
            pid,
            slot: Slot {
                service: "web".into(),
                index: 0,
            },
            contract,
        };
        let foreign = Foreign(vec![worker(7, None), worker(8, Some(CONTRACT + 1))]);
        let said = foreign.to_string();
        assert!(
            said.starts_with("workers 7 (web[0]), 8 (web[0]) of this control socket run under version none (started by Peregrine 0.1.0), "),
            "{said}"
        );
        assert!(said.ends_with("cannot adopt (it adopts 1)"), "{said}");
        assert_eq!(foreign.older(), Foreign(vec![worker(7, None)]));
    }

    /// Starts `sleep 30` with `vars`, and scans until it is found (its environment is in place only
    /// once its exec has happened) or 2 s have passed.
    fn scan_for(
        vars: &[(&str, &std::ffi::OsStr)],
        control: &Path,
        lineage: &Lineage,
    ) -> (std::process::Child, Vec<Found>) {
        let mut command = std::process::Command::new("sleep");
        command.arg("30");
        for (k, v) in vars {
            command.env(k, v);
        }
        let child = command.spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        let found = loop {
            let uids = HashSet::from([rustix::process::geteuid().as_raw()]);
            let found: Vec<Found> = scan(control, &uids, lineage)
                .into_iter()
                .filter(|f| f.pid == child.id())
                .collect();
            if !found.is_empty() || Instant::now() > deadline {
                break found;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        (child, found)
    }

    #[test]
    fn finds_a_child_started_as_a_worker_and_only_with_its_lineage() {
        let dir = tempfile::tempdir().unwrap();
        let control = dir.path().join("control.sock");
        let lineage = Lineage::random().unwrap();
        let vars = [
            (ENV_CONTROL, control.as_os_str()),
            (ENV_LINEAGE, OsStr::new(lineage.as_str())),
            (ENV_SERVICE, OsStr::new("web")),
            (ENV_INDEX, OsStr::new("1")),
        ];
        let (mut child, found) = scan_for(&vars, &control, &lineage);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].described.counter, None);
        // The same socket path without the lineage is not ours (checked with a lineage the process
        // does not carry; the scan is bounded by the same deadline).
        let (mut child, found) = scan_for(&vars, &control, &Lineage::random().unwrap());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn a_descriptor_too_small_for_the_counter_line_or_that_could_shrink_is_refused_not_mapped() {
        let (fd, _region) = CounterRegion::create(2).unwrap();
        let me = rustix::process::pidfd_open(
            rustix::process::getpid(),
            rustix::process::PidfdFlags::empty(),
        )
        .unwrap();
        use std::os::fd::AsRawFd;
        assert!(counter_of(&me, fd.as_raw_fd(), 1).is_ok());
        assert!(matches!(
            counter_of(&me, fd.as_raw_fd(), 2),
            Err(ShmError::TooSmall { .. })
        ));
        // A file its holder can shrink after the check is refused whatever its size: a plain file,
        // or a memfd the worker made without sealing it.
        let file = tempfile::tempfile().unwrap();
        file.set_len(4096).unwrap();
        assert!(matches!(
            counter_of(&me, file.as_raw_fd(), 0),
            Err(ShmError::Resizable)
        ));
        let unsealed =
            rustix::fs::memfd_create("counter", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&unsealed, 4096).unwrap();
        assert!(matches!(
            counter_of(&me, unsealed.as_raw_fd(), 0),
            Err(ShmError::Resizable)
        ));
    }
}
