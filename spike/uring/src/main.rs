//! Spike: the worker's data path on a small io_uring driver of its own, built directly on the
//! `io-uring` crate, measured against the worker as it was on tokio-uring (single-shot reads) and
//! hyper. The worker's driver grew from it; it stays as the measure of a loop that owns its thread
//! (no tokio, no timers, no limits), which the worker does not match yet (docs/runtime.md).
//!
//! `spike-uring ADDR` listens on `ADDR` (e.g. `127.0.0.1:8080`) and serves, on one thread until killed,
//! the same answer as the worker's hello app and `hyper-baseline`: status 200,
//! `content-type: text/plain; charset=utf-8`, `content-length` and `Hello from worker <pid>!\n`, over
//! HTTP/1.1 (keep-alive, pipelining) and HTTP/2 with prior knowledge (h2c), told apart by the preface.
//! Every request goes through the `tower::Service` of `peregrine_worker::Hello` with `http` types.
//!
//! Design:
//! - One ring (`COOP_TASKRUN`, `SINGLE_ISSUER`, and `DEFER_TASKRUN` when the kernel takes it). Each loop
//!   turn pushes the queued SQEs and enters the kernel once (`submit_and_wait(1)`), drains the whole
//!   completion queue, then processes the completions, polls the woken HTTP/2 connections, and queues
//!   one send per connection with output.
//! - One multishot accept, armed again when a CQE comes without `IORING_CQE_F_MORE`.
//! - Per connection one multishot receive into a provided buffer ring shared by all connections
//!   (`peregrine_worker::buf_ring`, the worker's own). Requests are parsed straight from the ring buffer, which goes back to the ring at
//!   once; only the bytes of an incomplete request are copied into the connection's input. `ENOBUFS`
//!   re-arms the receive at the end of the turn (buffers are back by then), a final CQE re-arms, EOF
//!   closes once the output is sent, an error closes.
//! - At most one send in flight per connection, from a buffer that stays in the connection slab until
//!   its CQE; a short send sends the rest next. A connection is freed (its descriptor closed) only once
//!   no operation of it is in flight: closing shuts the socket down and cancels the receive first.
//! - `user_data` is (op kind, generation, slot).
//! - HTTP/1.1 ([`http1`]) with `httparse`; HTTP/2 ([`h2c`]) with the `h2` crate over an in-memory IO
//!   object polled from the loop by a waker of its own, no async runtime.
//! - `SPIKE_STATS=1` prints the count of `io_uring_enter` calls and of completions every 5 s to stderr;
//!   `SPIKE_NO_DEFER=1` sets the ring up without `DEFER_TASKRUN`, to measure what it is worth.
//!
//! Left out, versus the real worker: limits (header, body and connection counts, HTTP/2 settings),
//! timeouts (header read, idle, handshake), request bodies (skipped on HTTP/1, dropped on HTTP/2;
//! chunked requests are refused), a graceful stop on signals, Unix socket listeners, registration with
//! the supervisor, the request counter, logging, and receive bundles.

mod app;
mod h2c;
mod http1;

use std::{
    io,
    net::{Shutdown, SocketAddr, TcpListener},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    process::ExitCode,
    sync::{Arc, Mutex, PoisonError},
};

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use peregrine_worker::Hello;
use socket2::SockRef;

use peregrine_worker::buf_ring::BufRing;

use crate::h2c::{H2Conn, ReadyList};

const USAGE: &str = "usage: spike-uring ADDR (e.g. 127.0.0.1:8080)";

/// Submission queue entries (the completion queue gets four times as many).
const RING_ENTRIES: u32 = 1024;
/// The provided buffer group every receive takes from.
const BUF_GROUP: u16 = 0;
const BUF_COUNT: u16 = 1024;
const BUF_SIZE: usize = 4096;
const LISTEN_BACKLOG: i32 = 1024;
const STATS_EVERY_SECS: u64 = 5;
/// The HTTP/2 connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let addr = match (args.next().map(|a| a.parse::<SocketAddr>()), args.next()) {
        (Some(Ok(addr)), None) => addr,
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match serve(addr) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("spike-uring: {error}");
            ExitCode::FAILURE
        }
    }
}

fn serve(addr: SocketAddr) -> io::Result<()> {
    let listener = TcpListener::bind(addr)?;
    SockRef::from(&listener).listen(LISTEN_BACKLOG)?;
    let (ring, deferred) = new_ring()?;
    let bufs = BufRing::new(&ring, BUF_GROUP, BUF_COUNT, BUF_SIZE)?;
    let stats = std::env::var_os("SPIKE_STATS").is_some_and(|v| v == "1");
    if stats {
        eprintln!("spike-uring: listening on {addr}, DEFER_TASKRUN {deferred}");
    }
    Driver::new(ring, bufs, listener, stats).run()
}

/// The ring, with `DEFER_TASKRUN` if the kernel takes it (then `true`).
fn new_ring() -> io::Result<(IoUring, bool)> {
    let deferred = if std::env::var_os("SPIKE_NO_DEFER").is_some() {
        Err(io::Error::other("DEFER_TASKRUN turned off"))
    } else {
        IoUring::builder()
            .setup_cqsize(RING_ENTRIES * 4)
            .setup_coop_taskrun()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(RING_ENTRIES)
    };
    match deferred {
        Ok(ring) => Ok((ring, true)),
        Err(_) => IoUring::builder()
            .setup_cqsize(RING_ENTRIES * 4)
            .setup_coop_taskrun()
            .setup_single_issuer()
            .build(RING_ENTRIES)
            .map(|ring| (ring, false)),
    }
}

/// The kind of operation a completion is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Accept = 1,
    Recv = 2,
    Send = 3,
    Cancel = 4,
    Stats = 5,
}

const GEN_MASK: u32 = 0x00FF_FFFF;

/// `user_data`: op kind in the top 8 bits, 24 bits of generation, 32 bits of slot.
fn user_data(op: Op, slot: u32, generation: u32) -> u64 {
    (op as u64) << 56 | u64::from(generation & GEN_MASK) << 32 | u64::from(slot)
}

fn decode(user_data: u64) -> (Option<Op>, u32, u32) {
    let op = match user_data >> 56 {
        1 => Some(Op::Accept),
        2 => Some(Op::Recv),
        3 => Some(Op::Send),
        4 => Some(Op::Cancel),
        5 => Some(Op::Stats),
        _ => None,
    };
    (op, user_data as u32, (user_data >> 32) as u32 & GEN_MASK)
}

/// How a connection speaks.
enum Proto {
    /// Not known yet: fewer bytes than the preface arrived, all matching it.
    Detect,
    Http1,
    H2(Box<H2Conn>),
}

struct Conn {
    fd: OwnedFd,
    generation: u32,
    recv_armed: bool,
    /// The receive ended for want of buffers; it is armed again at the end of the turn.
    starved: bool,
    send_in_flight: bool,
    in_flush_list: bool,
    /// Shut down: freed as soon as no operation is in flight.
    closing: bool,
    /// Close once the output is sent; input is ignored.
    close_after_flush: bool,
    /// The bytes of an incomplete request (or preface).
    input: Vec<u8>,
    /// Responses not sent yet.
    out: Vec<u8>,
    /// The buffer of the send in flight; `sending[sent..]` is still to go.
    sending: Vec<u8>,
    sent: usize,
    proto: Proto,
}

impl Conn {
    fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

struct Driver {
    ring: IoUring,
    bufs: BufRing,
    listener: TcpListener,
    service: Hello,
    /// The connection slab; a slot's generation goes up each time it is freed.
    conns: Vec<Option<Conn>>,
    generations: Vec<u32>,
    free: Vec<u32>,
    /// SQEs queued this turn.
    sqes: Vec<squeue::Entry>,
    /// Completions drained this turn: (user_data, result, flags).
    cqes: Vec<(u64, i32, u32)>,
    /// Connections with output to send at the end of the turn.
    flush: Vec<u32>,
    /// Connections whose receive waits for buffers.
    starved: Vec<u32>,
    ready: ReadyList,
    ready_batch: Vec<(u32, u32)>,
    stats: Option<Box<types::Timespec>>,
    enters: u64,
    completions: u64,
}

impl Driver {
    fn new(ring: IoUring, bufs: BufRing, listener: TcpListener, stats: bool) -> Self {
        Driver {
            ring,
            bufs,
            listener,
            service: Hello::new(),
            conns: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            sqes: Vec::new(),
            cqes: Vec::new(),
            flush: Vec::new(),
            starved: Vec::new(),
            ready: Arc::new(Mutex::new(Vec::new())),
            ready_batch: Vec::new(),
            stats: stats.then(|| Box::new(types::Timespec::new().sec(STATS_EVERY_SECS))),
            enters: 0,
            completions: 0,
        }
    }

    fn run(mut self) -> io::Result<()> {
        self.arm_accept();
        self.arm_stats();
        loop {
            self.push_sqes()?;
            self.bufs.publish();
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(error) if matches!(error.raw_os_error(), Some(libc::EINTR | libc::EBUSY)) => {}
                Err(error) => return Err(error),
            }
            self.enters += 1;
            let mut cqes = std::mem::take(&mut self.cqes);
            cqes.extend(
                self.ring
                    .completion()
                    .map(|cqe| (cqe.user_data(), cqe.result(), cqe.flags())),
            );
            self.completions += cqes.len() as u64;
            for &(data, result, flags) in &cqes {
                self.complete(data, result, flags);
            }
            cqes.clear();
            self.cqes = cqes;
            self.poll_ready();
            self.rearm_starved();
            self.flush_output();
        }
    }

    /// Pushes the queued SQEs, entering the kernel early only if the submission queue is full.
    fn push_sqes(&mut self) -> io::Result<()> {
        let mut pushed = 0;
        while pushed < self.sqes.len() {
            {
                let mut sq = self.ring.submission();
                while pushed < self.sqes.len() {
                    // SAFETY: every buffer an SQE points to outlives its operation: send buffers stay
                    // untouched in the connection slab until the send's CQE (a connection is never
                    // freed with an operation in flight), the stats timespec lives in the driver,
                    // and receives use the buffer ring, which is never unmapped.
                    if unsafe { sq.push(&self.sqes[pushed]) }.is_err() {
                        break;
                    }
                    pushed += 1;
                }
            }
            if pushed < self.sqes.len() {
                self.ring.submit()?;
                self.enters += 1;
            }
        }
        self.sqes.clear();
        Ok(())
    }

    fn arm_accept(&mut self) {
        let entry = opcode::AcceptMulti::new(types::Fd(self.listener.as_raw_fd()))
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(user_data(Op::Accept, 0, 0));
        self.sqes.push(entry);
    }

    fn arm_stats(&mut self) {
        if let Some(timespec) = &self.stats {
            let entry = opcode::Timeout::new(&**timespec as *const types::Timespec)
                .build()
                .user_data(user_data(Op::Stats, 0, 0));
            self.sqes.push(entry);
        }
    }

    fn complete(&mut self, data: u64, result: i32, flags: u32) {
        let (op, slot, generation) = decode(data);
        match op {
            Some(Op::Accept) => self.on_accept(result, flags),
            Some(Op::Recv) => self.on_recv(slot, generation, result, flags),
            Some(Op::Send) => self.on_send(slot, generation, result),
            Some(Op::Stats) => {
                eprintln!(
                    "spike-uring: io_uring_enter calls {}, completions {}",
                    self.enters, self.completions
                );
                self.arm_stats();
            }
            Some(Op::Cancel) | None => {}
        }
    }

    fn on_accept(&mut self, result: i32, flags: u32) {
        if !cqueue::more(flags) {
            self.arm_accept();
        }
        if result < 0 {
            eprintln!("accept: {}", io::Error::from_raw_os_error(-result));
            return;
        }
        // SAFETY: the kernel just installed this descriptor for this accept; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(result) };
        let _ = SockRef::from(&fd).set_tcp_nodelay(true);
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.conns.push(None);
                self.generations.push(0);
                (self.conns.len() - 1) as u32
            }
        };
        let generation = self.generations[slot as usize];
        self.conns[slot as usize] = Some(Conn {
            fd,
            generation,
            recv_armed: false,
            starved: false,
            send_in_flight: false,
            in_flush_list: false,
            closing: false,
            close_after_flush: false,
            input: Vec::new(),
            out: Vec::new(),
            sending: Vec::new(),
            sent: 0,
            proto: Proto::Detect,
        });
        self.arm_recv(slot);
    }

    fn arm_recv(&mut self, slot: u32) {
        let Some(Some(conn)) = self.conns.get_mut(slot as usize) else {
            return;
        };
        conn.recv_armed = true;
        let entry = opcode::RecvMulti::new(types::Fd(conn.raw_fd()), BUF_GROUP)
            .build()
            .user_data(user_data(Op::Recv, slot, conn.generation));
        self.sqes.push(entry);
    }

    fn on_recv(&mut self, slot: u32, generation: u32, result: i32, flags: u32) {
        let bid = cqueue::buffer_select(flags);
        if let Some(bid) = bid {
            self.bufs.take(bid);
        }
        let more = cqueue::more(flags);
        let Some(conn) = live(&mut self.conns, slot, generation) else {
            if let Some(bid) = bid {
                self.bufs.recycle(bid);
            }
            return;
        };
        if !more {
            conn.recv_armed = false;
        }
        let mut rearm = false;
        if result > 0 {
            if let Some(bid) = bid {
                if !conn.closing && !conn.close_after_flush {
                    let data = self.bufs.get(bid, result as usize);
                    on_bytes(conn, slot, data, &mut self.service, &self.ready);
                }
                self.bufs.recycle(bid);
            }
            rearm = !more && !conn.closing && !conn.close_after_flush;
        } else if result == 0 {
            match &conn.proto {
                Proto::H2(h2) => h2.eof(),
                _ => conn.close_after_flush = true,
            }
        } else if result == -libc::ENOBUFS {
            if !more && !conn.closing && !conn.starved {
                conn.starved = true;
                self.starved.push(slot);
            }
        } else if !conn.closing {
            begin_close(conn, slot, &mut self.sqes);
        }
        if rearm {
            self.arm_recv(slot);
        }
        self.settle(slot);
    }

    fn on_send(&mut self, slot: u32, generation: u32, result: i32) {
        let Some(conn) = live(&mut self.conns, slot, generation) else {
            return;
        };
        conn.send_in_flight = false;
        if result > 0 && !conn.closing {
            conn.sent += result as usize;
            if conn.sent < conn.sending.len() {
                let entry = send_entry(conn, slot);
                self.sqes.push(entry);
            } else {
                conn.sending.clear();
                conn.sent = 0;
            }
        } else if !conn.closing {
            begin_close(conn, slot, &mut self.sqes);
        }
        self.settle(slot);
    }

    /// After any event of a connection: close it once its output is out if asked, free it once
    /// closed and idle, or queue its output.
    fn settle(&mut self, slot: u32) {
        let Some(Some(conn)) = self.conns.get_mut(slot as usize) else {
            return;
        };
        if !conn.closing && conn.close_after_flush && !conn.send_in_flight && conn.out.is_empty() {
            begin_close(conn, slot, &mut self.sqes);
        }
        if conn.closing {
            if !conn.recv_armed && !conn.send_in_flight {
                // Dropping the connection closes its descriptor; no operation refers to it any more.
                self.conns[slot as usize] = None;
                self.generations[slot as usize] = self.generations[slot as usize].wrapping_add(1);
                self.free.push(slot);
            }
        } else if !conn.out.is_empty() && !conn.send_in_flight && !conn.in_flush_list {
            conn.in_flush_list = true;
            self.flush.push(slot);
        }
    }

    /// Polls every woken HTTP/2 connection until none is left woken.
    fn poll_ready(&mut self) {
        loop {
            std::mem::swap(
                &mut self.ready_batch,
                &mut *self.ready.lock().unwrap_or_else(PoisonError::into_inner),
            );
            if self.ready_batch.is_empty() {
                return;
            }
            let mut batch = std::mem::take(&mut self.ready_batch);
            for &(slot, generation) in &batch {
                let service = &mut self.service;
                let Some(conn) = self
                    .conns
                    .get_mut(slot as usize)
                    .and_then(Option::as_mut)
                    .filter(|conn| conn.generation & GEN_MASK == generation)
                else {
                    continue;
                };
                if conn.closing {
                    continue;
                }
                let Proto::H2(h2) = &mut conn.proto else {
                    continue;
                };
                let done = h2.poll(service);
                h2.take_output(&mut conn.out);
                if done {
                    conn.close_after_flush = true;
                }
                self.settle(slot);
            }
            batch.clear();
            self.ready_batch = batch;
        }
    }

    /// Arms again the receives that ran out of buffers (every buffer is back by the end of a turn).
    fn rearm_starved(&mut self) {
        while let Some(slot) = self.starved.pop() {
            let Some(Some(conn)) = self.conns.get_mut(slot as usize) else {
                continue;
            };
            if !conn.starved {
                continue;
            }
            conn.starved = false;
            if !conn.closing && !conn.recv_armed {
                self.arm_recv(slot);
            }
        }
    }

    /// One send per connection with output and none in flight.
    fn flush_output(&mut self) {
        while let Some(slot) = self.flush.pop() {
            let Some(Some(conn)) = self.conns.get_mut(slot as usize) else {
                continue;
            };
            conn.in_flush_list = false;
            if conn.closing || conn.send_in_flight || conn.out.is_empty() {
                continue;
            }
            debug_assert!(conn.sending.is_empty());
            std::mem::swap(&mut conn.out, &mut conn.sending);
            conn.sent = 0;
            let entry = send_entry(conn, slot);
            self.sqes.push(entry);
        }
    }
}

/// The live connection of `slot`, if its generation is `generation`.
fn live(conns: &mut [Option<Conn>], slot: u32, generation: u32) -> Option<&mut Conn> {
    conns
        .get_mut(slot as usize)?
        .as_mut()
        .filter(|conn| conn.generation & GEN_MASK == generation)
}

/// The send of `conn.sending[conn.sent..]`; marks it in flight.
fn send_entry(conn: &mut Conn, slot: u32) -> squeue::Entry {
    conn.send_in_flight = true;
    let rest = &conn.sending[conn.sent..];
    opcode::Send::new(
        types::Fd(conn.raw_fd()),
        rest.as_ptr(),
        u32::try_from(rest.len()).unwrap_or(u32::MAX),
    )
    .flags(libc::MSG_NOSIGNAL)
    .build()
    .user_data(user_data(Op::Send, slot, conn.generation))
}

/// Shuts the socket down (ending its receive, which is also cancelled); the connection is freed once
/// its operations have completed.
fn begin_close(conn: &mut Conn, slot: u32, sqes: &mut Vec<squeue::Entry>) {
    if conn.closing {
        return;
    }
    conn.closing = true;
    let _ = SockRef::from(&conn.fd).shutdown(Shutdown::Both);
    if conn.recv_armed {
        let target = user_data(Op::Recv, slot, conn.generation);
        sqes.push(
            opcode::AsyncCancel::new(target)
                .build()
                .user_data(user_data(Op::Cancel, slot, conn.generation)),
        );
    }
}

/// Received bytes of a connection: told apart by the preface at first, then served.
fn on_bytes(conn: &mut Conn, slot: u32, data: &[u8], service: &mut Hello, ready: &ReadyList) {
    match &conn.proto {
        Proto::Http1 => serve_http1(conn, data, service),
        Proto::H2(h2) => h2.received(data),
        Proto::Detect => {
            let buffered = !conn.input.is_empty();
            if buffered {
                conn.input.extend_from_slice(data);
            }
            let seen: &[u8] = if buffered { &conn.input } else { data };
            let n = seen.len().min(PREFACE.len());
            if seen[..n] != PREFACE[..n] {
                conn.proto = Proto::Http1;
                serve_http1(conn, if buffered { &[] } else { data }, service);
            } else if n == PREFACE.len() {
                let h2 = H2Conn::new(slot, conn.generation, ready, seen);
                conn.input = Vec::new();
                conn.proto = Proto::H2(h2);
            } else if !buffered {
                conn.input.extend_from_slice(data);
            }
        }
    }
}

/// Answers the complete HTTP/1 requests in the connection's input followed by `data`, parsing straight
/// from `data` when no earlier bytes wait; keeps the incomplete rest.
fn serve_http1(conn: &mut Conn, data: &[u8], service: &mut Hello) {
    if conn.input.is_empty() {
        let (used, close) = http1::serve(data, &mut conn.out, service);
        if close {
            conn.close_after_flush = true;
        } else if used < data.len() {
            conn.input.extend_from_slice(&data[used..]);
        }
    } else {
        conn.input.extend_from_slice(data);
        let (used, close) = http1::serve(&conn.input, &mut conn.out, service);
        if close {
            conn.close_after_flush = true;
            conn.input = Vec::new();
        } else {
            conn.input.drain(..used);
        }
    }
}
