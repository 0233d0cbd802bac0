//! `cargo xtask bench attacks`: the floods an outsider can send, at full size, against the release
//! build, with what they cost the supervisor and the worker. The suite runs the same attacks at a
//! size that fits its time (`tests/tests/grpc_port.rs`, `worker/tests/body_memory.rs`); this runs
//! them at the size they were found at.
//!
//! 1. **gRPC flood**: `--connections` (19,000, at most this process's open-file limit less a margin)
//!    TCP connections to the xDS port, first silent, then each sending the HTTP/2 preface and
//!    SETTINGS. While they are held: the supervisor's descriptors and memory, how long `peregrine
//!    status` takes, and how long a SIGKILLed worker takes to be replaced. After they close: how
//!    long until the memory is given back.
//! 2. **Unfinished bodies**: `--bodies` (1,500) HTTP/1 connections to a worker, each declaring a
//!    1 MB body and sending 900 KB of it, then nothing: the worker's peak memory, what each
//!    connection was answered, and the memory after they close.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use peregrine_e2e::{PeregrineToml, ServiceTable, Supervisor, TempDir, config::Sampler, free_port};
use rustix::process::{Pid, Resource, Signal, getrlimit, kill_process, setrlimit};

use super::{machine::today, release_peregrine, table::markdown};

const USAGE: &str = "cargo xtask bench attacks [--connections N] [--bodies N]";

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let mut connections = 19_000usize;
    let mut bodies = 1_500usize;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let mut value = |name: &str| -> anyhow::Result<usize> {
            rest.next()
                .and_then(|v| v.parse().ok())
                .with_context(|| format!("{name} needs a number; usage: {USAGE}"))
        };
        match arg.as_str() {
            "--connections" => connections = value("--connections")?,
            "--bodies" => bodies = value("--bodies")?,
            other => bail!("unknown argument {other:?}; usage: {USAGE}"),
        }
    }
    let mut limit = getrlimit(Resource::Nofile);
    limit.current = limit.maximum;
    let _ = setrlimit(Resource::Nofile, limit);
    let own_limit = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    let connections = connections.min(own_limit.saturating_sub(500) as usize);

    let binary = release_peregrine()?;
    let dir = TempDir::new()?;
    let (grpc, web) = (free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).control_in(dir.path());
    config.supervisor.sampler = Some(Sampler::Off);
    config.service("web", ServiceTable::at(format!("http://127.0.0.1:{web}")));
    let supervisor = Supervisor::start_in(&binary, dir.path(), &config.toml())?;
    let first = wait_for_worker(&supervisor, None)?;

    let mut report = format!(
        "# Attacks ({})\n\n`{}`, release build; {connections} connections, {bodies} bodies.\n\n",
        today()?,
        super::command_line("attacks", args)
    );
    report.push_str("## gRPC port\n\n");
    let mut rows = vec![[
        "flood".to_owned(),
        "admitted (fds)".to_owned(),
        "supervisor MiB before / held / 12 s after close".to_owned(),
        "status while held".to_owned(),
        "killed worker replaced in".to_owned(),
    ]];
    let mut worker = first;
    for speak in [false, true] {
        let (row, replaced) = grpc_flood(&supervisor, grpc, connections, speak, worker)?;
        worker = replaced;
        rows.push(row);
    }
    report.push_str(&markdown(&rows, 1));

    report.push_str("\n## Unfinished HTTP/1 bodies\n\n");
    let (row, answers) = bodies_flood(&supervisor, web, bodies)?;
    let rows = vec![
        [
            "connections".to_owned(),
            "worker MiB before / peak / after close".to_owned(),
            "answers".to_owned(),
        ],
        [bodies.to_string(), row, answers],
    ];
    report.push_str(&markdown(&rows, 0));
    println!("{report}");
    Ok(ExitCode::SUCCESS)
}

/// The registered worker's pid, once there is one other than `not`.
fn wait_for_worker(supervisor: &Supervisor, not: Option<u32>) -> anyhow::Result<u32> {
    peregrine_e2e::try_wait_until(Duration::from_secs(30), "a registered worker", || {
        let status = supervisor.status_json().ok()?;
        let pid = status["workers"][0]["pid"].as_u64()? as u32;
        (Some(pid) != not).then_some(pid)
    })
}

fn rss_mib(pid: u32) -> f64 {
    peregrine_contract::procfs::status(pid).map_or(0.0, |status| status.rss_kib as f64 / 1024.0)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Waits until `f` gives the same value for a second (at most `limit`); returns it.
fn settled(limit: Duration, mut f: impl FnMut() -> usize) -> usize {
    let deadline = Instant::now() + limit;
    let mut last = f();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = f();
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

fn grpc_flood(
    supervisor: &Supervisor,
    port: u16,
    n: usize,
    speak: bool,
    worker: u32,
) -> anyhow::Result<([String; 5], u32)> {
    let pid = supervisor.pid();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let before = rss_mib(pid);
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
            continue;
        };
        if speak {
            let _ = stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0");
        }
        held.push(stream);
    }
    let fds = settled(Duration::from_secs(20), || open_fds(pid));
    let held_rss = rss_mib(pid);
    let started = Instant::now();
    let status = Command::new(supervisor.binary())
        .arg("status")
        .arg(supervisor.config_path())
        .output()?;
    let status_took = started.elapsed();
    if !status.status.success() {
        bail!("status failed while flooded: {status:?}");
    }
    kill_process(Pid::from_raw(worker as i32).context("pid")?, Signal::KILL)?;
    let killed = Instant::now();
    let replaced = wait_for_worker(supervisor, Some(worker))?;
    let replaced_in = killed.elapsed();
    drop(held);
    // The supervisor's trimmer looks every 10 s: what it has not given back by then, it keeps.
    std::thread::sleep(Duration::from_secs(12));
    let after = rss_mib(pid);
    Ok((
        [
            if speak {
                format!("{n} sending preface + SETTINGS")
            } else {
                format!("{n} silent")
            },
            fds.to_string(),
            format!("{before:.0} / {held_rss:.0} / {after:.0}"),
            format!("{:.0} ms", status_took.as_secs_f64() * 1000.0),
            format!("{:.0} ms", replaced_in.as_secs_f64() * 1000.0),
        ],
        replaced,
    ))
}

fn bodies_flood(supervisor: &Supervisor, port: u16, n: usize) -> anyhow::Result<(String, String)> {
    let worker = wait_for_worker(supervisor, None)?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let before = rss_mib(worker);
    let mut peak = before;
    let head = b"POST / HTTP/1.1\r\nHost: bench\r\nContent-Length: 1000000\r\n\r\n";
    let body = vec![b'a'; 900_000];
    let mut streams = Vec::with_capacity(n);
    for i in 0..n {
        let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
            continue;
        };
        let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
        // A worker that refuses the body closes the connection: the write fails, as it should.
        let _ = stream
            .write_all(head)
            .and_then(|()| stream.write_all(&body));
        streams.push(stream);
        if i % 50 == 0 {
            peak = peak.max(rss_mib(worker));
        }
    }
    let mut answers: BTreeMap<String, usize> = BTreeMap::new();
    for stream in &mut streams {
        peak = peak.max(rss_mib(worker));
        let _ = stream.set_read_timeout(Some(Duration::from_secs(20)));
        let mut buf = [0u8; 12];
        let kind = match stream.read(&mut buf) {
            Ok(0) => "closed".to_owned(),
            Ok(n) => String::from_utf8_lossy(&buf[..n]).trim().to_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => "no answer in 20 s".into(),
            Err(e) => format!("{:?}", e.kind()),
        };
        *answers.entry(kind).or_default() += 1;
    }
    drop(streams);
    std::thread::sleep(Duration::from_secs(2));
    let after = rss_mib(worker);
    let answers = answers
        .iter()
        .map(|(k, v)| format!("{v} x `{k}`"))
        .collect::<Vec<_>>()
        .join(", ");
    Ok((format!("{before:.0} / {peak:.0} / {after:.0}"), answers))
}
