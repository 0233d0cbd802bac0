//! Unfinished request bodies cannot hold a worker's memory: many HTTP/1 connections and one HTTP/2
//! connection with many streams each send most of a large body and stall; the server (in this process,
//! on its own io_uring thread) must stay within its body budget, answer every one of them (`503` when
//! the budget is spent, `408` when the body stalls) and give the memory back.
//!
//! A test binary of its own, with one test: it measures this process's resident memory
//! (`/proc/self/status`), which another test running beside it would disturb.

mod common;

use common::{rss, start_server};
use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use peregrine_worker::server::Config;

/// How long any single step of the test may take.
const STEP: Duration = Duration::from_secs(10);

/// The declared body, and how much of it each client sends before it stalls.
const DECLARED: usize = 1_000_000;
const SENT: usize = 900_000;

/// The worker's body budget in this test, and the most its resident memory may grow by: the budget,
/// plus what a connection holds uncharged (a head and a read, 32 KiB) for each of them, plus slack for
/// the runtime, the clients' own buffers and the allocator.
const BUDGET: usize = 16 * 1024 * 1024;
const H1_CONNECTIONS: usize = 150;
const H2_STREAMS: usize = 200;
const MAX_GROWTH: usize = BUDGET + H1_CONNECTIONS * 32 * 1024 + 24 * 1024 * 1024;

/// How close to its baseline resident memory must come back once the connections are gone.
const RETURNED_WITHIN: usize = 8 * 1024 * 1024;

/// Waits (at most [`STEP`]) until resident memory is below `bound`; returns it.
fn wait_for_rss_below(bound: usize) -> usize {
    let deadline = Instant::now() + STEP;
    loop {
        let now = rss();
        if now < bound {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "resident memory stayed at {:.1} MiB, above {:.1} MiB",
            mib(now),
            mib(bound)
        );
        thread::sleep(Duration::from_millis(20));
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Samples resident memory every few milliseconds until dropped; keeps the highest reading.
struct PeakRss {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<thread::JoinHandle<usize>>,
}

impl PeakRss {
    fn start() -> Self {
        let (stop, stopped) = mpsc::channel();
        let thread = thread::spawn(move || {
            let mut peak = rss();
            while let Err(mpsc::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(Duration::from_millis(5))
            {
                peak = peak.max(rss());
            }
            peak.max(rss())
        });
        PeakRss {
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn stop(mut self) -> usize {
        drop(self.stop.take());
        self.thread.take().unwrap().join().unwrap()
    }
}

/// Reads an HTTP/1 connection to its end (or `deadline`); the status of the response on it, if any.
fn status_then_close(stream: &mut TcpStream, deadline: Instant) -> Option<u16> {
    let left = deadline.saturating_duration_since(Instant::now());
    stream
        .set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .unwrap();
    let mut got = Vec::new();
    let _ = stream.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got);
    text.strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
}

#[test]
fn stalled_bodies_stay_within_the_budget_and_are_cut_off() {
    let mut config = Config {
        max_buffered_body_bytes: BUDGET,
        ..Config::default()
    };
    config.limits.body_read_timeout = Duration::from_millis(700);
    config.limits.body_timeout = Duration::from_secs(2);
    config.http2.body_read_timeout = Duration::from_millis(700);
    config.http2.body_timeout = Duration::from_secs(2);
    config.http2.max_connection_body_bytes = BUDGET;
    let (addr, stop, server) = start_server(config);
    let payload = vec![b'a'; SENT];

    // HTTP/1: every connection sends its head and most of its body, then stalls.
    let baseline = rss();
    let started = Instant::now();
    let sampler = PeakRss::start();
    let mut connections = Vec::with_capacity(H1_CONNECTIONS);
    for _ in 0..H1_CONNECTIONS {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(STEP)).unwrap();
        stream.set_write_timeout(Some(STEP)).unwrap();
        stream
            .write_all(
                format!("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {DECLARED}\r\n\r\n")
                    .as_bytes(),
            )
            .unwrap();
        // A connection refused for the budget is closed under the client: a failed write is fine.
        let _ = stream.write_all(&payload);
        connections.push(stream);
    }
    let sent_in = started.elapsed();
    // Every connection is answered well within this; the sampler watches the server read meanwhile.
    let deadline = Instant::now() + Duration::from_secs(4);
    let mut statuses = std::collections::BTreeMap::new();
    for stream in &mut connections {
        *statuses
            .entry(status_then_close(stream, deadline))
            .or_insert(0) += 1;
    }
    let cut_off_in = started.elapsed();
    let peak = sampler.stop();
    drop(connections);
    let growth = peak.saturating_sub(baseline);
    eprintln!(
        "http/1: {H1_CONNECTIONS} connections x {SENT} bytes sent in {sent_in:?}: resident memory \
         {:.1} MiB -> peak {:.1} MiB (+{:.1} MiB, bound {:.1} MiB); answers {statuses:?} within {cut_off_in:?}",
        mib(baseline),
        mib(peak),
        mib(growth),
        mib(MAX_GROWTH),
    );
    assert_bounded_and_refused(growth, &statuses, "connections");
    assert!(
        statuses.contains_key(&Some(503)),
        "the budget never ran out"
    );
    // The connections are closed: their buffers go back to the system.
    let returned = wait_for_rss_below(baseline + RETURNED_WITHIN);
    eprintln!("http/1: after close {:.1} MiB", mib(returned));

    // HTTP/2: one connection, many streams, each with most of its body.
    let baseline = rss();
    let started = Instant::now();
    let sampler = PeakRss::start();
    let statuses = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            tokio::time::timeout(STEP, h2_streams(addr, Bytes::from(payload)))
                .await
                .expect("the streams were not answered in time")
        });
    let peak = sampler.stop();
    let growth = peak.saturating_sub(baseline);
    eprintln!(
        "http/2: {H2_STREAMS} streams x {SENT} bytes: resident memory {:.1} MiB -> peak {:.1} MiB \
         (+{:.1} MiB, bound {:.1} MiB); answers {statuses:?} within {:?}",
        mib(baseline),
        mib(peak),
        mib(growth),
        mib(MAX_GROWTH),
        started.elapsed(),
    );
    assert_bounded_and_refused(growth, &statuses, "streams");

    let returned = wait_for_rss_below(baseline + RETURNED_WITHIN);
    eprintln!("http/2: after the answers {:.1} MiB", mib(returned));
    let _ = stop.send(());
    server.join().unwrap();
}

/// Resident memory grew by less than [`MAX_GROWTH`], and every one of the `what` (connections or
/// streams) was refused: `503` (no room in the budget) or `408` (its body stalled), some of them `408`.
fn assert_bounded_and_refused(
    growth: usize,
    statuses: &std::collections::BTreeMap<Option<u16>, usize>,
    what: &str,
) {
    assert!(
        growth < MAX_GROWTH,
        "resident memory grew by {:.1} MiB",
        mib(growth)
    );
    for (status, n) in statuses {
        assert!(
            matches!(status, Some(503 | 408)),
            "{n} {what} ended with {status:?}"
        );
    }
    assert!(statuses.contains_key(&Some(408)), "no body timed out");
}

/// Opens [`H2_STREAMS`] streams on one connection, sends [`SENT`] bytes of each body and waits for
/// every answer; returns how many streams got which status.
async fn h2_streams(
    addr: SocketAddr,
    payload: Bytes,
) -> std::collections::BTreeMap<Option<u16>, usize> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let (client, connection) = h2::client::Builder::new()
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    tokio::spawn(connection);
    let mut streams = tokio::task::JoinSet::new();
    for _ in 0..H2_STREAMS {
        let client = client.clone();
        let payload = payload.clone();
        streams.spawn(async move {
            let mut client = client.ready().await.ok()?;
            let request = Request::builder()
                .method(Method::POST)
                .uri("http://localhost/")
                .header("content-length", DECLARED)
                .body(())
                .unwrap();
            let (response, mut send) = client.send_request(request, false).ok()?;
            let sending = async {
                let mut offset = 0;
                while offset < payload.len() {
                    send.reserve_capacity(payload.len() - offset);
                    let capacity = match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
                        Some(Ok(n)) if n > 0 => n,
                        Some(Ok(_)) => continue,
                        _ => break,
                    };
                    let n = capacity.min(payload.len() - offset);
                    if send
                        .send_data(payload.slice(offset..offset + n), false)
                        .is_err()
                    {
                        break;
                    }
                    offset += n;
                }
                // Then stall: the stream stays open, its end never sent.
                send
            };
            let (_send, response) = tokio::join!(sending, response);
            let status = response.ok().map(|r| r.status());
            Some(status.map_or(0, |s: StatusCode| s.as_u16()))
        });
    }
    let mut statuses = std::collections::BTreeMap::new();
    while let Some(done) = streams.join_next().await {
        let status = done.unwrap().filter(|s| *s != 0);
        *statuses.entry(status).or_insert(0) += 1;
    }
    statuses
}
