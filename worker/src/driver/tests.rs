//! The driver over real loopback sockets: back-pressure when the ring runs dry, and what closing with
//! operations and buffers outstanding leaves behind (nothing).

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    os::fd::OwnedFd,
    time::Duration,
};

use super::{DRIVER, net::Listener, net::Stream};
use crate::{runtime::Builder, stream};

/// The driver's free buffers and slots in use.
fn census() -> (u16, usize) {
    DRIVER.with_borrow(|driver| {
        let driver = driver.as_ref().expect("a driver");
        (
            driver.bufs.free(),
            driver.slots.iter().filter(|slot| slot.in_use).count(),
        )
    })
}

/// Lets the driver turn (submissions, completions, cancellations) until `census` passes `done`, at
/// most 10 s; returns how long it took.
async fn until(what: &str, done: impl Fn((u16, usize)) -> bool) -> Duration {
    let begun = std::time::Instant::now();
    loop {
        let now = census();
        if done(now) {
            return begun.elapsed();
        }
        assert!(
            begun.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}: (free buffers, slots in use) = {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Lets the driver turn for `window`, `census` holding `holds` all along: for what must not happen
/// (a slot freed too early), which no condition can be waited on for.
async fn holds_for(window: Duration, what: &str, holds: impl Fn((u16, usize)) -> bool) {
    let begun = std::time::Instant::now();
    while begun.elapsed() < window {
        let now = census();
        assert!(holds(now), "{what}: (free buffers, slots in use) = {now:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// A connected pair: the driver's end and a std client.
fn pair(listener: &TcpListener) -> (Stream, TcpStream) {
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    (Stream::new(OwnedFd::from(server)), client)
}

#[test]
fn a_dry_ring_holds_the_peers_back_and_loses_or_reorders_nothing() {
    const CONNECTIONS: usize = 32;
    const BYTES: usize = 256 * 1024;
    // 8 buffers of 512 bytes for 32 connections sending 256 KiB each: the ring runs dry all the time.
    let runtime = Builder::new().buffers(8, 512);
    runtime
        .block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let mut readers = Vec::new();
            let mut writers = Vec::new();
            for seed in 0..CONNECTIONS {
                let (stream, mut client) = pair(&listener);
                writers.push(std::thread::spawn(move || {
                    client.write_all(&pattern(BYTES, seed as u8)).unwrap();
                    client.shutdown(std::net::Shutdown::Write).unwrap();
                    // Keep the socket open until the server has read everything.
                    let mut rest = Vec::new();
                    let _ = client.read_to_end(&mut rest);
                }));
                readers.push(crate::runtime::spawn(async move {
                    let mut got = Vec::with_capacity(BYTES);
                    let mut turn = 0u32;
                    loop {
                        // Slow readers now and then, so buffers pile up and receives pause.
                        turn += 1;
                        if turn.is_multiple_of(7) {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        let room = Vec::with_capacity(3000);
                        let (result, chunk) = stream::read(&stream, room).await;
                        if result.unwrap() == 0 {
                            break;
                        }
                        got.extend_from_slice(&chunk);
                    }
                    stream.shutdown();
                    (seed, got)
                }));
            }
            for reader in readers {
                let (seed, got) = tokio::time::timeout(Duration::from_secs(60), reader)
                    .await
                    .expect("every reader finishes")
                    .unwrap();
                assert_eq!(got.len(), BYTES, "connection {seed}: every byte");
                assert!(
                    got == pattern(BYTES, seed as u8),
                    "connection {seed}: in order"
                );
            }
            for writer in writers {
                writer.join().unwrap();
            }
            until("every buffer back, every slot free", |c| c == (8, 0)).await;
        })
        .unwrap();
}

#[test]
fn closing_with_buffers_outstanding_returns_them() {
    Builder::new()
        .buffers(16, 1024)
        .block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let (stream, mut client) = pair(&listener);
            // Bytes arrive and are never read: the stream holds ring buffers (and pauses its receive).
            client.write_all(&pattern(64 * 1024, 1)).unwrap();
            until(
                "the unread bytes to hold buffers, on the one slot",
                |(free, in_use)| free < 16 && in_use == 1,
            )
            .await;
            drop(stream);
            until("every buffer back, every slot free", |c| c == (16, 0)).await;
            // Closed with the peer's bytes unread: the peer sees a reset, or the end.
            client
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut rest = Vec::new();
            if let Err(error) = client.read_to_end(&mut rest) {
                assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset);
            }
        })
        .unwrap();
}

#[test]
fn a_dropped_stream_still_sends_what_it_queued_then_closes() {
    Builder::new()
        .block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let (stream, client) = pair(&listener);
            // More than the sockets hold, queued before the peer reads anything: queueing stops
            // once the queue stays full.
            let mut queued = Vec::new();
            for seed in 0..=255 {
                let mut chunk = pattern(64 * 1024, seed);
                let copy = chunk.clone();
                let write = stream::write(&stream, &mut chunk);
                match tokio::time::timeout(Duration::from_millis(100), write).await {
                    Ok(written) => written.unwrap(),
                    Err(_) => break,
                }
                queued.extend_from_slice(&copy);
            }
            assert!(queued.len() < 256 * 64 * 1024, "the queue filled up");
            drop(stream);
            holds_for(Duration::from_millis(100), "lingering until sent", |c| {
                c.1 == 1
            })
            .await;
            let reader = std::thread::spawn(move || {
                let mut client = client;
                client
                    .set_read_timeout(Some(Duration::from_secs(10)))
                    .unwrap();
                let mut got = Vec::new();
                client.read_to_end(&mut got).map(|_| got)
            });
            let got = loop {
                if reader.is_finished() {
                    break reader.join().unwrap().unwrap();
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            assert!(got == queued, "{} of {} bytes", got.len(), queued.len());
            until("the slot free once everything is sent", |c| c.1 == 0).await;
        })
        .unwrap();
}

#[test]
fn a_dropped_stream_whose_peer_reads_nothing_is_cut_off_after_the_linger_time() {
    Builder::new()
        .linger(Duration::from_millis(200))
        .block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let (stream, mut client) = pair(&listener);
            // Far more than the sockets hold: sends stay in flight while nobody reads.
            for seed in 0..64 {
                let mut chunk = pattern(64 * 1024, seed);
                let queued = tokio::time::timeout(
                    Duration::from_millis(50),
                    stream::write(&stream, &mut chunk),
                )
                .await;
                if queued.is_err() {
                    break;
                }
            }
            drop(stream);
            let dropped = std::time::Instant::now();
            holds_for(Duration::from_millis(150), "lingering", |c| c.1 == 1).await;
            until("cut off and freed", |c| c.1 == 0).await;
            let lingered = dropped.elapsed();
            assert!(
                lingered >= Duration::from_millis(200),
                "freed after {lingered:?}, before the linger time"
            );
            // The peer sees the end (or a reset) once it reads.
            client
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut rest = Vec::new();
            let _ = client.read_to_end(&mut rest);
        })
        .unwrap();
}

#[test]
fn dropping_a_listener_cancels_its_accept_and_closes_it() {
    Builder::new()
        .block_on(async {
            let std_listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = std_listener.local_addr().unwrap();
            let listener = Listener::new(OwnedFd::from(std_listener));
            let client = TcpStream::connect(addr).unwrap();
            let accepted = tokio::time::timeout(Duration::from_secs(10), listener.accept())
                .await
                .expect("an accept")
                .unwrap();
            drop(accepted);
            drop(client);
            drop(listener);
            until("the accept's slot free", |c| c.1 == 0).await;
            let refused = TcpStream::connect(addr).expect_err("the listener is closed");
            assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
        })
        .unwrap();
}

#[test]
fn a_receive_error_and_the_end_of_stream_surface_in_order() {
    Builder::new()
        .block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let (stream, mut client) = pair(&listener);
            client.write_all(b"last words").unwrap();
            drop(client);
            let (result, got) = stream::read(&stream, Vec::with_capacity(64)).await;
            assert_eq!(result.unwrap(), 10);
            assert_eq!(got, b"last words");
            for _ in 0..3 {
                let (result, _) = stream::read(&stream, Vec::with_capacity(64)).await;
                assert_eq!(result.unwrap(), 0, "the end of the stream, every time");
            }
        })
        .unwrap();
}
