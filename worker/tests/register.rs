//! Registration against a fake supervisor (a std Unix listener in the test), including the supervisor
//! going away and a new one taking its place on the same socket path.

use std::{
    io::{Read, Write},
    net::TcpStream,
    os::unix::net::{UnixListener, UnixStream},
    path::Path,
    time::{Duration, Instant},
};

use peregrine_proto::v1::{
    Protocol, Refused, Registered, address, refused::Code, supervisor_message,
};
use peregrine_worker::{
    Settings, WorkerError, register::RegisterError, settings::DEFAULT_ORPHAN_TIMEOUT,
};

mod common;

use common::{STEP, accept_register, socket_addr, spawn_worker};

fn settings(control: &Path) -> Settings {
    Settings {
        service: "web".into(),
        index: 3,
        url: "http://127.0.0.1:0".parse().unwrap(),
        control: control.into(),
        counters: None,
        orphan_timeout: DEFAULT_ORPHAN_TIMEOUT,
    }
}

/// Asserts that the worker holds `conn` open: nothing to read, no end of stream.
fn assert_held(conn: &mut UnixStream) {
    conn.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let err = conn.read(&mut byte).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock);
    conn.set_nonblocking(false).unwrap();
}

fn registered(hostname: &str) -> supervisor_message::Message {
    supervisor_message::Message::Registered(Registered {
        hostname: hostname.into(),
    })
}

fn get(addr: std::net::SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(STEP)).unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn registers_every_address_and_keeps_the_connection_open() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.sock");
    let listener = UnixListener::bind(&control).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let (result, worker) = spawn_worker(settings(&control), stopped);

    let (mut conn, register) = accept_register(
        &listener,
        supervisor_message::Message::Registered(Registered {
            hostname: "web-3-abc".into(),
        }),
    );
    assert_eq!(register.service, "web");
    assert_eq!(register.index, 3);
    assert_eq!(register.pid, std::process::id());
    let l = register.listener.unwrap();
    assert_eq!(l.name, "web");
    assert_eq!(l.scheme, "http");
    assert_eq!(
        l.protocols,
        vec![i32::from(Protocol::Http1), i32::from(Protocol::Http2)]
    );
    assert_eq!(l.addresses.len(), 1);
    let Some(address::Address::Socket(sa)) = l.addresses[0].address.clone() else {
        panic!("expected a socket address")
    };
    assert_eq!(sa.ip, "127.0.0.1");
    assert_ne!(sa.port, 0);

    // The registered address serves the hello app.
    let addr = format!("127.0.0.1:{}", sa.port).parse().unwrap();
    let response = get(addr);
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(
        response.ends_with(&format!("Hello from worker {}!\n", std::process::id())),
        "{response}"
    );

    // The registration is still open while the worker serves: nothing to read, no end of stream.
    conn.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let err = conn.read(&mut byte).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock);
    conn.set_nonblocking(false).unwrap();

    // Stopping the worker closes the registration.
    stop.send(()).unwrap();
    result.recv_timeout(STEP).unwrap().unwrap();
    worker.join().unwrap();
    assert_eq!(conn.read(&mut byte).unwrap(), 0);
}

#[test]
fn a_refusal_fails_the_worker_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.sock");
    let listener = UnixListener::bind(&control).unwrap();
    let (_stop, stopped) = tokio::sync::oneshot::channel();
    let (result, worker) = spawn_worker(settings(&control), stopped);

    let (conn, _) = accept_register(
        &listener,
        supervisor_message::Message::Refused(Refused {
            reason: "index 3 is taken".into(),
            code: Code::SlotMismatch.into(),
        }),
    );
    drop(conn);
    let err = result.recv_timeout(STEP).unwrap().unwrap_err();
    match &err {
        WorkerError::Register(RegisterError::Refused { code, reason }) => {
            assert_eq!(
                (*code, reason.as_str()),
                (Code::SlotMismatch, "index 3 is taken")
            )
        }
        other => panic!("unexpected error: {other:?}"),
    }
    worker.join().unwrap();
}

#[test]
fn a_supervisor_that_closes_without_answering_fails_the_worker() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.sock");
    let listener = UnixListener::bind(&control).unwrap();
    let (_stop, stopped) = tokio::sync::oneshot::channel();
    let (result, worker) = spawn_worker(settings(&control), stopped);
    drop(listener.accept().unwrap());
    let err = result.recv_timeout(STEP).unwrap().unwrap_err();
    assert!(
        matches!(err, WorkerError::Register(RegisterError::Closed)),
        "{err:?}"
    );
    worker.join().unwrap();
}

#[test]
fn a_missing_supervisor_fails_the_worker() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("absent.sock");
    let (_stop, stopped) = tokio::sync::oneshot::channel();
    let (result, worker) = spawn_worker(settings(&control), stopped);
    let err = result.recv_timeout(STEP).unwrap().unwrap_err();
    assert!(
        matches!(err, WorkerError::Register(RegisterError::Connect { .. })),
        "{err:?}"
    );
    worker.join().unwrap();
}

#[test]
fn the_worker_keeps_serving_when_the_supervisor_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.sock");
    let listener = UnixListener::bind(&control).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let (result, worker) = spawn_worker(settings(&control), stopped);
    let (conn, register) = accept_register(
        &listener,
        supervisor_message::Message::Registered(Registered {
            hostname: "web-3".into(),
        }),
    );
    drop(conn);
    drop(listener);
    let Some(address::Address::Socket(sa)) =
        register.listener.unwrap().addresses[0].address.clone()
    else {
        panic!("expected a socket address")
    };
    let addr = format!("127.0.0.1:{}", sa.port).parse().unwrap();
    for _ in 0..3 {
        assert!(get(addr).starts_with("HTTP/1.1 200 OK\r\n"));
    }
    stop.send(()).unwrap();
    result.recv_timeout(STEP).unwrap().unwrap();
    worker.join().unwrap();
}

#[test]
fn the_worker_registers_again_with_the_next_supervisor_and_serves_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.sock");
    let mut listener = UnixListener::bind(&control).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let (result, worker) = spawn_worker(settings(&control), stopped);
    let (mut conn, first) = accept_register(&listener, registered("web-3-a"));
    let addr = socket_addr(&first);

    // Two supervisors in turn die and are replaced: the worker registers with each new one.
    for next in ["web-3-b", "web-3-c"] {
        // The supervisor dies: its connection and its listener close; its socket file stays behind.
        drop(conn);
        drop(listener);
        // Meanwhile the worker serves.
        let response = get(addr);
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        // The next supervisor removes the stale socket file and listens on the same path.
        std::fs::remove_file(&control).unwrap();
        listener = UnixListener::bind(&control).unwrap();
        let again;
        (conn, again) = accept_register(&listener, registered(next));
        assert_eq!(again, first, "the same service, index, pid and addresses");
        assert_eq!(again.pid, std::process::id());
        assert!(get(addr).starts_with("HTTP/1.1 200 OK\r\n"));
        assert_held(&mut conn);
    }

    // Stopping the worker closes the new registration.
    stop.send(()).unwrap();
    result.recv_timeout(STEP).unwrap().unwrap();
    worker.join().unwrap();
    assert_eq!(conn.read(&mut [0u8; 1]).unwrap(), 0);
}

#[test]
fn a_refused_new_registration_stops_the_worker_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.sock");
    let listener = UnixListener::bind(&control).unwrap();
    let (_stop, stopped) = tokio::sync::oneshot::channel();
    let (result, worker) = spawn_worker(settings(&control), stopped);
    let (conn, first) = accept_register(&listener, registered("web-3"));
    let addr = socket_addr(&first);

    // The supervisor drops the connection, and the one that answers next no longer wants the worker.
    drop(conn);
    let (_conn, again) = accept_register(
        &listener,
        supervisor_message::Message::Refused(Refused {
            reason: "service web has no slot 3".into(),
            code: Code::NotOurs.into(),
        }),
    );
    assert_eq!(again, first);
    let err = result.recv_timeout(STEP).unwrap().unwrap_err();
    match &err {
        WorkerError::Unwanted(RegisterError::Refused { code, reason }) => {
            assert_eq!(
                (*code, reason.as_str()),
                (Code::NotOurs, "service web has no slot 3")
            )
        }
        other => panic!("unexpected error: {other:?}"),
    }
    let source = std::error::Error::source(&err).unwrap().to_string();
    assert!(source.contains("service web has no slot 3"), "{source}");
    worker.join().unwrap();
    // The worker stopped serving.
    assert!(TcpStream::connect(addr).is_err());
}

#[test]
fn without_a_supervisor_the_worker_stops_after_the_orphan_timeout() {
    const ORPHAN_TIMEOUT: Duration = Duration::from_millis(300);
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.sock");
    let listener = UnixListener::bind(&control).unwrap();
    let (_stop, stopped) = tokio::sync::oneshot::channel();
    let settings = Settings {
        orphan_timeout: ORPHAN_TIMEOUT,
        ..settings(&control)
    };
    let (result, worker) = spawn_worker(settings, stopped);
    let (conn, _) = accept_register(&listener, registered("web-3"));

    // The supervisor goes away for good.
    let lost = Instant::now();
    drop(conn);
    drop(listener);
    result.recv_timeout(STEP).unwrap().unwrap();
    let waited = lost.elapsed();
    assert!(waited >= ORPHAN_TIMEOUT, "stopped after {waited:?}");
    worker.join().unwrap();
}
