//! Registration abuse against the real supervisor: a process that is not one of its workers is refused,
//! and a malformed message closes only its own connection; the workers keep serving through Envoy. A
//! flood of refused or silent connections costs a few log lines and a bounded count of descriptors.

use std::{
    io::{Read, Write},
    os::unix::net::UnixStream,
    time::Duration,
};

use bytes::BytesMut;
use peregrine_e2e::{
    Envoy, PeregrineToml, Supervisor, config::ServiceTable, envoy_or_skip, free_port, hosts,
    http_get, one_worker, wait_until, worker_pid,
};
use peregrine_proto::{
    decode_frame, encode,
    v1::{
        self, SupervisorMessage, WorkerMessage, refused::Code, supervisor_message, worker_message,
    },
};

fn impostor_registration() -> WorkerMessage {
    WorkerMessage {
        message: Some(worker_message::Message::Register(v1::Register {
            service: "cluster".into(),
            index: 0,
            pid: std::process::id(),
            listener: Some(v1::Listener {
                name: "cluster".into(),
                scheme: "http".into(),
                protocols: vec![v1::Protocol::Http1 as i32],
                addresses: vec![v1::Address {
                    address: Some(v1::address::Address::Socket(v1::SocketAddress {
                        ip: "127.0.0.1".into(),
                        port: 9,
                    })),
                }],
            }),
        })),
    }
}

/// Reads one answer, or `None` when the supervisor closes the connection without one.
fn read_answer(stream: &mut UnixStream) -> Option<SupervisorMessage> {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = BytesMut::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(message) = decode_frame(&mut buf).expect("a well-formed answer") {
            return Some(message);
        }
        let n = stream
            .read(&mut chunk)
            .expect("an answer or a close within 10 s");
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[test]
fn strangers_and_garbage_cannot_disturb_the_workers() {
    if envoy_or_skip("strangers_and_garbage_cannot_disturb_the_workers").is_none() {
        return;
    }
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let supervisor = Supervisor::start(&PeregrineToml::one_service(grpc, listen, admin, 2).toml());
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().unwrap());
    let before = wait_until(Duration::from_secs(30), "2 healthy hosts", || {
        let hosts = hosts(&envoy.clusters(), "cluster");
        (hosts.len() == 2 && hosts.iter().all(|h| h.healthy)).then_some(hosts)
    });
    let control = supervisor.dir().join("peregrine.sock");

    // This test process is not a worker of the supervisor, even with a well-formed claim.
    let mut stranger = UnixStream::connect(&control).unwrap();
    stranger
        .write_all(&encode(&impostor_registration()))
        .unwrap();
    match read_answer(&mut stranger).and_then(|a| a.message) {
        Some(supervisor_message::Message::Refused(refused)) => {
            assert_eq!(refused.code(), Code::NotOurs, "{}", refused.reason);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(
        read_answer(&mut stranger).is_none(),
        "the refused connection is closed"
    );

    // A frame that is not a message closes that connection and nothing else.
    let mut garbage = UnixStream::connect(&control).unwrap();
    garbage
        .write_all(&[5, 0xff, 0xff, 0xff, 0xff, 0xff])
        .unwrap();
    assert!(
        read_answer(&mut garbage).is_none(),
        "the malformed connection is closed"
    );

    wait_until(Duration::from_secs(10), "both refusals logged", || {
        let logs = supervisor.logs();
        (logs.contains("not a worker of this supervisor") && logs.contains("malformed message"))
            .then_some(())
    });
    let after = hosts(&envoy.clusters(), "cluster");
    let names =
        |h: &[peregrine_e2e::Host]| h.iter().map(|h| h.hostname.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&after),
        names(&before),
        "the endpoints did not change"
    );
    for _ in 0..20 {
        let (status, body) = http_get(([127, 0, 0, 1], listen), "/").unwrap();
        assert_eq!(status, 200);
        assert!(worker_pid(&body).is_some(), "{body}");
    }
}

#[test]
fn a_worker_may_register_only_addresses_it_listens_on() {
    // Someone else's listener: this test process's, as Envoy's admin port would be.
    let someone_elses = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let foreign = someone_elses.local_addr().unwrap();
    let listen = free_port();
    let mut config = PeregrineToml::local(free_port());
    config.service(
        "web",
        ServiceTable::at(format!("http://127.0.0.1:{listen}")),
    );
    config.service(
        "imp",
        ServiceTable::default().command([
            env!("CARGO_BIN_EXE_register-as").to_owned(),
            "--stay".to_owned(),
            "120".to_owned(),
            // Its own slot, at a port another process listens on; then at a listener of its own.
            format!("-,imp,0@{foreign}"),
            "-,imp,0@listen".to_owned(),
        ]),
    );
    let supervisor = Supervisor::start(&config.toml());
    let lines = wait_until(Duration::from_secs(30), "the two claims of imp", || {
        let logs = supervisor.logs();
        let lines: Vec<String> = logs
            .lines()
            .filter(|line| line.contains("register-as: uid"))
            .map(str::to_owned)
            .collect();
        (lines.len() >= 2).then_some(lines)
    });
    let pid: u32 = lines[0]
        .split(" pid ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {:?}", lines[0]));
    let refusal = format!("refused CODE_NOT_LISTENING: process {pid} does not listen on {foreign}");
    assert!(lines[0].ends_with(&refusal), "{lines:?}");
    assert!(
        lines[1].ends_with(&format!("registered as imp-0-{pid}")),
        "{lines:?}"
    );
    wait_until(Duration::from_secs(10), "the refusal logged", || {
        supervisor
            .logs()
            .lines()
            .any(|line| {
                line.contains("Registration connection closed")
                    && line.contains(&format!("process {pid} does not listen on {foreign}"))
            })
            .then_some(())
    });
    // The real worker registered as ever, and serves; imp is registered at its own listener.
    wait_until(Duration::from_secs(30), "both slots ready", || {
        let status = supervisor.status_json().ok()?;
        let ready = |service: &str| {
            status["workers"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|row| {
                    row["service"] == service && row["index"] == 0 && row["state"] == "ready"
                })
        };
        (ready("web") && ready("imp")).then_some(())
    });
    let (status, body) = http_get(([127, 0, 0, 1], listen), "/").unwrap();
    assert_eq!(status, 200);
    assert!(worker_pid(&body).is_some(), "{body}");
    drop(someone_elses);
}

/// Whether the supervisor has closed `stream` (EOF or a reset), without waiting.
fn closed(mut stream: &UnixStream) -> bool {
    stream.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

#[test]
fn a_flood_of_refused_and_silent_connections_logs_a_few_lines_and_holds_few_descriptors() {
    let (supervisor, _addr) = one_worker();
    let first = wait_until(Duration::from_secs(30), "the worker registered", || {
        supervisor.status_pids().ok().filter(|pids| pids.len() == 1)
    });
    let control = supervisor.dir().join("peregrine.sock");

    // Silent connections, which never send a frame, held open throughout.
    let silent: Vec<UnixStream> = (0..300)
        .map(|_| UnixStream::connect(&control).unwrap())
        .collect();
    // Refused connections, as fast as this process opens them, for at most 3 s.
    let claim = encode(&impostor_registration());
    let started = std::time::Instant::now();
    let mut flood = 0;
    while flood < 3000 && started.elapsed() < Duration::from_secs(3) {
        let mut stranger = UnixStream::connect(&control).unwrap();
        stranger.write_all(&claim).unwrap();
        // The answer is read, so that the refusal is done before the next.
        assert!(read_answer(&mut stranger).is_some());
        flood += 1;
    }
    assert!(flood >= 500, "only {flood} refusals in 3 s");

    // The supervisor answers and a real worker registers again.
    supervisor
        .status_json()
        .expect("status answers during the flood");
    let old = *first.iter().next().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(old as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    wait_until(Duration::from_secs(20), "a new worker registered", || {
        supervisor
            .status_pids()
            .ok()
            .filter(|pids| pids.len() == 1 && !pids.contains(&old))
    });

    // All but the newest pending connections were closed, long before their deadline.
    let closed = silent.iter().filter(|stream| closed(stream)).count();
    assert!(
        closed >= 300 - 64,
        "{closed} of 300 silent connections closed"
    );

    let logs = supervisor.logs();
    let lines = logs
        .lines()
        .filter(|line| line.contains("Registration connection closed"))
        .count();
    assert!(
        (1..=4).contains(&lines),
        "{lines} lines for {flood} refusals and 300 silent connections; the first 20:\n{}",
        logs.lines().take(20).collect::<Vec<_>>().join("\n")
    );
    assert!(
        logs.contains("not a worker of this supervisor"),
        "the first refusal is logged"
    );
}
