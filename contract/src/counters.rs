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
    _reserved: [u64; 7],
}

const _: () = assert!(size_of::<Counter>() == LINE);
const _: () = assert!(std::mem::offset_of!(Counter, requests) == 0);

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
