//! Accept loops: one per bound listener, one task per connection, all on the worker's io_uring thread.
//!
//! [`serve`] must be polled on a tokio-uring runtime (`tokio_uring::start` or
//! `tokio_uring::Runtime::block_on`): its tasks are spawned on the runtime's local set. Graceful shutdown:
//! when the `shutdown` future completes, every accept loop stops, idle connections close, connections with
//! requests in hand answer them (with `connection: close`) and close; `serve` returns once every
//! connection is gone or [`Config::drain_timeout`] has passed, whichever is first.
//!
//! TCP listeners accept through io_uring. tokio-uring 0.5 cannot adopt a std Unix listener, so a Unix
//! listener accepts through the runtime's readiness driver (tokio) and hands each accepted stream to
//! io_uring; only the accept differs, every read and write goes through io_uring.

use std::{
    cell::Cell,
    future::Future,
    io,
    rc::Rc,
    time::{Duration, Instant},
};

use tokio::sync::{Notify, watch};
use tracing::Instrument;

use crate::{
    BoxError,
    http1::{self, Limits},
    http2,
    listen::{BoundAddr, BoundListener, Listener},
    service::HttpService,
    stream::{Io, Stream},
};

/// How the server runs connections.
///
/// The defaults are [`Limits::default`], [`http2::Limits::default`] and a drain timeout of 5 seconds.
#[derive(Clone, Debug)]
pub struct Config {
    /// The limits every HTTP/1 request is held to.
    pub limits: Limits,
    /// The settings and limits of HTTP/2 connections.
    pub http2: http2::Limits,
    /// How long in-flight connections may take to finish after shutdown begins.
    pub drain_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            limits: Limits::default(),
            http2: http2::Limits::default(),
            drain_timeout: Duration::from_secs(5),
        }
    }
}

/// Why serving could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listener could not be handed to the runtime.
    #[error("cannot serve on {addr}")]
    Listener {
        /// The listener's address.
        addr: BoundAddr,
        /// The system's error.
        #[source]
        source: io::Error,
    },
}

/// Serves HTTP/1 on every listener until `shutdown` completes, then drains (see the module docs).
///
/// `make_service` is called once per connection.
pub async fn serve<F, S>(
    listeners: Vec<BoundListener>,
    make_service: F,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError>
where
    F: Fn() -> S + 'static,
    S: HttpService,
{
    let (stop, stopped) = watch::channel(false);
    let shared = Rc::new(Shared {
        make_service,
        limits: config.limits,
        http2: config.http2,
        connections: Cell::new(0),
        drained: Notify::new(),
    });
    let mut loops = Vec::with_capacity(listeners.len());
    for BoundListener { listener, addr } in listeners {
        let acceptor = Acceptor::new(listener).map_err(|source| ServeError::Listener {
            addr: addr.clone(),
            source,
        })?;
        tracing::info!(%addr, "Listening");
        loops.push(tokio_uring::spawn(accept_loop(
            acceptor,
            addr,
            shared.clone(),
            stopped.clone(),
        )));
    }

    shutdown.await;
    tracing::info!("Shutting down: no longer accepting connections");
    // The receivers may all be gone already (no listener); that is fine.
    let _ = stop.send(true);
    for handle in loops {
        let _ = handle.await;
    }

    let deadline = Instant::now() + config.drain_timeout;
    loop {
        let drained = shared.drained.notified();
        let open = shared.connections.get();
        if open == 0 {
            tracing::info!("Drained every connection");
            break;
        }
        if tokio::time::timeout_at(deadline.into(), drained)
            .await
            .is_err()
        {
            tracing::warn!(
                open,
                "Drain timeout reached, closing the remaining connections"
            );
            break;
        }
    }
    Ok(())
}

/// What every connection task shares.
struct Shared<F> {
    make_service: F,
    limits: Limits,
    http2: http2::Limits,
    connections: Cell<usize>,
    drained: Notify,
}

/// A listener as the runtime accepts on it.
enum Acceptor {
    Tcp(tokio_uring::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

// === impl Acceptor ===

impl Acceptor {
    fn new(listener: Listener) -> io::Result<Self> {
        Ok(match listener {
            Listener::Tcp(l) => Acceptor::Tcp(tokio_uring::net::TcpListener::from_std(l)),
            Listener::Unix(l) => {
                l.set_nonblocking(true)?;
                Acceptor::Unix(tokio::net::UnixListener::from_std(l)?)
            }
        })
    }

    async fn accept(&self) -> io::Result<(Stream, String)> {
        match self {
            Acceptor::Tcp(l) => {
                let (stream, peer) = l.accept().await?;
                // Small responses go out at once; batching is done by the connection itself.
                stream.set_nodelay(true)?;
                Ok((Stream::Tcp(stream), peer.to_string()))
            }
            Acceptor::Unix(l) => {
                let (stream, _) = l.accept().await?;
                let stream = stream.into_std()?;
                // io_uring waits for readiness itself; a blocking fd keeps it from reporting EAGAIN.
                stream.set_nonblocking(false)?;
                Ok((
                    Stream::Unix(tokio_uring::net::UnixStream::from_std(stream)),
                    "unix".into(),
                ))
            }
        }
    }
}

async fn accept_loop<F, S>(
    acceptor: Acceptor,
    addr: BoundAddr,
    shared: Rc<Shared<F>>,
    mut stopped: watch::Receiver<bool>,
) where
    F: Fn() -> S + 'static,
    S: HttpService,
{
    loop {
        if *stopped.borrow_and_update() {
            return;
        }
        let accepted = tokio::select! {
            accepted = acceptor.accept() => accepted,
            _ = stopped.changed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Typically EMFILE: back off a little rather than spin.
                tracing::warn!(%addr, %error, "Accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let service = (shared.make_service)();
        let shared = shared.clone();
        let stopped = stopped.clone();
        shared.connections.set(shared.connections.get() + 1);
        let span = tracing::debug_span!("conn", %peer);
        tokio_uring::spawn(
            async move {
                let _guard = Guard(&shared);
                tracing::debug!("Accepted");
                let (protocol, already_read) =
                    match sniff(&stream, &shared.limits, stopped.clone()).await {
                        Ok(Some(sniffed)) => sniffed,
                        Ok(None) => return,
                        Err(error) => {
                            tracing::debug!(%error, "Connection failed before its first request");
                            return;
                        }
                    };
                let result = match protocol {
                    Protocol::Http1 => http1::serve_connection(
                        stream,
                        already_read,
                        service,
                        &shared.limits,
                        stopped,
                    )
                    .await
                    .map_err(BoxError::from),
                    Protocol::Http2 => http2::serve_connection(
                        Rc::new(stream),
                        already_read,
                        service,
                        &shared.http2,
                        stopped,
                    )
                    .await
                    .map_err(BoxError::from),
                };
                if let Err(error) = result {
                    tracing::debug!(%error, ?protocol, "Connection failed");
                }
            }
            .instrument(span),
        );
    }
}

/// The protocol a connection speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    Http1,
    /// HTTP/2 with prior knowledge (h2c): the connection starts with the client preface.
    Http2,
}

/// The start of the HTTP/2 client preface; `PRI` is reserved as an HTTP/1 method for exactly this.
const PREFACE_START: &[u8] = b"PRI * HTTP/2.0\r\n";

/// Reads until the first bytes tell HTTP/1 from HTTP/2; returns the protocol and the bytes read, or
/// `None` when the client closes, has not told within the idle timeout (however it trickles its
/// bytes), or shutdown begins first.
async fn sniff(
    stream: &Stream,
    limits: &Limits,
    mut stopped: watch::Receiver<bool>,
) -> io::Result<Option<(Protocol, Vec<u8>)>> {
    let mut buf = Vec::with_capacity(16 * 1024);
    let deadline = tokio::time::Instant::now() + limits.idle_timeout;
    loop {
        if *stopped.borrow_and_update() {
            return Ok(None);
        }
        let (result, read) = tokio::select! {
            r = stream.read(buf) => r,
            _ = stopped.changed() => return Ok(None),
            () = tokio::time::sleep_until(deadline) => return Ok(None),
        };
        buf = read;
        if result? == 0 {
            return Ok(None);
        }
        let n = buf.len().min(PREFACE_START.len());
        if buf[..n] != PREFACE_START[..n] {
            return Ok(Some((Protocol::Http1, buf)));
        }
        if n == PREFACE_START.len() {
            return Ok(Some((Protocol::Http2, buf)));
        }
    }
}

/// Counts a connection out when its task ends, however it ends.
struct Guard<'a, F>(&'a Shared<F>);

impl<F> Drop for Guard<'_, F> {
    fn drop(&mut self) {
        let n = self.0.connections.get() - 1;
        self.0.connections.set(n);
        if n == 0 {
            self.0.drained.notify_waiters();
        }
    }
}
