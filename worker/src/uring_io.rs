//! A poll adapter: tokio's `AsyncRead` and `AsyncWrite` over the completion-IO [`Io`], for the `h2`
//! crate.
//!
//! - **Reads.** Bytes come from the driver's receive as they arrived, copied straight into the caller's
//!   buffer; the bytes read before the hand-over (`already_read`) come first. Nothing is submitted per
//!   read and the adapter holds no read buffer: what does not fit stays with the driver.
//! - **Writes.** `poll_write` queues the caller's bytes on the stream (a copy: the caller may reuse its
//!   slice at once) and is Pending only while the stream's queue is full. The driver sends everything a
//!   connection queued during a turn in one send at the turn's end, so the frames `h2` writes between
//!   two turns leave together, and `poll_flush` has nothing to wait for: it reports an earlier send's
//!   error, if any. `poll_shutdown` waits until everything queued is sent, then shuts the socket down.
//! - **Errors.** A failed read is returned by the `poll_read` that observes it. A failed send is
//!   returned by the next write call, and by every one after it: bytes after a lost send would be
//!   garbage to the peer.
//!
//! Architecture Invariant: the adapter knows nothing of HTTP; it is tested with a fake [`Io`].

use std::{
    fmt,
    io::{self, IoSlice},
    pin::Pin,
    rc::Rc,
    task::{Context, Poll, ready},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::stream::Io;

/// tokio's `AsyncRead + AsyncWrite` over an [`Io`]; see the module docs.
pub(crate) struct UringIo<T> {
    io: Rc<T>,
    /// Bytes read before the hand-over and not yet handed out are `already_read[consumed..]`.
    already_read: Vec<u8>,
    consumed: usize,
    shut_down: bool,
}

impl<T> fmt::Debug for UringIo<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringIo")
            .field("already_read", &(self.already_read.len() - self.consumed))
            .field("shut_down", &self.shut_down)
            .finish()
    }
}

// === impl UringIo ===

impl<T: Io> UringIo<T> {
    /// Wraps `io`; `already_read` are bytes read from it before (they are handed out first).
    pub(crate) fn new(io: Rc<T>, already_read: Vec<u8>) -> Self {
        UringIo {
            io,
            already_read,
            consumed: 0,
            shut_down: false,
        }
    }
}

impl<T: Io> AsyncRead for UringIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if this.consumed < this.already_read.len() {
            let unread = &this.already_read[this.consumed..];
            let n = unread.len().min(buf.remaining());
            buf.put_slice(&unread[..n]);
            this.consumed += n;
            if this.consumed == this.already_read.len() {
                this.already_read = Vec::new();
                this.consumed = 0;
            }
            return Poll::Ready(Ok(()));
        }
        ready!(this.io.poll_read(cx, &mut |data| {
            let n = data.len().min(buf.remaining());
            buf.put_slice(&data[..n]);
            n
        }))?;
        Poll::Ready(Ok(()))
    }
}

impl<T: Io> AsyncWrite for UringIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.io.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut total = 0;
        for buf in bufs.iter().filter(|b| !b.is_empty()) {
            match self.io.poll_write(cx, buf) {
                Poll::Ready(Ok(n)) => {
                    total += n;
                    if n < buf.len() {
                        break;
                    }
                }
                Poll::Ready(Err(error)) if total == 0 => return Poll::Ready(Err(error)),
                Poll::Pending if total == 0 => return Poll::Pending,
                // What was queued is reported; the error or the wait comes with the next call.
                Poll::Ready(Err(_)) | Poll::Pending => break,
            }
        }
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Every byte accepted is queued with the driver, which sends it at the end of the turn: there is
    /// nothing to wait for, only an earlier send's error to report.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.io.poll_write(cx, &[]).map_ok(|_| ())
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.io.poll_flushed(cx))?;
        if !this.shut_down {
            this.shut_down = true;
            this.io.shutdown();
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    //! The adapter against a fake [`Io`] that receives and sends when the test says so.

    use std::{
        cell::{Cell, RefCell},
        collections::VecDeque,
        task::Waker,
    };

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// How many bytes the fake queues before a writer waits.
    const QUEUE: usize = 1000;

    /// A fake stream: bytes the test delivers are received; bytes written queue (up to [`QUEUE`]) until
    /// the test sends them.
    #[derive(Default)]
    struct Fake {
        received: RefCell<VecDeque<u8>>,
        eof: Cell<bool>,
        read_error: Cell<Option<io::ErrorKind>>,
        queued: RefCell<Vec<u8>>,
        sent: RefCell<Vec<u8>>,
        send_error: Cell<Option<io::ErrorKind>>,
        wakers: RefCell<Vec<Waker>>,
        shut_down: Cell<bool>,
    }

    impl Fake {
        fn wake(&self) {
            for w in self.wakers.borrow_mut().drain(..) {
                w.wake();
            }
        }
        fn deliver(&self, data: &[u8]) {
            self.received.borrow_mut().extend(data);
            self.wake();
        }
        fn send_queued(&self) {
            let queued = std::mem::take(&mut *self.queued.borrow_mut());
            self.sent.borrow_mut().extend_from_slice(&queued);
            self.wake();
        }
        fn wait(&self, cx: &mut Context<'_>) {
            self.wakers.borrow_mut().push(cx.waker().clone());
        }
    }

    impl Io for Fake {
        fn poll_read(
            &self,
            cx: &mut Context<'_>,
            take: &mut dyn FnMut(&[u8]) -> usize,
        ) -> Poll<io::Result<usize>> {
            if let Some(kind) = self.read_error.take() {
                return Poll::Ready(Err(kind.into()));
            }
            let mut received = self.received.borrow_mut();
            if received.is_empty() {
                if self.eof.get() {
                    return Poll::Ready(Ok(0));
                }
                self.wait(cx);
                return Poll::Pending;
            }
            let (front, _) = received.as_slices();
            let n = take(front);
            received.drain(..n);
            Poll::Ready(Ok(n))
        }

        fn poll_write(&self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
            if let Some(kind) = self.send_error.get() {
                return Poll::Ready(Err(kind.into()));
            }
            let mut queued = self.queued.borrow_mut();
            if !data.is_empty() && queued.len() >= QUEUE {
                self.wait(cx);
                return Poll::Pending;
            }
            let n = data.len().min(QUEUE - queued.len());
            queued.extend_from_slice(&data[..n]);
            Poll::Ready(Ok(n))
        }

        fn poll_flushed(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            if let Some(kind) = self.send_error.get() {
                return Poll::Ready(Err(kind.into()));
            }
            if self.queued.borrow().is_empty() {
                return Poll::Ready(Ok(()));
            }
            self.wait(cx);
            Poll::Pending
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
    fn hands_out_already_read_bytes_before_received_ones() {
        let fake = Rc::new(Fake::default());
        fake.deliver(b"SM");
        let mut io = UringIo::new(fake.clone(), b"PRI * HTTP/2.0".to_vec());
        let mut cx = noop_cx();
        let mut small = [0u8; 4];
        let mut rb = ReadBuf::new(&mut small);
        assert!(Pin::new(&mut io).poll_read(&mut cx, &mut rb).is_ready());
        assert_eq!(rb.filled(), b"PRI ");
        let mut rest = [0u8; 64];
        for expected in [&b"* HTTP/2.0"[..], b"SM"] {
            let mut rb = ReadBuf::new(&mut rest);
            assert!(Pin::new(&mut io).poll_read(&mut cx, &mut rb).is_ready());
            assert_eq!(rb.filled(), expected);
        }
        let mut rb = ReadBuf::new(&mut rest);
        assert!(Pin::new(&mut io).poll_read(&mut cx, &mut rb).is_pending());
    }

    #[test]
    fn reads_end_and_fail_as_the_stream_does() {
        let fake = Rc::new(Fake::default());
        fake.deliver(b"ab");
        let mut io = UringIo::new(fake.clone(), Vec::new());
        run(async move {
            let mut buf = [0u8; 8];
            assert_eq!(io.read(&mut buf).await.unwrap(), 2);
            fake.read_error.set(Some(io::ErrorKind::ConnectionReset));
            let error = io.read(&mut buf).await.unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::ConnectionReset);
            fake.eof.set(true);
            assert_eq!(io.read(&mut buf).await.unwrap(), 0);
        });
    }

    #[test]
    fn writes_queue_in_order_and_wait_only_while_the_queue_is_full() {
        let fake = Rc::new(Fake::default());
        let mut io = UringIo::new(fake.clone(), Vec::new());
        let mut cx = noop_cx();
        let a = pattern(300, 1);
        let b = pattern(2000, 2);
        // A vectored write takes what fits, in order.
        let bufs = [IoSlice::new(&a), IoSlice::new(&b)];
        let n = match Pin::new(&mut io).poll_write_vectored(&mut cx, &bufs) {
            Poll::Ready(Ok(n)) => n,
            other => panic!("{other:?}"),
        };
        assert_eq!(n, QUEUE);
        assert!(Pin::new(&mut io).poll_write(&mut cx, &b).is_pending());
        // A flush waits for nothing.
        assert!(matches!(
            Pin::new(&mut io).poll_flush(&mut cx),
            Poll::Ready(Ok(()))
        ));
        // Shutdown waits until everything is sent.
        assert!(Pin::new(&mut io).poll_shutdown(&mut cx).is_pending());
        assert!(!fake.shut_down.get());
        fake.send_queued();
        assert!(Pin::new(&mut io).poll_shutdown(&mut cx).is_ready());
        assert!(fake.shut_down.get());
        let mut expected = a.clone();
        expected.extend_from_slice(&b[..QUEUE - a.len()]);
        assert_eq!(*fake.sent.borrow(), expected);
    }

    #[test]
    fn a_send_error_surfaces_on_every_later_write() {
        let fake = Rc::new(Fake::default());
        let mut io = UringIo::new(fake.clone(), Vec::new());
        run(async move {
            io.write_all(b"hello").await.unwrap();
            fake.send_error.set(Some(io::ErrorKind::BrokenPipe));
            let error = io.flush().await.unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::BrokenPipe);
            let error = io.write_all(b"more").await.unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::BrokenPipe);
            assert!(io.shutdown().await.is_err());
        });
    }

    /// Writers and readers interleaved at random through the adapter: every byte arrives once, in
    /// order.
    #[test]
    fn interleaved_random_progress_keeps_every_byte() {
        let fake = Rc::new(Fake::default());
        let input = pattern(1_000_000, 7);
        let mut io = UringIo::new(fake.clone(), b"preface".to_vec());
        let mut cx = noop_cx();
        let output = pattern(1_000_000, 9);
        let (mut delivered, mut sent, mut received) = (0usize, 0usize, Vec::new());
        let mut rng = 0x1234_5678u32;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 17;
            rng ^= rng << 5;
            rng
        };
        let mut eof = false;
        while sent < output.len() || !eof {
            match next() % 4 {
                0 if delivered < input.len() => {
                    let len = (next() as usize % 9000 + 1).min(input.len() - delivered);
                    fake.deliver(&input[delivered..delivered + len]);
                    delivered += len;
                    fake.eof.set(delivered == input.len());
                }
                1 => fake.send_queued(),
                2 if sent < output.len() => {
                    let len = (next() as usize % 20_000 + 1).min(output.len() - sent);
                    if let Poll::Ready(n) =
                        Pin::new(&mut io).poll_write(&mut cx, &output[sent..sent + len])
                    {
                        sent += n.unwrap();
                    }
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
        fake.send_queued();
        let mut expected = b"preface".to_vec();
        expected.extend_from_slice(&input);
        assert!(received == expected, "read bytes differ");
        assert!(*fake.sent.borrow() == output, "written bytes differ");
    }
}
