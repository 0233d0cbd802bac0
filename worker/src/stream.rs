//! The byte streams connections run over.
//!
//! [`Io`] is what the protocol modules see: bytes the kernel received are handed out as they are
//! (nothing is submitted per read), and bytes to send are queued and go out at the end of the turn,
//! so a writer waits only when its queue is full or when it asks to ([`Io::poll_flushed`]). [`Stream`]
//! is an accepted TCP or Unix connection on the worker's driver.

use std::{
    future::poll_fn,
    io,
    task::{Context, Poll},
};

pub(crate) use crate::driver::net::Stream;

/// The byte stream a connection runs over.
pub(crate) trait Io {
    /// Hands the bytes received and not yet read to `take`, in order, a slice at a time; `take` returns
    /// how many bytes of the slice it took and is offered no more once it took less than the whole
    /// slice. It must take at least one byte of the first slice. Ready with the total taken, `Ok(0)`
    /// only at the end of the stream.
    fn poll_read(
        &self,
        cx: &mut Context<'_>,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Poll<io::Result<usize>>;
    /// Queues bytes of `data` to send: Ready with how many (at least one, unless `data` is empty),
    /// Pending while the queue is full. An earlier send's error is returned here and from then on.
    fn poll_write(&self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>>;
    /// Queues all of `buf` to send and leaves it empty; Pending while the queue is full.
    fn poll_write_vec(&self, cx: &mut Context<'_>, buf: &mut Vec<u8>) -> Poll<io::Result<()>> {
        while !buf.is_empty() {
            match self.poll_write(cx, buf) {
                Poll::Ready(Ok(n)) => {
                    buf.drain(..n);
                }
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
    /// Ready once everything queued is sent, or with the error that lost it.
    fn poll_flushed(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// Shuts the stream down in both directions once everything queued is sent.
    fn shutdown(&self);
}

/// Appends what `io` received to `buf`, at most its spare capacity (which must not be zero), and hands
/// the buffer back with the count (0 at the end of the stream). Dropping the future loses no byte.
pub(crate) async fn read<I: Io>(io: &I, mut buf: Vec<u8>) -> (io::Result<usize>, Vec<u8>) {
    debug_assert!(buf.capacity() > buf.len(), "a read needs room");
    let result = poll_fn(|cx| {
        io.poll_read(cx, &mut |data| {
            let n = data.len().min(buf.capacity() - buf.len());
            buf.extend_from_slice(&data[..n]);
            n
        })
    })
    .await;
    (result, buf)
}

/// Queues all of `buf` to send, leaving it empty; waits only while the queue is full.
pub(crate) async fn write<I: Io>(io: &I, buf: &mut Vec<u8>) -> io::Result<()> {
    poll_fn(|cx| io.poll_write_vec(cx, buf)).await
}

// === impl Stream ===

impl Io for Stream {
    fn poll_read(
        &self,
        cx: &mut Context<'_>,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Poll<io::Result<usize>> {
        Stream::poll_read(self, cx, take)
    }

    fn poll_write(&self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Stream::poll_write(self, cx, data)
    }

    fn poll_write_vec(&self, cx: &mut Context<'_>, buf: &mut Vec<u8>) -> Poll<io::Result<()>> {
        Stream::poll_write_vec(self, cx, buf)
    }

    fn poll_flushed(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Stream::poll_flushed(self, cx)
    }

    fn shutdown(&self) {
        Stream::shutdown(self);
    }
}
