//! The worker's io_uring driver: one ring per thread, on the `io-uring` crate, with exactly the
//! operations the worker needs (`docs/runtime.md` says why and how it was chosen).
//!
//! - **Multishot accept.** One submission per listener accepts every connection that arrives
//!   ([`net::Listener`]).
//! - **Multishot receive into a provided buffer ring.** One submission per connection receives for as
//!   long as the connection lives ([`net::Stream`]). The kernel picks a buffer from a ring shared by
//!   every connection ([`buf_ring`]) when data arrives, so an idle connection owns no read buffer; the
//!   reader copies the bytes out and the buffer goes back to the ring at once.
//! - **Sends, one per connection per turn.** A writer queues bytes with the driver and goes on; at the
//!   end of the turn each connection with queued bytes gets one send of all of them (while a send is in
//!   flight, more bytes queue behind it). So every response a turn produced for a connection leaves in
//!   one send, and a writer never waits for the kernel unless its queue is full
//!   ([`MAX_QUEUED_SEND`]).
//! - **Batching.** Operations are queued in the submission queue and reach the kernel together when
//!   the thread is about to wait: the host runtime calls [`turn`] before it parks.
//!
//! The host runtime is a tokio current-thread runtime ([`crate::runtime`]): it runs the connections'
//! tasks, the application's futures and every timer. The ring's descriptor is registered with it, so a
//! completion wakes the thread when it waits. The ring is set up with `SINGLE_ISSUER` and
//! `COOP_TASKRUN` (completions are posted when the thread next enters the kernel, which it does every
//! turn, instead of interrupting it). Not `DEFER_TASKRUN`: its completions are posted only by an
//! `io_uring_enter` asking for them, and a thread waiting in tokio's `epoll_wait` is then not woken by
//! the ring's descriptor (measured: with it, the worker's tests hang).
//!
//! **Back-pressure.** A connection holds at most [`MAX_QUEUED`] received buffers that its reader has
//! not taken. When it reaches that, its receive is cancelled, and armed again once the reader has taken
//! half of them; meanwhile the bytes stay in the socket and TCP's window holds the peer back. When the
//! ring has no free buffer, the kernel ends the receive with `ENOBUFS`: no byte is lost (it stays in the
//! socket) and the receive is armed again as soon as a buffer is back. A connection has one receive at a
//! time, so its bytes arrive in order.
//!
//! **Ownership and close.** Every listener and stream has a slot, named by its completions'
//! `user_data`. A slot is freed only once its owner is gone *and* the kernel has posted the last
//! completion of each of its operations, so a completion never meets a reused slot; the bytes of a
//! send live in the slot until then. A buffer the kernel hands to a slot whose owner is gone goes
//! straight back to the ring. A stream dropped with bytes still queued keeps its descriptor in the
//! driver and sends them first (for at most [`LINGER`]; a peer that reads nothing is then cut off at
//! the next turn after that), then closes.
//!
//! Invariant: nothing here calls the application or any waker while the driver is borrowed: wakers are
//! collected and woken after.
#![allow(
    unsafe_code,
    reason = "submissions name memory the kernel uses until they complete"
)]

pub(crate) mod buf_ring;
pub(crate) mod net;

use std::{
    cell::RefCell,
    collections::VecDeque,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use peregrine_contract::rings;

use self::buf_ring::BufRing;

/// How a driver is sized.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    /// Submission queue entries.
    pub(crate) entries: u32,
    /// Completion queue entries.
    pub(crate) completions: u32,
    /// Buffers in the provided buffer ring (a power of two).
    pub(crate) buffers: u16,
    /// Bytes per buffer.
    pub(crate) buffer_size: usize,
    /// How long a dropped stream may take to send what it queued before it is cut off.
    pub(crate) linger: Duration,
}

impl Default for Sizes {
    fn default() -> Self {
        // What a worker's user is charged in locked memory follows from these
        // (`peregrine_contract::rings`).
        Sizes {
            entries: rings::SUBMISSION_ENTRIES,
            completions: rings::COMPLETION_ENTRIES,
            buffers: rings::RECEIVE_BUFFERS,
            buffer_size: rings::RECEIVE_BUFFER_BYTES,
            linger: LINGER,
        }
    }
}

/// How many received buffers a connection may hold untaken before its receive pauses.
pub(crate) const MAX_QUEUED: u16 = 8;

/// How many bytes a connection may queue for sending before its writer waits.
pub(crate) const MAX_QUEUED_SEND: usize = 64 * 1024;

/// How long a dropped stream may take to send what it queued before it is cut off, by default.
pub(crate) const LINGER: Duration = Duration::from_secs(10);

/// The largest send buffer a connection keeps for reuse once its bytes are sent.
const KEEP_SEND_BUFFER: usize = 16 * 1024;

/// The buffer group every receive takes from.
const BUF_GROUP: u16 = 0;

/// The `user_data` of cancellations, whose completions say nothing anyone waits for.
const CANCEL: u64 = u64::MAX;

/// Set in the `user_data` of a stream's sends (its receive has it clear).
const SEND: u64 = 1 << 32;

thread_local! {
    static DRIVER: RefCell<Option<Driver>> = const { RefCell::new(None) };
}

/// What a slot serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Kind {
    #[default]
    Listener,
    Stream,
}

/// One listener's or stream's state, named by its index in `user_data`.
#[derive(Debug, Default)]
struct Slot {
    in_use: bool,
    kind: Kind,
    fd: RawFd,
    /// Its owner (a [`net::Listener`], a [`net::Stream`]) still exists.
    owned: bool,
    /// The kernel holds the multishot accept or receive (no final completion yet).
    armed: bool,
    /// A cancellation of the armed receive was submitted (back-pressure).
    pausing: bool,
    /// Waiting in the driver's list for a free buffer.
    starving: bool,
    /// The task waiting to accept or read.
    reader: Option<Waker>,
    /// Accept or receive completions not yet taken by the owner: `(result, flags)`.
    completions: VecDeque<(i32, u32)>,
    /// How many bytes of the front completion's buffer the reader has taken.
    offset: usize,
    /// How many of `completions` hold a ring buffer.
    buffers: u16,
    /// Bytes queued for the next send.
    out: Vec<u8>,
    /// The bytes of the send in flight (or to resubmit), of which `sent` are sent.
    inflight: Vec<u8>,
    sent: usize,
    /// The kernel holds a send of this slot.
    sending: bool,
    /// Listed for a send at the end of the turn.
    listed: bool,
    /// A send failed: every later write fails too (bytes after a lost write would be garbage).
    send_error: Option<i32>,
    /// The task waiting for room in `out` or for everything to be sent.
    writer: Option<Waker>,
    /// Shut the socket down once everything queued is sent.
    shutdown_after: bool,
    /// A dropped stream's descriptor, closed once what it queued is sent.
    lingering: Option<OwnedFd>,
}

// === impl Slot ===

impl Slot {
    fn drained(&self) -> bool {
        self.out.is_empty() && self.inflight.is_empty()
    }
}

struct Driver {
    ring: IoUring,
    bufs: BufRing,
    linger: Duration,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Receives waiting for a free buffer to be armed again.
    starved: Vec<u32>,
    /// Streams with bytes to send at the end of the turn.
    to_send: Vec<u32>,
    /// Dropped streams still sending, with their deadlines.
    lingering: Vec<(u32, Instant)>,
    /// Completions drained and not yet handled.
    drained: Vec<(u64, i32, u32)>,
    /// Wakers to wake once the driver is no longer borrowed.
    wake: Vec<Waker>,
}

/// Installs a driver on this thread; fails if one is installed already or the ring cannot be set up.
pub(crate) fn install(sizes: Sizes) -> io::Result<RawFd> {
    let driver = Driver::new(sizes)?;
    let fd = driver.ring.as_raw_fd();
    DRIVER.with_borrow_mut(|slot| {
        if slot.is_some() {
            return Err(io::Error::other(
                "an io_uring driver runs on this thread already",
            ));
        }
        *slot = Some(driver);
        Ok(fd)
    })
}

/// Removes this thread's driver, submitting what its last owners queued (their cancellations) first.
pub(crate) fn uninstall() {
    if let Some(mut driver) = DRIVER.with_borrow_mut(Option::take) {
        driver.flush();
        driver.forget_in_flight();
    }
}

/// The end of a turn: submits everything queued in one `io_uring_enter` and handles every completion
/// posted, before and by it; wakes the owners they concern. The host runtime calls it before it parks.
pub(crate) fn turn() {
    run(|driver| {
        driver.reap();
        driver.flush();
        driver.reap();
    });
}

/// Handles every completion posted, without entering the kernel: the host runtime calls it when the
/// ring's descriptor is readable. Submitting waits for the end of the turn, when the tasks it wakes
/// have queued their sends.
pub(crate) fn reap() {
    run(Driver::reap);
}

/// Runs `step` on this thread's driver, then wakes the owners it found completions for.
fn run(step: impl FnOnce(&mut Driver)) {
    let mut wake = DRIVER.with_borrow_mut(|driver| match driver {
        Some(driver) => {
            step(driver);
            std::mem::take(&mut driver.wake)
        }
        None => Vec::new(),
    });
    for waker in wake.drain(..) {
        waker.wake();
    }
    // Hand the (empty) vector back, so turns do not allocate.
    DRIVER.with_borrow_mut(|driver| {
        if let Some(driver) = driver
            && driver.wake.capacity() < wake.capacity()
        {
            driver.wake = wake;
        }
    });
}

/// Runs `f` on this thread's driver.
///
/// # Panics
///
/// When no driver is installed: the worker's sockets are used only on its runtime.
fn with<R>(f: impl FnOnce(&mut Driver) -> R) -> R {
    DRIVER.with_borrow_mut(|driver| {
        f(driver
            .as_mut()
            .expect("io_uring operations need the worker's runtime (peregrine_worker::runtime)"))
    })
}

/// Like [`with`], but does nothing when the driver is gone (an owner dropped after the runtime).
fn with_if_installed(f: impl FnOnce(&mut Driver)) {
    DRIVER.with_borrow_mut(|driver| {
        if let Some(driver) = driver {
            f(driver);
        }
    });
}

/// Takes ownership of a descriptor the kernel created (an accepted connection).
fn own(fd: RawFd) -> OwnedFd {
    // SAFETY: a successful accept's result is a new descriptor that nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

// === impl Driver ===

impl Driver {
    fn new(sizes: Sizes) -> io::Result<Self> {
        let ring = IoUring::builder()
            .setup_cqsize(sizes.completions)
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .setup_single_issuer()
            .build(sizes.entries)?;
        let bufs = BufRing::new(&ring, BUF_GROUP, sizes.buffers, sizes.buffer_size)?;
        Ok(Driver {
            ring,
            bufs,
            linger: sizes.linger,
            slots: Vec::new(),
            free: Vec::new(),
            starved: Vec::new(),
            to_send: Vec::new(),
            lingering: Vec::new(),
            drained: Vec::new(),
            wake: Vec::new(),
        })
    }

    fn alloc(&mut self, kind: Kind, fd: RawFd) -> u32 {
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                self.slots.push(Slot::default());
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 sockets")
            }
        };
        let slot = &mut self.slots[index as usize];
        debug_assert!(!slot.in_use && slot.completions.is_empty());
        slot.in_use = true;
        slot.kind = kind;
        slot.fd = fd;
        slot.owned = true;
        index
    }

    /// Frees `index` if nobody needs it any more: no owner, nothing in the kernel, nothing to send.
    fn settle(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        if !slot.in_use || slot.owned || slot.armed || slot.sending {
            return;
        }
        if slot.lingering.is_some() && !slot.drained() && slot.send_error.is_none() {
            return;
        }
        for (result, flags) in slot.completions.drain(..) {
            if result > 0
                && let Some(bid) = cqueue::buffer_select(flags)
            {
                self.bufs.recycle(bid);
            }
            if slot.kind == Kind::Listener && result >= 0 {
                // An accepted connection nobody will serve.
                drop(own(result));
            }
        }
        if slot.lingering.take().is_some() {
            self.lingering.retain(|&(i, _)| i != index);
        }
        // Keep the queue's allocation for the next socket of this slot.
        let completions = std::mem::take(&mut slot.completions);
        *slot = Slot {
            completions,
            ..Slot::default()
        };
        self.free.push(index);
    }

    /// Queues `entry`; submits first when the submission queue is full.
    fn push(&mut self, entry: &squeue::Entry) {
        loop {
            // SAFETY: every entry names memory that outlives its operation: a send's bytes live in
            // its slot until its completion (and are leaked if the ring goes first), receives use the
            // buffer ring (never unmapped), accepts and cancellations name no memory.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return;
            }
            if let Err(error) = self.ring.submit() {
                tracing::warn!(%error, "io_uring submission failed");
            }
        }
    }

    fn cancel(&mut self, user_data: u64) {
        let cancel = opcode::AsyncCancel::new(user_data)
            .build()
            .user_data(CANCEL);
        self.push(&cancel);
    }

    /// The end of a turn: sends what streams queued, publishes recycled buffers, arms starved
    /// receives when buffers are back, cuts off lingering streams past their deadline, and submits.
    fn flush(&mut self) {
        let mut to_send = std::mem::take(&mut self.to_send);
        for &index in &to_send {
            self.slots[index as usize].listed = false;
            self.send(index);
        }
        to_send.clear();
        self.to_send = to_send;
        self.bufs.publish();
        while self.bufs.free() > 0
            && let Some(index) = self.starved.pop()
        {
            self.slots[index as usize].starving = false;
            self.arm_recv(index);
        }
        self.bufs.publish();
        if !self.lingering.is_empty() {
            let now = Instant::now();
            let expired: Vec<u32> = self
                .lingering
                .iter()
                .filter(|&&(_, deadline)| deadline <= now)
                .map(|&(index, _)| index)
                .collect();
            for index in expired {
                self.lingering.retain(|&(i, _)| i != index);
                tracing::debug!(
                    linger_ms = self.linger.as_millis() as u64,
                    "A closed connection's peer did not read what was left to send, cut off"
                );
                let slot = &mut self.slots[index as usize];
                slot.send_error = Some(libc::ETIMEDOUT);
                if slot.sending {
                    // Its completion frees the slot.
                    self.cancel(u64::from(index) | SEND);
                } else {
                    self.settle(index);
                }
            }
        }
        let queued = !self.ring.submission().is_empty();
        let taskrun = self.ring.submission().taskrun();
        if queued || taskrun {
            // With COOP_TASKRUN, completions whose work is pending are posted on this entry too.
            if let Err(error) = self.ring.submit() {
                // EBUSY/EAGAIN: the kernel is short of room and takes the entries at the next turn.
                if !matches!(error.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) {
                    tracing::warn!(%error, "io_uring submission failed");
                }
            }
        }
    }

    fn reap(&mut self) {
        let mut drained = std::mem::take(&mut self.drained);
        drained.extend(
            self.ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result(), cqe.flags())),
        );
        for &(user_data, result, flags) in &drained {
            if user_data == CANCEL {
                continue;
            }
            let index = user_data as u32;
            if user_data & SEND != 0 {
                self.sent(index, result);
            } else {
                self.received(index, result, flags);
            }
        }
        drained.clear();
        self.drained = drained;
    }

    /// An accept's or a receive's completion.
    fn received(&mut self, index: u32, result: i32, flags: u32) {
        let bid = cqueue::buffer_select(flags);
        if let Some(bid) = bid {
            self.bufs.take(bid);
        }
        let slot = &mut self.slots[index as usize];
        if !cqueue::more(flags) {
            slot.armed = false;
            slot.pausing = false;
        }
        if !slot.owned {
            if let Some(bid) = bid {
                self.bufs.recycle(bid);
            }
            if slot.kind == Kind::Listener && result >= 0 {
                drop(own(result));
            }
            self.settle(index);
            return;
        }
        match -result {
            // The ring ran dry: the bytes wait in the socket until a buffer is back.
            libc::ENOBUFS if slot.kind == Kind::Stream && !slot.armed => {
                if !slot.starving {
                    slot.starving = true;
                    self.starved.push(index);
                }
                return;
            }
            // The end of a receive paused for back-pressure (`pausing` was cleared just above).
            libc::ECANCELED if slot.kind == Kind::Stream && !slot.armed => {}
            _ => {
                slot.completions.push_back((result, flags));
                if bid.is_some() {
                    slot.buffers += 1;
                }
            }
        }
        let pause =
            slot.armed && slot.kind == Kind::Stream && !slot.pausing && slot.buffers >= MAX_QUEUED;
        if pause {
            slot.pausing = true;
        }
        if let Some(waker) = slot.reader.take() {
            self.wake.push(waker);
        }
        if pause {
            self.cancel(u64::from(index));
        }
    }

    /// A send's completion.
    fn sent(&mut self, index: u32, result: i32) {
        let slot = &mut self.slots[index as usize];
        slot.sending = false;
        if result < 0 && result != -libc::EINTR && result != -libc::EAGAIN {
            slot.send_error = Some(-result);
            slot.out.clear();
            slot.inflight.clear();
        } else if result > 0 {
            slot.sent += result as usize;
            if slot.sent == slot.inflight.len() {
                slot.inflight.clear();
                slot.sent = 0;
                if slot.inflight.capacity() > KEEP_SEND_BUFFER {
                    slot.inflight = Vec::new();
                }
            }
        }
        let more = slot.send_error.is_none() && !slot.drained();
        if slot.drained() || slot.send_error.is_some() {
            if std::mem::take(&mut slot.shutdown_after) {
                shut_down(slot.fd);
            }
            if slot.out.capacity() > KEEP_SEND_BUFFER {
                slot.out = Vec::new();
            }
        }
        if let Some(waker) = slot.writer.take() {
            self.wake.push(waker);
        }
        if more {
            self.list(index);
        } else {
            self.settle(index);
        }
    }

    /// Lists `index` for a send at the end of the turn.
    fn list(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        if !slot.listed {
            slot.listed = true;
            self.to_send.push(index);
        }
    }

    /// Submits one send of everything `index` has queued, unless one is in flight.
    fn send(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        if !slot.in_use || slot.sending || slot.send_error.is_some() {
            return;
        }
        if slot.inflight.is_empty() {
            if slot.out.is_empty() {
                return;
            }
            std::mem::swap(&mut slot.inflight, &mut slot.out);
            slot.sent = 0;
        }
        let rest = &slot.inflight[slot.sent..];
        let entry = opcode::Send::new(
            types::Fd(slot.fd),
            rest.as_ptr(),
            u32::try_from(rest.len()).unwrap_or(u32::MAX),
        )
        .flags(libc::MSG_NOSIGNAL)
        .build()
        .user_data(u64::from(index) | SEND);
        slot.sending = true;
        self.push(&entry);
    }

    /// Arms the multishot receive of `index` if its reader wants bytes and none is armed.
    fn arm_recv(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        let ended = slot
            .completions
            .back()
            .is_some_and(|&(result, _)| result <= 0);
        if !slot.owned || slot.armed || slot.starving || ended || slot.buffers > MAX_QUEUED / 2 {
            return;
        }
        if self.bufs.free() == 0 {
            slot.starving = true;
            self.starved.push(index);
            return;
        }
        slot.armed = true;
        let entry = opcode::RecvMulti::new(types::Fd(slot.fd), BUF_GROUP)
            .build()
            .user_data(u64::from(index));
        self.push(&entry);
    }

    fn arm_accept(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        if slot.armed {
            return;
        }
        slot.armed = true;
        let entry = opcode::AcceptMulti::new(types::Fd(slot.fd))
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(u64::from(index));
        self.push(&entry);
    }

    /// The owner of `index` is gone, handing over its descriptor: cancels the accept or receive, lets
    /// queued bytes go out first (within the linger time), frees the slot and closes when it can.
    fn release(&mut self, index: u32, fd: OwnedFd) {
        let slot = &mut self.slots[index as usize];
        slot.owned = false;
        slot.reader = None;
        slot.writer = None;
        if slot.starving {
            slot.starving = false;
            self.starved.retain(|&i| i != index);
        }
        let linger = slot.send_error.is_none() && !slot.drained();
        let armed = slot.armed;
        if linger {
            slot.lingering = Some(fd);
            self.lingering.push((index, Instant::now() + self.linger));
        } else {
            // Closing the descriptor does not end what the kernel holds (it holds the socket too):
            // the cancellation below does, at the next turn.
            drop(fd);
        }
        if armed {
            self.cancel(u64::from(index));
        }
        self.settle(index);
    }

    /// The ring is going away with operations in flight: the kernel finishes tearing them down on its own
    /// time, so the send buffers they name are leaked rather than freed under it.
    fn forget_in_flight(&mut self) {
        for slot in &mut self.slots {
            if slot.sending {
                std::mem::forget(std::mem::take(&mut slot.inflight));
            }
        }
    }

    /// Hands the bytes `index` received to `take` (see [`net::Stream::poll_read`]).
    fn poll_read(
        &mut self,
        index: u32,
        cx: &mut Context<'_>,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Poll<io::Result<usize>> {
        let mut total = 0;
        let outcome = loop {
            let slot = &mut self.slots[index as usize];
            let Some(&(result, flags)) = slot.completions.front() else {
                break None;
            };
            if result > 0 {
                let bid = cqueue::buffer_select(flags).expect("a receive names its buffer");
                let data = &self.bufs.get(bid, result as usize)[slot.offset..];
                let n = take(data);
                total += n;
                if n < data.len() {
                    slot.offset += n;
                    break None;
                }
                slot.completions.pop_front();
                slot.offset = 0;
                slot.buffers -= 1;
                self.bufs.recycle(bid);
            } else if total > 0 {
                break None;
            } else if result == 0 {
                // The end of the stream stays queued: every later read sees it too.
                break Some(Ok(0));
            } else {
                slot.completions.pop_front();
                break Some(Err(io::Error::from_raw_os_error(-result)));
            }
        };
        self.arm_recv(index);
        match outcome {
            Some(outcome) => Poll::Ready(outcome),
            None if total > 0 => Poll::Ready(Ok(total)),
            None => {
                self.slots[index as usize].reader = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    /// Queues bytes to send on `index` (see [`net::Stream::poll_write`]).
    fn poll_write(
        &mut self,
        index: u32,
        cx: &mut Context<'_>,
        data: &mut dyn FnMut(&mut Vec<u8>) -> usize,
    ) -> Poll<io::Result<usize>> {
        let slot = &mut self.slots[index as usize];
        if let Some(error) = slot.send_error {
            return Poll::Ready(Err(io::Error::from_raw_os_error(error)));
        }
        if slot.out.len() >= MAX_QUEUED_SEND {
            slot.writer = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = data(&mut slot.out);
        if n > 0 {
            self.list(index);
        }
        Poll::Ready(Ok(n))
    }

    /// Ready once everything `index` queued is sent.
    fn poll_flushed(&mut self, index: u32, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let slot = &mut self.slots[index as usize];
        if let Some(error) = slot.send_error {
            return Poll::Ready(Err(io::Error::from_raw_os_error(error)));
        }
        if slot.drained() {
            return Poll::Ready(Ok(()));
        }
        slot.writer = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Shuts `index` down both ways once everything it queued is sent.
    fn shutdown(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        if slot.drained() || slot.send_error.is_some() {
            shut_down(slot.fd);
        } else {
            slot.shutdown_after = true;
        }
    }
}

/// Shuts a socket down both ways; the peer may be gone already, which is no error.
fn shut_down(fd: RawFd) {
    // SAFETY: `fd` is the descriptor of a slot in use, open for as long as the slot is (its owner or
    // the slot's `lingering` holds it).
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
}

#[cfg(test)]
mod tests;
