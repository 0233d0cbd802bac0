//! An open-loop HTTP/1.1 load generator: requests at a fixed rate, each one's latency measured from
//! the time it was *scheduled* to be sent, so a slow server cannot slow the load down and hide its own
//! queueing (no coordinated omission).
//!
//! Request `i` is scheduled at `i / rate` after the start. A fixed pool of threads, each with one
//! keep-alive connection, takes the next request number when it is free, sleeps until that request's
//! time, sends it and reads the answer. That shared queue hands each request to a free connection,
//! which is itself a balancer when the connections reach different servers (`SO_REUSEPORT`): with
//! [`Plan::per_connection`] each connection is a client of its own instead, sending requests `n`,
//! `n + connections`, ... on its own schedule, as independent clients do. When every connection is busy, requests leave late; their
//! latency still counts from their schedule, so the lateness shows up where it belongs. Everything is
//! bounded: the number of requests (`rate * duration`), each answer's wait ([`Plan::timeout`]), and
//! sending (nothing is sent later than `duration + timeout` after the start; what is left is recorded
//! as not sent).

use std::{
    io::{self, Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::Context;
use peregrine_e2e::worker_pid;

/// Stack size of a load thread: each holds one connection and a small buffer.
const STACK: usize = 256 * 1024;
/// The most a response head may hold.
const MAX_HEAD: usize = 16 * 1024;

/// What to send, how fast and for how long.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub(crate) addr: SocketAddr,
    /// The request target, e.g. `/orca?cpu=4`.
    pub(crate) path: String,
    /// Requests per second.
    pub(crate) rate: f64,
    /// How long requests are scheduled for.
    pub(crate) duration: Duration,
    /// Connections (and threads): the most requests in flight at once.
    pub(crate) connections: usize,
    /// How long one answer may take, and how late a request may still be sent after `duration`.
    pub(crate) timeout: Duration,
    /// Each connection its own schedule (every `connections`-th request) instead of the next
    /// request to whichever connection is free.
    pub(crate) per_connection: bool,
    /// A span of `duration` sent at a multiple of `rate`.
    pub(crate) burst: Option<Burst>,
}

/// `factor` times the plan's rate from `from` to `to` (offsets from the start).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Burst {
    pub(crate) from: Duration,
    pub(crate) to: Duration,
    pub(crate) factor: f64,
}

impl Plan {
    /// Every request's scheduled send time, as an offset from the start, in order: evenly spaced at
    /// `rate`, and at `rate * factor` within the burst.
    pub(crate) fn schedule(&self) -> Vec<Duration> {
        let end = self.duration;
        let spans = match self.burst {
            Some(Burst { from, to, factor }) => {
                let (from, to) = (from.min(end), to.clamp(from.min(end), end));
                vec![
                    (Duration::ZERO, from, self.rate),
                    (from, to, self.rate * factor),
                    (to, end, self.rate),
                ]
            }
            None => vec![(Duration::ZERO, end, self.rate)],
        };
        let mut times = Vec::new();
        for (from, to, rate) in spans {
            let count = (rate * (to - from).as_secs_f64()).round() as usize;
            times.extend((0..count).map(|i| from + Duration::from_secs_f64(i as f64 / rate)));
        }
        times
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// `200` from the hello worker with this pid.
    Worker(u32),
    /// Another status, or a `200` that is not a hello answer.
    Status(u16),
    /// Connecting, sending or reading failed, or no answer within the timeout.
    Error,
    /// Not sent: every connection was busy until the sending deadline.
    NotSent,
}

/// One request, its times as offsets from the start.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Record {
    pub(crate) scheduled: Duration,
    pub(crate) sent: Duration,
    pub(crate) done: Duration,
    pub(crate) answer: Answer,
}

impl Record {
    /// From the scheduled send time to the answer's end.
    pub(crate) fn latency(&self) -> Duration {
        self.done.saturating_sub(self.scheduled)
    }
}

/// Runs `plan`, starting at `start` (which should be a little in the future, so the threads are
/// connected by then), and returns every scheduled request's record, in no particular order.
pub(crate) fn run(plan: &Plan, start: Instant) -> anyhow::Result<Vec<Record>> {
    let schedule: Arc<[Duration]> = plan.schedule().into();
    let next = Arc::new(AtomicUsize::new(0));
    let request = Arc::new(
        format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: peregrine-bench\r\n\r\n",
            plan.path, plan.addr
        )
        .into_bytes(),
    );
    let threads = (0..plan.connections.max(1))
        .map(|n| {
            let (plan, next, request) = (plan.clone(), next.clone(), request.clone());
            let schedule = schedule.clone();
            thread::Builder::new()
                .name(format!("load-{n}"))
                .stack_size(STACK)
                .spawn(move || worker(&plan, start, &schedule, (n, &next), &request))
                .context("starting a load thread")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut records = Vec::with_capacity(schedule.len());
    for thread in threads {
        records.extend(
            thread
                .join()
                .map_err(|_| anyhow::anyhow!("a load thread panicked"))?,
        );
    }
    Ok(records)
}

/// One load thread, the `n`th: takes request numbers until all are taken (from the shared `next`,
/// or its own every `connections`-th with [`Plan::per_connection`]).
fn worker(
    plan: &Plan,
    start: Instant,
    schedule: &[Duration],
    (n, next): (usize, &AtomicUsize),
    request: &[u8],
) -> Vec<Record> {
    let send_deadline = start + plan.duration + plan.timeout;
    let mut connection: Option<Connection> = Connection::open(plan.addr, plan.timeout).ok();
    let mut records = Vec::new();
    let mut own = (n..).step_by(plan.connections.max(1));
    loop {
        let i = if plan.per_connection {
            own.next().unwrap_or(usize::MAX)
        } else {
            next.fetch_add(1, Ordering::Relaxed)
        };
        let Some(&scheduled) = schedule.get(i) else {
            return records;
        };
        let at = start + scheduled;
        let now = Instant::now();
        if at > now {
            thread::sleep(at - now);
        }
        let sent = Instant::now();
        if sent > send_deadline {
            records.push(Record {
                scheduled,
                sent: sent - start,
                done: sent - start,
                answer: Answer::NotSent,
            });
            continue;
        }
        let answer = match exchange(&mut connection, plan, request) {
            Ok((200, body)) => std::str::from_utf8(&body)
                .ok()
                .and_then(worker_pid)
                .map_or(Answer::Status(200), Answer::Worker),
            Ok((status, _)) => Answer::Status(status),
            Err(_) => {
                connection = None;
                Answer::Error
            }
        };
        records.push(Record {
            scheduled,
            sent: sent - start,
            done: start.elapsed(),
            answer,
        });
    }
}

/// Sends `request` on the open connection (opening one first if there is none) and reads the answer.
fn exchange(
    connection: &mut Option<Connection>,
    plan: &Plan,
    request: &[u8],
) -> io::Result<(u16, Vec<u8>)> {
    let open = match connection {
        Some(open) => open,
        None => connection.insert(Connection::open(plan.addr, plan.timeout)?),
    };
    let (status, body, keep_alive) = open.get(request)?;
    if !keep_alive {
        *connection = None;
    }
    Ok((status, body))
}

// === impl Connection ===

/// A keep-alive HTTP/1.1 client connection.
#[derive(Debug)]
struct Connection {
    stream: TcpStream,
    /// Bytes read and not consumed yet.
    buffer: Vec<u8>,
}

impl Connection {
    fn open(addr: SocketAddr, timeout: Duration) -> io::Result<Connection> {
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(Connection {
            stream,
            buffer: Vec::with_capacity(4096),
        })
    }

    /// Sends one request and reads its answer: the status, the body, and whether the connection stays
    /// open.
    fn get(&mut self, request: &[u8]) -> io::Result<(u16, Vec<u8>, bool)> {
        self.stream.write_all(request)?;
        let head_end = loop {
            if let Some(end) = find(&self.buffer, b"\r\n\r\n") {
                break end;
            }
            if self.buffer.len() > MAX_HEAD {
                return Err(invalid("response head too long"));
            }
            self.fill()?;
        };
        let head = parse_head(&self.buffer[..head_end])?;
        self.buffer.drain(..head_end + 4);
        let body = match head.framing {
            Framing::Length(length) => {
                while self.buffer.len() < length {
                    self.fill()?;
                }
                self.buffer.drain(..length).collect()
            }
            Framing::Chunked => self.read_chunked()?,
        };
        Ok((head.status, body, head.keep_alive))
    }

    fn read_chunked(&mut self) -> io::Result<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(end) = find(&self.buffer, b"\r\n") {
                    break end;
                }
                self.fill()?;
            };
            let line = std::str::from_utf8(&self.buffer[..line_end])
                .map_err(|_| invalid("chunk size is not text"))?;
            let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| invalid("bad chunk size"))?;
            self.buffer.drain(..line_end + 2);
            if size == 0 {
                // No trailers are expected: the empty line that ends the message.
                while self.buffer.len() < 2 {
                    self.fill()?;
                }
                self.buffer.drain(..2);
                return Ok(body);
            }
            while self.buffer.len() < size + 2 {
                self.fill()?;
            }
            body.extend(self.buffer.drain(..size));
            self.buffer.drain(..2);
        }
    }

    /// Reads more bytes into the buffer; the peer closing is an error (an answer was expected).
    fn fill(&mut self) -> io::Result<()> {
        let mut chunk = [0u8; 4096];
        let n = self.stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed before the answer ended",
            ));
        }
        self.buffer.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}

/// How a response body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    Length(usize),
    Chunked,
}

/// What the client needs from a response head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Head {
    status: u16,
    framing: Framing,
    keep_alive: bool,
}

/// Parses a response head (without the final empty line). A response without `Content-Length` or
/// chunked encoding would be delimited by the connection's close, which a keep-alive client cannot
/// use: it is an error here.
fn parse_head(head: &[u8]) -> io::Result<Head> {
    let head = std::str::from_utf8(head).map_err(|_| invalid("response head is not text"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| invalid("bad status line"))?;
    let (mut framing, mut keep_alive) = (None, true);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let length = value.parse().map_err(|_| invalid("bad content-length"))?;
            framing = Some(Framing::Length(length));
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            && value.eq_ignore_ascii_case("chunked")
        {
            framing = Some(Framing::Chunked);
        } else if name.eq_ignore_ascii_case("connection") && value.eq_ignore_ascii_case("close") {
            keep_alive = false;
        }
    }
    let framing = match (framing, status) {
        (Some(framing), _) => framing,
        (None, 204 | 304) => Framing::Length(0),
        (None, _) => return Err(invalid("response without length")),
    };
    Ok(Head {
        status,
        framing,
        keep_alive,
    })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn invalid(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn parses_heads() {
        assert_eq!(
            parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 25\r\nx: y").unwrap(),
            Head {
                status: 200,
                framing: Framing::Length(25),
                keep_alive: true
            }
        );
        assert_eq!(
            parse_head(b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\nconnection: close")
                .unwrap(),
            Head {
                status: 503,
                framing: Framing::Chunked,
                keep_alive: false
            }
        );
        assert!(parse_head(b"HTTP/1.1 200 OK").is_err());
        assert!(parse_head(b"garbage").is_err());
    }

    /// A plan of `GET /` at `rate` per second for `duration` on `connections` to `addr`.
    fn plan(addr: SocketAddr, rate: f64, duration: Duration, connections: usize) -> Plan {
        Plan {
            addr,
            path: "/".into(),
            rate,
            duration,
            connections,
            timeout: Duration::from_secs(1),
            per_connection: false,
            burst: None,
        }
    }

    /// An address nothing listens on (bound once, then closed).
    fn closed_port() -> SocketAddr {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    }

    /// A server that answers every request on one connection, alternating content-length and chunked
    /// framing, with the hello body of pid 7.
    fn serve(listener: TcpListener, answers: usize) {
        let (mut stream, _) = listener.accept().unwrap();
        let mut buffer = Vec::new();
        for n in 0..answers {
            while find(&buffer, b"\r\n\r\n").is_none() {
                let mut chunk = [0u8; 1024];
                let read = stream.read(&mut chunk).unwrap();
                assert!(read > 0, "the client closed early");
                buffer.extend_from_slice(&chunk[..read]);
            }
            let end = find(&buffer, b"\r\n\r\n").unwrap();
            buffer.drain(..end + 4);
            let answer: &[u8] = if n % 2 == 0 {
                b"HTTP/1.1 200 OK\r\ncontent-length: 21\r\n\r\nHello from worker 7!\n"
            } else {
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nHello \r\nf\r\nfrom worker 7!\n\r\n0\r\n\r\n"
            };
            stream.write_all(answer).unwrap();
        }
    }

    #[test]
    fn sends_at_the_rate_on_kept_alive_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || serve(listener, 20));
        let plan = Plan {
            timeout: Duration::from_secs(5),
            ..plan(addr, 100.0, Duration::from_millis(200), 1)
        };
        let start = Instant::now() + Duration::from_millis(50);
        let mut records = run(&plan, start).unwrap();
        server.join().unwrap();
        records.sort_by_key(|r| r.scheduled);
        assert_eq!(records.len(), 20);
        assert!(
            records.iter().all(|r| r.answer == Answer::Worker(7)),
            "{records:?}"
        );
        for (i, record) in records.iter().enumerate() {
            assert_eq!(record.scheduled, Duration::from_millis(10 * i as u64));
            assert!(record.sent >= record.scheduled && record.done >= record.sent);
        }
    }

    #[test]
    fn a_closed_server_is_an_error_per_request_and_nothing_hangs() {
        let plan = plan(closed_port(), 50.0, Duration::from_millis(100), 2);
        let records = run(&plan, Instant::now()).unwrap();
        assert_eq!(records.len(), 5);
        assert!(records.iter().all(|r| r.answer == Answer::Error));
    }

    #[test]
    fn per_connection_clients_send_every_request_once_on_their_own_schedules() {
        let plan = Plan {
            per_connection: true,
            ..plan(closed_port(), 100.0, Duration::from_millis(70), 3)
        };
        let mut records = run(&plan, Instant::now()).unwrap();
        records.sort_by_key(|r| r.scheduled);
        let scheduled: Vec<u64> = records
            .iter()
            .map(|r| r.scheduled.as_millis() as u64)
            .collect();
        assert_eq!(scheduled, [0, 10, 20, 30, 40, 50, 60]);
    }

    #[test]
    fn a_burst_multiplies_the_rate_over_its_span_only() {
        let plan = Plan {
            per_connection: true,
            burst: Some(Burst {
                from: Duration::from_secs(1),
                to: Duration::from_secs(2),
                factor: 2.0,
            }),
            ..plan(
                "127.0.0.1:9".parse().unwrap(),
                10.0,
                Duration::from_secs(3),
                1,
            )
        };
        let times = plan.schedule();
        assert_eq!(times.len(), 10 + 20 + 10);
        assert!(times.windows(2).all(|w| w[0] < w[1]), "{times:?}");
        let in_burst = times
            .iter()
            .filter(|&&t| (Duration::from_secs(1)..Duration::from_secs(2)).contains(&t))
            .count();
        assert_eq!(in_burst, 20);
        assert_eq!(times[11] - times[10], Duration::from_millis(50));
        assert_eq!(times[31] - times[30], Duration::from_millis(100));
    }
}
