//! Out of file descriptors, the accept loop backs off and says so once, not once per attempt; it accepts
//! again once descriptors are free.
//!
//! A test binary of its own: it lowers this process's descriptor limit and installs a global `tracing`
//! subscriber that counts the server's warnings.

mod common;

use common::{EventCounter, start_server};
use std::{
    io::{Read, Write},
    net::TcpStream,
    sync::atomic::{AtomicUsize, Ordering},
    thread,
    time::Duration,
};

use peregrine_worker::server::Config;
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use tracing::Level;

/// Warnings logged by the accept loops.
static ACCEPT_WARNINGS: AtomicUsize = AtomicUsize::new(0);

/// Counts the accept loops' warnings.
fn count(metadata: &tracing::Metadata<'_>) {
    if *metadata.level() == Level::WARN && metadata.target() == "peregrine_worker::server" {
        ACCEPT_WARNINGS.fetch_add(1, Ordering::SeqCst);
    }
}

fn open_descriptors() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

#[test]
fn emfile_is_logged_once_per_interval_and_accepting_resumes() {
    EventCounter::install(count);
    // The kernel takes the descriptor limit for an io_uring accept when the accept is armed, so the
    // limit is lowered before the server starts, with room to start it.
    let limit = getrlimit(Resource::Nofile);
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(open_descriptors() + 64),
            maximum: limit.maximum,
        },
    )
    .unwrap();
    let (addr, stop, server) = start_server(Config::default());
    // The server is up once it answers.
    let mut probe = TcpStream::connect(addr).unwrap();
    probe
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    probe.read_to_end(&mut Vec::new()).unwrap();
    drop(probe);

    // Fill the descriptor table, then free room for one client's socket only: the server's accept of
    // it fails with EMFILE (the client's socket takes the last descriptor before it can connect, so
    // the server cannot win that race).
    let mut filler = Vec::new();
    while let Ok(file) = std::fs::File::open("/dev/null") {
        filler.push(file);
    }
    filler.pop();
    let waiting: Vec<TcpStream> = TcpStream::connect(addr).into_iter().collect();
    assert!(!waiting.is_empty(), "no client could connect");
    // A window during which the loop, retrying every 50 ms as it did, would have warned 30 times.
    // What is measured is a rate, so the window is fixed.
    let window = Duration::from_millis(1500);
    let start = std::time::Instant::now();
    while start.elapsed() < window {
        // Descriptors the server frees meanwhile (the probe's connection, closed at its next turn)
        // are taken too, so the table stays full.
        while let Ok(file) = std::fs::File::open("/dev/null") {
            filler.push(file);
        }
        thread::sleep(Duration::from_millis(20));
    }
    let warnings = ACCEPT_WARNINGS.load(Ordering::SeqCst);
    drop(filler);
    setrlimit(Resource::Nofile, limit).unwrap();
    eprintln!("{warnings} accept warnings in {window:?} of EMFILE");
    assert!(
        warnings >= 1,
        "the accept never failed: the test proves nothing"
    );
    assert!(warnings <= 1, "{warnings} warnings in {window:?}");

    // Descriptors are back: the waiting clients are served (the back-off is at most a second).
    for mut client in waiting {
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut response = Vec::new();
        client.read_to_end(&mut response).unwrap();
        assert!(response.starts_with(b"HTTP/1.1 200 OK\r\n"), "{response:?}");
    }
    let _ = stop.send(());
    server.join().unwrap();
}
