//! A poll adapter: tokio's `AsyncRead` and `AsyncWrite` over the owned-buffer (completion) [`Io`].
//!
//! The `h2` crate drives its IO through `poll_read` / `poll_write`, which lend a buffer for one call
//! only; io_uring needs a buffer it owns until the kernel completes. [`UringIo`] bridges the two by
//! owning every buffer the kernel sees and copying at the boundary:
//!
//! - **Reads.** At most one read is in flight. It reads into the adapter's own buffer (`input`); a
//!   `poll_read` hands out bytes already read first and only submits a read when none are left. What does
//!   not fit in the caller's buffer stays in `input` for the next call. A read in flight is kept in the
//!   adapter (never rebuilt per poll: a read future created and dropped on every poll never completes,
//!   which is tokio-uring issue #318).
//! - **Writes.** `poll_write` copies the caller's bytes into `output` (at most [`WRITE_BUFFER`] bytes are
//!   held there) before it reports them written: the caller may reuse its slice at once. `output` is
//!   submitted as one `write_all` when it fills up, on `poll_flush` and on `poll_shutdown`, so the frames
//!   `h2` writes between two flushes go out in one operation. At most one write is in flight; its buffer
//!   lives in the operation until it completes and is then reused. Bytes are submitted once, in the order
//!   they were accepted.
//! - **Errors.** A failed read is returned by the `poll_read` that observes it. A failed write is returned
//!   by the next `poll_write`, `poll_flush` or `poll_shutdown` (like a `BufWriter`, a write reported as
//!   accepted may fail later), and every later write call fails too: bytes after a lost write would be
//!   garbage to the peer.
//!
//! Dropping the adapter with an operation in flight drops the operation; tokio-uring keeps its buffer
//! until the kernel completes it (see DESIGN.md, "Cancellation").
//!
//! Architecture Invariant: the adapter knows nothing of HTTP; it is tested with a fake [`Io`] whose
//! operations complete when the test says so.

use std::{
    fmt,
    future::Future,
    io::{self, IoSlice},
    pin::Pin,
    rc::Rc,
    task::{Context, Poll, ready},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::stream::Io;

/// How many bytes a read asks for.
pub(crate) const READ_CHUNK: usize = 64 * 1024;

/// How many accepted bytes the adapter holds before it must submit them (and wait for the previous write).
pub(crate) const WRITE_BUFFER: usize = 64 * 1024;

type ReadOp = Pin<Box<dyn Future<Output = (io::Result<usize>, Vec<u8>)>>>;
type WriteOp = Pin<Box<dyn Future<Output = (io::Result<()>, Vec<u8>)>>>;

/// tokio's `AsyncRead + AsyncWrite` over an [`Io`]; see the module docs.
pub(crate) struct UringIo<T> {
    io: Rc<T>,
    /// Bytes read and not yet handed out are `input[consumed..]`; while a read is in flight the buffer
    /// lives in `reading` and `input` is empty.
    input: Vec<u8>,
    consumed: usize,
    reading: Option<ReadOp>,
    eof: bool,
    /// Bytes accepted from the caller and not yet submitted.
    output: Vec<u8>,
    writing: Option<WriteOp>,
    /// A spare buffer (a completed write's) for the next `output`.
    spare: Vec<u8>,
    /// Set once a write failed: the error is reported once, then every write call fails with this kind.
    write_failed: Option<io::ErrorKind>,
    pending_error: Option<io::Error>,
    shut_down: bool,
}

impl<T> fmt::Debug for UringIo<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringIo")
            .field("buffered_input", &(self.input.len() - self.consumed))
            .field("reading", &self.reading.is_some())
            .field("eof", &self.eof)
            .field("buffered_output", &self.output.len())
            .field("writing", &self.writing.is_some())
            .field("write_failed", &self.write_failed)
            .finish()
    }
}

// === impl UringIo ===

impl<T: Io + 'static> UringIo<T> {
    /// Wraps `io`; `already_read` are bytes read from it before (they are handed out first).
    pub(crate) fn new(io: Rc<T>, already_read: Vec<u8>) -> Self {
        UringIo {
            io,
            input: already_read,
            consumed: 0,
            reading: None,
            eof: false,
            output: Vec::new(),
            writing: None,
            spare: Vec::new(),
            write_failed: None,
            pending_error: None,
            shut_down: false,
        }
    }

    /// Polls the read in flight, submitting one first if there is none. Ready once `input` holds unread
    /// bytes, or at end of stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.consumed < self.input.len() || self.eof {
            return Poll::Ready(Ok(()));
        }
        let op = match &mut self.reading {
            Some(op) => op,
            None => {
                let mut buf = std::mem::take(&mut self.input);
                buf.clear();
                buf.reserve(READ_CHUNK);
                self.consumed = 0;
                let io = self.io.clone();
                self.reading
                    .insert(Box::pin(async move { io.read(buf).await }))
            }
        };
        let (result, buf) = ready!(op.as_mut().poll(cx));
        self.reading = None;
        self.input = buf;
        match result {
            Ok(0) => {
                self.eof = true;
                Poll::Ready(Ok(()))
            }
            Ok(_) => Poll::Ready(Ok(())),
            Err(error) => Poll::Ready(Err(error)),
        }
    }

    /// Polls the write in flight, if any: Ready once none is in flight. A failure is recorded, not
    /// returned.
    fn poll_op(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(op) = &mut self.writing {
            let (result, mut buf) = ready!(op.as_mut().poll(cx));
            self.writing = None;
            buf.clear();
            self.spare = buf;
            if let Err(error) = result {
                self.write_failed = Some(error.kind());
                self.pending_error = Some(error);
            }
        }
        Poll::Ready(())
    }

    /// Polls the write in flight, if any: Ready once none is in flight, with any write failure.
    fn poll_writing(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_op(cx));
        Poll::Ready(self.check_write_failed())
    }

    fn check_write_failed(&mut self) -> io::Result<()> {
        if let Some(error) = self.pending_error.take() {
            return Err(error);
        }
        if let Some(kind) = self.write_failed {
            return Err(io::Error::new(
                kind,
                "an earlier write on this stream failed",
            ));
        }
        Ok(())
    }

    /// Ready once `output` is submitted, and, with `complete`, once no write is in flight either.
    fn poll_submitted(&mut self, cx: &mut Context<'_>, complete: bool) -> Poll<io::Result<()>> {
        loop {
            match self.poll_writing(cx) {
                Poll::Ready(result) => result?,
                // A write is in flight and this task is woken when it completes; what was accepted
                // since is ours and goes out, coalesced, in the next write then.
                Poll::Pending if !complete => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
            if self.output.is_empty() {
                return Poll::Ready(Ok(()));
            }
            self.submit(cx);
        }
    }

    /// Submits `output` as one write. No write may be in flight.
    fn submit(&mut self, cx: &mut Context<'_>) {
        debug_assert!(self.writing.is_none());
        let buf = std::mem::replace(&mut self.output, std::mem::take(&mut self.spare));
        let io = self.io.clone();
        self.writing = Some(Box::pin(async move { io.write_all(buf).await }));
        // Polling once pushes the operation to the ring (an async block runs nothing until polled) and
        // registers the waker; a result that is ready at once is kept for the next write call.
        let _ = self.poll_op(cx);
    }

    /// Accepts bytes from `bufs` into `output`, submitting it when full. Ready with the number of bytes
    /// copied (never more than were copied: the caller may reuse its buffers at once).
    fn poll_accept(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            self.check_write_failed()?;
            return Poll::Ready(Ok(0));
        }
        // Collect a finished write's result (and its error) without waiting for one in flight.
        if self.poll_writing(cx)?.is_pending() && self.output.len() >= WRITE_BUFFER {
            return Poll::Pending;
        }
        if self.output.len() >= WRITE_BUFFER {
            // No write in flight and `output` full: submit it, then accept into the spare buffer.
            self.submit(cx);
        }
        let mut room = WRITE_BUFFER - self.output.len();
        let mut copied = 0;
        for buf in bufs {
            if room == 0 {
                break;
            }
            let n = buf.len().min(room);
            self.output.extend_from_slice(&buf[..n]);
            copied += n;
            room -= n;
        }
        if room == 0 && self.writing.is_none() {
            self.submit(cx);
        }
        Poll::Ready(Ok(copied))
    }
}

impl<T: Io + 'static> AsyncRead for UringIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        ready!(this.poll_fill(cx))?;
        let unread = &this.input[this.consumed..];
        let n = unread.len().min(buf.remaining());
        buf.put_slice(&unread[..n]);
        this.consumed += n;
        Poll::Ready(Ok(()))
    }
}

impl<T: Io + 'static> AsyncWrite for UringIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_accept(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_accept(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Ready once every byte accepted is either in a write submitted to the kernel or, while a write is
    /// in flight, held by the adapter: the task is woken when that write completes, and the next call
    /// submits what was held, coalesced. Every byte is ours once accepted, and a write's error surfaces
    /// on the next call. Waiting for completions here would cost the connection an event-loop turn per
    /// flush; `poll_shutdown` waits until everything is written.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_submitted(cx, false)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.as_mut().get_mut().poll_submitted(cx, true))?;
        let this = self.get_mut();
        if !this.shut_down {
            this.shut_down = true;
            this.io.shutdown();
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    //! The adapter against a fake [`Io`] whose operations complete when the test releases them.

    use std::{
        cell::{Cell, RefCell},
        collections::VecDeque,
        future::poll_fn,
        task::Waker,
    };

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// What the fake returns for the next read.
    enum ReadStep {
        Data(Vec<u8>),
        Eof,
        Fail(io::ErrorKind),
    }

    /// A fake stream: each operation stays pending until the test allows it (`allow_reads` /
    /// `allow_writes`), then completes on its next poll. It records every submission.
    #[derive(Default)]
    struct Fake {
        reads: RefCell<VecDeque<ReadStep>>,
        read_budget: Cell<usize>,
        write_budget: Cell<usize>,
        /// How many operations have been started, and how many are in flight now.
        reads_started: Cell<usize>,
        writes_started: Cell<usize>,
        reads_in_flight: Cell<usize>,
        writes_in_flight: Cell<usize>,
        /// Each write's bytes, in the order submitted.
        written: RefCell<Vec<Vec<u8>>>,
        fail_write: Cell<Option<io::ErrorKind>>,
        wakers: RefCell<Vec<Waker>>,
        shut_down: Cell<bool>,
    }

    impl Fake {
        fn wake(&self) {
            for w in self.wakers.borrow_mut().drain(..) {
                w.wake();
            }
        }
        fn allow_reads(&self, n: usize) {
            self.read_budget.set(self.read_budget.get() + n);
            self.wake();
        }
        fn allow_writes(&self, n: usize) {
            self.write_budget.set(self.write_budget.get() + n);
            self.wake();
        }
        fn all_written(&self) -> Vec<u8> {
            self.written.borrow().concat()
        }
    }

    /// Waits until `budget` allows one more operation, then takes it.
    async fn take(fake: &Fake, budget: &Cell<usize>) {
        poll_fn(|cx| {
            if budget.get() > 0 {
                budget.set(budget.get() - 1);
                Poll::Ready(())
            } else {
                fake.wakers.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }

    impl Io for Fake {
        async fn read(&self, mut buf: Vec<u8>) -> (io::Result<usize>, Vec<u8>) {
            self.reads_started.set(self.reads_started.get() + 1);
            self.reads_in_flight.set(self.reads_in_flight.get() + 1);
            assert_eq!(self.reads_in_flight.get(), 1, "two reads in flight");
            take(self, &self.read_budget).await;
            self.reads_in_flight.set(self.reads_in_flight.get() - 1);
            let step = self.reads.borrow_mut().pop_front().unwrap_or(ReadStep::Eof);
            match step {
                ReadStep::Data(data) => {
                    // Like a socket: at most the spare capacity, the rest stays for the next read.
                    let room = buf.capacity() - buf.len();
                    let n = data.len().min(room);
                    buf.extend_from_slice(&data[..n]);
                    if n < data.len() {
                        self.reads
                            .borrow_mut()
                            .push_front(ReadStep::Data(data[n..].to_vec()));
                    }
                    (Ok(n), buf)
                }
                ReadStep::Eof => (Ok(0), buf),
                ReadStep::Fail(kind) => (Err(kind.into()), buf),
            }
        }

        async fn write_all(&self, buf: Vec<u8>) -> (io::Result<()>, Vec<u8>) {
            self.writes_started.set(self.writes_started.get() + 1);
            self.writes_in_flight.set(self.writes_in_flight.get() + 1);
            assert_eq!(self.writes_in_flight.get(), 1, "two writes in flight");
            take(self, &self.write_budget).await;
            self.writes_in_flight.set(self.writes_in_flight.get() - 1);
            if let Some(kind) = self.fail_write.get() {
                return (Err(kind.into()), buf);
            }
            self.written.borrow_mut().push(buf.clone());
            (Ok(()), buf)
        }

        fn shutdown(&self) {
            self.shut_down.set(true);
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn noop_cx() -> Context<'static> {
        Context::from_waker(Waker::noop())
    }

    fn run<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async { tokio::time::timeout(std::time::Duration::from_secs(10), f).await })
            .expect("the test timed out")
    }

    #[test]
    fn hands_out_already_read_bytes_before_reading() {
        let fake = Rc::new(Fake::default());
        let mut io = UringIo::new(fake.clone(), b"PRI * HTTP/2.0".to_vec());
        let mut cx = noop_cx();
        let mut small = [0u8; 4];
        let mut rb = ReadBuf::new(&mut small);
        assert!(Pin::new(&mut io).poll_read(&mut cx, &mut rb).is_ready());
        assert_eq!(rb.filled(), b"PRI ");
        let mut rest = [0u8; 64];
        let mut rb = ReadBuf::new(&mut rest);
        assert!(Pin::new(&mut io).poll_read(&mut cx, &mut rb).is_ready());
        assert_eq!(rb.filled(), b"* HTTP/2.0");
        assert_eq!(fake.reads_started.get(), 0);
    }

    #[test]
    fn a_pending_read_is_polled_not_resubmitted() {
        let fake = Rc::new(Fake::default());
        fake.reads
            .borrow_mut()
            .push_back(ReadStep::Data(pattern(100_000, 1)));
        let mut io = UringIo::new(fake.clone(), Vec::new());
        let mut cx = noop_cx();
        let mut out = Vec::new();
        let mut chunk = [0u8; 1000];
        for _ in 0..10 {
            let mut rb = ReadBuf::new(&mut chunk);
            assert!(Pin::new(&mut io).poll_read(&mut cx, &mut rb).is_pending());
        }
        assert_eq!(fake.reads_started.get(), 1);
        // The fake delivers at most READ_CHUNK per read (a short read), in small caller buffers.
        fake.allow_reads(1);
        loop {
            let mut rb = ReadBuf::new(&mut chunk);
            match Pin::new(&mut io).poll_read(&mut cx, &mut rb) {
                Poll::Ready(Ok(())) => {
                    assert!(!rb.filled().is_empty());
                    out.extend_from_slice(rb.filled());
                }
                Poll::Ready(Err(e)) => panic!("{e}"),
                Poll::Pending => break,
            }
        }
        assert_eq!(out.len(), READ_CHUNK);
        assert_eq!(fake.reads_started.get(), 2);
        fake.allow_reads(2);
        let mut rb_all = vec![0u8; 200_000];
        loop {
            let mut rb = ReadBuf::new(&mut rb_all);
            match Pin::new(&mut io).poll_read(&mut cx, &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => break,
                Poll::Ready(Ok(())) => out.extend_from_slice(rb.filled()),
                Poll::Ready(Err(e)) => panic!("{e}"),
                Poll::Pending => panic!("pending with reads allowed"),
            }
        }
        assert_eq!(out, pattern(100_000, 1));
        // Two data reads and the end of stream.
        assert_eq!(fake.reads_started.get(), 3);
    }

    #[test]
    fn a_read_error_surfaces() {
        let fake = Rc::new(Fake::default());
        fake.reads.borrow_mut().extend([
            ReadStep::Data(b"ab".to_vec()),
            ReadStep::Fail(io::ErrorKind::ConnectionReset),
        ]);
        fake.allow_reads(2);
        let mut io = UringIo::new(fake, Vec::new());
        run(async move {
            let mut buf = [0u8; 8];
            assert_eq!(io.read(&mut buf).await.unwrap(), 2);
            let error = io.read(&mut buf).await.unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::ConnectionReset);
        });
    }

    #[test]
    fn writes_are_owned_before_they_are_reported_and_submitted_once() {
        let fake = Rc::new(Fake::default());
        let mut io = UringIo::new(fake.clone(), Vec::new());
        let mut cx = noop_cx();
        let mut expected = Vec::new();
        // Small writes coalesce; nothing is submitted before a flush or a full buffer.
        for seed in 0..10u8 {
            let mut data = pattern(1000, seed);
            match Pin::new(&mut io).poll_write(&mut cx, &data) {
                Poll::Ready(Ok(n)) => assert_eq!(n, 1000),
                other => panic!("{other:?}"),
            }
            expected.extend_from_slice(&data);
            // The caller reuses its buffer at once: the adapter must have copied it.
            data.fill(0xEE);
        }
        assert_eq!(fake.writes_started.get(), 0);
        // A flush submits once; it is done once the write is in the kernel's hands (in flight), and
        // flushing again submits nothing more.
        for _ in 0..5 {
            assert!(matches!(
                Pin::new(&mut io).poll_flush(&mut cx),
                Poll::Ready(Ok(()))
            ));
        }
        assert_eq!(fake.writes_started.get(), 1);
        // Shutdown waits for the write in flight.
        assert!(Pin::new(&mut io).poll_shutdown(&mut cx).is_pending());
        // Writes while one is in flight are accepted up to the buffer size, then wait.
        let big = pattern(3 * WRITE_BUFFER, 99);
        let mut offered = 0;
        while let Poll::Ready(n) = Pin::new(&mut io).poll_write(&mut cx, &big[offered..]) {
            offered += n.unwrap();
        }
        assert_eq!(offered, WRITE_BUFFER);
        expected.extend_from_slice(&big[..offered]);
        assert_eq!(fake.writes_started.get(), 1);
        fake.allow_writes(1);
        // Now the first write completes, the full buffer is submitted, more is accepted.
        let n = match Pin::new(&mut io).poll_write(&mut cx, &big[offered..]) {
            Poll::Ready(Ok(n)) => n,
            other => panic!("{other:?}"),
        };
        expected.extend_from_slice(&big[offered..offered + n]);
        assert_eq!(fake.writes_started.get(), 2);
        fake.allow_writes(10);
        assert!(matches!(
            Pin::new(&mut io).poll_flush(&mut cx),
            Poll::Ready(Ok(()))
        ));
        assert_eq!(fake.all_written(), expected);
        assert_eq!(fake.writes_started.get(), 3);
        // A flush with nothing buffered submits nothing.
        assert!(Pin::new(&mut io).poll_flush(&mut cx).is_ready());
        assert_eq!(fake.writes_started.get(), 3);
    }

    #[test]
    fn vectored_writes_keep_their_order() {
        let fake = Rc::new(Fake::default());
        fake.allow_writes(usize::MAX / 2);
        let mut io = UringIo::new(fake.clone(), Vec::new());
        let mut cx = noop_cx();
        let a = pattern(9, 1);
        let b = pattern(WRITE_BUFFER, 2);
        let mut expected = Vec::new();
        let mut slices_a: &[u8] = &a;
        let mut slices_b: &[u8] = &b;
        while !slices_a.is_empty() || !slices_b.is_empty() {
            let bufs = [IoSlice::new(slices_a), IoSlice::new(slices_b)];
            let n = match Pin::new(&mut io).poll_write_vectored(&mut cx, &bufs) {
                Poll::Ready(Ok(n)) => n,
                Poll::Pending => continue,
                Poll::Ready(Err(e)) => panic!("{e}"),
            };
            let from_a = n.min(slices_a.len());
            expected.extend_from_slice(&slices_a[..from_a]);
            slices_a = &slices_a[from_a..];
            expected.extend_from_slice(&slices_b[..n - from_a]);
            slices_b = &slices_b[n - from_a..];
        }
        while Pin::new(&mut io).poll_flush(&mut cx).is_pending() {}
        assert_eq!(fake.all_written(), expected);
    }

    #[test]
    fn a_write_error_surfaces_and_sticks() {
        let fake = Rc::new(Fake::default());
        fake.fail_write.set(Some(io::ErrorKind::BrokenPipe));
        fake.allow_writes(1);
        let mut io = UringIo::new(fake.clone(), Vec::new());
        run(async move {
            io.write_all(b"hello").await.unwrap();
            let error = io.flush().await.unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::BrokenPipe);
            let error = io.write_all(b"more").await.unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::BrokenPipe);
            assert!(io.shutdown().await.is_err());
        });
        assert_eq!(fake.writes_started.get(), 1);
    }

    #[test]
    fn an_error_of_a_background_write_surfaces_on_the_next_write() {
        let fake = Rc::new(Fake::default());
        fake.fail_write.set(Some(io::ErrorKind::ConnectionReset));
        let mut io = UringIo::new(fake.clone(), Vec::new());
        let mut cx = noop_cx();
        // Fill the buffer: it is submitted in the background.
        let data = pattern(WRITE_BUFFER, 3);
        assert!(matches!(
            Pin::new(&mut io).poll_write(&mut cx, &data),
            Poll::Ready(Ok(n)) if n == WRITE_BUFFER
        ));
        assert_eq!(fake.writes_started.get(), 1);
        fake.allow_writes(1);
        match Pin::new(&mut io).poll_write(&mut cx, b"x") {
            Poll::Ready(Err(e)) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn shutdown_flushes_first() {
        let fake = Rc::new(Fake::default());
        let mut io = UringIo::new(fake.clone(), Vec::new());
        let fake2 = fake.clone();
        run(async move {
            io.write_all(b"last words").await.unwrap();
            let release = async {
                tokio::task::yield_now().await;
                assert!(!fake2.shut_down.get());
                fake2.allow_writes(1);
            };
            let (done, ()) = tokio::join!(io.shutdown(), release);
            done.unwrap();
        });
        assert!(fake.shut_down.get());
        assert_eq!(fake.all_written(), b"last words");
    }

    /// Many writers and readers interleaved at random through the adapter: every byte arrives once, in
    /// order, while operations complete in arbitrary order relative to the polls.
    #[test]
    fn interleaved_random_completion_keeps_every_byte() {
        let fake = Rc::new(Fake::default());
        let input = pattern(1_000_000, 7);
        for chunk in input.chunks(7777) {
            fake.reads
                .borrow_mut()
                .push_back(ReadStep::Data(chunk.to_vec()));
        }
        let mut io = UringIo::new(fake.clone(), b"preface".to_vec());
        let mut cx = noop_cx();
        let output = pattern(1_000_000, 9);
        let (mut sent, mut received) = (0usize, Vec::new());
        let mut rng = 0x1234_5678u32;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 17;
            rng ^= rng << 5;
            rng
        };
        let mut eof = false;
        while sent < output.len() || !eof {
            match next() % 5 {
                0 => fake.allow_reads(1),
                1 => fake.allow_writes(1),
                2 if sent < output.len() => {
                    let len = (next() as usize % 20_000 + 1).min(output.len() - sent);
                    if let Poll::Ready(n) =
                        Pin::new(&mut io).poll_write(&mut cx, &output[sent..sent + len])
                    {
                        sent += n.unwrap();
                    }
                }
                3 => {
                    let _ = Pin::new(&mut io).poll_flush(&mut cx);
                }
                _ => {
                    let mut buf = vec![0u8; next() as usize % 10_000 + 1];
                    let mut rb = ReadBuf::new(&mut buf);
                    if let Poll::Ready(r) = Pin::new(&mut io).poll_read(&mut cx, &mut rb) {
                        r.unwrap();
                        eof = rb.filled().is_empty();
                        received.extend_from_slice(rb.filled());
                    }
                }
            }
        }
        fake.allow_writes(usize::MAX / 2);
        while Pin::new(&mut io).poll_flush(&mut cx).is_pending() {}
        let mut expected = b"preface".to_vec();
        expected.extend_from_slice(&input);
        assert!(received == expected, "read bytes differ");
        assert!(fake.all_written() == output, "written bytes differ");
    }
}
