//! The gRPC port under a flood of connections that never speak: the supervisor keeps its descriptors
//! for its workers and its control socket (a killed worker is restarted, `peregrine status` answers),
//! refuses connections over its cap with a few log lines rather than one per connection, closes those
//! that send no HTTP/2 preface in time and those that stay without a stream, and then serves again.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use peregrine_e2e::{Supervisor, free_port, wait_until};

const STEP: Duration = Duration::from_secs(30);

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn worker_pid(supervisor: &Supervisor) -> Option<u32> {
    let status = supervisor.status_json().ok()?;
    status["workers"][0]["pid"].as_u64().map(|p| p as u32)
}

/// `peregrine status` answers within `limit`.
fn status_answers_within(supervisor: &Supervisor, limit: Duration) {
    let started = Instant::now();
    supervisor.status_json().expect("status answers");
    assert!(
        started.elapsed() < limit,
        "status took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_flood_of_silent_connections_starves_nothing_and_is_closed() {
    let grpc = free_port();
    // 1024 open files: after the reserve for 4 lanes (256 + 32), 736 gRPC connections at most.
    let supervisor = Supervisor::start_wrapped_in(
        &["prlimit", "--nofile=1024:1024", "--"],
        &format!(
            r#"[supervisor]
bind = "http://127.0.0.1:{grpc}"
control = "{{dir}}/peregrine.sock"
sampler = "off"
grpc_handshake_timeout_ms = 2000
grpc_idle_timeout_ms = 1000

[service.web]
url = "http://127.0.0.1:{web}"
"#,
            web = free_port()
        ),
    );
    let pid = supervisor.pid();
    let first = wait_until(STEP, "the worker registered", || worker_pid(&supervisor));
    let (fds_before, rss_before) = (open_fds(pid), rss_kib(pid));
    let addr = SocketAddr::from(([127, 0, 0, 1], grpc));

    // 1,500 connections that say nothing: twice what the supervisor may hold.
    let flood: Vec<TcpStream> = (0..1500)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok())
        .collect();
    assert!(flood.len() > 1000, "{} connected", flood.len());
    wait_until(STEP, "the cap reached", || {
        supervisor
            .logs()
            .contains("cap of open connections is reached")
            .then_some(())
    });
    let held = open_fds(pid);
    assert!(
        held < 1024 - 200,
        "{held} descriptors open: the reserve is gone"
    );
    // The supervisor still does its job: status answers, and a killed worker is restarted.
    status_answers_within(&supervisor, Duration::from_secs(5));
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(first as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let second = wait_until(STEP, "the killed worker restarted", || {
        worker_pid(&supervisor).filter(|p| *p != first)
    });
    assert_ne!(second, first);
    let logs = supervisor.logs();
    assert!(
        !logs.contains("Too many open files"),
        "the supervisor ran out of descriptors:\n{logs}"
    );
    // Throttled: a line per 10 s, not one per refused connection.
    let refusals = logs.matches("cap of open connections is reached").count();
    assert!(
        refusals <= 3,
        "{refusals} lines for the refused connections"
    );

    // Without a preface, the admitted ones are closed after the handshake timeout.
    wait_until(STEP, "the silent connections closed", || {
        (open_fds(pid) <= fds_before + 8).then_some(())
    });
    drop(flood);
    assert!(
        logs.contains("no HTTP/2 preface in time")
            || supervisor.logs().contains("no HTTP/2 preface in time")
    );
    let rss_after = rss_kib(pid);
    println!(
        "supervisor: {fds_before} fds and {rss_before} KiB before, {held} fds while flooded, \
         {rss_after} KiB after"
    );

    // A client that speaks HTTP/2 is served again (the server's SETTINGS come back), and is closed
    // once it has had no stream for the idle timeout.
    let mut client = TcpStream::connect(addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    client
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .unwrap();
    client.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).unwrap();
    let mut header = [0u8; 9];
    client.read_exact(&mut header).unwrap();
    assert_eq!(header[3], 4, "a SETTINGS frame first: {header:?}");
    let opened = Instant::now();
    let mut rest = Vec::new();
    // Ends (EOF, or a reset after GOAWAY) once idle too long; the read timeout would be an error.
    let result = client.read_to_end(&mut rest);
    assert!(
        !matches!(&result, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "still open after {:?}",
        opened.elapsed()
    );
    assert!(
        opened.elapsed() < Duration::from_secs(5),
        "closed after {:?}",
        opened.elapsed()
    );
}
