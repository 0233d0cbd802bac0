//! The provided buffer ring shared by every connection's multishot receive
//! (`IORING_REGISTER_PBUF_RING`): the kernel picks a buffer per completion and names it in the CQE
//! flags; the driver hands it back ([`BufRing::recycle`]) once it has consumed its bytes, and makes the
//! returned buffers visible to the kernel in one store per loop turn ([`BufRing::publish`]).
//!
//! Invariant: the ring and the buffers are mapped once and never unmapped, so the memory the kernel was
//! given outlives its registration (and the ring itself, whose teardown the kernel finishes on its own
//! time); a buffer is written by the kernel only between a publish that returned it and the CQE that
//! hands it out, and is handed back exactly once per hand-out.
#![allow(unsafe_code, reason = "memory shared with the kernel")]

use std::{
    io,
    ptr::NonNull,
    sync::atomic::{AtomicU16, Ordering},
};

use io_uring::{IoUring, types::BufRingEntry};

/// The provided buffer ring: `count` buffers of `buf_size` bytes.
#[derive(Debug)]
pub(crate) struct BufRing {
    entries: NonNull<BufRingEntry>,
    bufs: NonNull<u8>,
    buf_size: usize,
    count: u16,
    /// The tail as this side knows it; the kernel sees it at the next [`BufRing::publish`].
    tail: u16,
    /// The tail the kernel saw last.
    published: u16,
    /// How many buffers completions have handed out and this side has not recycled yet.
    out: u16,
}

/// Anonymous, zeroed, page-aligned memory of `len` bytes, never unmapped.
fn map(len: usize) -> io::Result<NonNull<u8>> {
    // SAFETY: an anonymous private mapping at an address the kernel chooses aliases no memory of this
    // process; the result is checked before use.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(addr.cast()).ok_or_else(|| io::Error::other("mmap returned null"))
}

impl BufRing {
    /// Maps `count` buffers of `buf_size` bytes, registers them as buffer group `group` of `uring`
    /// and hands them all to the kernel.
    pub(crate) fn new(
        uring: &IoUring,
        group: u16,
        count: u16,
        buf_size: usize,
    ) -> io::Result<Self> {
        assert!(count.is_power_of_two() && buf_size <= u32::MAX as usize);
        let entries = map(usize::from(count) * size_of::<BufRingEntry>())?.cast::<BufRingEntry>();
        let bufs = map(usize::from(count) * buf_size)?;
        // SAFETY: `entries` is page aligned, holds `count` zeroed entries (tail 0) and is never
        // unmapped, so it stays valid for as long as the kernel may read it.
        unsafe {
            uring.submitter().register_buf_ring_with_flags(
                entries.as_ptr() as u64,
                count,
                group,
                0,
            )?;
        }
        let mut ring = BufRing {
            entries,
            bufs,
            buf_size,
            count,
            tail: 0,
            published: 0,
            out: count,
        };
        for bid in 0..count {
            ring.recycle(bid);
        }
        ring.publish();
        Ok(ring)
    }

    /// Counts buffer `bid` out: a completion handed it over. It must be recycled once.
    pub(crate) fn take(&mut self, bid: u16) {
        assert!(bid < self.count && self.out < self.count);
        self.out += 1;
    }

    /// How many buffers the kernel may still fill (after the next publish).
    pub(crate) fn free(&self) -> u16 {
        self.count - self.out
    }

    /// The first `len` bytes of buffer `bid`, which a completion handed out.
    pub(crate) fn get(&self, bid: u16, len: usize) -> &[u8] {
        assert!(bid < self.count && len <= self.buf_size);
        // SAFETY: the buffer lies inside the mapping (checked above); the kernel filled its first `len`
        // bytes before posting the CQE and writes it again only after `recycle` (which needs `&mut
        // self`, so not while this borrow lives) and a `publish`.
        unsafe {
            std::slice::from_raw_parts(
                self.bufs.as_ptr().add(usize::from(bid) * self.buf_size),
                len,
            )
        }
    }

    /// Returns buffer `bid` to the ring; the kernel sees it after the next [`BufRing::publish`].
    pub(crate) fn recycle(&mut self, bid: u16) {
        assert!(bid < self.count && self.out > 0);
        self.out -= 1;
        let index = usize::from(self.tail & (self.count - 1));
        // SAFETY: `index < count`, inside the mapping. At most `count` buffers exist and each is
        // returned once per hand-out, so the slot at the tail is one the kernel has consumed (or never
        // saw) and does not read until the tail is published past it. Only this entry's addr, len and
        // bid are written, never the ring's tail that overlays entry 0.
        let entry = unsafe { &mut *self.entries.as_ptr().add(index) };
        entry.set_addr(self.bufs.as_ptr() as u64 + u64::from(bid) * self.buf_size as u64);
        entry.set_len(self.buf_size as u32);
        entry.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
    }

    /// Makes the recycled buffers visible to the kernel.
    pub(crate) fn publish(&mut self) {
        if self.published == self.tail {
            return;
        }
        self.published = self.tail;
        // SAFETY: the tail field of entry 0 is an aligned u16 inside the mapping; the kernel only reads
        // it, and this side writes it only here, atomically, with release ordering so the entries
        // written before are visible first.
        let tail =
            unsafe { AtomicU16::from_ptr(BufRingEntry::tail(self.entries.as_ptr()).cast_mut()) };
        tail.store(self.tail, Ordering::Release);
    }
}
