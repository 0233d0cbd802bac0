//! Freed request-body buffers go back to the system. glibc raises its mmap threshold each time a mapped
//! chunk is freed, after which buffers of a body's size come from the heap, and the heap keeps freed
//! pages that lie between live allocations. The server pins the threshold when it starts.
//!
//! A test binary of its own: it measures this process's resident memory and depends on the
//! allocator's process-wide state.

mod common;

use common::{Ok200, rss};
use std::{hint::black_box, thread};

use peregrine_worker::{
    listen,
    server::{self, Config},
};

fn rss_mib() -> usize {
    rss() / (1024 * 1024)
}

/// `n` buffers of `len` bytes, every page touched, each followed by a small allocation that outlives
/// it (as a connection's other state does).
fn bodies(n: usize, len: usize) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let mut large = Vec::with_capacity(n);
    let mut small = Vec::with_capacity(n);
    for i in 0..n {
        large.push(black_box(vec![i as u8 | 1; len]));
        small.push(black_box(vec![1u8; 64]));
    }
    (large, small)
}

#[test]
fn freed_body_buffers_are_returned_once_the_server_runs() {
    // A large buffer freed before: glibc now serves 1 MB from its heap.
    drop(black_box(vec![1u8; 8 * 1024 * 1024]));

    // Starting a server pins the threshold (and then stops: only the setting matters here).
    let listeners = listen::bind(&"http://127.0.0.1:0".parse().unwrap()).unwrap();
    thread::spawn(move || {
        peregrine_worker::runtime::start(async move {
            server::serve(listeners, || Ok200, Config::default(), async {})
                .await
                .unwrap();
        });
    })
    .join()
    .unwrap();

    let before = rss_mib();
    let (large, small) = bodies(100, 1_000_000);
    let held = rss_mib();
    drop(large);
    let after = rss_mib();
    eprintln!("resident: {before} MiB, with 100 bodies {held} MiB, after freeing them {after} MiB");
    assert!(held >= before + 90, "the bodies were not resident");
    assert!(
        after < before + 10,
        "{} MiB of freed bodies kept",
        after - before
    );
    drop(small);
}
