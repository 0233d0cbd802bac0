//! A proxy's cancellations are not an attack: while the worker's one thread is busy (a `?cpu=` call),
//! clients of Envoy give up on their requests, so Envoy resets those streams on its HTTP/2 connection to
//! the worker; the resets wait in the worker's accept queue until the thread is free. The worker must
//! not take that for rapid reset: it must keep the connection (no GOAWAY), and every other request Envoy
//! has in flight on it must succeed.

use std::{
    io::Write,
    net::{SocketAddr, TcpStream},
    thread,
    time::Duration,
};

use peregrine_e2e::{
    CLUSTER, Envoy, Stack, deploy::STEP, envoy_or_skip, http_get, wait_until, worker_pid,
};

/// Busy periods, and the cancelled and the ordinary requests sent during each.
const ROUNDS: usize = 2;
const CANCELLED: usize = 40;
const ORDINARY: usize = 10;

/// The CPU time a process has used, in clock ticks (`/proc/PID/stat`, utime + stime).
fn cpu_ticks(pid: u32) -> u64 {
    peregrine_contract::procfs::stat(pid).unwrap().cpu_ticks()
}

/// Sends a request through Envoy and goes away before the answer, once Envoy has sent it upstream
/// (its `upstream_rq_total` at `upstream`): Envoy resets the upstream stream.
fn cancelled_request(listen: SocketAddr, envoy: &Envoy, i: usize, upstream: u64) {
    let mut stream = TcpStream::connect(listen).unwrap();
    stream
        .write_all(format!("GET /?cancelled={i} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .unwrap();
    let sent = format!("cluster.{CLUSTER}.upstream_rq_total");
    wait_until(STEP, "Envoy to send the request upstream", || {
        (envoy.stat(&sent).unwrap_or(0) >= upstream).then_some(())
    });
    drop(stream);
}

#[test]
fn cancellations_through_envoy_while_the_worker_is_busy_fail_no_other_request() {
    if envoy_or_skip("cancellations_through_envoy_while_the_worker_is_busy_fail_no_other_request")
        .is_none()
    {
        return;
    }
    let stack = Stack::start(1);
    let hosts = stack.wait_for_hosts(1);
    let pid: u32 = hosts[0]
        .hostname
        .rsplit('-')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap();
    // Envoy's HTTP/2 connection to the worker is up, and answers.
    let (status, body) = http_get(stack.listen, "/").unwrap();
    assert_eq!((status, worker_pid(&body)), (200, Some(pid)));

    let mut failures = Vec::new();
    for round in 0..ROUNDS {
        let listen = stack.listen;
        let before = cpu_ticks(pid);
        let busy = thread::spawn(move || http_get(listen, "/?cpu=1000"));
        // The worker's thread is busy once it burns CPU (ticks are 10 ms).
        wait_until(Duration::from_secs(10), "the worker busy", || {
            (cpu_ticks(pid) >= before + 5).then_some(())
        });
        // Envoy's requests upstream so far: the busy one's and every one before it.
        let upstream = stack
            .envoy
            .stat(&format!("cluster.{CLUSTER}.upstream_rq_total"))
            .unwrap_or(0);
        let ordinary: Vec<_> = (0..ORDINARY)
            .map(|_| thread::spawn(move || http_get(listen, "/")))
            .collect();
        // Each cancelled request is dropped once it, every ordinary one and the cancelled ones
        // before it are upstream (HTTP/2: Envoy sends each at once, busy worker or not).
        for i in 0..CANCELLED {
            cancelled_request(
                listen,
                &stack.envoy,
                i,
                upstream + (ORDINARY + i + 1) as u64,
            );
        }
        for (i, request) in std::iter::once(busy).chain(ordinary).enumerate() {
            match request.join().unwrap() {
                Ok((200, body)) if worker_pid(&body) == Some(pid) => {}
                other => failures.push(format!("round {round}, request {i}: {other:?}")),
            }
        }
    }

    let logs = stack.supervisor.all_logs();
    let destroyed = stack
        .envoy
        .stat(&format!(
            "cluster.{CLUSTER}.upstream_cx_destroy_remote_with_active_rq"
        ))
        .unwrap_or(0);
    let goaway = stack
        .envoy
        .stat(&format!("cluster.{CLUSTER}.http2.goaway_received"))
        .unwrap_or(0);
    assert!(
        failures.is_empty(),
        "{} requests failed: {failures:#?}\nworker log:\n{logs}",
        failures.len()
    );
    assert_eq!(
        destroyed, 0,
        "the worker closed a connection with requests on it"
    );
    assert_eq!(goaway, 0, "the worker sent GOAWAY");
    for sign in ["reached limit", "resets too many"] {
        assert!(!logs.contains(sign), "the worker logged {sign:?}:\n{logs}");
    }
    // The connection lived on: one connection made, the same one still in use.
    assert_eq!(
        stack
            .envoy
            .stat(&format!("cluster.{CLUSTER}.upstream_cx_total"))
            .unwrap_or(0),
        1,
        "Envoy had to connect again"
    );
}
