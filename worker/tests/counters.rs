//! The request counter in shared memory: a worker given a lane of a counter region counts every request
//! there, where another mapping (the supervisor's) reads it without asking the worker.
//!
//! A test binary of its own: attaching the counter is once per process.

use std::{
    io::{Read, Write},
    net::TcpStream,
    os::fd::AsFd,
    sync::atomic::Ordering,
    thread,
    time::Duration,
};

use peregrine_contract::counters::CounterRegion;
use peregrine_worker::{
    Hello, counter, listen,
    server::{self, Config},
};

#[test]
fn requests_are_counted_in_the_shared_lane() {
    let (fd, supervisor_view) = CounterRegion::create(4).unwrap();
    counter::attach(fd.as_fd(), 2).unwrap();
    assert!(
        counter::attach(fd.as_fd(), 1).is_err(),
        "a worker counts in one lane only"
    );

    let listeners = listen::bind(&"http://127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = match &listeners[0].addr {
        listen::BoundAddr::Ip(addr) => *addr,
        other => panic!("expected an IP address, got {other}"),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = thread::spawn(move || {
        peregrine_worker::runtime::start(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            server::serve(listeners, Hello::new, Config::default(), shutdown)
                .await
                .unwrap();
        })
    });

    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(&b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".repeat(5))
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(6).filter(|w| w == b"Hello ").count() < 5 {
        let n = stream.read(&mut buf).unwrap();
        assert_ne!(n, 0, "the server closed early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(supervisor_view.lane(2).load(Ordering::Relaxed), 5);
    assert_eq!(
        supervisor_view.lane(1).load(Ordering::Relaxed),
        0,
        "other lanes are untouched"
    );

    drop(stream);
    stop.send(()).unwrap();
    server.join().unwrap();
}
