//! Continuous load through Envoy for lifecycle tests: HTTP/1.1 keep-alive and HTTP/2 (h2c) clients
//! that send `GET /` (or another path, [`LoadOptions::path`]) one after another until stopped, and
//! record every answer.
//!
//! Every request is checked: a 200 whose body is the hello worker's (`Hello from worker <pid>!`) counts
//! as served by that pid; anything else (a status other than 200, a body that is not a worker's, a
//! connection error) is a failure, kept with what went wrong. A client whose connection fails opens a
//! new one and goes on. The load stops when [`Load::stop`] is called or after its time limit, whichever
//! is first. [`LoadOptions`] can pace each client (a pause after each answer) and run the load from
//! elsewhere (a closure run first on the load's thread, e.g. entering a host's network namespace).

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

use crate::{http_get, worker_pid};

/// How long one request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The protocol a client speaks to Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Protocol {
    /// HTTP/1.1 with keep-alive.
    Http1,
    /// HTTP/2 with prior knowledge (h2c).
    Http2,
}

/// What the load saw.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Requests answered 200 by a worker, by protocol.
    pub ok: BTreeMap<Protocol, u64>,
    /// Requests answered, by worker pid.
    pub by_pid: BTreeMap<u32, u64>,
    /// Every failed request, in the order they failed.
    pub failures: Vec<FailedRequest>,
    /// How long the load ran.
    pub elapsed: Duration,
}

/// A request that failed.
#[derive(Clone, Debug)]
pub struct FailedRequest {
    /// The client's protocol.
    pub protocol: Protocol,
    /// What went wrong.
    pub what: String,
    /// When, on the load's clock ([`Load::elapsed`]).
    pub after: Duration,
    /// Whether its answer was cut short: its head had arrived when its body failed. Envoy cannot
    /// retry such a request on another worker, as it retries one whose worker reset it unanswered.
    pub cut: bool,
}

impl LoadReport {
    /// Requests answered 200 by a worker, over all protocols.
    pub fn served(&self) -> u64 {
        self.ok.values().sum()
    }
}

/// How a [`Load`] runs: its clients, its limit, its pace, and where from.
pub struct LoadOptions {
    /// HTTP/1.1 clients.
    pub http1: usize,
    /// HTTP/2 clients.
    pub http2: usize,
    /// The load stops by itself after this long.
    pub limit: Duration,
    /// Each client waits this long after each answer before its next request (zero: none).
    pub pause: Duration,
    /// The request target every client sends: `/` by default, e.g. `/?cpu=2` for requests that
    /// each take 2 ms of a worker's CPU.
    pub path: String,
    /// Run first on the load's thread, before any connection: e.g.
    /// [`NetHost::entry`](crate::NetHost::entry), so that the load comes from inside a host. An
    /// error is recorded as a failure and no request is sent.
    pub enter: Option<Box<dyn FnOnce() -> anyhow::Result<()> + Send>>,
}

impl LoadOptions {
    /// `http1` HTTP/1.1 and `http2` HTTP/2 clients, unpaced, from here, for at most `limit`.
    pub fn new(http1: usize, http2: usize, limit: Duration) -> LoadOptions {
        LoadOptions {
            http1,
            http2,
            limit,
            pause: Duration::ZERO,
            path: "/".to_owned(),
            enter: None,
        }
    }
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("http1", &self.http1)
            .field("http2", &self.http2)
            .field("limit", &self.limit)
            .field("pause", &self.pause)
            .field("path", &self.path)
            .field("enter", &self.enter.is_some())
            .finish()
    }
}

/// A running load; stop it with [`Load::stop`] (dropping it stops it too).
#[derive(Debug)]
pub struct Load {
    stop: Arc<AtomicBool>,
    report: Arc<Mutex<LoadReport>>,
    thread: Option<thread::JoinHandle<()>>,
    started: Instant,
    clients: usize,
}

impl Load {
    /// Starts `http1` HTTP/1.1 clients and `http2` HTTP/2 clients against `addr`, for at most `limit`.
    pub fn start(addr: SocketAddr, http1: usize, http2: usize, limit: Duration) -> Load {
        Load::start_with(addr, LoadOptions::new(http1, http2, limit))
    }

    /// Starts the clients `options` describe against `addr`.
    pub fn start_with(addr: SocketAddr, options: LoadOptions) -> Load {
        let LoadOptions {
            http1,
            http2,
            limit,
            pause,
            path,
            enter,
        } = options;
        let path: Arc<str> = path.into();
        let stop = Arc::new(AtomicBool::new(false));
        let report = Arc::new(Mutex::new(LoadReport::default()));
        let started = Instant::now();
        let thread = {
            let (stop, report) = (stop.clone(), report.clone());
            thread::spawn(move || {
                if let Some(enter) = enter
                    && let Err(error) = enter()
                {
                    let mut report = report.lock().unwrap_or_else(|e| e.into_inner());
                    report.failures.push(FailedRequest {
                        protocol: Protocol::Http1,
                        what: format!("entering: {error:#}"),
                        after: started.elapsed(),
                        cut: false,
                    });
                    return;
                }
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime");
                runtime.block_on(async move {
                    let deadline = started + limit;
                    let mut clients = tokio::task::JoinSet::new();
                    let protocols = std::iter::repeat_n(Protocol::Http1, http1)
                        .chain(std::iter::repeat_n(Protocol::Http2, http2));
                    for protocol in protocols {
                        let (stop, report, path) = (stop.clone(), report.clone(), path.clone());
                        let clock = Clock { started, deadline };
                        clients.spawn(client(addr, path, protocol, pause, stop, report, clock));
                    }
                    while clients.join_next().await.is_some() {}
                });
            })
        };
        Load {
            stop,
            report,
            thread: Some(thread),
            started,
            clients: http1 + http2,
        }
    }

    /// How long the load has run: its clock, on which [`FailedRequest::after`] is read.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// How many clients it runs: at most as many requests are in flight at once.
    pub fn clients(&self) -> usize {
        self.clients
    }

    /// What was seen so far.
    pub fn snapshot(&self) -> LoadReport {
        self.report
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Stops every client (each finishes its request in hand) and returns what they saw.
    pub fn stop(mut self) -> LoadReport {
        self.halt();
        let mut report = self.snapshot();
        report.elapsed = self.started.elapsed();
        report
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.halt();
    }
}

/// When a load started, and when it stops by itself.
#[derive(Clone, Copy)]
struct Clock {
    started: Instant,
    deadline: Instant,
}

/// One client: a connection at a time, requests one after another on it.
async fn client(
    addr: SocketAddr,
    path: Arc<str>,
    protocol: Protocol,
    pause: Duration,
    stop: Arc<AtomicBool>,
    report: Arc<Mutex<LoadReport>>,
    clock: Clock,
) {
    let Clock { started, deadline } = clock;
    let answered = |pid: u32| {
        let mut report = report.lock().unwrap_or_else(|e| e.into_inner());
        *report.ok.entry(protocol).or_default() += 1;
        *report.by_pid.entry(pid).or_default() += 1;
    };
    let failed = |what: String, cut: bool| {
        let mut report = report.lock().unwrap_or_else(|e| e.into_inner());
        report.failures.push(FailedRequest {
            protocol,
            what,
            after: started.elapsed(),
            cut,
        });
    };
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        let mut sender = match connect(addr, protocol).await {
            Ok(sender) => sender,
            Err(error) => {
                failed(format!("connect: {error}"), false);
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            match tokio::time::timeout(REQUEST_TIMEOUT, sender.get(addr, &path)).await {
                Ok(Ok(pid)) => {
                    answered(pid);
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                }
                Ok(Err(Failure::Closed)) => break,
                Ok(Err(Failure::Failed { what, cut })) => {
                    failed(what, cut);
                    break;
                }
                Err(_) => {
                    failed(format!("no answer within {REQUEST_TIMEOUT:?}"), false);
                    break;
                }
            }
        }
    }
}

/// How a request went wrong.
enum Failure {
    /// The connection was closed between requests (Envoy may close an idle connection): not a failed
    /// request, the client reconnects.
    Closed,
    /// The request failed: what went wrong, and whether its answer was cut short.
    Failed { what: String, cut: bool },
}

enum Sender {
    Http1(hyper::client::conn::http1::SendRequest<Empty<Bytes>>),
    Http2(hyper::client::conn::http2::SendRequest<Empty<Bytes>>),
}

async fn connect(addr: SocketAddr, protocol: Protocol) -> anyhow::Result<Sender> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let io = TokioIo::new(stream);
    Ok(match protocol {
        Protocol::Http1 => {
            let (sender, connection) = hyper::client::conn::http1::handshake(io).await?;
            tokio::spawn(connection);
            Sender::Http1(sender)
        }
        Protocol::Http2 => {
            let (sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            tokio::spawn(connection);
            Sender::Http2(sender)
        }
    })
}

impl Sender {
    /// `GET path`: the pid of the worker that answered.
    async fn get(&mut self, addr: SocketAddr, path: &str) -> Result<u32, Failure> {
        let ready = match self {
            Sender::Http1(s) => s.ready().await,
            Sender::Http2(s) => s.ready().await,
        };
        if ready.is_err() {
            return Err(Failure::Closed);
        }
        let request = Request::get(format!("http://{addr}{path}"))
            .header("host", addr.to_string())
            .body(Empty::<Bytes>::new())
            .expect("a valid request");
        let response = match self {
            Sender::Http1(s) => s.send_request(request).await,
            Sender::Http2(s) => s.send_request(request).await,
        }
        .map_err(|e| Failure::Failed {
            what: format!("request: {e}"),
            cut: false,
        })?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| Failure::Failed {
                what: format!("body: {e}"),
                cut: true,
            })?
            .to_bytes();
        let body = String::from_utf8_lossy(&body);
        if status != 200 {
            return Err(Failure::Failed {
                what: format!("status {status}: {body}"),
                cut: false,
            });
        }
        worker_pid(&body).ok_or_else(|| Failure::Failed {
            what: format!("not a worker's answer: {body:?}"),
            cut: false,
        })
    }
}

/// Runs `check` while `clients` threads send `GET path` to `listen`, each one request after
/// another, answers unread; returns what `check` returns. The clients stop when `check` returns or
/// panics (a failed wait must fail the test, not leave it waiting on clients that never stop).
pub fn requesting_while<T>(
    listen: SocketAddr,
    path: &str,
    clients: usize,
    check: impl FnOnce() -> T,
) -> T {
    /// Stops the clients when dropped, on a return or an unwind alike.
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = AtomicBool::new(false);
    thread::scope(|scope| {
        for _ in 0..clients {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let _ = http_get(listen, path);
                }
            });
        }
        let _stop = StopOnDrop(&stop);
        check()
    })
}

/// Sends `GET path` (e.g. a CPU-heavy `/?cpu=4`) from `clients` threads, each one request after
/// another, for `duration`; returns the requests answered per worker pid, and the failures.
pub fn answers_for(
    listen: SocketAddr,
    path: &str,
    clients: usize,
    duration: Duration,
) -> (BTreeMap<u32, u64>, u64) {
    let counts = Arc::new(Mutex::new((BTreeMap::new(), 0u64)));
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (counts, stop, path) = (counts.clone(), stop.clone(), path.to_owned());
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let answer = http_get(listen, &path);
                    let mut counts = counts.lock().unwrap();
                    match answer
                        .ok()
                        .and_then(|(code, body)| (code == 200).then(|| worker_pid(&body)).flatten())
                    {
                        Some(pid) => *counts.0.entry(pid).or_insert(0) += 1,
                        None => counts.1 += 1,
                    }
                }
            })
        })
        .collect();
    thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    let counts = counts.lock().unwrap();
    (counts.0.clone(), counts.1)
}
