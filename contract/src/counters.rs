//! The request counters: one `u64` per worker *lane*, readable from outside the worker without a
//! syscall or a message.
//!
//! Layout (the one definition; the kernel program's `struct peregrine_counter` in
//! `ebpf/src/bpf/sampler.h` mirrors it, and `ebpf/src/layout.rs` asserts the two agree): lane `k`'s
//! counter is the native-endian `u64` at byte offset `64 * k` ([`LINE`]: a cache line each, so workers
//! on different cores never share a line). A worker that counts its own requests inherits a region of
//! its own, a `memfd` of one line (lane 0), through [`crate::settings`]: it can map no other worker's
//! count. The supervisor's shared region, a lane per worker instance, is a `memfd` or, where the eBPF
//! sampler loads, its `counters` map (a BPF array created with `BPF_F_MMAPABLE`, [`Counter`]-sized
//! values), where the kernel counts the responses of servers on passed listeners; no worker inherits
//! it. The supervisor zeroes a shared lane before it starts a worker in it, so a lane holds exactly the
//! requests of its current worker; while that worker runs, the counter only grows. A worker's own
//! region also holds its load report slot, after the counter line ([`crate::report_slot`], which
//! creates such regions).
//!
//! A line's second word is the lane's requests in flight ([`InFlight`]), which a worker that keeps
//! it says in the third ([`FEATURE_IN_FLIGHT`]): the requests open now, and the integral of that
//! count over time, packed so that one atomic add per request start and end keeps both together (a
//! reader never sees one changed without the other). A worker of an older version leaves both words
//! zero, as the kernel program does for the lanes it counts in.
//!
//! Invariant: a region is mapped only once the object behind it is known to hold every lane asked for
//! ([`SharedMemory::map`]), so a descriptor named by another process's environment ends in an error,
//! never in `SIGBUS`.

use std::{
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    sync::atomic::AtomicU64,
};

use crate::shm::{Access, SharedMemory, ShmError};

/// The bytes between two lanes' counters: one cache line.
pub const LINE: usize = 64;

/// One lane's counter, as the kernel program sees it (`struct peregrine_counter`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Counter {
    /// Requests served by the lane's current worker.
    pub requests: u64,
    /// Its requests in flight, packed ([`InFlight`]).
    pub in_flight: u64,
    /// What else the worker keeps in the line: [`FEATURE_IN_FLIGHT`].
    pub features: u64,
    _reserved: [u64; 5],
}

const _: () = assert!(size_of::<Counter>() == LINE);
const _: () = assert!(std::mem::offset_of!(Counter, requests) == 0);
const _: () = assert!(std::mem::offset_of!(Counter, in_flight) == IN_FLIGHT_OFFSET);
const _: () = assert!(std::mem::offset_of!(Counter, features) == FEATURES_OFFSET);

/// The byte offset of [`Counter::in_flight`] in a line.
pub const IN_FLIGHT_OFFSET: usize = 8;
/// The byte offset of [`Counter::features`] in a line.
pub const FEATURES_OFFSET: usize = 16;
/// A bit of [`Counter::features`]: the worker keeps [`Counter::in_flight`].
pub const FEATURE_IN_FLIGHT: u64 = 1;

/// The bits of [`Counter::in_flight`] that hold the requests open now; the others hold the time.
const OPEN_BITS: u32 = 20;
/// The most requests in flight the word holds (a worker holds fewer: its connections are bounded).
pub const MAX_OPEN: u64 = (1 << OPEN_BITS) - 1;
/// The bits of the time part, in microseconds: sums are exact modulo 2^44 us (203 days), so the
/// integral's growth between two readings is exact while it stays below that.
const TIME_BITS: u32 = 64 - OPEN_BITS;
const TIME_MASK: u64 = (1 << TIME_BITS) - 1;

/// Requests in flight as one word: the requests open now in the low 20 bits, and above them the sum
/// of every finished request's end time less every started request's start time (microseconds of
/// `CLOCK_MONOTONIC_COARSE`, wrapping). At time `t`, the integral of the open count over time since
/// the lane was zeroed is that sum plus `open x t`: each open request adds `t - start`, each finished
/// one `end - start`. A start adds `1 - (start << 20)` and an end `(end << 20) - 1`, each one
/// atomic add, so the open count and the sum never tear apart. Reading the clock costs no system
/// call (the vDSO), and the coarse clock (a scheduler tick, 1 to 4 ms) costs a few nanoseconds: its
/// rounding of a start and an end cancels out on average over many requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlight(pub u64);

impl InFlight {
    /// What a request starting at `now_us` adds to the word.
    pub fn start_delta(now_us: u64) -> u64 {
        1u64.wrapping_sub(now_us << OPEN_BITS)
    }

    /// What a request ending at `now_us` adds to the word.
    pub fn end_delta(now_us: u64) -> u64 {
        (now_us << OPEN_BITS).wrapping_sub(1)
    }

    /// The requests open now.
    pub fn open(self) -> u64 {
        self.0 & MAX_OPEN
    }

    /// The integral of the open count over time up to `now_us` (in request-microseconds), modulo
    /// 2^44: only the difference of two such values means something ([`InFlight::mean_between`]).
    pub fn integral_at(self, now_us: u64) -> u64 {
        let sum = self.0 >> OPEN_BITS;
        sum.wrapping_add(self.open().wrapping_mul(now_us)) & TIME_MASK
    }

    /// The mean number of requests in flight between an earlier reading (`self` at `since_us`) and a
    /// later one (`later` at `now_us`); `None` when no time passed.
    pub fn mean_between(self, since_us: u64, later: InFlight, now_us: u64) -> Option<f64> {
        let elapsed = now_us.checked_sub(since_us).filter(|&e| e > 0)?;
        let grown = later
            .integral_at(now_us)
            .wrapping_sub(self.integral_at(since_us))
            & TIME_MASK;
        Some(grown as f64 / elapsed as f64)
    }
}

/// `CLOCK_MONOTONIC_COARSE` in microseconds: the clock of [`InFlight`], the same for every process of
/// the host (in one time namespace).
pub fn coarse_now_us() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    (t.tv_sec as u64)
        .wrapping_mul(1_000_000)
        .wrapping_add(t.tv_nsec as u64 / 1_000)
}

/// A mapped region of request counters (see the module docs for the layout).
#[derive(Debug)]
pub struct CounterRegion {
    memory: SharedMemory,
    lanes: usize,
}

impl CounterRegion {
    /// Creates a zeroed region of `lanes` counters in a new memfd, sealed against resizing; returns
    /// the descriptor to hand to workers (close-on-exec: the spawner clears that flag for the child
    /// only) and the mapping.
    pub fn create(lanes: usize) -> Result<(OwnedFd, CounterRegion), ShmError> {
        // Exactly the lanes asked for: a region made for one worker's line offers no second line to
        // map.
        Self::create_sized(lanes, lanes.max(1) * LINE)
    }

    /// A sealed memfd of `bytes`, its first `lanes` counters mapped (a worker's own region is longer
    /// than its line: [`crate::report_slot::create_worker_region`]).
    pub(crate) fn create_sized(
        lanes: usize,
        bytes: usize,
    ) -> Result<(OwnedFd, CounterRegion), ShmError> {
        use rustix::fs::{MemfdFlags, SealFlags};
        let fd = rustix::fs::memfd_create(
            "peregrine-counters",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(std::io::Error::from)?;
        rustix::fs::ftruncate(&fd, bytes as u64).map_err(std::io::Error::from)?;
        // The size is fixed: a worker can never shrink it under the others.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(std::io::Error::from)?;
        let region = CounterRegion::map(fd.as_fd(), lanes)?;
        Ok((fd, region))
    }

    /// Maps the first `lanes` counters of the region behind `fd` (shared, read-write), once the
    /// object is known to hold them.
    pub fn map(fd: BorrowedFd<'_>, lanes: usize) -> Result<CounterRegion, ShmError> {
        let bytes = lanes.checked_mul(LINE).ok_or(ShmError::TooSmall {
            size: 0,
            needed: u64::MAX,
        })?;
        let memory = SharedMemory::map(fd, bytes, Access::ReadWrite)?;
        Ok(CounterRegion { memory, lanes })
    }

    /// [`CounterRegion::map`] for a descriptor taken from another process, which could resize the
    /// object: refused unless it can never shrink ([`SharedMemory::map_fixed`]).
    pub fn map_fixed(fd: BorrowedFd<'_>, lanes: usize) -> Result<CounterRegion, ShmError> {
        crate::shm::ensure_fixed_size(fd)?;
        CounterRegion::map(fd, lanes)
    }

    /// How many counters the region holds.
    pub fn lanes(&self) -> usize {
        self.lanes
    }

    /// Lane `lane`'s counter.
    ///
    /// # Panics
    ///
    /// When `lane` is out of range.
    pub fn lane(&self, lane: usize) -> &AtomicU64 {
        assert!(
            lane < self.lanes,
            "counter lane {lane} out of range 0..{}",
            self.lanes
        );
        self.memory.u64_at(lane * LINE)
    }

    /// Lane `lane`'s requests in flight ([`InFlight`]).
    ///
    /// # Panics
    ///
    /// When `lane` is out of range.
    pub fn in_flight(&self, lane: usize) -> &AtomicU64 {
        self.lane(lane);
        self.memory.u64_at(lane * LINE + IN_FLIGHT_OFFSET)
    }

    /// Lane `lane`'s features ([`FEATURE_IN_FLIGHT`]).
    ///
    /// # Panics
    ///
    /// When `lane` is out of range.
    pub fn features(&self, lane: usize) -> &AtomicU64 {
        self.lane(lane);
        self.memory.u64_at(lane * LINE + FEATURES_OFFSET)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    #[test]
    fn two_mappings_see_each_others_counts() {
        let (fd, writer) = CounterRegion::create(600).unwrap();
        let reader = CounterRegion::map(fd.as_fd(), 600).unwrap();
        writer.lane(0).fetch_add(3, Ordering::Relaxed);
        writer.lane(599).fetch_add(7, Ordering::Relaxed);
        assert_eq!(reader.lane(0).load(Ordering::Relaxed), 3);
        assert_eq!(reader.lane(599).load(Ordering::Relaxed), 7);
        assert_eq!(reader.lane(1).load(Ordering::Relaxed), 0);
    }

    /// A lane's word after the given starts and ends (microseconds), in that order.
    fn word(events: &[(bool, u64)]) -> InFlight {
        InFlight(events.iter().fold(0u64, |word, &(start, at)| {
            word.wrapping_add(if start {
                InFlight::start_delta(at)
            } else {
                InFlight::end_delta(at)
            })
        }))
    }

    #[test]
    fn the_in_flight_word_keeps_the_open_count_and_the_integral_of_it() {
        // Two requests: one over [10, 40), one over [20, 25); read at 30 and at 50.
        let at_30 = word(&[(true, 10), (true, 20), (false, 25)]);
        assert_eq!(at_30.open(), 1);
        // 20 us of the first so far, 5 of the second.
        assert_eq!(at_30.integral_at(30), 25);
        let at_50 = word(&[(true, 10), (true, 20), (false, 25), (false, 40)]);
        assert_eq!(at_50.open(), 0);
        assert_eq!(at_50.integral_at(50), 35);
        // Between 30 and 50 the first request was open for 10 us: a mean of 0.5 in flight.
        assert_eq!(at_30.mean_between(30, at_50, 50), Some(0.5));
        assert_eq!(at_30.mean_between(30, at_50, 30), None, "no time passed");
        // Little's law on a steady stream: a request every 10 us lasting 25 us is 2.5 in flight.
        let events: Vec<(bool, u64)> = (0..1000u64)
            .flat_map(|n| [(true, n * 10), (false, n * 10 + 25)])
            .collect();
        let mut sorted = events.clone();
        sorted.sort_by_key(|&(start, at)| (at, start));
        let (early, late) = (word(&sorted[..600]), word(&sorted[..1400]));
        let (t0, t1) = (sorted[599].1, sorted[1399].1);
        let mean = early.mean_between(t0, late, t1).unwrap();
        assert!((mean - 2.5).abs() < 0.05, "{mean}");
    }

    #[test]
    fn the_in_flight_word_survives_wrapping_clocks_and_sums() {
        // Times near the top of the 44 bits, and a word that wrapped many times: only differences
        // count, and they stay exact.
        let base = (1u64 << 44) - 15;
        let early = word(&[(true, base), (true, base + 5)]);
        let later = word(&[(true, base), (true, base + 5), (false, base + 25)]);
        // Between base + 10 and base + 30: the first open throughout (20), the second until +25 (15).
        assert_eq!(
            early.mean_between(base + 10, later, base + 30),
            Some(35.0 / 20.0)
        );
        let many = (0..100_000u64).fold(0u64, |w, n| {
            w.wrapping_add(InFlight::start_delta(n << 30))
                .wrapping_add(InFlight::end_delta((n << 30) + 7))
        });
        let many = InFlight(many);
        assert_eq!(many.open(), 0);
        let more = InFlight(many.0.wrapping_add(InFlight::start_delta(1 << 50)));
        assert_eq!(more.open(), 1);
        assert_eq!(many.mean_between(1 << 50, more, (1 << 50) + 100), Some(1.0));
    }

    /// What a request's start and end cost a worker (two clock reads, two atomic adds):
    /// `cargo test -p peregrine-contract --release -- --ignored --nocapture what_a_request_costs`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn what_a_request_costs() {
        let (_fd, region) = CounterRegion::create(1).unwrap();
        let word = region.in_flight(0);
        let rounds = 10_000_000u32;
        let started = std::time::Instant::now();
        for _ in 0..rounds {
            word.fetch_add(InFlight::start_delta(coarse_now_us()), Ordering::Relaxed);
            word.fetch_add(InFlight::end_delta(coarse_now_us()), Ordering::Relaxed);
        }
        let each = started.elapsed() / rounds;
        eprintln!("a request's start and end: {each:?}");
        assert_eq!(InFlight(word.load(Ordering::Relaxed)).open(), 0);
    }

    #[test]
    fn the_in_flight_words_are_the_second_and_third_of_a_line() {
        let (fd, writer) = CounterRegion::create(2).unwrap();
        let reader = CounterRegion::map(fd.as_fd(), 2).unwrap();
        writer.in_flight(1).store(7, Ordering::Relaxed);
        writer
            .features(1)
            .store(FEATURE_IN_FLIGHT, Ordering::Relaxed);
        assert_eq!(reader.lane(1).load(Ordering::Relaxed), 0);
        assert_eq!(reader.in_flight(1).load(Ordering::Relaxed), 7);
        assert_eq!(reader.features(1).load(Ordering::Relaxed), 1);
        assert_eq!(reader.in_flight(0).load(Ordering::Relaxed), 0);
        assert!(coarse_now_us() > 0);
    }

    #[test]
    fn the_region_cannot_be_resized() {
        let (fd, _region) = CounterRegion::create(1).unwrap();
        assert!(
            rustix::fs::ftruncate(&fd, 0).is_err(),
            "sealed against shrinking"
        );
    }

    #[test]
    fn lanes_are_bounds_checked() {
        let (_fd, region) = CounterRegion::create(2).unwrap();
        let out_of_range = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            region.lane(2);
        }));
        assert!(out_of_range.is_err());
    }

    #[test]
    fn a_region_of_one_line_maps_no_second_line() {
        let (fd, region) = CounterRegion::create(1).unwrap();
        region.lane(0).fetch_add(1, Ordering::Relaxed);
        assert!(matches!(
            CounterRegion::map(fd.as_fd(), 2),
            Err(ShmError::TooSmall { .. })
        ));
    }

    #[test]
    fn a_lane_past_the_region_is_an_error_not_a_sigbus() {
        // 64 lanes fill one 4 KiB page; lane 64 would be past the memfd's end.
        let (fd, _region) = CounterRegion::create(64).unwrap();
        let page = rustix::param::page_size();
        let fits = page / LINE;
        assert!(CounterRegion::map(fd.as_fd(), fits).is_ok());
        assert!(matches!(
            CounterRegion::map(fd.as_fd(), fits + 1),
            Err(ShmError::TooSmall { .. })
        ));
    }
}
