//! The metrics endpoint: HTTP/1.1 on its own listener, `GET /metrics` (or `HEAD`) answered with the
//! OpenMetrics text of the [`Metrics`] registry, anything else with 404. At most
//! [`MAX_CONNECTIONS`] at once, each with [`HEADER_TIMEOUT`] to send its request head: the port is
//! for a scraper, and a client that holds connections open costs the supervisor nothing more.

use std::{convert::Infallible, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry as Metrics;
use tokio::{net::TcpListener, sync::Semaphore};

/// Connections served at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a connection may take to send its request head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The OpenMetrics text format's content type.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `metrics` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors, most likely: wait rather than spin.
                tracing::warn!(%error, "Metrics: cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let metrics = metrics.clone();
                async move { Ok::<_, Infallible>(answer(&request, &metrics)) }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(error) = served {
                tracing::debug!(%peer, %error, "Metrics connection ended with an error");
            }
            drop(permit);
        });
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
    use super::*;

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
