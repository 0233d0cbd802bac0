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
//!
//! Like the hello app, `?cpu=MS` burns MS milliseconds of the thread's CPU before answering (the
//! hello app's own function), so that the balance benchmark loads both servers alike.
//! `hyper-baseline ADDR --reuseport` binds with `SO_REUSEPORT`: several processes on one port, the
//! kernel spreading connections over them by a hash of each connection's addresses, as people run
//! servers today (the baseline `cargo xtask bench balance` compares Peregrine against).

use std::{convert::Infallible, net::SocketAddr};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, body::Incoming, header, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use peregrine_worker::hello;
use tokio::net::TcpListener;

const USAGE: &str = "usage: hyper-baseline ADDR [--reuseport] (e.g. 127.0.0.1:8080)";

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr: SocketAddr = args
        .next()
        .context(USAGE)?
        .parse()
        .context("ADDR must be an ip:port")?;
    let reuseport = match args.next().as_deref() {
        None => false,
        Some("--reuseport") => true,
        Some(other) => anyhow::bail!("unknown argument {other:?}; {USAGE}"),
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(serve(addr, reuseport))
}

/// A listener on `addr`, sharing the port with other processes' when `reuseport`.
fn listen(addr: SocketAddr, reuseport: bool) -> anyhow::Result<TcpListener> {
    use rustix::net::{AddressFamily, SocketType, bind, listen, socket, sockopt};
    let family = if addr.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd = socket(family, SocketType::STREAM, None).context("socket")?;
    sockopt::set_socket_reuseaddr(&fd, true).context("SO_REUSEADDR")?;
    if reuseport {
        sockopt::set_socket_reuseport(&fd, true).context("SO_REUSEPORT")?;
    }
    bind(&fd, &addr).with_context(|| format!("binding {addr}"))?;
    listen(&fd, 1024).context("listen")?;
    let listener = std::net::TcpListener::from(fd);
    listener.set_nonblocking(true)?;
    Ok(TcpListener::from_std(listener)?)
}

async fn serve(addr: SocketAddr, reuseport: bool) -> anyhow::Result<()> {
    let listener = listen(addr, reuseport)?;
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
            let service = service_fn(move |request: Request<Incoming>| {
                let body = body.clone();
                if let Some(ms) = hello::cpu_ms(request.uri().query()) {
                    hello::burn_cpu(std::time::Duration::from_millis(ms));
                }
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
