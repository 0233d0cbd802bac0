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
//!
//! **Several servers.** With more than one address in [`Plan::addrs`] (several Envoys in front of the
//! same workers, say), request `i` goes to address `i mod k` of the `k`: thread `n` holds a connection
//! to address `n mod k` and takes the requests of that address alone, from a queue of its own (with
//! [`Plan::per_connection`], its own every `connections`-th, `k` dividing `connections`), so each
//! address gets every `k`-th request of the very same schedule.
//!
//! **Random arrivals and targets.** With [`Plan::poisson`] the gaps between scheduled times are
//! exponential (a Poisson process at the plan's rate, as independent users arrive) instead of even,
//! drawn from a seed; with [`Plan::mix`] each request draws its target from weighted paths (from
//! another seed), e.g. 90% `/slow?ms=5` and 10% `/slow?ms=100`. The draws happen before the run, so
//! the same seeds give every set-up the very same requests at the very same times. An answer's
//! `x-worker-index` header, when the server sends one, is kept in its record: it tells apart the
//! processes behind one address (a server that forks several on one socket).

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
    /// The servers: one, or several that take every `k`-th request each (at least one; no more
    /// than `connections`).
    pub(crate) addrs: Vec<SocketAddr>,
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
    /// Exponential gaps between requests (a Poisson process) drawn from this seed, instead of even
    /// spacing.
    pub(crate) poisson: Option<u64>,
    /// Targets each request draws from instead of `path`.
    pub(crate) mix: Option<Mix>,
}

/// Weighted request targets and the seed of the draws.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Mix {
    pub(crate) seed: u64,
    /// `(path, weight)`: a request goes to `path` with probability `weight / sum of weights`.
    pub(crate) targets: Vec<(String, f64)>,
}

impl Mix {
    /// The target of each of `count` requests, as an index into [`Mix::targets`].
    pub(crate) fn draw(&self, count: usize) -> Vec<usize> {
        let total: f64 = self.targets.iter().map(|(_, w)| w.max(0.0)).sum();
        let mut rng = SplitMix64::new(self.seed);
        (0..count)
            .map(|_| {
                let mut u = rng.unit() * total;
                for (i, (_, weight)) in self.targets.iter().enumerate() {
                    u -= weight.max(0.0);
                    if u < 0.0 {
                        return i;
                    }
                }
                self.targets.len().saturating_sub(1)
            })
            .collect()
    }
}

/// SplitMix64: a small, seeded, well-mixed generator, enough for arrival times and target draws
/// (no dependency, and the same numbers on every machine).
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with mean `1 / rate`.
    pub(crate) fn exponential(&mut self, rate: f64) -> f64 {
        // 1 - unit() is in (0, 1]: its logarithm is finite.
        -(1.0 - self.unit()).ln() / rate
    }
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
    /// `rate`, and at `rate * factor` within the burst; with [`Plan::poisson`], a Poisson process
    /// at those rates instead.
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
        if let Some(seed) = self.poisson {
            let mut rng = SplitMix64::new(seed);
            for (from, to, rate) in spans {
                if rate <= 0.0 {
                    continue;
                }
                let mut t = from.as_secs_f64() + rng.exponential(rate);
                while t < to.as_secs_f64() {
                    times.push(Duration::from_secs_f64(t));
                    t += rng.exponential(rate);
                }
            }
            return times;
        }
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
    /// The target drawn from [`Plan::mix`] (0 without one).
    pub(crate) target: usize,
    /// The answer's `x-worker-index` header, if it had one.
    pub(crate) worker_index: Option<u32>,
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
    let servers = plan.addrs.len();
    let connections = plan.connections.max(1);
    anyhow::ensure!(
        servers >= 1
            && connections >= servers
            && (!plan.per_connection || connections.is_multiple_of(servers)),
        "a plan needs an address, and a connection for each of its {servers} addresses (with \
         per-connection clients, a multiple of them)"
    );
    let schedule: Arc<[Duration]> = plan.schedule().into();
    let paths: Vec<&str> = match &plan.mix {
        Some(mix) if !mix.targets.is_empty() => {
            mix.targets.iter().map(|(path, _)| path.as_str()).collect()
        }
        _ => vec![plan.path.as_str()],
    };
    let targets: Arc<[usize]> = match &plan.mix {
        Some(mix) if !mix.targets.is_empty() => mix.draw(schedule.len()).into(),
        _ => vec![0; schedule.len()].into(),
    };
    // One queue per address: its requests' numbers are `server + servers * taken`.
    let next: Arc<[AtomicUsize]> = (0..servers).map(|_| AtomicUsize::new(0)).collect();
    // Each address's requests, by target.
    let requests: Arc<[Vec<Vec<u8>>]> = plan
        .addrs
        .iter()
        .map(|addr| {
            paths
                .iter()
                .map(|path| {
                    format!(
                        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: peregrine-bench\r\n\r\n"
                    )
                    .into_bytes()
                })
                .collect()
        })
        .collect();
    let threads = (0..plan.connections.max(1))
        .map(|n| {
            let (plan, next, requests) = (plan.clone(), next.clone(), requests.clone());
            let (schedule, targets) = (schedule.clone(), targets.clone());
            thread::Builder::new()
                .name(format!("load-{n}"))
                .stack_size(STACK)
                .spawn(move || {
                    let server = n % servers;
                    worker(
                        &plan,
                        start,
                        (&schedule, &targets),
                        (n, &next[server]),
                        &requests[server],
                    )
                })
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

/// One load thread, the `n`th: takes request numbers until all are taken (from `next`, the queue of
/// its address, or its own every `connections`-th with [`Plan::per_connection`]), on a connection to
/// address `n mod k`; request `i` goes to `requests[targets[i]]`.
fn worker(
    plan: &Plan,
    start: Instant,
    (schedule, targets): (&[Duration], &[usize]),
    (n, next): (usize, &AtomicUsize),
    requests: &[Vec<u8>],
) -> Vec<Record> {
    let send_deadline = start + plan.duration + plan.timeout;
    let servers = plan.addrs.len();
    let addr = plan.addrs[n % servers];
    let mut connection: Option<Connection> = Connection::open(addr, plan.timeout).ok();
    let mut records = Vec::new();
    let mut own = (n..).step_by(plan.connections.max(1));
    loop {
        let i = if plan.per_connection {
            own.next().unwrap_or(usize::MAX)
        } else {
            next.fetch_add(1, Ordering::Relaxed)
                .saturating_mul(servers)
                .saturating_add(n % servers)
        };
        let Some(&scheduled) = schedule.get(i) else {
            return records;
        };
        let target = targets.get(i).copied().unwrap_or(0);
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
                target,
                worker_index: None,
            });
            continue;
        }
        let (answer, worker_index) = match exchange(&mut connection, addr, plan, &requests[target])
        {
            Ok((200, body, index)) => (
                std::str::from_utf8(&body)
                    .ok()
                    .and_then(worker_pid)
                    .map_or(Answer::Status(200), Answer::Worker),
                index,
            ),
            Ok((status, _, index)) => (Answer::Status(status), index),
            Err(_) => {
                connection = None;
                (Answer::Error, None)
            }
        };
        records.push(Record {
            scheduled,
            sent: sent - start,
            done: start.elapsed(),
            answer,
            target,
            worker_index,
        });
    }
}

/// Sends `request` on the open connection (opening one to `addr` first if there is none) and reads
/// the answer: its status, body and `x-worker-index`.
fn exchange(
    connection: &mut Option<Connection>,
    addr: SocketAddr,
    plan: &Plan,
    request: &[u8],
) -> io::Result<(u16, Vec<u8>, Option<u32>)> {
    let open = match connection {
        Some(open) => open,
        None => connection.insert(Connection::open(addr, plan.timeout)?),
    };
    let (head, body) = open.get(request)?;
    if !head.keep_alive {
        *connection = None;
    }
    Ok((head.status, body, head.worker_index))
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

    /// Sends one request and reads its answer: its head (the status, whether the connection stays
    /// open) and its body.
    fn get(&mut self, request: &[u8]) -> io::Result<(Head, Vec<u8>)> {
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
        Ok((head, body))
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
    /// `x-worker-index`: which of the processes behind one address answered.
    worker_index: Option<u32>,
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
    let (mut framing, mut keep_alive, mut worker_index) = (None, true, None);
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
        } else if name.eq_ignore_ascii_case("x-worker-index") {
            worker_index = value.parse().ok();
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
        worker_index,
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
                keep_alive: true,
                worker_index: None,
            }
        );
        assert_eq!(
            parse_head(b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\nconnection: close\r\nX-Worker-Index: 3")
                .unwrap(),
            Head {
                status: 503,
                framing: Framing::Chunked,
                keep_alive: false,
                worker_index: Some(3),
            }
        );
        assert!(parse_head(b"HTTP/1.1 200 OK").is_err());
        assert!(parse_head(b"garbage").is_err());
    }

    /// A plan of `GET /` at `rate` per second for `duration` on `connections` to `addr`.
    fn plan(addr: SocketAddr, rate: f64, duration: Duration, connections: usize) -> Plan {
        Plan {
            addrs: vec![addr],
            path: "/".into(),
            rate,
            duration,
            connections,
            timeout: Duration::from_secs(1),
            per_connection: false,
            burst: None,
            poisson: None,
            mix: None,
        }
    }

    /// An address nothing listens on (bound once, then closed).
    fn closed_port() -> SocketAddr {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    }

    /// Reads the next request's head from `stream` (what `buffer` holds first) and takes it, its
    /// blank line included, off `buffer`.
    fn read_head(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> String {
        while find(buffer, b"\r\n\r\n").is_none() {
            let mut chunk = [0u8; 1024];
            let read = stream.read(&mut chunk).unwrap();
            assert!(read > 0, "the client closed early");
            buffer.extend_from_slice(&chunk[..read]);
        }
        let end = find(buffer, b"\r\n\r\n").unwrap();
        let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
        buffer.drain(..end + 4);
        head
    }

    /// A server that answers every request on one connection, alternating content-length and chunked
    /// framing, with the hello body of `pid`.
    fn serve(listener: TcpListener, answers: usize, pid: u32) {
        let (mut stream, _) = listener.accept().unwrap();
        let mut buffer = Vec::new();
        for n in 0..answers {
            read_head(&mut stream, &mut buffer);
            let (first, rest) = ("Hello ", format!("from worker {pid}!\n"));
            let answer = if n % 2 == 0 {
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{first}{rest}",
                    first.len() + rest.len()
                )
            } else {
                format!(
                    "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{first}\r\n{:x}\r\n{rest}\r\n0\r\n\r\n",
                    first.len(),
                    rest.len()
                )
            };
            stream.write_all(answer.as_bytes()).unwrap();
        }
    }

    #[test]
    fn sends_at_the_rate_on_kept_alive_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || serve(listener, 20, 7));
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
    fn several_servers_take_every_kth_request_each() {
        let listeners: Vec<TcpListener> = (0..2)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let servers: Vec<_> = listeners
            .into_iter()
            .zip([7, 8])
            .map(|(listener, pid)| thread::spawn(move || serve(listener, 10, pid)))
            .collect();
        let two = Plan {
            addrs,
            timeout: Duration::from_secs(5),
            ..plan(closed_port(), 100.0, Duration::from_millis(200), 2)
        };
        let mut records = run(&two, Instant::now() + Duration::from_millis(50)).unwrap();
        for server in servers {
            server.join().unwrap();
        }
        records.sort_by_key(|r| r.scheduled);
        let answers: Vec<Answer> = records.iter().map(|r| r.answer).collect();
        let expected: Vec<Answer> = (0..20).map(|i| Answer::Worker(7 + i % 2)).collect();
        assert_eq!(answers, expected, "request i to server i mod 2");
        let three = Plan {
            addrs: vec![closed_port(); 3],
            ..plan(closed_port(), 10.0, Duration::from_millis(100), 2)
        };
        assert!(
            run(&three, Instant::now()).is_err(),
            "fewer connections than servers"
        );
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

    #[test]
    fn poisson_arrivals_are_seeded_exponential_and_at_the_rate() {
        let plan = Plan {
            poisson: Some(7),
            ..plan(closed_port(), 1000.0, Duration::from_secs(20), 1)
        };
        let times = plan.schedule();
        assert_eq!(times, plan.schedule(), "the same seed, the same times");
        let other = Plan {
            poisson: Some(8),
            ..plan.clone()
        };
        assert_ne!(times, other.schedule());
        // 20,000 expected: within 3% (the standard deviation is 141).
        assert!((19_400..=20_600).contains(&times.len()), "{}", times.len());
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        assert!(times.iter().all(|t| *t < Duration::from_secs(20)));
        // Exponential gaps: mean 1 ms, and about e^-1 of them longer than the mean, e^-3 than 3x.
        let gaps: Vec<f64> = times
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64() * 1000.0)
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((mean - 1.0).abs() < 0.03, "{mean}");
        let over = |x: f64| gaps.iter().filter(|g| **g > x).count() as f64 / gaps.len() as f64;
        assert!((over(1.0) - (-1.0f64).exp()).abs() < 0.02, "{}", over(1.0));
        assert!((over(3.0) - (-3.0f64).exp()).abs() < 0.01, "{}", over(3.0));
    }

    #[test]
    fn the_mix_draws_targets_by_weight_from_its_seed() {
        let mix = Mix {
            seed: 3,
            targets: vec![("/slow?ms=5".into(), 0.9), ("/slow?ms=100".into(), 0.1)],
        };
        let drawn = mix.draw(100_000);
        assert_eq!(drawn, mix.draw(100_000));
        let long = drawn.iter().filter(|&&i| i == 1).count();
        assert!((9_700..=10_300).contains(&long), "{long}");
        assert!(drawn.iter().all(|&i| i < 2));
        let one = Mix {
            seed: 3,
            targets: vec![("/".into(), 1.0)],
        };
        assert!(one.draw(100).iter().all(|&i| i == 0));
    }

    #[test]
    fn each_request_goes_to_its_drawn_target() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        // Answers with the target's last character as its worker index.
        let server = thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut buffer = Vec::new();
            for _ in 0..30 {
                let line = read_head(&mut stream, &mut buffer);
                let path = line.split(' ').nth(1).unwrap().to_owned();
                let index = path.chars().last().unwrap();
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nx-worker-index: {index}\r\ncontent-length: 21\r\n\r\nHello from worker 7!\n"
                );
                stream.write_all(answer.as_bytes()).unwrap();
            }
        });
        let plan = Plan {
            timeout: Duration::from_secs(5),
            poisson: Some(1),
            mix: Some(Mix {
                seed: 2,
                targets: vec![("/t0".into(), 1.0), ("/t1".into(), 1.0)],
            }),
            ..plan(addr, 30.0 / 0.3, Duration::from_secs(10), 1)
        };
        // Exactly 30 requests: cut the Poisson schedule's duration to its 30th time.
        let times = plan.schedule();
        let plan = Plan {
            duration: times[29] + Duration::from_micros(1),
            ..plan
        };
        assert_eq!(plan.schedule().len(), 30);
        let records = run(&plan, Instant::now() + Duration::from_millis(50)).unwrap();
        server.join().unwrap();
        assert_eq!(records.len(), 30);
        for record in &records {
            assert_eq!(record.answer, Answer::Worker(7));
            assert_eq!(
                record.worker_index,
                Some(record.target as u32),
                "{record:?}"
            );
        }
        assert!(records.iter().any(|r| r.target == 0) && records.iter().any(|r| r.target == 1));
    }
}
