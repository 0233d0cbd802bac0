//! Accept loops: one per bound listener, one task per connection, all on the worker's thread.
//!
//! [`serve`] must be polled on the worker's runtime ([`crate::runtime`]): its tasks are spawned there.
//! Every listener, TCP or Unix, accepts through one multishot accept, and every connection receives
//! through one multishot receive (see the driver). Graceful shutdown:
//! when the `shutdown` future completes, every accept loop stops, idle connections close, connections with
//! requests in hand answer them (with `connection: close`) and close; `serve` returns once every
//! connection is gone or [`Config::drain_timeout`] has passed, whichever is first. Stopping an accept
//! loop cancels its multishot accept; a connection the kernel accepted meanwhile is closed unserved.

use std::{
    cell::Cell,
    future::Future,
    io,
    os::fd::OwnedFd,
    rc::Rc,
    time::{Duration, Instant},
};

use tokio::sync::{Notify, watch};
use tracing::Instrument;

use crate::{
    BoxError,
    budget::{self, Budget},
    driver::net::Listener as Acceptor,
    http1::{self, Limits},
    http2,
    listen::{BoundAddr, BoundListener, Listener},
    log_limit::{LogLimit, Verdict},
    runtime,
    service::HttpService,
    stream::{self, Stream},
};

/// How the server runs connections.
///
/// The defaults are [`Limits::default`], [`http2::Limits::default`], a drain timeout of 5 seconds and
/// 128 MiB of request bodies buffered at once.
#[derive(Clone, Debug)]
pub struct Config {
    /// The limits every HTTP/1 request is held to.
    pub limits: Limits,
    /// The settings and limits of HTTP/2 connections.
    pub http2: http2::Limits,
    /// How long in-flight connections may take to finish after shutdown begins.
    pub drain_timeout: Duration,
    /// How many bytes of request bodies the worker buffers at once, over all connections and both
    /// protocols. A request that would take more is answered `503` (HTTP/1: with `connection: close`;
    /// HTTP/2: on that stream only); see the protocol modules for what each one charges.
    pub max_buffered_body_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            limits: Limits::default(),
            http2: http2::Limits::default(),
            drain_timeout: Duration::from_secs(5),
            max_buffered_body_bytes: 128 * 1024 * 1024,
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
    budget::return_large_frees();
    let shared = Rc::new(Shared {
        make_service,
        limits: config.limits,
        http2: config.http2,
        bodies: Budget::new(config.max_buffered_body_bytes, None),
        connections: Cell::new(0),
        drained: Notify::new(),
    });
    let mut loops = Vec::with_capacity(listeners.len());
    for BoundListener { listener, addr } in listeners {
        let acceptor = new_acceptor(listener).map_err(|source| ServeError::Listener {
            addr: addr.clone(),
            source,
        })?;
        tracing::info!(%addr, "Listening");
        loops.push(runtime::spawn(accept_loop(
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
    /// The worker's budget of buffered request-body bytes.
    bodies: Rc<Budget>,
    connections: Cell<usize>,
    drained: Notify,
}

/// Hands a listener to the driver; refuses a socket that is not listening (its accept would fail for
/// ever).
fn new_acceptor(listener: Listener) -> io::Result<Acceptor> {
    let fd = match listener {
        Listener::Tcp(l) => OwnedFd::from(l),
        Listener::Unix(l) => OwnedFd::from(l),
    };
    if !rustix::net::sockopt::socket_acceptconn(&fd)? {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a listening socket",
        ));
    }
    Ok(Acceptor::new(fd))
}

/// Prepares an accepted connection: small responses go out at once (batching is done by the
/// connection itself); the peer's address is looked up only when connections are logged.
fn prepare(fd: OwnedFd, addr: &BoundAddr) -> io::Result<(Stream, String)> {
    let peer = match addr {
        BoundAddr::Unix(_) => "unix".into(),
        BoundAddr::Ip(_) => {
            rustix::net::sockopt::set_tcp_nodelay(&fd, true)?;
            if tracing::enabled!(tracing::Level::DEBUG) {
                rustix::net::getpeername(&fd)?
                    .and_then(|peer| std::net::SocketAddr::try_from(peer).ok())
                    .map_or_else(|| "unknown".into(), |peer| peer.to_string())
            } else {
                String::new()
            }
        }
    };
    Ok((Stream::new(fd), peer))
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
    let mut failures = LogLimit::default();
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        if *stopped.borrow_and_update() {
            return;
        }
        let accepted = tokio::select! {
            accepted = acceptor.accept() => accepted,
            _ = stopped.changed() => return,
        };
        let (stream, peer) = match accepted.map(|fd| prepare(fd, &addr)) {
            Ok(Ok(accepted)) => {
                backoff = ACCEPT_BACKOFF_MIN;
                accepted
            }
            Ok(Err(error)) => {
                // The peer may be gone already (the connection is closed unserved).
                tracing::debug!(%error, "Accepted connection unusable, closed");
                continue;
            }
            Err(error) => {
                // Typically EMFILE: the condition lasts until connections close, so back off
                // (doubling, up to a second) rather than spin, and say so once per interval.
                if let Verdict::Log { suppressed, over } = failures.hit(Instant::now()) {
                    tracing::warn!(
                        %addr,
                        %error,
                        suppressed,
                        over_ms = over.as_millis() as u64,
                        backoff_ms = backoff.as_millis() as u64,
                        "Accept failed"
                    );
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = stopped.changed() => return,
                }
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        let service = (shared.make_service)();
        let shared = shared.clone();
        let stopped = stopped.clone();
        shared.connections.set(shared.connections.get() + 1);
        let span = tracing::debug_span!("conn", %peer);
        runtime::spawn(
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
                        &shared.bodies,
                        stopped,
                    )
                    .await
                    .map_err(BoxError::from),
                    // Boxed: the HTTP/2 connection's future is the larger, and an HTTP/1
                    // connection's task should not carry its size.
                    Protocol::Http2 => Box::pin(http2::serve_connection(
                        Rc::new(stream),
                        already_read,
                        service,
                        &shared.http2,
                        &shared.bodies,
                        stopped,
                    ))
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

/// How long the accept loop waits after its first failure in a row, and at most.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How many bytes telling the protocol reads at most.
const SNIFF_BYTES: usize = 2048;

/// The HTTP/2 client preface; `PRI` is reserved as an HTTP/1 method for exactly this.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a connection whose first bytes begin `PRI ` must continue with to be HTTP/2.
const PRI: &[u8] = b"PRI ";

/// Reads until the first bytes tell HTTP/1 from HTTP/2; returns the protocol and the bytes read, or
/// `None` when the client closes, has not told within [`Limits::first_byte_timeout`] (however it
/// trickles its bytes), sent a broken HTTP/2 preface (answered with GOAWAY), or shutdown begins first.
/// Every `None` but the client's own close shuts the socket down at once.
async fn sniff(
    stream: &Stream,
    limits: &Limits,
    mut stopped: watch::Receiver<bool>,
) -> io::Result<Option<(Protocol, Vec<u8>)>> {
    // Room for the preface, and for a typical request head: HTTP/1 grows its input when it needs to.
    let mut buf = Vec::with_capacity(SNIFF_BYTES);
    let deadline = tokio::time::Instant::now() + limits.first_byte_timeout;
    loop {
        if *stopped.borrow_and_update() {
            stream.shutdown();
            return Ok(None);
        }
        let (result, read) = tokio::select! {
            read = stream::read(stream, buf) => read,
            _ = stopped.changed() => {
                stream.shutdown();
                return Ok(None);
            }
            () = tokio::time::sleep_until(deadline) => {
                tracing::debug!("No request within the first-byte timeout, closing");
                stream.shutdown();
                return Ok(None);
            }
        };
        buf = read;
        if result? == 0 {
            return Ok(None);
        }
        match classify(&buf) {
            Some(Ok(protocol)) => return Ok(Some((protocol, buf))),
            Some(Err(BadPreface)) => {
                tracing::debug!("Invalid HTTP/2 preface, answering GOAWAY");
                let written =
                    stream::write(stream, &mut http2::GOAWAY_PROTOCOL_ERROR.to_vec()).await;
                stream.shutdown();
                written?;
                return Ok(None);
            }
            None => {}
        }
    }
}

/// A connection that began like the HTTP/2 preface (`PRI `) and then differed from it.
#[derive(Debug, PartialEq, Eq)]
struct BadPreface;

/// Tells the protocol from a connection's first bytes; `None` while they cannot tell yet.
fn classify(buf: &[u8]) -> Option<Result<Protocol, BadPreface>> {
    let n = buf.len().min(PREFACE.len());
    if buf[..n] == PREFACE[..n] {
        return (n == PREFACE.len()).then_some(Ok(Protocol::Http2));
    }
    if buf.len() >= PRI.len() && buf.starts_with(PRI) {
        // `PRI` is no HTTP/1 method anyone uses: the peer meant HTTP/2 and got its preface wrong.
        return Some(Err(BadPreface));
    }
    Some(Ok(Protocol::Http1))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_that_is_not_listening_is_refused() {
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        let addr: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        socket.bind(&addr.into()).unwrap();
        let listener = std::net::TcpListener::from(OwnedFd::from(socket));
        let error = new_acceptor(Listener::Tcp(listener)).err().unwrap();
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn the_preface_decides_the_protocol() {
        assert_eq!(classify(b"GET / HTTP/1.1\r\n"), Some(Ok(Protocol::Http1)));
        assert_eq!(classify(b"G"), Some(Ok(Protocol::Http1)));
        assert_eq!(classify(b"PRI * HTTP/2.0\r\n"), None, "not whole yet");
        assert_eq!(classify(b"PR"), None);
        assert_eq!(classify(PREFACE), Some(Ok(Protocol::Http2)));
        let mut more = PREFACE.to_vec();
        more.extend_from_slice(&[0, 0, 0, 4]);
        assert_eq!(classify(&more), Some(Ok(Protocol::Http2)));
        assert_eq!(classify(b"PRI * HTTP/2.0\r\n\r\nXX"), Some(Err(BadPreface)));
        assert_eq!(classify(b"PRI / HTTP/1.1\r\n"), Some(Err(BadPreface)));
        assert_eq!(classify(b"PRIX"), Some(Ok(Protocol::Http1)));
    }
}
