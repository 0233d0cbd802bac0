//! A Peregrine worker.
//!
//! A worker binds its own listeners ([`listen`]), registers them with the supervisor ([`register`]) and
//! serves HTTP/1.1 and HTTP/2 ([`server`], [`http1`], [`http2`]) on one thread, whose sockets are driven
//! by an io_uring driver of the worker's own inside a tokio current-thread runtime ([`runtime`]), with
//! an application given as a [`tower::Service`] over `http` types. It stops accepting on SIGTERM or SIGINT, lets in-flight requests
//! finish within a short deadline and exits.
//!
//! A worker outlives its supervisor: it goes on serving and registers again with the next supervisor on
//! the same control socket. It stops the same graceful way when a new supervisor refuses it (an error) or
//! when none has accepted it for the orphan timeout ([`Settings::orphan_timeout`]).
//!
//! Invariants: the worker runs one thread and never shares a listener (no `SO_REUSEPORT`); the library
//! never installs a `tracing` subscriber (the binary does); the worker knows nothing of Envoy or xDS.
// Unsafe code is denied but where a module says why.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod budget;
pub mod counter;
mod driver;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod hello;
pub mod http1;
pub mod http2;
pub mod listen;
mod load_report;
mod log_limit;
pub mod register;
pub mod runtime;
pub mod server;
pub mod service;
mod stream;
mod uring_io;

/// The supervisor–worker contract, re-exported: a worker is started with these settings.
pub use peregrine_contract::{settings, url};

use std::{future::Future, io, pin::Pin};

pub use crate::{
    counter::requests,
    hello::Hello,
    service::{HttpService, RequestBody},
    settings::Settings,
};
use crate::{
    listen::{BindError, BoundAddr},
    register::{Abandoned, Announcement, RegisterError},
    server::{Config, ServeError},
    settings::SettingsError,
};

/// The error type an application's errors are converted to.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a worker stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The settings are missing or invalid.
    #[error("invalid worker settings")]
    Settings(#[from] SettingsError),
    /// The listener could not be bound.
    #[error("cannot bind the worker's listener")]
    Bind(#[from] BindError),
    /// The supervisor could not be reached or refused the worker.
    #[error("cannot register with the supervisor")]
    Register(#[from] RegisterError),
    /// The io_uring runtime could not start.
    #[error("cannot start the io_uring runtime")]
    Runtime(#[source] io::Error),
    /// The io_uring ring could not be set up: its user's locked memory is used up.
    #[error(
        "cannot start the io_uring runtime: the locked memory of uid {uid} is used up (the ring \
         needs about {needed_kib} KiB; RLIMIT_MEMLOCK is {limit}, and it counts every process of \
         this user together). Raise the limit (LimitMEMLOCK= in the unit, `ulimit -l`), give fewer \
         workers this user, or give the supervisor CAP_SYS_RESOURCE, which raises its workers' limit to \
         fit"
    )]
    LockedMemory {
        /// The user charged.
        uid: u32,
        /// What one worker's ring needs, in KiB.
        needed_kib: usize,
        /// The process's `RLIMIT_MEMLOCK`, as text (`unlimited`, or KiB).
        limit: String,
    },
    /// The signal handlers could not be installed.
    #[error("cannot install signal handlers")]
    Signals(#[source] io::Error),
    /// Serving could not start.
    #[error("cannot serve")]
    Serve(#[from] ServeError),
    /// The inherited request counter region could not be mapped.
    #[error("cannot attach the request counter")]
    Counters(#[from] counter::AttachError),
    /// A later supervisor refused to register the worker again: it is no longer wanted, so it stopped.
    #[error("stopped: a new supervisor refused to register the worker again")]
    Unwanted(#[source] RegisterError),
}

/// Maps the counter lane the supervisor gave this worker.
///
/// The inherited descriptor stays open for the life of the process, never closed: a supervisor that
/// adopts this worker later takes a duplicate of it with `pidfd_getfd(2)` to go on reading its counter.
#[allow(unsafe_code, reason = "borrows the inherited descriptor")]
fn attach_counters(counters: settings::CounterLane) -> Result<(), counter::AttachError> {
    use std::os::fd::BorrowedFd;
    // SAFETY: the supervisor opened this descriptor for this process and named it in the environment;
    // nothing in this process owns or closes it, so it stays open for the life of the process.
    let fd = unsafe { BorrowedFd::borrow_raw(counters.fd) };
    counter::attach(fd, counters.lane as usize)
}

/// Runs the built-in hello app with the settings from the environment, until SIGTERM or SIGINT.
pub fn run_hello() -> Result<(), WorkerError> {
    run(Settings::from_env()?, Hello::new)
}

/// Runs a worker until SIGTERM or SIGINT: binds, registers, serves, drains.
///
/// The worker also stops (draining the same way) when no supervisor has accepted its registration for
/// [`Settings::orphan_timeout`] (then `Ok`), or when a later supervisor refuses to register it again
/// ([`WorkerError::Unwanted`]). A refusal of the first registration is [`WorkerError::Register`], before
/// any request is served.
///
/// `make_service` is called once per connection. Blocks the calling thread, which becomes the worker's
/// io_uring thread.
pub fn run<F, S>(settings: Settings, make_service: F) -> Result<(), WorkerError>
where
    F: Fn() -> S + 'static,
    S: HttpService,
{
    run_inner(settings, make_service, None)
}

/// Runs a worker like [`run`], but stops when `shutdown` completes instead of on a signal (or, like
/// [`run`], when orphaned or unwanted).
pub fn run_until<F, S>(
    settings: Settings,
    make_service: F,
    shutdown: impl Future<Output = ()> + 'static,
) -> Result<(), WorkerError>
where
    F: Fn() -> S + 'static,
    S: HttpService,
{
    run_inner(settings, make_service, Some(Box::pin(shutdown)))
}

fn run_inner<F, S>(
    settings: Settings,
    make_service: F,
    shutdown: Option<Pin<Box<dyn Future<Output = ()>>>>,
) -> Result<(), WorkerError>
where
    F: Fn() -> S + 'static,
    S: HttpService,
{
    if let Some(counters) = settings.counters {
        attach_counters(counters)?;
    }
    let listeners = listen::bind(&settings.url)?;
    let addresses: Vec<BoundAddr> = listeners.iter().map(|l| l.addr.clone()).collect();
    let shown: Vec<String> = addresses.iter().map(ToString::to_string).collect();
    tracing::info!(url = %settings.url, addresses = ?shown, "Bound");

    runtime::Builder::new()
        .block_on(async move {
            let shutdown = match shutdown {
                Some(shutdown) => shutdown,
                None => Box::pin(signals().map_err(WorkerError::Signals)?),
            };
            let registration = register::register(
                &settings.control,
                &Announcement {
                    service: &settings.service,
                    index: settings.index,
                    addresses: &addresses,
                },
            )
            .await?;
            tracing::info!(
                hostname = registration.hostname(),
                service = %settings.service,
                index = settings.index,
                "Registered"
            );
            // The task owns the connection and registers again when it ends. It is never waited for: it
            // is aborted once the server has drained, which closes the connection (deregistering the
            // worker) if it is open.
            let mut keeper = runtime::spawn(registration.keep(settings.orphan_timeout));
            let mut abandoned = None;
            let stop = async {
                tokio::select! {
                    () = shutdown => {}
                    outcome = &mut keeper => match outcome {
                        Ok(outcome) => abandoned = Some(outcome),
                        // Only a panic ends it otherwise (it is aborted only below); that stops the worker.
                        Err(error) => tracing::error!(%error, "The registration task failed"),
                    },
                }
            };
            let served = server::serve(listeners, make_service, Config::default(), stop).await;
            keeper.abort();
            served?;
            match abandoned {
                Some(Abandoned::Refused(error)) => Err(WorkerError::Unwanted(error)),
                Some(Abandoned::Orphaned(_)) | None => Ok(()),
            }
        })
        .map_err(runtime_error)?
}

/// Why the runtime could not start: `ENOMEM` from the ring's setup is its user's locked memory
/// running out ([`peregrine_contract::rings`]), said with what to change.
fn runtime_error(error: io::Error) -> WorkerError {
    if error.raw_os_error() != Some(libc::ENOMEM) {
        return WorkerError::Runtime(error);
    }
    let limit = match rustix::process::getrlimit(rustix::process::Resource::Memlock).current {
        Some(bytes) => format!("{} KiB", bytes / 1024),
        None => "unlimited".to_owned(),
    };
    WorkerError::LockedMemory {
        uid: rustix::process::getuid().as_raw(),
        needed_kib: peregrine_contract::rings::locked_bytes(rustix::param::page_size()) / 1024,
        limit,
    }
}

/// Completes on the first SIGTERM or SIGINT. Must be called on the runtime.
fn signals() -> io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "Stopping");
    })
}
