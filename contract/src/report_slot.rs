//! A worker's latest load report, where the worker reads it without a syscall: for in-band ORCA, the
//! supervisor writes each worker's report here, and the worker copies it into its responses (each
//! report once per connection) as the `endpoint-load-metrics-bin` header.
//!
//! Layout (the one definition): the slot lives in the worker's *own* counter region (the one-line
//! `memfd` a worker that counts its own requests inherits, [`crate::counters`]), right after the
//! counter line, at byte [`SLOT_OFFSET`]: a sequence word, a length word, then up to [`CAPACITY`]
//! bytes of the report, ready to send (the base64 text of an `xds.data.orca.v3.OrcaLoadReport`),
//! packed eight to a native-endian `u64`. A region made for a worker is [`WORKER_REGION_BYTES`]
//! long ([`create_worker_region`]); the shared region of lanes, where
//! the kernel counts passed-socket servers, has no slot and keeps its layout.
//!
//! It is a seqlock with one writer (the supervisor): the sequence is odd while a report is being
//! written and even otherwise; a reader that sees it odd, or changed across its copy, has a torn
//! copy and reads again. A length of 0 means no report: the worker sends no header. A writer that
//! died mid-write (a supervisor restarting) leaves the sequence odd; the next writer, which finds the
//! slot again through the same region (adoption duplicates the worker's descriptor), finishes it.
//!
//! Versions: a worker of an older version never maps the slot (it sends no header); a region made
//! by an older supervisor is one line long, so a newer worker finds no slot ([`ReportSlot::map`]
//! fails with [`ShmError::TooSmall`]) and sends none.
//!
//! Invariant: only atomics touch the slot (it is shared with another process), and a read never
//! returns a torn report.

use std::{
    os::fd::{BorrowedFd, OwnedFd},
    sync::atomic::{Ordering, fence},
};

use crate::{
    counters::{CounterRegion, LINE},
    shm::{Access, SharedMemory, ShmError},
};

/// Where the slot starts in a worker's own region: after its counter line.
pub const SLOT_OFFSET: usize = LINE;
/// The slot's size: two cache lines.
pub const SLOT_BYTES: usize = 2 * LINE;
/// A worker's own region: its counter line and the slot.
pub const WORKER_REGION_BYTES: usize = SLOT_OFFSET + SLOT_BYTES;

/// Creates a worker's own region: one counter line ([`CounterRegion::create`] for one lane),
/// followed by the worker's load report slot; returns the descriptor and the mapping of its counter
/// line.
pub fn create_worker_region() -> Result<(OwnedFd, CounterRegion), ShmError> {
    CounterRegion::create_sized(1, WORKER_REGION_BYTES)
}
/// The most report bytes the slot holds (the slot less its sequence and length words).
pub const CAPACITY: usize = SLOT_BYTES - 16;

const SEQUENCE: usize = SLOT_OFFSET;
const LENGTH: usize = SLOT_OFFSET + 8;
const DATA: usize = SLOT_OFFSET + 16;

/// How many times a reader copies the slot before it gives up on a writer that keeps writing.
const READ_ATTEMPTS: usize = 4;

/// A report too long for the slot.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("a load report of {0} bytes does not fit the slot's {CAPACITY}")]
pub struct TooLong(pub usize);

/// A mapped report slot (see the module docs for the layout).
#[derive(Debug)]
pub struct ReportSlot {
    memory: SharedMemory,
}

/// A copy of the slot's report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Report {
    /// The sequence it was written under: a later report has a larger one.
    pub sequence: u64,
    /// How many bytes of `bytes` are the report (0: none).
    pub len: usize,
    /// The report, then zeros.
    pub bytes: [u8; CAPACITY],
}

impl Report {
    /// The report's bytes (empty: no report).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl ReportSlot {
    /// Maps the slot of the worker region behind `fd`, once the object is known to hold it (a
    /// region made by an older supervisor does not: [`ShmError::TooSmall`]). The writer maps it
    /// [`Access::ReadWrite`], a reader may map it [`Access::ReadOnly`].
    pub fn map(fd: BorrowedFd<'_>, access: Access) -> Result<ReportSlot, ShmError> {
        let memory = SharedMemory::map(fd, WORKER_REGION_BYTES, access)?;
        Ok(ReportSlot { memory })
    }

    /// Writes `report` (empty: clears the slot). One writer at a time: the supervisor.
    ///
    /// # Panics
    ///
    /// When the slot was mapped read-only.
    pub fn write(&self, report: &[u8]) -> Result<(), TooLong> {
        if report.len() > CAPACITY {
            return Err(TooLong(report.len()));
        }
        let sequence = self.memory.u64_at(SEQUENCE);
        // Odd while writing; already odd if a writer died mid-write, which this write finishes.
        let writing = sequence.load(Ordering::Relaxed) | 1;
        sequence.store(writing, Ordering::Relaxed);
        // No store below may become visible before the odd sequence.
        fence(Ordering::Release);
        self.memory
            .u64_at(LENGTH)
            .store(report.len() as u64, Ordering::Relaxed);
        for (i, chunk) in report.chunks(8).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.memory
                .u64_at(DATA + 8 * i)
                .store(u64::from_ne_bytes(word), Ordering::Relaxed);
        }
        sequence.store(writing.wrapping_add(1), Ordering::Release);
        Ok(())
    }

    /// The sequence of the report in the slot now (even) or being written (odd): a reader that
    /// kept a copy compares it with its copy's to know whether to read again.
    pub fn sequence(&self) -> u64 {
        self.memory.load_u64(SEQUENCE, Ordering::Acquire)
    }

    /// A whole copy of the report, or `None` while a writer keeps writing it (after a few attempts;
    /// try again later) or a writer died mid-write.
    pub fn read(&self) -> Option<Report> {
        for _ in 0..READ_ATTEMPTS {
            let before = self.memory.load_u64(SEQUENCE, Ordering::Acquire);
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let len = (self.memory.load_u64(LENGTH, Ordering::Relaxed) as usize).min(CAPACITY);
            let mut bytes = [0u8; CAPACITY];
            for (i, chunk) in bytes[..len].chunks_mut(8).enumerate() {
                let word = self.memory.load_u64(DATA + 8 * i, Ordering::Relaxed);
                chunk.copy_from_slice(&word.to_ne_bytes()[..chunk.len()]);
            }
            // The copy above happens before the sequence is checked again.
            fence(Ordering::Acquire);
            if self.memory.load_u64(SEQUENCE, Ordering::Relaxed) == before {
                return Some(Report {
                    sequence: before,
                    len,
                    bytes,
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;
    use crate::counters::CounterRegion;

    #[test]
    fn a_report_written_is_read_whole_with_a_later_sequence() {
        let (fd, _counters) = create_worker_region().unwrap();
        let writer = ReportSlot::map(fd.as_fd(), Access::ReadWrite).unwrap();
        let reader = ReportSlot::map(fd.as_fd(), Access::ReadOnly).unwrap();
        let empty = reader.read().unwrap();
        assert_eq!(empty.as_bytes(), b"");
        writer.write(b"CQAAAAAAAOA/MQAAAAAAAFlA").unwrap();
        let first = reader.read().unwrap();
        assert_eq!(first.as_bytes(), b"CQAAAAAAAOA/MQAAAAAAAFlA");
        assert!(first.sequence > empty.sequence && first.sequence.is_multiple_of(2));
        writer.write(b"short").unwrap();
        let second = reader.read().unwrap();
        assert_eq!(second.as_bytes(), b"short");
        assert_eq!(reader.sequence(), second.sequence);
        writer.write(&[b'x'; CAPACITY]).unwrap();
        assert_eq!(reader.read().unwrap().as_bytes(), &[b'x'; CAPACITY]);
        assert_eq!(writer.write(&[0; CAPACITY + 1]), Err(TooLong(CAPACITY + 1)));
        writer.write(b"").unwrap();
        assert_eq!(reader.read().unwrap().as_bytes(), b"");
    }

    #[test]
    fn the_slot_leaves_the_counter_line_alone() {
        let (fd, counters) = create_worker_region().unwrap();
        counters
            .lane(0)
            .fetch_add(41, std::sync::atomic::Ordering::Relaxed);
        let slot = ReportSlot::map(fd.as_fd(), Access::ReadWrite).unwrap();
        slot.write(&[0xff; CAPACITY]).unwrap();
        assert_eq!(counters.lane(0).load(Ordering::Relaxed), 41);
    }

    #[test]
    fn a_region_of_one_line_has_no_slot() {
        // A region made by an older supervisor: the worker finds no slot, and sends no header.
        let (fd, _region) = CounterRegion::create(1).unwrap();
        assert!(matches!(
            ReportSlot::map(fd.as_fd(), Access::ReadOnly),
            Err(ShmError::TooSmall { .. })
        ));
    }

    #[test]
    fn a_write_left_half_done_is_not_read_and_the_next_writer_finishes_it() {
        let (fd, _counters) = create_worker_region().unwrap();
        let slot = ReportSlot::map(fd.as_fd(), Access::ReadWrite).unwrap();
        slot.write(b"old").unwrap();
        // A writer that died after marking the slot as being written.
        let sequence = slot.memory.u64_at(SEQUENCE);
        sequence.fetch_add(1, Ordering::Relaxed);
        assert_eq!(slot.read(), None);
        // The next writer (a restarted supervisor, through the same region).
        let again = ReportSlot::map(fd.as_fd(), Access::ReadWrite).unwrap();
        again.write(b"new").unwrap();
        assert_eq!(slot.read().unwrap().as_bytes(), b"new");
    }

    #[test]
    fn readers_racing_a_writer_never_see_a_torn_report() {
        let (fd, _counters) = create_worker_region().unwrap();
        let writer = ReportSlot::map(fd.as_fd(), Access::ReadWrite).unwrap();
        let reader = ReportSlot::map(fd.as_fd(), Access::ReadOnly).unwrap();
        let reports: Vec<Vec<u8>> = (0..8u8)
            .map(|i| vec![b'a' + i; 10 + 12 * i as usize])
            .collect();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let (done, reports, writer) = (&done, &reports, &writer);
            scope.spawn(move || {
                for i in 0..20_000 {
                    writer.write(&reports[i % reports.len()]).unwrap();
                }
                done.store(true, Ordering::Release);
            });
            while !done.load(Ordering::Acquire) {
                if let Some(report) = reader.read()
                    && !report.as_bytes().is_empty()
                {
                    assert!(reports.iter().any(|r| r == report.as_bytes()));
                }
            }
        });
        let last = &reports[(20_000 - 1) % reports.len()];
        assert_eq!(reader.read().unwrap().as_bytes(), last.as_slice());
    }
}
