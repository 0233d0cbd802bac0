//! What a slot's worker is started with, and the spawn itself.
//!
//! Invariant: a worker inherits one descriptor besides its standard streams and a passed listener:
//! its own request counter, a one-line region no other worker can reach, created for it (so it
//! counts exactly its own requests). A passed-socket server inherits none; the kernel counts its
//! responses in its lane of the shared region, zeroed before it starts. Every worker starts without
//! the supervisor's privileges ([`Privileges`]).

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Command, Stdio},
    sync::{Arc, atomic::Ordering},
};

use peregrine_contract::{
    report_slot::create_worker_region,
    settings::{CounterLane, ENV_LINEAGE, Settings},
    url::BindUrl,
};
use rustix::io::FdFlags;

use super::locked_memory::Limit;
pub(super) use super::passed::PassedListener;
use super::privileges::{Identity, Privileges};
use crate::{
    children::{CounterRef, Counters},
    config::{
        FD_PLACEHOLDER, INDEX_PLACEHOLDER, PASSED_FD, Program, ServiceConfig, StopSignal,
        SupervisorConfig,
    },
    instance::Lineage,
};

/// The hidden subcommand that starts a passed-socket server: `peregrine exec-passed -- PROGRAM
/// ARGS...` sets `LISTEN_PID` to its own pid (when `LISTEN_FDS` is set) and execs `PROGRAM`, which
/// keeps it.
pub const EXEC_PASSED: &str = "exec-passed";

/// What [`EXEC_PASSED`] does, in the process it starts: sets `LISTEN_PID` to this process's pid
/// when `LISTEN_FDS` is set (a command that names the descriptor itself gets neither), and execs
/// `program` with `args` in its place. Returns only if the exec failed, with why.
pub fn exec_passed(program: &std::path::Path, args: &[std::ffi::OsString]) -> io::Error {
    let mut command = Command::new(program);
    command.args(args);
    if std::env::var_os("LISTEN_FDS").is_some() {
        command.env("LISTEN_PID", std::process::id().to_string());
    }
    command.exec()
}

/// What a slot task needs to start its worker.
#[derive(Clone, Debug)]
pub(super) struct Launch {
    pub(super) program: PathBuf,
    args: Vec<String>,
    /// The service's own environment.
    env: Vec<(String, String)>,
    /// The worker's settings; the counter lane is filled in at each start.
    pub(super) settings: Settings,
    /// The request counter region, inherited by the worker.
    counters: Arc<Counters>,
    /// Whether the supervisor binds the worker's listener and passes it (`pass_socket`).
    pub(super) pass_socket: bool,
    /// How many requests a worker serves at once (`concurrency`; `None`: many).
    pub(super) concurrency: Option<u32>,
    /// Whether the command names the passed descriptor itself (`{fd}` in an argument): then the
    /// server is not told of it through systemd's variables as well (gunicorn would open it twice).
    names_fd: bool,
    /// What a passed-socket worker must answer before it is registered.
    pub(super) ready_path: String,
    /// What asks the worker to finish its requests and exit.
    pub(super) stop_signal: StopSignal,
    /// The listener every worker of the service shares (`listener = "shared"`), which the
    /// supervisor keeps: each worker is passed a duplicate.
    pub(super) shared: Option<Arc<PassedListener>>,
    /// What the worker gives up before it runs: the supervisor's user, for the service's, and every
    /// capability.
    privileges: Privileges,
    /// The `RLIMIT_MEMLOCK` a worker with an io_uring ring gets, if not the inherited one
    /// ([`locked_memory`](super::locked_memory)).
    locked_memory: Option<Limit>,
}

/// What, in a service's config, its workers are started with: a change replaces them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct LaunchKey {
    command: crate::config::WorkerCommand,
    url: String,
    env: std::collections::BTreeMap<String, String>,
    pass_socket: bool,
    listener: crate::config::concurrency::ListenerMode,
    account: Option<crate::config::Account>,
}

impl LaunchKey {
    pub(super) fn of(service: &ServiceConfig) -> Self {
        LaunchKey {
            command: service.command.clone(),
            url: service.url.clone(),
            env: service.env.clone(),
            pass_socket: service.pass_socket,
            listener: service.listener,
            account: service.account.clone(),
        }
    }
}

impl Launch {
    pub(super) fn new(
        service: &ServiceConfig,
        index: u32,
        supervisor: &SupervisorConfig,
        lineage: &Lineage,
        counters: &Arc<Counters>,
        (locked_memory, shared): (Option<Limit>, Option<Arc<PassedListener>>),
    ) -> io::Result<Self> {
        let program = match &service.command.program {
            Program::Peregrine => std::env::current_exe()?,
            Program::Path(path) => path.clone(),
        };
        // `{index}` in an argument is the worker's index (e.g. `taskset -c {index}` pins each worker to
        // its own CPU).
        let args = service
            .command
            .args
            .iter()
            .map(|arg| arg.replace(INDEX_PLACEHOLDER, &index.to_string()))
            .collect::<Vec<String>>();
        let names_fd = args.iter().any(|arg| arg.contains(FD_PLACEHOLDER));
        // A service of its own user registers on a socket its group may open; the others on the
        // owner-only control socket.
        let control = match &service.account {
            Some(_) => crate::config::worker_socket(&supervisor.control, &service.name),
            None => supervisor.control.clone(),
        };
        let settings = Settings {
            service: service.name.clone(),
            index,
            url: service.url_for(index),
            control,
            counters: None,
            orphan_timeout: supervisor.lifecycle.orphan_timeout,
        };
        Ok(Launch {
            program,
            args,
            // A switched worker's `USER`, `LOGNAME` and `HOME` are its user's, as a login (and
            // systemd's `User=`) would give them; the service's own `env` may still say otherwise.
            env: account_env(service.account.as_ref())
                .into_iter()
                .chain(service.env.iter().map(|(k, v)| (k.clone(), v.clone())))
                .chain([(ENV_LINEAGE.to_owned(), lineage.as_str().to_owned())])
                .collect(),
            settings,
            counters: counters.clone(),
            pass_socket: service.pass_socket,
            concurrency: service.concurrency.limit,
            names_fd,
            ready_path: service.ready_path.clone(),
            stop_signal: service.stop_signal,
            shared,
            privileges: Privileges {
                identity: service
                    .account
                    .as_ref()
                    .filter(|account| switches(account))
                    .map(Identity::of),
            },
            locked_memory,
        })
    }

    /// The uid the worker runs as: the service's `user`, or the supervisor's own.
    pub(super) fn uid(&self) -> u32 {
        match &self.privileges.identity {
            Some(identity) => identity.uid.as_raw(),
            None => rustix::process::geteuid().as_raw(),
        }
    }

    /// Where the next worker, in lane `lane`, counts its requests: a region of its own, or (for a
    /// passed-socket server, counted by the kernel) its lane of the shared region, zeroed now.
    pub(super) fn counter(&self, lane: usize) -> io::Result<CounterRef> {
        if self.pass_socket {
            // No worker counts in this lane now, so nothing counts in it until the new one starts.
            self.counters
                .region()
                .lane(lane)
                .store(0, Ordering::Relaxed);
            return Ok(CounterRef::new(self.counters.clone(), lane));
        }
        // Its counter line and its load report slot (in-band ORCA).
        let (fd, region) = create_worker_region().map_err(io::Error::other)?;
        Ok(CounterRef::new(Arc::new(Counters::new(fd, region)), 0))
    }

    /// Starts a worker: one that counts its requests in `counter` ([`counter`](Self::counter)), or
    /// a server on `passed`, the listener [`bind_passed`](Self::bind_passed) bound for it
    /// ([`passed`](super::passed)).
    pub(super) fn spawn(
        &self,
        counter: &CounterRef,
        passed: Option<PassedListener>,
    ) -> io::Result<u32> {
        match passed {
            Some(listener) => self.spawn_passed(listener),
            None => self.spawn_counting(counter),
        }
    }

    /// For a passed-socket service, the listener of the next worker: bound now, or a duplicate of
    /// the service's shared one.
    pub(super) fn bind_passed(&self) -> io::Result<Option<PassedListener>> {
        if !self.pass_socket {
            return Ok(None);
        }
        match &self.shared {
            Some(shared) => shared.share().map(Some),
            None => PassedListener::bind(&self.settings.url).map(Some),
        }
    }

    /// Starts the server on its listener, as descriptor [`PASSED_FD`], through `peregrine
    /// exec-passed` (which sets `LISTEN_PID` to the server's own pid and execs it). The server counts
    /// no requests for the supervisor, so it inherits no counter region; the eBPF sampler may count
    /// its responses in its lane.
    ///
    /// A command that names the descriptor (`{fd}`) is given it there alone: without `LISTEN_FDS`,
    /// `LISTEN_PID` and `LISTEN_FDNAMES`, which a server such as gunicorn would also act on, opening
    /// the descriptor a second time.
    fn spawn_passed(&self, listener: PassedListener) -> io::Result<u32> {
        let settings = Settings {
            url: listener.url(),
            counters: None,
            ..self.settings.clone()
        };
        let mut command = Command::new(std::env::current_exe()?);
        command
            .arg(EXEC_PASSED)
            .arg("--")
            .arg(&self.program)
            .args(self.args.iter().map(|arg| listener.substitute(arg)))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(settings.to_env())
            .env_remove("LISTEN_PID")
            .stdin(Stdio::null())
            .process_group(0);
        if self.names_fd {
            command
                .env_remove("LISTEN_FDS")
                .env_remove("LISTEN_FDNAMES");
        } else {
            command
                .env("LISTEN_FDS", "1")
                .env("LISTEN_FDNAMES", &self.settings.service);
        }
        let fd = listener.fd.as_raw_fd();
        let privileges = self.privileges.clone();
        let locked_memory = self.locked_memory.map(Limit::rlimit);
        // SAFETY: the closure runs in the child between fork and exec and calls only dup2(2),
        // fcntl(2), setrlimit(2) and `Privileges::apply`, which are async-signal-safe; it touches no
        // memory shared with the parent (`privileges` and `locked_memory` are its own copies). The listener is owned by `listener`, open
        // until after the spawn, so `fd` is valid in the child. The listener is bound already: a
        // server of a user without CAP_NET_BIND_SERVICE still serves a port below 1024.
        unsafe {
            command.pre_exec(move || {
                if fd == PASSED_FD {
                    rustix::io::fcntl_setfd(BorrowedFd::borrow_raw(fd), FdFlags::empty())?;
                } else if libc::dup2(fd, PASSED_FD) < 0 {
                    return Err(io::Error::last_os_error());
                }
                super::locked_memory::set_in_child(locked_memory.as_ref());
                privileges.apply()
            });
        }
        for name in crate::service_manager::INHERITED {
            command.env_remove(name);
        }
        let child = command.spawn()?;
        // The worker owns its listener now: the supervisor's copy closes here.
        drop(listener);
        Ok(child.id())
    }

    /// Starts a worker that counts its requests in `counter`, a region of its own.
    fn spawn_counting(&self, counter: &CounterRef) -> io::Result<u32> {
        let counters = counter.fd().as_raw_fd();
        let settings = Settings {
            counters: Some(CounterLane {
                fd: counters,
                lane: u32::try_from(counter.index()).map_err(io::Error::other)?,
            }),
            ..self.settings.clone()
        };
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(settings.to_env())
            .stdin(Stdio::null())
            // A terminal's Ctrl-C reaches the supervisor only; it stops the workers in order. Workers
            // outlive a supervisor that dies, and re-register with the next one.
            .process_group(0);
        let privileges = self.privileges.clone();
        let locked_memory = self.locked_memory.map(Limit::rlimit);
        // SAFETY: the closure runs in the child between fork and exec and calls only fcntl(2),
        // setrlimit(2) and `Privileges::apply`, which are async-signal-safe; it touches no memory
        // shared with the parent (`privileges` and `locked_memory` are its own copies). The counter
        // descriptor is owned by `counter`, borrowed across the spawn, so it is valid in the child.
        unsafe {
            command.pre_exec(move || {
                // The counter region is the one descriptor the worker inherits.
                rustix::io::fcntl_setfd(BorrowedFd::borrow_raw(counters), FdFlags::empty())?;
                // Room for the ring, while CAP_SYS_RESOURCE may still raise a hard limit.
                super::locked_memory::set_in_child(locked_memory.as_ref());
                privileges.apply()
            });
        }
        // Only the supervisor speaks for its unit to the service manager.
        for name in crate::service_manager::INHERITED {
            command.env_remove(name);
        }
        let child = command.spawn()?;
        // The pid is reaped through its pidfd, not through `Child`.
        Ok(child.id())
    }
}

/// The environment a worker of `account` gets from its user: `USER`, `LOGNAME` and `HOME` from the
/// user database (nothing for a uid without an entry, or no account).
fn account_env(account: Option<&crate::config::Account>) -> Vec<(String, String)> {
    let Some((name, home)) = account.and_then(|a| a.login.as_ref()) else {
        return Vec::new();
    };
    vec![
        ("USER".to_owned(), name.clone()),
        ("LOGNAME".to_owned(), name.clone()),
        ("HOME".to_owned(), home.to_string_lossy().into_owned()),
    ]
}

/// Whether workers of `account` are switched to it: always when this supervisor may switch users;
/// otherwise the config check let it through only as the supervisor's own uid and gid, and the
/// workers keep the supervisor's groups (setting them takes the right to switch).
fn switches(account: &crate::config::Account) -> bool {
    let own = crate::config::account::Identity::of_this_process();
    own.can_switch || account.is_other_than(&own)
}

/// Whether two workers cannot listen on `url` at once: a given TCP port, or a Unix socket path.
pub(super) fn fixed_address(url: &BindUrl) -> bool {
    match url {
        BindUrl::Tcp { port, .. } => *port != 0,
        BindUrl::Unix { .. } => true,
    }
}
