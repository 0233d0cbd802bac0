//! The gRPC port's front door: which TCP connections reach the xDS and ORCA server, and for how long.
//!
//! Anyone who can reach the port can connect; without limits, 20,000 idle connections take every file
//! descriptor the supervisor has, and then a dead worker cannot be restarted nor `peregrine status`
//! answered. So every connection, from its accept to its close, holds one of
//! [`GrpcLimits::max_connections`] permits (a connection over the cap is closed at once, with a log
//! line at most every 10 s saying how many were); it must send the HTTP/2 client preface within
//! [`GrpcLimits::handshake_timeout`]; and once admitted it is closed after
//! [`GrpcLimits::idle_timeout`] without an open stream. The cap is lowered at start to what the
//! open-file limit leaves after [`reserved_fds`] (raised first from its soft to its hard value,
//! [`raise_nofile_limit`]), so workers and the control socket never starve.
//!
//! With `[supervisor.tls]` the TLS handshake ([`ServerTls::accept`]) comes first, within the same
//! handshake timeout as the preface.
//!
//! The pieces: [`incoming`] accepts on the listeners and yields [`Admitted`] connections (the
//! preface read and replayed to the server); [`TrackStreamsLayer`] counts each connection's open
//! streams (gRPC calls), which is what "idle" is measured on; [`Admitted`] closes itself (a read
//! error, which ends the connection in the server) once idle too long.
//!
//! Invariant: nothing here knows xDS or ORCA; it sees TCP connections, their TLS, the HTTP/2
//! preface and the count of open requests.

use std::{
    future::Future,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore, mpsc},
    time::{Instant, Sleep},
};
use tokio_stream::wrappers::ReceiverStream;

use crate::{config::GrpcLimits, throttle::Throttle, tls::server::ServerTls};

/// The HTTP/2 client connection preface (RFC 9113, section 3.4).
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// File descriptors kept back from the gRPC port for the rest of the supervisor: per worker lane a
/// pidfd, its registration connection and the pipes of a spawn, plus the control socket's clients,
/// the sampler, the runtime and logs.
pub fn reserved_fds(lanes: usize) -> u64 {
    256 + 8 * lanes as u64
}

/// Raises the soft limit on open files to the hard limit; returns the limit now in effect (`None`:
/// unlimited).
pub fn raise_nofile_limit() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let before = limit.current;
        limit.current = limit.maximum;
        match setrlimit(Resource::Nofile, limit) {
            Ok(()) => {
                tracing::info!(from = ?before, to = ?limit.maximum, "Raised the open-file limit (RLIMIT_NOFILE) to its hard limit");
            }
            Err(error) => {
                tracing::warn!(%error, "Cannot raise the open-file limit (RLIMIT_NOFILE) to its hard limit");
                return before;
            }
        }
    }
    limit.current
}

/// The connection cap in effect: `limits.max_connections`, lowered to what `nofile` open files leave
/// after the reserve for `lanes` worker lanes (at least 16).
pub fn connection_cap(limits: &GrpcLimits, nofile: Option<u64>, lanes: usize) -> usize {
    let budget = nofile.map_or(u64::MAX, |n| n.saturating_sub(reserved_fds(lanes)));
    let cap = limits
        .max_connections
        .min(usize::try_from(budget).unwrap_or(usize::MAX));
    cap.max(16)
}

/// What every connection of the port shares: the permits and the throttled log lines.
#[derive(Debug)]
pub struct Admission {
    limits: GrpcLimits,
    cap: usize,
    permits: Arc<Semaphore>,
    over_cap: Throttle,
    no_preface: Throttle,
    accept_failed: Throttle,
    /// TLS, when the port has it (`[supervisor.tls]`): the handshake comes before the preface.
    tls: Option<Arc<ServerTls>>,
}

// === impl Admission ===

impl Admission {
    /// Admission under `limits`, with at most `cap` connections (see [`connection_cap`]).
    pub fn new(limits: GrpcLimits, cap: usize) -> Arc<Self> {
        Self::with_tls(limits, cap, None)
    }

    /// [`Admission::new`], with every connection's TLS handshake done by `tls` when given.
    pub fn with_tls(limits: GrpcLimits, cap: usize, tls: Option<Arc<ServerTls>>) -> Arc<Self> {
        Arc::new(Admission {
            limits,
            cap,
            permits: Arc::new(Semaphore::new(cap)),
            over_cap: Throttle::new(Duration::from_secs(10)),
            no_preface: Throttle::new(Duration::from_secs(10)),
            accept_failed: Throttle::new(Duration::from_secs(10)),
            tls,
        })
    }

    /// How many connections are open (admitted, or still in their handshake).
    pub fn open(&self) -> usize {
        self.cap - self.permits.available_permits()
    }

    /// The connection cap.
    pub fn cap(&self) -> usize {
        self.cap
    }
}

/// Gives the allocator's free memory back to the system after a wave of connections has gone: glibc
/// keeps what thousands of connections freed (in every thread's arena) unless asked, so a flood
/// would leave the supervisor hundreds of MB larger for good. Looks every 10 s; trims when the
/// open connections fell by at least 256 since the highest count seen after the last trim. Runs
/// until the admission is dropped.
pub fn spawn_trimmer(admission: &Arc<Admission>) {
    let admission = Arc::downgrade(admission);
    tokio::spawn(async move {
        let mut peak = 0;
        let mut ticks = tokio::time::interval(Duration::from_secs(10));
        loop {
            ticks.tick().await;
            let Some(admission) = admission.upgrade() else {
                return;
            };
            let open = admission.open();
            peak = peak.max(open);
            if peak >= open + 256 {
                tracing::debug!(
                    peak,
                    open,
                    "Giving freed connection memory back to the system"
                );
                peak = open;
                let _ = tokio::task::spawn_blocking(trim).await;
            }
        }
    });
}

/// `malloc_trim(3)`: releases free memory at the top of the heap and in every arena.
fn trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim is thread-safe in glibc and only touches the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Accepts on every one of `listeners` and yields the connections admitted (see the module docs),
/// until the stream is dropped.
pub fn incoming(
    listeners: Vec<TcpListener>,
    admission: Arc<Admission>,
) -> ReceiverStream<io::Result<Admitted>> {
    let (tx, rx) = mpsc::channel(64);
    for listener in listeners {
        tokio::spawn(accept_loop(listener, admission.clone(), tx.clone()));
    }
    ReceiverStream::new(rx)
}

async fn accept_loop(
    listener: TcpListener,
    admission: Arc<Admission>,
    tx: mpsc::Sender<io::Result<Admitted>>,
) {
    let addr = listener.local_addr().ok();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = tx.closed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Typically EMFILE: the cap leaves descriptors for the rest of the supervisor, so
                // this is someone else's doing; wait a little rather than spin.
                if let Some(held_back) = admission.accept_failed.allow() {
                    tracing::warn!(?addr, %error, held_back, "gRPC port: accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = admission.permits.clone().try_acquire_owned() else {
            if let Some(held_back) = admission.over_cap.allow() {
                tracing::warn!(
                    %peer,
                    cap = admission.cap,
                    refused_since_last_line = held_back,
                    "gRPC port: connection refused, the cap of open connections is reached \
                     (supervisor.grpc_max_connections, or the open-file limit)"
                );
            }
            drop(stream);
            continue;
        };
        let (admission, tx) = (admission.clone(), tx.clone());
        tokio::spawn(async move {
            if let Some(admitted) = handshake(stream, peer, permit, &admission).await {
                let _ = tx.send(Ok(admitted)).await;
            }
        });
    }
}

/// Does the TLS handshake (when the port has TLS) and reads the preface, both within the handshake
/// timeout; `None` (and the connection closed) if either fails or the preface is not HTTP/2's.
async fn handshake(
    stream: TcpStream,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
    admission: &Admission,
) -> Option<Admitted> {
    let _ = stream.set_nodelay(true);
    let timeout = admission.limits.handshake_timeout;
    let deadline = Instant::now() + timeout;
    let late = || {
        if let Some(held_back) = admission.no_preface.allow() {
            if admission.tls.is_some() {
                tracing::info!(%peer, ?timeout, held_back, "gRPC port: no TLS handshake and HTTP/2 preface in time, closing");
            } else {
                tracing::info!(%peer, ?timeout, held_back, "gRPC port: no HTTP/2 preface in time, closing");
            }
        }
    };
    let mut conn = match &admission.tls {
        None => Conn::Plain(stream),
        Some(tls) => match tokio::time::timeout_at(deadline, tls.accept(stream, peer)).await {
            Ok(Ok(stream)) => Conn::Tls(Box::new(stream)),
            // Logged by the TLS side, which knows why.
            Ok(Err(_)) => return None,
            Err(_) => {
                late();
                return None;
            }
        },
    };
    let mut preface = [0u8; PREFACE.len()];
    match tokio::time::timeout_at(deadline, conn.read_exact(&mut preface)).await {
        Ok(Ok(_)) if &preface == PREFACE => Some(Admitted::new(
            conn,
            peer,
            permit,
            admission.limits.idle_timeout,
        )),
        Ok(Ok(_)) => {
            tracing::debug!(%peer, "gRPC port: not an HTTP/2 connection preface, closing");
            None
        }
        Ok(Err(error)) => {
            tracing::debug!(%peer, %error, "gRPC port: connection ended before its preface");
            None
        }
        Err(_) => {
            late();
            None
        }
    }
}

/// A connection of the port: cleartext, or TLS.
#[derive(Debug)]
enum Conn {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Conn::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Conn::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Conn::Tls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(stream) => stream.is_write_vectored(),
            Conn::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Conn::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Conn::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A connection's open streams, and since when it has had none.
#[derive(Debug)]
struct Streams {
    open: AtomicUsize,
    idle_since: Mutex<Instant>,
}

impl Streams {
    fn opened(self: &Arc<Self>) -> StreamGuard {
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
struct StreamGuard(Arc<Streams>);

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
    pub peer: SocketAddr,
    streams: Arc<Streams>,
}

/// An admitted connection: its permit, its preface to replay, and its idle deadline.
#[derive(Debug)]
pub struct Admitted {
    stream: Conn,
    peer: SocketAddr,
    /// Bytes of the preface not yet handed to the server.
    replay: usize,
    streams: Arc<Streams>,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    _permit: OwnedSemaphorePermit,
}

// === impl Admitted ===

impl Admitted {
    fn new(
        stream: Conn,
        peer: SocketAddr,
        permit: OwnedSemaphorePermit,
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
            }),
            idle_timeout,
            idle: Box::pin(tokio::time::sleep_until(now + idle_timeout)),
            _permit: permit,
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
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(result) => Poll::Ready(result),
            Poll::Pending => match this.poll_idle(cx) {
                Poll::Ready(error) => Poll::Ready(Err(error)),
                Poll::Pending => Poll::Pending,
            },
        }
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

/// Counts each request (a gRPC stream) as open on its connection until its response body is done.
#[derive(Clone, Copy, Debug, Default)]
pub struct TrackStreamsLayer;

impl<S> tower::Layer<S> for TrackStreamsLayer {
    type Service = TrackStreams<S>;

    fn layer(&self, inner: S) -> TrackStreams<S> {
        TrackStreams(inner)
    }
}

/// See [`TrackStreamsLayer`].
#[derive(Clone, Debug)]
pub struct TrackStreams<S>(S);

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> tower::Service<http::Request<B>> for TrackStreams<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    R: http_body::Body<Data = Bytes> + Unpin + Send + 'static,
{
    type Response = http::Response<Tracked<R>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let guard = request
            .extensions()
            .get::<ConnInfo>()
            .map(|info| info.streams.opened());
        let response = self.0.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|body| Tracked {
                body,
                _guard: guard,
            }))
        })
    }
}

/// A response body that holds its stream open on its connection until it is dropped.
#[derive(Debug)]
pub struct Tracked<B> {
    body: B,
    _guard: Option<StreamGuard>,
}

impl<B: http_body::Body + Unpin> http_body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_descriptors_for_the_rest() {
        let limits = GrpcLimits::default();
        assert_eq!(connection_cap(&limits, None, 64), 8192);
        assert_eq!(connection_cap(&limits, Some(1 << 20), 64), 8192);
        // 20,000 open files, 16 lanes: 20,000 - 256 - 128.
        let small = GrpcLimits {
            max_connections: 100_000,
            ..limits
        };
        assert_eq!(connection_cap(&small, Some(20_000), 16), 19_616);
        assert_eq!(connection_cap(&limits, Some(300), 16), 16, "never below 16");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_streams_times_out_and_one_with_a_stream_does_not() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            tokio::io::AsyncWriteExt::write_all(&mut stream, PREFACE)
                .await
                .unwrap();
            stream
        });
        let limits = GrpcLimits {
            idle_timeout: Duration::from_secs(5),
            // The paused clock jumps ahead while the test waits on sockets.
            handshake_timeout: Duration::from_secs(3600),
            ..GrpcLimits::default()
        };
        let admission = Admission::new(limits, 4);
        let mut incoming = incoming(vec![listener], admission.clone());
        let mut admitted = tokio_stream::StreamExt::next(&mut incoming)
            .await
            .unwrap()
            .unwrap();
        let _client = client.await.unwrap();
        assert_eq!(admission.open(), 1);
        let mut preface = [0u8; 24];
        admitted.read_exact(&mut preface).await.unwrap();
        assert_eq!(&preface, PREFACE, "the preface is replayed");
        // A stream is open for 20 s: no timeout meanwhile.
        let info = tonic::transport::server::Connected::connect_info(&admitted);
        let stream = info.streams.opened();
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(20), admitted.read(&mut byte)).await;
        assert!(read.is_err(), "still reading after 20 s: {read:?}");
        drop(stream);
        let started = Instant::now();
        let error = admitted.read(&mut byte).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(
            (Duration::from_secs(5)..Duration::from_secs(6)).contains(&started.elapsed()),
            "{:?}",
            started.elapsed()
        );
        drop(admitted);
        assert_eq!(admission.open(), 0, "the permit is back");
    }
}
