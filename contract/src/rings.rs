//! The io_uring a worker built on the worker library sets up, and what it costs its user in locked
//! memory: the one home of both numbers, for the worker that sizes its ring by them and the
//! supervisor that raises its workers' `RLIMIT_MEMLOCK` to fit them.
//!
//! Without `CAP_IPC_LOCK` (workers have no capability) the kernel charges a ring's memory to its
//! user's locked memory (`user->locked_vm`, against the *creating process's* `RLIMIT_MEMLOCK`): the
//! submission and completion rings and the submission entries (Linux 6.13 and later, where rings
//! live in accounted regions), and the pages of the provided buffer ring, which the kernel pins (all
//! kernels). The charge is the user's, summed over every process of the uid: 256 workers of one user
//! share one allowance, 8 MiB on many systems, so a worker's ring must stay under 32 KiB. The sizes
//! below are what one worker behind Envoy needs: a few dozen connections, each with a receive and a
//! send in flight; a full submission ring is submitted and refilled, the completion ring is four
//! times the submission ring (a multishot receive keeps completing without a new submission), and a
//! full one spills into the kernel's overflow list and loses nothing; 512 receive buffers hold 8 for
//! each of 64 busy connections before a receive pauses (its peer waits in the socket, nothing is
//! lost).
//!
//! Invariant: [`locked_bytes`] is an upper bound of what one worker's ring charges, whatever the
//! kernel version. **Held by:** `tests/tests/privileges.rs:
//! two_hundred_fifty_six_workers_of_one_user_serve_within_an_8_mib_locked_memory_limit` (a bound too
//! low fails it: the limit the supervisor sets from it would be too small).

/// Submission queue entries of a worker's ring.
pub const SUBMISSION_ENTRIES: u32 = 128;

/// Completion queue entries of a worker's ring.
pub const COMPLETION_ENTRIES: u32 = 4 * SUBMISSION_ENTRIES;

/// Buffers in a worker's provided buffer ring (a power of two), shared by every connection's
/// receive.
pub const RECEIVE_BUFFERS: u16 = 512;

/// Bytes per receive buffer.
pub const RECEIVE_BUFFER_BYTES: usize = 4096;

/// The kernel's `struct io_rings` before its completion entries, rounded up: heads, tails, masks,
/// flags and counters (about 320 bytes, with cache-line alignment).
const RINGS_HEADER: usize = 512;

/// An upper bound of the bytes one worker's ring charges to its user's locked memory with pages of
/// `page` bytes: the rings region (header, completions of 16 bytes, the submission index array of 4
/// bytes each), the submission entries (64 bytes each) and the buffer ring's entries (16 bytes each),
/// each rounded up to whole pages.
pub const fn locked_bytes(page: usize) -> usize {
    let rings = RINGS_HEADER + COMPLETION_ENTRIES as usize * 16 + SUBMISSION_ENTRIES as usize * 4;
    let entries = SUBMISSION_ENTRIES as usize * 64;
    let buffer_ring = RECEIVE_BUFFERS as usize * 16;
    (rings.div_ceil(page) + entries.div_ceil(page) + buffer_ring.div_ceil(page)) * page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_ring_locks_twenty_eight_kib_with_four_kib_pages() {
        // Rings 9 KiB -> 3 pages, entries 8 KiB -> 2, buffer ring 8 KiB -> 2.
        assert_eq!(locked_bytes(4096), 7 * 4096);
        // 256 workers of one user (and one more, for a rolling restart's successor) fit in the
        // 8 MiB many systems default to, with room for the rest of what the user locks.
        assert!(257 * locked_bytes(4096) <= 8 << 20);
        assert!(RECEIVE_BUFFERS.is_power_of_two());
    }
}
