//! A peer cannot flood the worker's log: `h2` warns once per unsolicited PING acknowledgement, and the
//! worker rate-limits `h2`'s warnings while it drives a connection.
//!
//! A test binary of its own: it installs a global `tracing` subscriber that counts warnings.

mod common;

use common::{EventCounter, start_server};
use std::{
    io::{Read, Write},
    net::TcpStream,
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use peregrine_worker::server::Config;
use tracing::Level;

/// Warnings (and errors) logged by `h2`, and every warning.
static H2_WARNINGS: AtomicUsize = AtomicUsize::new(0);
static WARNINGS: AtomicUsize = AtomicUsize::new(0);

/// Counts warnings, and `h2`'s apart.
fn count(metadata: &tracing::Metadata<'_>) {
    if *metadata.level() <= Level::WARN {
        WARNINGS.fetch_add(1, Ordering::SeqCst);
        if metadata.target().starts_with("h2") {
            H2_WARNINGS.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A frame header: length, type, flags, stream 0.
fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = vec![
        (len >> 16) as u8,
        (len >> 8) as u8,
        len as u8,
        kind,
        flags,
        0,
        0,
        0,
        0,
    ];
    out.extend_from_slice(payload);
    out
}

#[test]
fn unsolicited_ping_acks_do_not_flood_the_log() {
    const ACKS: usize = 500;
    EventCounter::install(count);
    let (addr, stop, server) = start_server(Config::default());

    let mut tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(4, 0, &[]));
    for i in 0..ACKS {
        out.extend(frame(6, 1, &(i as u64).to_be_bytes()));
    }
    // Then a PING of our own: its acknowledgement comes after every frame before it was handled.
    out.extend(frame(6, 0, b"lastping"));
    tcp.write_all(&out).unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while !got.windows(8).any(|w| w == b"lastping") {
        let n = tcp.read(&mut chunk).expect("no PING acknowledgement");
        assert_ne!(n, 0, "the server closed the connection");
        got.extend_from_slice(&chunk[..n]);
    }
    let h2 = H2_WARNINGS.load(Ordering::SeqCst);
    let all = WARNINGS.load(Ordering::SeqCst);
    eprintln!("{ACKS} unsolicited PING acks: {h2} warnings from h2, {all} in all");
    assert!(h2 >= 1, "h2 no longer warns: the test proves nothing");
    assert!(all <= 2, "{all} warnings for {ACKS} frames");
    drop(tcp);
    let _ = stop.send(());
    server.join().unwrap();
}
