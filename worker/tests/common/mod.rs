//! A fake supervisor for the worker's tests: a std Unix listener that accepts a worker, reads its
//! `Register` and answers, every step bounded by [`STEP`].

#![allow(
    dead_code,
    reason = "each test binary uses its own part of these helpers"
)]

use std::{
    io::{Read, Write},
    os::unix::net::{UnixListener, UnixStream},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use bytes::BytesMut;
use peregrine_proto::{
    decode_frame, encode,
    v1::{Register, SupervisorMessage, WorkerMessage, address, supervisor_message, worker_message},
};
use peregrine_worker::{Hello, Settings, WorkerError};

/// How long any single step of a test may take.
pub(crate) const STEP: Duration = Duration::from_secs(10);

/// Accepts one connection, failing the test if none comes within [`STEP`].
pub(crate) fn accept(listener: &UnixListener) -> UnixStream {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + STEP;
    let conn = loop {
        match listener.accept() {
            Ok((conn, _)) => break conn,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    Instant::now() < deadline,
                    "no worker connected within {STEP:?}"
                );
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("accept failed: {e}"),
        }
    };
    listener.set_nonblocking(false).unwrap();
    conn.set_nonblocking(false).unwrap();
    conn
}

/// Accepts one worker, reads its `Register` and answers `answer`.
pub(crate) fn accept_register(
    listener: &UnixListener,
    answer: supervisor_message::Message,
) -> (UnixStream, Register) {
    let mut conn = accept(listener);
    conn.set_read_timeout(Some(STEP)).unwrap();
    let mut buf = BytesMut::new();
    let message = loop {
        if let Some(m) = decode_frame::<WorkerMessage>(&mut buf).unwrap() {
            break m;
        }
        let mut chunk = [0u8; 1024];
        let n = conn.read(&mut chunk).unwrap();
        assert_ne!(n, 0, "the worker closed before registering");
        buf.extend_from_slice(&chunk[..n]);
    };
    let Some(worker_message::Message::Register(register)) = message.message else {
        panic!("expected a register message, got {message:?}")
    };
    conn.write_all(&encode(&SupervisorMessage {
        message: Some(answer),
    }))
    .unwrap();
    (conn, register)
}

/// Runs a worker on its own thread; its result arrives on the returned channel.
pub(crate) fn spawn_worker(
    settings: Settings,
    shutdown: tokio::sync::oneshot::Receiver<()>,
) -> (
    mpsc::Receiver<Result<(), WorkerError>>,
    thread::JoinHandle<()>,
) {
    let (tx, rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        let result = peregrine_worker::run_until(settings, Hello::new, async {
            let _ = shutdown.await;
        });
        let _ = tx.send(result);
    });
    (rx, handle)
}

/// The one IP address a worker bound to `127.0.0.1:0` registers.
pub(crate) fn socket_addr(register: &Register) -> std::net::SocketAddr {
    let addresses = &register.listener.as_ref().unwrap().addresses;
    assert_eq!(addresses.len(), 1, "{addresses:?}");
    let Some(address::Address::Socket(sa)) = addresses[0].address.clone() else {
        panic!("expected a socket address")
    };
    format!("{}:{}", sa.ip, sa.port).parse().unwrap()
}

/// An application that answers every request `200 ok`.
#[derive(Clone, Debug)]
pub(crate) struct Ok200;

impl tower::Service<http::Request<peregrine_worker::RequestBody>> for Ok200 {
    type Response = http::Response<http_body_util::Full<bytes::Bytes>>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<peregrine_worker::RequestBody>) -> Self::Future {
        std::future::ready(Ok(http::Response::new(http_body_util::Full::from("ok"))))
    }
}

/// This process's resident memory, in bytes (`VmRSS` of `/proc/self/status`).
pub(crate) fn rss() -> usize {
    let status = peregrine_contract::procfs::StatusText::read_self().unwrap();
    let kib = status.kib("VmRSS").expect("VmRSS in /proc/self/status");
    usize::try_from(kib).unwrap() * 1024
}

/// A global `tracing` subscriber that hands every event's metadata to `on_event` (which counts what
/// its test looks for) and records nothing else.
pub(crate) struct EventCounter {
    next_id: std::sync::atomic::AtomicU64,
    on_event: fn(&tracing::Metadata<'_>),
}

impl EventCounter {
    /// Installs one as the global subscriber of this test binary.
    pub(crate) fn install(on_event: fn(&tracing::Metadata<'_>)) {
        tracing::subscriber::set_global_default(EventCounter {
            next_id: std::sync::atomic::AtomicU64::new(1),
            on_event,
        })
        .expect("the only global subscriber of this binary");
    }
}

impl tracing::Subscriber for EventCounter {
    fn register_callsite(
        &self,
        _: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::always()
    }

    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(
            self.next_id
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        )
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        (self.on_event)(event.metadata());
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// Starts a server of [`Ok200`] under `config` on a free port of 127.0.0.1, on an io_uring thread of
/// its own; returns its address, the sender that stops it, and its thread.
pub(crate) fn start_server(
    config: peregrine_worker::server::Config,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    thread::JoinHandle<()>,
) {
    let listeners = peregrine_worker::listen::bind(&"http://127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listeners
        .iter()
        .find_map(|l| match &l.addr {
            peregrine_worker::listen::BoundAddr::Ip(sa) => Some(*sa),
            peregrine_worker::listen::BoundAddr::Unix(_) => None,
        })
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = thread::spawn(move || {
        peregrine_worker::runtime::start(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            peregrine_worker::server::serve(listeners, || Ok200, config, shutdown)
                .await
                .unwrap();
        });
    });
    (addr, stop, thread)
}
