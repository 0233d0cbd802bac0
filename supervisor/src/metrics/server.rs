//! The metrics endpoint: HTTP/1.1 on its own listener, `GET /metrics` (or `HEAD`) answered with the
//! OpenMetrics text of the [`Metrics`] registry, anything else with 404.
//!
//! At most [`MAX_CONNECTIONS`] are open at once, and a new connection is always served: when every
//! slot is taken, the oldest connection without a request in progress makes room for it (the
//! oldest connection of all when every one has a request in progress). A client that holds
//! connections open (idle, or sending its request head slowly) so cannot keep a scraper out: it
//! only loses its own oldest ones. Each connection has [`HEADER_TIMEOUT`] to send a request head,
//! its first and each next on a kept-alive connection, so an idle connection is closed after
//! that: before Prometheus's next scrape at its default 15 s interval, which then opens a new one.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry as Metrics;
use tokio::{net::TcpListener, sync::oneshot};

/// Connections served at once; a new one takes the place of the oldest idle one.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a connection may take to send a request head, and stay idle between requests.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The OpenMetrics text format's content type.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `metrics` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let open = Arc::new(Mutex::new(Connections::default()));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors, most likely: wait rather than spin.
                tracing::warn!(%error, "Metrics: cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (entry, evicted) = lock(&open).admit(MAX_CONNECTIONS);
        if evicted {
            tracing::debug!(%peer, "Metrics: every connection slot taken; the oldest idle one was closed");
        }
        let metrics = metrics.clone();
        let open = open.clone();
        tokio::spawn(async move {
            let Entry { id, busy, evicted } = entry;
            let service = hyper::service::service_fn(move |request| {
                let busy = Busy::mark(&busy);
                let response =
                    answer(&request, &metrics).map(|body| BusyBody { body, _busy: busy });
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                served = connection => {
                    if let Err(error) = served {
                        tracing::debug!(%peer, %error, "Metrics connection ended with an error");
                    }
                }
                // Its sender dropped: the connection gave its slot to a newer one.
                _ = evicted => {}
            }
            lock(&open).remove(id);
        });
    }
}

fn lock(open: &Mutex<Connections>) -> std::sync::MutexGuard<'_, Connections> {
    // A panic while holding the lock leaves the table consistent (each step is one map operation).
    open.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The open connections, by age (ids grow).
#[derive(Debug, Default)]
struct Connections {
    next_id: u64,
    open: BTreeMap<u64, Slot>,
}

/// One open connection: whether a request is in progress on it, and the sender whose drop closes it.
#[derive(Debug)]
struct Slot {
    busy: Arc<AtomicBool>,
    _close: oneshot::Sender<()>,
}

/// What a new connection's task holds.
struct Entry {
    id: u64,
    busy: Arc<AtomicBool>,
    evicted: oneshot::Receiver<()>,
}

impl Connections {
    /// Takes a slot for a new connection, closing another first when `max` are open; returns its
    /// entry and whether another was closed.
    fn admit(&mut self, max: usize) -> (Entry, bool) {
        let evicted = self.open.len() >= max && self.evict().is_some();
        let id = self.next_id;
        self.next_id += 1;
        let busy = Arc::new(AtomicBool::new(false));
        let (close, evicted_rx) = oneshot::channel();
        self.open.insert(
            id,
            Slot {
                busy: busy.clone(),
                _close: close,
            },
        );
        let entry = Entry {
            id,
            busy,
            evicted: evicted_rx,
        };
        (entry, evicted)
    }

    /// Closes the oldest connection without a request in progress, else the oldest; returns its id.
    fn evict(&mut self) -> Option<u64> {
        let id = self
            .open
            .iter()
            .find(|(_, slot)| !slot.busy.load(Ordering::Acquire))
            .or_else(|| self.open.iter().next())
            .map(|(&id, _)| id)?;
        // Dropping its sender ends its task.
        self.open.remove(&id);
        Some(id)
    }

    fn remove(&mut self, id: u64) {
        self.open.remove(&id);
    }
}

/// A connection's request in progress: set from its head until hyper has taken the whole answer
/// (and dropped it).
#[derive(Debug)]
struct Busy(Arc<AtomicBool>);

impl Busy {
    fn mark(busy: &Arc<AtomicBool>) -> Busy {
        busy.store(true, Ordering::Release);
        Busy(busy.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// An answer's body, which keeps its connection [`Busy`] until hyper drops it.
#[derive(Debug)]
struct BusyBody {
    body: Full<Bytes>,
    _busy: Busy,
}

impl Body for BusyBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The answer to one request (pure but for the scrape itself).
pub fn answer(request: &Request<Incoming>, metrics: &Metrics) -> Response<Full<Bytes>> {
    respond(request.method(), request.uri().path(), metrics)
}

fn respond(method: &Method, path: &str, metrics: &Metrics) -> Response<Full<Bytes>> {
    let plain = |status: StatusCode, text: &str| {
        let mut response = Response::new(Full::new(Bytes::from(text.to_owned())));
        *response.status_mut() = status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        response
    };
    if path != "/metrics" {
        return plain(
            StatusCode::NOT_FOUND,
            "Prometheus metrics are at /metrics\n",
        );
    }
    if method != Method::GET && method != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "GET /metrics\n");
    }
    let mut text = String::new();
    if let Err(error) = prometheus_client::encoding::text::encode(&mut text, metrics) {
        tracing::error!(%error, "Metrics: cannot encode");
        return plain(
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot encode the metrics\n",
        );
    }
    let body = if method == Method::HEAD {
        Bytes::new()
    } else {
        Bytes::from(text)
    };
    let mut response = Response::new(Full::new(body));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(CONTENT_TYPE),
    );
    response
}

#[cfg(test)]
mod tests {
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpStream,
    };

    use super::*;

    /// One `GET /metrics` on a connection of its own: the status line.
    async fn scrape(addr: std::net::SocketAddr) -> std::io::Result<String> {
        let mut stream = TcpStream::connect(addr).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: metrics\r\nconnection: close\r\n\r\n")
            .await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        let answer = String::from_utf8_lossy(&answer);
        Ok(answer.lines().next().unwrap_or_default().to_owned())
    }

    #[tokio::test]
    async fn scrapes_are_served_while_idle_connections_hold_every_slot() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(listener, Arc::new(Metrics::default())));
        // Every slot held by a connection that sends nothing, and more waiting behind them.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS + 8 {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        for scrape_number in 0..5 {
            let status = tokio::time::timeout(Duration::from_secs(3), scrape(addr))
                .await
                .unwrap_or_else(|_| panic!("scrape {scrape_number} not answered within 3 s"))
                .unwrap();
            assert_eq!(status, "HTTP/1.1 200 OK");
        }
        server.abort();
    }

    #[test]
    fn a_new_connection_takes_the_place_of_the_oldest_idle_one() {
        let mut open = Connections::default();
        let entries: Vec<Entry> = (0..3).map(|_| open.admit(3).0).collect();
        // The oldest has a request in progress: the next oldest makes room.
        let _busy = Busy::mark(&entries[0].busy);
        let (_, evicted) = open.admit(3);
        assert!(evicted);
        assert_eq!(open.open.keys().copied().collect::<Vec<_>>(), [0, 2, 3]);
        let mut closed = entries;
        assert!(
            closed[1]
                .evicted
                .try_recv()
                .is_err_and(|e| e == oneshot::error::TryRecvError::Closed)
        );
        assert_eq!(
            closed[0].evicted.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        );
        // Every one busy: the oldest.
        for slot in open.open.values() {
            slot.busy.store(true, Ordering::Release);
        }
        open.admit(3);
        assert_eq!(open.open.keys().copied().collect::<Vec<_>>(), [2, 3, 4]);
        // Below the cap, nothing is closed.
        open.remove(2);
        assert!(!open.admit(3).1);
    }

    #[test]
    fn metrics_are_at_slash_metrics_only_and_for_get_or_head() {
        let metrics = Metrics::default();
        let ok = respond(&Method::GET, "/metrics", &metrics);
        assert_eq!(ok.status(), StatusCode::OK);
        assert_eq!(ok.headers()[header::CONTENT_TYPE], CONTENT_TYPE);
        assert_eq!(
            respond(&Method::GET, "/", &metrics).status(),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            respond(&Method::POST, "/metrics", &metrics).status(),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            respond(&Method::HEAD, "/metrics", &metrics).status(),
            StatusCode::OK
        );
    }
}
