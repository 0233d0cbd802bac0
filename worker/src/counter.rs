//! The worker's request count: a process-local total ([`requests`]), and, when the supervisor hands
//! the worker a lane of its shared counter region ([`peregrine_contract::counters`]), the same count
//! in that lane, where the supervisor and its eBPF sampler read it without a syscall or a message.
//!
//! The worker keeps the inherited descriptor open for as long as it lives (it only borrows it to map
//! the region): workers outlive their supervisor, and a supervisor that adopts a running worker takes a
//! duplicate of the descriptor with `pidfd_getfd(2)` to go on reading the worker's counter.
//!
//! A request costs one relaxed atomic increment in the mapped lane (and one in the process-local
//! counter), and, for the requests in flight, one atomic add when it starts and one when it ends, each
//! with a read of the coarse monotonic clock (the vDSO: no system call), into the lane's
//! [`InFlight`] word. A request ends when its response is written or given up, or when its
//! connection goes away: whatever drops the [`Open`] it started with.

use std::{
    os::fd::BorrowedFd,
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
    },
};

use peregrine_contract::{
    counters::{CounterRegion, FEATURE_IN_FLIGHT, InFlight, coarse_now_us},
    shm::ShmError,
};

static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// The shared lane this worker counts in, once [`attach`] has run.
static SHARED: OnceLock<(CounterRegion, usize)> = OnceLock::new();

/// How many requests this process has handed to its application so far.
pub fn requests() -> u64 {
    REQUESTS.load(Ordering::Relaxed)
}

/// Counts one request, and keeps it in flight until the [`Open`] it returns is dropped.
pub(crate) fn record_request() -> Open {
    REQUESTS.fetch_add(1, Ordering::Relaxed);
    if let Some((region, lane)) = SHARED.get() {
        region.lane(*lane).fetch_add(1, Ordering::Relaxed);
        region
            .in_flight(*lane)
            .fetch_add(InFlight::start_delta(coarse_now_us()), Ordering::Relaxed);
        return Open { counted: true };
    }
    Open { counted: false }
}

/// A request in flight: dropping it ends the request in the lane's [`InFlight`] word.
#[derive(Debug)]
#[must_use = "a request is in flight until this is dropped"]
pub(crate) struct Open {
    /// Whether its start went into a lane (no lane was attached otherwise).
    counted: bool,
}

impl Drop for Open {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        if let Some((region, lane)) = SHARED.get() {
            region
                .in_flight(*lane)
                .fetch_add(InFlight::end_delta(coarse_now_us()), Ordering::Relaxed);
        }
    }
}

/// Why the shared counter could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The region could not be mapped (or does not hold the lane).
    #[error("cannot map lane {lane} of the request counter region")]
    Map {
        /// The lane asked for.
        lane: usize,
        /// The cause.
        #[source]
        source: ShmError,
    },
    /// A lane is attached already.
    #[error("the request counter is attached already")]
    Attached,
}

/// Maps lane `lane` of the counter region behind `fd` and counts every later request there too.
/// Attaching twice is an error.
///
/// A worker's own region (lane 0) may also hold its load report slot: it is mapped too, and its
/// report goes out once per connection ([`crate::load_report`]).
pub fn attach(fd: BorrowedFd<'_>, lane: usize) -> Result<(), AttachError> {
    let region =
        CounterRegion::map(fd, lane + 1).map_err(|source| AttachError::Map { lane, source })?;
    // Says that this worker keeps its requests in flight: one of an older version leaves the word
    // zero, which a reader must not take for an idle worker.
    region
        .features(lane)
        .fetch_or(FEATURE_IN_FLIGHT, Ordering::Relaxed);
    SHARED
        .set((region, lane))
        .map_err(|_| AttachError::Attached)?;
    if lane == 0 {
        crate::load_report::attach(fd).map_err(|source| AttachError::Map { lane, source })?;
    }
    Ok(())
}
