//! Benchmark fixture: the hello worker's answer served by hyper 1.x at its best, as the baseline that
//! `cargo xtask bench http` measures the Peregrine worker against.
//!
//! `hyper-baseline ADDR` listens on `ADDR` (e.g. `127.0.0.1:8080`) on a tokio current-thread runtime (one
//! thread, like a worker's one io_uring thread) and answers every request with the same bytes as the
//! worker: status 200, `content-type: text/plain; charset=utf-8`, `content-length` and the body
//! `Hello from worker <pid>!\n`.
//!
//! Configuration, chosen for throughput: hyper-util's auto builder serves HTTP/1.1 and HTTP/2 with prior
//! knowledge (h2c) on the same port, telling them apart by the connection preface; HTTP/1 keeps
//! connections alive and flushes pipelined responses in batches (`pipeline_flush`); no `date` header in
//! either protocol (the worker sends none, and hyper's cached date costs a little each response);
//! `TCP_NODELAY` on every connection, as the worker sets it. Runs until killed.

use std::{convert::Infallible, net::SocketAddr};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, body::Incoming, header, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use tokio::net::TcpListener;

fn main() -> anyhow::Result<()> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .context("usage: hyper-baseline ADDR (e.g. 127.0.0.1:8080)")?
        .parse()
        .context("ADDR must be an ip:port")?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(serve(addr))
}

async fn serve(addr: SocketAddr) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let body = Bytes::from(format!("Hello from worker {}!\n", std::process::id()));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .keep_alive(true)
        .pipeline_flush(true)
        .auto_date_header(false);
    builder.http2().auto_date_header(false);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            // Running out of file descriptors or a connection reset before accept: keep serving.
            Err(error) => {
                eprintln!("accept: {error}");
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let builder = builder.clone();
        let body = body.clone();
        tokio::spawn(async move {
            let service = service_fn(move |_: Request<Incoming>| {
                let body = body.clone();
                async move {
                    let mut res = Response::new(Full::new(body));
                    res.headers_mut().insert(
                        header::CONTENT_TYPE,
                        header::HeaderValue::from_static("text/plain; charset=utf-8"),
                    );
                    Ok::<_, Infallible>(res)
                }
            });
            // A client that goes away mid-request is an error here and nothing to report in a benchmark.
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
