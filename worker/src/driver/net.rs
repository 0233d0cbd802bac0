//! Sockets on the driver: a [`Listener`] accepts with one multishot accept; a [`Stream`] receives with
//! one multishot receive and queues what it sends, which the driver sends at the end of the turn.

use std::{
    future::poll_fn,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    task::{Context, Poll},
};

use super::{Kind, MAX_QUEUED_SEND, own, with, with_if_installed};

/// A listening socket accepting through one multishot accept. Dropping it cancels the accept; the
/// socket closes once the kernel lets go of it (at the next turn).
#[derive(Debug)]
pub(crate) struct Listener {
    fd: Option<OwnedFd>,
    slot: u32,
}

impl Listener {
    /// Takes over a listening socket (TCP or Unix). Must be called on the worker's runtime.
    pub(crate) fn new(fd: OwnedFd) -> Self {
        let slot = with(|driver| driver.alloc(Kind::Listener, fd.as_raw_fd()));
        Listener { fd: Some(fd), slot }
    }

    /// The next accepted connection. A failure (typically `EMFILE`) ends the multishot accept; the next
    /// call arms it again. The kernel takes the descriptor limit when the accept is armed.
    pub(crate) fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<OwnedFd>> {
        with(|driver| {
            let slot = &mut driver.slots[self.slot as usize];
            if let Some((result, _)) = slot.completions.pop_front() {
                return Poll::Ready(if result >= 0 {
                    Ok(own(result))
                } else {
                    Err(io::Error::from_raw_os_error(-result))
                });
            }
            slot.reader = Some(cx.waker().clone());
            driver.arm_accept(self.slot);
            Poll::Pending
        })
    }

    /// [`Listener::poll_accept`] as a future; dropping it loses no connection.
    pub(crate) async fn accept(&self) -> io::Result<OwnedFd> {
        poll_fn(|cx| self.poll_accept(cx)).await
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(fd) = self.fd.take() {
            let slot = self.slot;
            with_if_installed(|driver| driver.release(slot, fd));
        }
    }
}

/// A connected socket: a multishot receive, armed from the start, and a send queue.
///
/// Dropping it cancels the receive; bytes already queued are still sent (for a while, see the
/// driver), then the socket closes. Received bytes not yet read are dropped with it.
#[derive(Debug)]
pub(crate) struct Stream {
    fd: Option<OwnedFd>,
    slot: u32,
}

impl Stream {
    /// Takes over a connected socket and arms its receive. Must be called on the worker's runtime.
    pub(crate) fn new(fd: OwnedFd) -> Self {
        let slot = with(|driver| {
            let slot = driver.alloc(Kind::Stream, fd.as_raw_fd());
            driver.arm_recv(slot);
            slot
        });
        Stream { fd: Some(fd), slot }
    }

    /// Hands the bytes received and not yet read to `take`, in order, a slice at a time; `take`
    /// returns how many bytes of the slice it took and is offered no more once it took less than the
    /// whole slice. It must take at least one byte of the first slice. Ready with the total taken,
    /// `Ok(0)` only at the end of the stream (and from then on), or with the receive's error.
    pub(crate) fn poll_read(
        &self,
        cx: &mut Context<'_>,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Poll<io::Result<usize>> {
        with(|driver| driver.poll_read(self.slot, cx, take))
    }

    /// Queues bytes of `data` to send: Ready with how many (at least one, unless `data` is empty), or
    /// Pending while [`MAX_QUEUED_SEND`] bytes wait already. The error of an earlier send is returned
    /// here, and by every later call.
    pub(crate) fn poll_write(&self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        with(|driver| {
            driver.poll_write(self.slot, cx, &mut |out| {
                let n = data.len().min(MAX_QUEUED_SEND - out.len());
                out.extend_from_slice(&data[..n]);
                n
            })
        })
    }

    /// Queues all of `buf` to send, leaving it empty (without a copy when nothing else is queued:
    /// then the vectors are swapped). Pending while [`MAX_QUEUED_SEND`] bytes wait already.
    pub(crate) fn poll_write_vec(
        &self,
        cx: &mut Context<'_>,
        buf: &mut Vec<u8>,
    ) -> Poll<io::Result<()>> {
        with(|driver| {
            driver.poll_write(self.slot, cx, &mut |out| {
                let n = buf.len();
                if out.is_empty() {
                    std::mem::swap(out, buf);
                } else {
                    out.extend_from_slice(buf);
                    buf.clear();
                }
                n
            })
        })
        .map_ok(|_| ())
    }

    /// Ready once everything queued is sent, or with the error that lost it.
    pub(crate) fn poll_flushed(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        with(|driver| driver.poll_flushed(self.slot, cx))
    }

    /// Shuts the socket down both ways once everything queued is sent (the peer may be gone already;
    /// that is no error).
    pub(crate) fn shutdown(&self) {
        with(|driver| driver.shutdown(self.slot));
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_ref().expect("open until dropped").as_fd()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Some(fd) = self.fd.take() {
            let slot = self.slot;
            with_if_installed(|driver| driver.release(slot, fd));
        }
    }
}
