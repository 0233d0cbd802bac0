//! SIGTERM to a worker process: it stops accepting, finishes the request in hand, exits 0; nothing is
//! lost. Tested on the real signal path (`peregrine worker` under the supervisor), over HTTP/1 and h2c.

use std::{net::SocketAddr, process::Command, thread, time::Duration};

use peregrine_e2e::{http_get, one_worker, wait_until, worker_pid};

/// utime + stime of a process, in clock ticks (10 ms).
fn cpu_ticks(pid: u32) -> Option<u64> {
    peregrine_contract::procfs::stat(pid)
        .ok()
        .map(|stat| stat.cpu_ticks())
}

fn sigterm(pid: u32) {
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
}

/// Sends a request that burns 400 ms of CPU, SIGTERMs the worker while it runs, and checks the request
/// completes and the worker exits 0; `send` performs the request and returns its body.
fn finishes_in_flight(send: impl FnOnce(SocketAddr) -> String + Send + 'static) {
    let (supervisor, addr) = one_worker();
    let (_, body) = http_get(addr, "/").unwrap();
    let pid = worker_pid(&body).unwrap();
    let before = cpu_ticks(pid).unwrap();
    let slow = thread::spawn(move || send(addr));
    // The request is in the worker once the worker has burnt 50 ms (5 ticks) more CPU time.
    wait_until(Duration::from_secs(10), "the slow request running", || {
        (cpu_ticks(pid)? >= before + 5).then_some(())
    });
    sigterm(pid);
    let body = slow.join().unwrap();
    assert_eq!(
        worker_pid(&body),
        Some(pid),
        "the in-flight request was answered: {body:?}"
    );
    wait_until(
        Duration::from_secs(10),
        "the worker's clean exit logged",
        || {
            let logs = supervisor.logs();
            logs.lines()
                .any(|l| {
                    l.contains("Worker exited")
                        && l.contains(&format!("pid={pid}"))
                        && l.contains("exit code 0")
                })
                .then_some(())
        },
    );
}

#[test]
fn sigterm_finishes_an_in_flight_http1_request() {
    finishes_in_flight(|addr| {
        let (status, body) = http_get(addr, "/?cpu=400").unwrap();
        assert_eq!(status, 200);
        body
    });
}

#[test]
fn sigterm_finishes_an_in_flight_h2c_request() {
    finishes_in_flight(|addr| {
        let output = Command::new("curl")
            .args([
                "--silent",
                "--show-error",
                "--max-time",
                "10",
                "--http2-prior-knowledge",
            ])
            .arg(format!("http://{addr}/?cpu=400"))
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    });
}
