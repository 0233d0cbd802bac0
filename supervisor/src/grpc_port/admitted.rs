//! An admitted connection as the server reads it: the preface replayed, then the socket, closed (a
//! read error, which ends the connection in the server) once it has had no stream for the idle
//! timeout or its slot went to a newer connection.

use std::{
    io,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::{Instant, Sleep},
};

use super::{
    PREFACE,
    conn::Conn,
    slots::{Prover, Slot},
};

/// A connection's open streams, and since when it has had none.
#[derive(Debug)]
pub(super) struct Streams {
    open: AtomicUsize,
    idle_since: Mutex<Instant>,
    /// What the service tells once a stream carried a client's request ([`ClientProof`]).
    prover: Prover,
}

impl Streams {
    pub(super) fn opened(self: &Arc<Self>) -> StreamGuard {
        self.open.fetch_add(1, Ordering::AcqRel);
        StreamGuard(self.clone())
    }

    fn idle_since(&self) -> Option<Instant> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(*self.idle_since.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// One open stream of a connection; counted out when dropped.
#[derive(Debug)]
pub(super) struct StreamGuard(Arc<Streams>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut since = self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner());
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            *since = Instant::now();
        }
    }
}

/// What the server learns of a connection, in each request's extensions.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    /// The peer.
    pub peer: std::net::SocketAddr,
    pub(super) streams: Arc<Streams>,
}

impl ConnInfo {
    /// What a service uses to prove this connection, once one of its requests shows a client.
    pub fn proof(&self) -> ClientProof {
        ClientProof(self.streams.prover.clone())
    }
}

/// Proves a connection a client, so that it is never evicted for a new one (see
/// [`super::slots`]); in each request's extensions ([`super::TrackStreamsLayer`]). A service calls
/// [`ClientProof::prove`] once a stream carried a request only a client sends: an xDS request with
/// a node id, an ORCA request for a registered worker. Opening a stream proves nothing: anyone who
/// reaches a cleartext port can open streams and send nothing on them.
#[derive(Clone, Debug)]
pub struct ClientProof(Prover);

impl ClientProof {
    /// The connection showed it is a client: it is never evicted from now on.
    pub fn prove(&self) {
        self.0.prove();
    }
}

/// An admitted connection: its slot, its preface to replay, and its idle deadline.
#[derive(Debug)]
pub struct Admitted {
    stream: Conn,
    peer: std::net::SocketAddr,
    /// Bytes of the preface not yet handed to the server.
    replay: usize,
    streams: Arc<Streams>,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    slot: Slot,
}

// === impl Admitted ===

impl Admitted {
    pub(super) fn new(
        stream: Conn,
        peer: std::net::SocketAddr,
        slot: Slot,
        idle_timeout: Duration,
    ) -> Self {
        let now = Instant::now();
        Admitted {
            stream,
            peer,
            replay: PREFACE.len(),
            streams: Arc::new(Streams {
                open: AtomicUsize::new(0),
                idle_since: Mutex::new(now),
                prover: slot.prover(),
            }),
            idle_timeout,
            idle: Box::pin(tokio::time::sleep_until(now + idle_timeout)),
            slot,
        }
    }

    /// Ready with an error once the connection has had no stream for the idle timeout; else pending,
    /// with a timer that wakes it to look again.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        loop {
            let now = Instant::now();
            match self.streams.idle_since() {
                // Busy: look again one idle timeout from now, at the latest.
                None if self.idle.is_elapsed() => {
                    self.idle.as_mut().reset(now + self.idle_timeout);
                }
                None => {}
                Some(since) => {
                    let deadline = since + self.idle_timeout;
                    if deadline <= now {
                        tracing::debug!(peer = %self.peer, timeout = ?self.idle_timeout, "gRPC port: connection idle too long, closing");
                        return Poll::Ready(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "no stream within the idle timeout",
                        ));
                    }
                    if self.idle.deadline() != deadline {
                        self.idle.as_mut().reset(deadline);
                    }
                }
            }
            if self.idle.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }

    /// Ready with an error once the connection's slot went to a newer one (it had proved nothing).
    fn poll_evicted(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        self.slot.poll_evicted(cx).map(|()| {
            tracing::debug!(peer = %self.peer, "gRPC port: connection that proved nothing evicted for a new one, closing");
            io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "evicted: no client's request yet, and the connection cap is reached",
            )
        })
    }
}

impl AsyncRead for Admitted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.replay > 0 {
            let start = PREFACE.len() - this.replay;
            let n = this.replay.min(buf.remaining());
            buf.put_slice(&PREFACE[start..start + n]);
            this.replay -= n;
            return Poll::Ready(Ok(()));
        }
        if let Poll::Ready(result) = Pin::new(&mut this.stream).poll_read(cx, buf) {
            return Poll::Ready(result);
        }
        if let Poll::Ready(error) = this.poll_evicted(cx) {
            return Poll::Ready(Err(error));
        }
        this.poll_idle(cx).map(Err)
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Admitted {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        ConnInfo {
            peer: self.peer,
            streams: self.streams.clone(),
        }
    }
}
