//! `cargo xtask bench http --idle N`: what an idle connection costs a server in memory. For each
//! server, N connections are opened and left idle, and the server's resident memory is compared
//! before and after, as growth per connection.
//!
//! Two kinds of idle connection:
//! - HTTP/1.1 keep-alive after one request was answered;
//! - h2c after the preface and the SETTINGS exchange.
//!
//! The memory is `Rss` in `/proc/PID/smaps_rollup`. It is read once the server holds all N
//! connections (its descriptor count has grown by N) and its memory has stopped moving (two readings
//! 200 ms apart that agree within 1%). Each measurement is made on a freshly started server, because
//! memory freed by earlier connections stays with the process's allocator and would hide the cost of
//! the next ones.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{Context, bail, ensure};

/// The idle connections measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Idle {
    /// HTTP/1.1 keep-alive, after one request answered.
    Http1,
    /// h2c, after the preface and the SETTINGS exchange.
    H2c,
}

impl Idle {
    pub(super) const ALL: [Idle; 2] = [Idle::Http1, Idle::H2c];

    pub(super) fn name(self) -> &'static str {
        match self {
            Idle::Http1 => "HTTP/1.1 keep-alive, after one request",
            Idle::H2c => "h2c, after the preface and SETTINGS",
        }
    }
}

/// How long the server may take to hold every connection, and to settle.
const SETTLE_DEADLINE: Duration = Duration::from_secs(60);

/// The HTTP/2 client preface and an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
/// A SETTINGS frame with the ACK flag, answering the server's.
const H2_SETTINGS_ACK: &[u8] = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00";

/// Opens `n` idle connections of `kind` to the server `pid` on `port` (freshly started); returns its
/// resident memory growth per connection, in bytes.
pub(super) fn growth_per_connection(
    kind: Idle,
    pid: u32,
    port: u16,
    n: usize,
) -> anyhow::Result<f64> {
    raise_own_nofile()?;
    let before = settled_rss(pid)?;
    let fds_before = settled_fds(pid)?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut connections = Vec::with_capacity(n);
    for i in 0..n {
        let stream = open(kind, addr).with_context(|| format!("idle connection {i} of {n}"))?;
        connections.push(stream);
    }
    let deadline = Instant::now() + SETTLE_DEADLINE;
    while open_fds(pid)? < fds_before + n {
        if Instant::now() > deadline {
            bail!(
                "the server has {} descriptors open after {SETTLE_DEADLINE:?}, {fds_before} before the {n} connections (its open-file limit?)",
                open_fds(pid)?
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = settled_rss(pid)?;
    drop(connections);
    Ok((after as f64 - before as f64) / n as f64)
}

/// One idle connection of `kind`, its exchange done.
fn open(kind: Idle, addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    match kind {
        Idle::Http1 => {
            stream.write_all(b"GET / HTTP/1.1\r\nhost: bench\r\n\r\n")?;
            let mut answer = Vec::new();
            let mut chunk = [0u8; 512];
            // The hello answer: a head and a 25-byte body, whole once the body's end arrived.
            while !answer.ends_with(b"!\n") {
                let read = stream.read(&mut chunk)?;
                ensure!(read > 0, "closed before answering: {answer:?}");
                answer.extend_from_slice(&chunk[..read]);
            }
            ensure!(answer.starts_with(b"HTTP/1.1 200"), "answered {answer:?}");
        }
        Idle::H2c => {
            stream.write_all(H2_PREFACE)?;
            // The server's SETTINGS frame: a 9-byte header, type 4, then its payload.
            let mut header = [0u8; 9];
            stream.read_exact(&mut header)?;
            ensure!(header[3] == 4, "the first frame is of type {}", header[3]);
            let length =
                usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
            let mut payload = vec![0u8; length];
            stream.read_exact(&mut payload)?;
            stream.write_all(H2_SETTINGS_ACK)?;
        }
    }
    Ok(stream)
}

/// The resident memory of `pid` once two readings 200 ms apart agree within 1%.
fn settled_rss(pid: u32) -> anyhow::Result<u64> {
    let deadline = Instant::now() + SETTLE_DEADLINE;
    let mut last = rss(pid)?;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = rss(pid)?;
        if now.abs_diff(last) * 100 <= last || Instant::now() > deadline {
            return Ok(now);
        }
        last = now;
    }
}

/// `Rss` of `/proc/PID/smaps_rollup`, in bytes.
fn rss(pid: u32) -> anyhow::Result<u64> {
    let path = format!("/proc/{pid}/smaps_rollup");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    parse_rss(&text).with_context(|| format!("no Rss line in {path}"))
}

fn parse_rss(text: &str) -> Option<u64> {
    let kib: u64 = text
        .lines()
        .find_map(|line| line.strip_prefix("Rss:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// How many descriptors `pid` has open, once two counts 200 ms apart agree (a connection the
/// server's start-up check made may still be closing).
fn settled_fds(pid: u32) -> anyhow::Result<usize> {
    let deadline = Instant::now() + SETTLE_DEADLINE;
    let mut last = open_fds(pid)?;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = open_fds(pid)?;
        if now == last || Instant::now() > deadline {
            return Ok(now);
        }
        last = now;
    }
}

/// How many descriptors `pid` has open.
fn open_fds(pid: u32) -> anyhow::Result<usize> {
    let path = format!("/proc/{pid}/fd");
    Ok(std::fs::read_dir(&path)
        .with_context(|| format!("reading {path}"))?
        .count())
}

/// Raises this process's soft open-file limit to its hard one: it holds every client end.
fn raise_own_nofile() -> anyhow::Result<()> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    limit.current = limit.maximum;
    setrlimit(Resource::Nofile, limit).context("raising the open-file limit")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rss_from_smaps_rollup() {
        let text = "00400000-7ffd [rollup]\nRss:               12345 kB\nPss:  100 kB\n";
        assert_eq!(parse_rss(text), Some(12345 * 1024));
        assert_eq!(parse_rss("Pss: 1 kB\n"), None);
        assert!(rss(std::process::id()).unwrap() > 0);
    }
}
