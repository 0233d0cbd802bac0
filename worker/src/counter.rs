//! The worker's request counter, readable from outside the process without a syscall or a message.
//!
//! Layout (shared with the supervisor and its eBPF sampler: `struct peregrine_counter` in
//! `ebpf/src/bpf/sampler.h`): one native-endian `u64` counter per worker *slot*, slot `k` at byte offset
//! `64 * k` ([`SLOT_BYTES`]: a cache line each, so workers on different cores never share a line),
//! mapped `MAP_SHARED` from a file descriptor the supervisor hands to the worker:
//! `PEREGRINE_COUNTERS_FD` names the inherited descriptor and `PEREGRINE_COUNTERS_SLOT` the slot. The
//! descriptor is the eBPF sampler's `counters` map (a BPF array created with `BPF_F_MMAPABLE`, 64-byte
//! values) or, where eBPF cannot load, a `memfd` of the same layout. The supervisor zeroes a slot before
//! it starts a worker in it, so a slot holds exactly the requests of its current worker; while that
//! worker runs, the counter only grows.
//!
//! The worker keeps the inherited descriptor open for as long as it lives (it only borrows it to map
//! the region): workers outlive their supervisor, and a supervisor that adopts a running worker takes a
//! duplicate of the descriptor with `pidfd_getfd(2)` to go on reading the worker's counter.
//!
//! A request costs one relaxed atomic increment in the mapped slot (and one in a process-local counter,
//! which [`requests`] reads).

use std::{
    io,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    ptr::NonNull,
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
    },
};

use rustix::mm::{MapFlags, ProtFlags};

/// The bytes between two slots' counters: one cache line.
pub const SLOT_BYTES: usize = 64;

static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// The shared slot this worker counts in, once [`attach`] has run.
static SHARED: OnceLock<(CounterRegion, usize)> = OnceLock::new();

/// How many requests this process has handed to its application so far.
pub fn requests() -> u64 {
    REQUESTS.load(Ordering::Relaxed)
}

/// Counts one request.
pub(crate) fn record_request() {
    REQUESTS.fetch_add(1, Ordering::Relaxed);
    if let Some((region, slot)) = SHARED.get() {
        region.slot(*slot).fetch_add(1, Ordering::Relaxed);
    }
}

/// Maps slot `slot` of the counter region behind `fd` and counts every later request there too.
/// Attaching twice is an error.
pub fn attach(fd: BorrowedFd<'_>, slot: usize) -> io::Result<()> {
    let region = CounterRegion::map(fd, slot + 1)?;
    SHARED
        .set((region, slot))
        .map_err(|_| io::Error::other("the request counter is attached already"))
}

/// A mapped region of `u64` counters (see the module docs for the layout).
#[derive(Debug)]
pub struct CounterRegion {
    base: NonNull<AtomicU64>,
    slots: usize,
    len: usize,
}

// SAFETY: the region is only ever accessed through `&AtomicU64`, which is `Sync`; the mapping itself is
// owned by the value and unmapped once, on drop.
unsafe impl Send for CounterRegion {}
// SAFETY: as above.
unsafe impl Sync for CounterRegion {}

impl CounterRegion {
    /// Creates a zeroed region of `slots` counters in a new memfd; returns the descriptor to hand to
    /// workers (close-on-exec: the spawner clears that flag for the child only) and the mapping.
    pub fn create(slots: usize) -> io::Result<(OwnedFd, CounterRegion)> {
        let fd = rustix::fs::memfd_create(
            "peregrine-counters",
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, page_len(slots) as u64)?;
        // The size is fixed: a worker can never shrink it under the others.
        rustix::fs::fcntl_add_seals(
            &fd,
            rustix::fs::SealFlags::SHRINK
                | rustix::fs::SealFlags::GROW
                | rustix::fs::SealFlags::SEAL,
        )?;
        let region = CounterRegion::map(fd.as_fd(), slots)?;
        Ok((fd, region))
    }

    /// Maps the first `slots` counters of the region behind `fd` (shared, read-write).
    pub fn map(fd: BorrowedFd<'_>, slots: usize) -> io::Result<CounterRegion> {
        if slots == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a counter region needs a slot",
            ));
        }
        let len = page_len(slots);
        // SAFETY: a fresh shared mapping (null hint: the kernel picks the address) of `len` bytes of
        // `fd` from offset 0; nothing else in this process aliases it. It is page-aligned, so every
        // 8-byte slot is aligned for `AtomicU64`, and it stays mapped until `Drop` unmaps it.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )?
        };
        let base = NonNull::new(ptr.cast::<AtomicU64>())
            .ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(CounterRegion { base, slots, len })
    }

    /// How many counters the region holds.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Counter `slot`.
    ///
    /// # Panics
    ///
    /// When `slot` is out of range.
    pub fn slot(&self, slot: usize) -> &AtomicU64 {
        assert!(
            slot < self.slots,
            "counter slot {slot} out of range 0..{}",
            self.slots
        );
        // SAFETY: `slot < slots` and the mapping covers `slots * SLOT_BYTES` bytes from a page-aligned
        // base, so the counter is in bounds and 8-aligned; the memory is only accessed atomically, here
        // and in every other process that maps it.
        unsafe { &*self.base.as_ptr().byte_add(slot * SLOT_BYTES) }
    }
}

impl Drop for CounterRegion {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are exactly what `mmap` returned; references handed out by `slot`
        // borrow `self`, so none outlives this.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// The bytes `slots` counters take, rounded up to whole pages.
fn page_len(slots: usize) -> usize {
    let page = rustix::param::page_size();
    (slots * SLOT_BYTES).div_ceil(page) * page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_see_each_others_counts() {
        let (fd, writer) = CounterRegion::create(600).unwrap();
        let reader = CounterRegion::map(fd.as_fd(), 600).unwrap();
        writer.slot(0).fetch_add(3, Ordering::Relaxed);
        writer.slot(599).fetch_add(7, Ordering::Relaxed);
        assert_eq!(reader.slot(0).load(Ordering::Relaxed), 3);
        assert_eq!(reader.slot(599).load(Ordering::Relaxed), 7);
        assert_eq!(reader.slot(1).load(Ordering::Relaxed), 0);
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
    fn slots_are_bounds_checked() {
        let (_fd, region) = CounterRegion::create(2).unwrap();
        let out_of_range = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            region.slot(2);
        }));
        assert!(out_of_range.is_err());
    }
}
