//! The inherited counter descriptor stays open for the life of the worker, for a supervisor that adopts
//! it to duplicate with `pidfd_getfd(2)`.
//!
//! A test binary of its own: attaching the counter is once per process.

use std::{
    io::{Read, Write},
    net::TcpStream,
    os::{
        fd::{AsFd, AsRawFd},
        unix::net::UnixListener,
    },
    sync::{atomic::Ordering, mpsc},
    thread,
};

use peregrine_contract::counters::CounterRegion;
use peregrine_proto::v1::{Registered, supervisor_message};
use peregrine_worker::{
    Hello, Settings,
    settings::{CounterLane, DEFAULT_ORPHAN_TIMEOUT},
};

mod common;

use common::{STEP, accept_register, socket_addr};

#[test]
fn the_worker_keeps_the_counter_descriptor_open() {
    let (fd, supervisor_view) = CounterRegion::create(4).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.sock");
    let listener = UnixListener::bind(&control).unwrap();
    let settings = Settings {
        service: "web".into(),
        index: 1,
        url: "http://127.0.0.1:0".parse().unwrap(),
        control: control.clone(),
        counters: Some(CounterLane {
            fd: fd.as_raw_fd(),
            lane: 1,
        }),
        orphan_timeout: DEFAULT_ORPHAN_TIMEOUT,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (result, rx) = mpsc::channel();
    let worker = thread::spawn(move || {
        let _ = result.send(peregrine_worker::run_until(settings, Hello::new, async {
            let _ = stopped.await;
        }));
    });

    // A fake supervisor accepts the registration.
    let (_conn, register) = accept_register(
        &listener,
        supervisor_message::Message::Registered(Registered {
            hostname: "web-1".into(),
        }),
    );
    let sa = socket_addr(&register);

    // A request is counted in the lane, and the worker has not closed the descriptor after mapping it.
    let mut http = TcpStream::connect(sa).unwrap();
    http.set_read_timeout(Some(STEP)).unwrap();
    http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    http.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert_eq!(supervisor_view.lane(1).load(Ordering::Relaxed), 1);
    rustix::io::fcntl_getfd(fd.as_fd()).expect("the counter descriptor is open while serving");

    stop.send(()).unwrap();
    rx.recv_timeout(STEP).unwrap().unwrap();
    worker.join().unwrap();
    rustix::io::fcntl_getfd(fd.as_fd()).expect("the counter descriptor outlives the runtime");
}
