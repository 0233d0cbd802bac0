//! HTTP/1 over real sockets: a server on its own io_uring thread, a blocking std client.

use std::{
    convert::Infallible,
    future::ready,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    os::unix::net::UnixStream,
    pin::Pin,
    sync::{Arc, mpsc},
    task::{Context, Poll},
    thread,
    time::Duration,
};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use peregrine_worker::{
    HttpService, RequestBody,
    listen::{self, BoundAddr},
    server::{self, Config},
};
use tower::Service;

/// How long any single step of a test may take.
const STEP: Duration = Duration::from_secs(10);

/// Answers `METHOD PATH BODY`.
fn echo() -> impl HttpService {
    tower::service_fn(|req: Request<RequestBody>| {
        let mut body = format!("{} {} ", req.method(), req.uri()).into_bytes();
        body.extend_from_slice(req.body().as_bytes());
        ready(Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(
            body,
        )))))
    })
}

/// A server on its own thread; stopping it (or dropping it) shuts it down and joins the thread.
struct TestServer {
    addrs: Vec<BoundAddr>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: mpsc::Receiver<()>,
    thread: Option<thread::JoinHandle<()>>,
}

impl TestServer {
    fn start(url: &str) -> Self {
        Self::start_with(url, echo)
    }

    fn start_with<F, S>(url: &str, make_service: F) -> Self
    where
        F: Fn() -> S + Send + 'static,
        S: HttpService,
    {
        Self::start_with_config(url, make_service, Config::default())
    }

    fn start_with_config<F, S>(url: &str, make_service: F, config: Config) -> Self
    where
        F: Fn() -> S + Send + 'static,
        S: HttpService,
    {
        let listeners = listen::bind(&url.parse().unwrap()).unwrap();
        let addrs = listeners.iter().map(|l| l.addr.clone()).collect();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done) = mpsc::channel();
        let thread = thread::spawn(move || {
            // A small receive ring, so the tests also run with the ring running dry.
            peregrine_worker::runtime::Builder::new()
                .buffers(16, 1024)
                .block_on(async move {
                    let shutdown = async {
                        let _ = stopped.await;
                    };
                    server::serve(listeners, make_service, config, shutdown)
                        .await
                        .unwrap();
                })
                .unwrap();
            let _ = done_tx.send(());
        });
        TestServer {
            addrs,
            stop: Some(stop),
            done,
            thread: Some(thread),
        }
    }

    fn tcp_addr(&self) -> SocketAddr {
        self.addrs
            .iter()
            .find_map(|a| match a {
                BoundAddr::Ip(sa) => Some(*sa),
                BoundAddr::Unix(_) => None,
            })
            .unwrap()
    }

    fn connect(&self) -> Client<TcpStream> {
        let stream = TcpStream::connect(self.tcp_addr()).unwrap();
        stream.set_read_timeout(Some(STEP)).unwrap();
        Client {
            stream,
            buf: Vec::new(),
        }
    }

    /// Asks the server to stop without waiting for it.
    fn begin_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    fn stop(&mut self) {
        self.begin_stop();
        if let Some(thread) = self.thread.take() {
            self.done
                .recv_timeout(STEP)
                .expect("the server did not stop in time");
            thread.join().unwrap();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if !thread::panicking() {
            self.stop();
        }
    }
}

#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A blocking client that keeps unread bytes between responses (for pipelining).
struct Client<T> {
    stream: T,
    buf: Vec<u8>,
}

impl<T: Read + Write> Client<T> {
    fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    fn fill(&mut self) -> usize {
        let mut chunk = [0u8; 4096];
        let n = self
            .stream
            .read(&mut chunk)
            .expect("read failed or timed out");
        self.buf.extend_from_slice(&chunk[..n]);
        n
    }

    /// Reads one response; `head_only` for a response to HEAD.
    fn response(&mut self, head_only: bool) -> Resp {
        loop {
            let mut fields = [httparse::EMPTY_HEADER; 32];
            let mut res = httparse::Response::new(&mut fields);
            if let httparse::Status::Complete(head) = res.parse(&self.buf).unwrap() {
                let headers: Vec<(String, String)> = res
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_string(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect();
                let status = res.code.unwrap();
                let len: usize = headers
                    .iter()
                    .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
                    .expect("every response carries content-length")
                    .1
                    .parse()
                    .unwrap();
                let body_len = if head_only { 0 } else { len };
                while self.buf.len() < head + body_len {
                    assert_ne!(self.fill(), 0, "eof inside a body");
                }
                let body = self.buf[head..head + body_len].to_vec();
                self.buf.drain(..head + body_len);
                return Resp {
                    status,
                    headers,
                    body,
                };
            }
            assert_ne!(self.fill(), 0, "eof before a response");
        }
    }

    /// Asserts that the server closes the connection with nothing more to say.
    fn expect_close(&mut self) {
        assert!(self.buf.is_empty(), "unexpected bytes: {:?}", self.buf);
        assert_eq!(self.fill(), 0, "expected the connection to close");
    }
}

#[test]
fn keep_alive_serves_several_requests_on_one_connection() {
    let server = TestServer::start("http://127.0.0.1:0");
    let mut client = server.connect();
    let before = peregrine_worker::requests();
    for i in 0..3 {
        client.send(format!("GET /{i} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes());
        let res = client.response(false);
        assert_eq!(res.status, 200);
        assert_eq!(res.body, format!("GET /{i} ").as_bytes());
        assert_eq!(res.header("connection"), None);
    }
    // Other tests run in parallel and count too.
    assert!(peregrine_worker::requests() >= before + 3);
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let server = TestServer::start("http://127.0.0.1:0");
    let mut client = server.connect();
    client.send(
        b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\nPOST /2 HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nbodyGET /3 HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    assert_eq!(client.response(false).body, b"GET /1 ");
    assert_eq!(client.response(false).body, b"POST /2 body");
    assert_eq!(client.response(false).body, b"GET /3 ");
}

#[test]
fn http10_closes_after_one_response() {
    let server = TestServer::start("http://127.0.0.1:0");
    let mut client = server.connect();
    client.send(b"GET / HTTP/1.0\r\n\r\n");
    let res = client.response(false);
    assert_eq!(res.status, 200);
    assert_eq!(res.header("connection"), Some("close"));
    client.expect_close();
}

#[test]
fn http10_keep_alive_is_honoured() {
    let server = TestServer::start("http://127.0.0.1:0");
    let mut client = server.connect();
    for _ in 0..2 {
        client.send(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
        let res = client.response(false);
        assert_eq!(res.header("connection"), Some("keep-alive"));
    }
}

#[test]
fn connection_close_closes() {
    let server = TestServer::start("http://127.0.0.1:0");
    let mut client = server.connect();
    // The second request follows the one asking to close: it must not be answered.
    client.send(b"GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n");
    let res = client.response(false);
    assert_eq!(res.body, b"GET /a ");
    assert_eq!(res.header("connection"), Some("close"));
    client.expect_close();
}

#[test]
fn chunked_request_bodies_are_decoded() {
    let server = TestServer::start("http://127.0.0.1:0");
    let mut client = server.connect();
    client.send(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWiki\r\n");
    // The rest arrives separately.
    client.send(b"5;x=y\r\npedia\r\n0\r\n\r\n");
    let res = client.response(false);
    assert_eq!(res.status, 200);
    assert_eq!(res.body, b"POST /c Wikipedia");
    // The connection is still usable.
    client.send(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(client.response(false).body, b"GET /after ");
}

/// Requests refused before they reach the application: each is answered with a status and
/// `connection: close`, and the connection closes (the next request's start is unknown).
#[test]
fn refused_requests_are_answered_and_closed() {
    let cases: [(&[u8], u16); 9] = [
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nxyz\r\n",
            400,
        ),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            400,
        ),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n",
            413,
        ),
        (b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n", 400),
        // Obsolete line folding.
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\n\r\n", 400),
        // HTTP/1.1 needs exactly one `Host`; HTTP/1.0 may leave it out (see
        // `http10_closes_after_one_response`), never repeat it.
        (b"GET / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", 400),
    ];
    let server = TestServer::start("http://127.0.0.1:0");
    for (request, status) in cases {
        let shown = String::from_utf8_lossy(request);
        let mut client = server.connect();
        client.send(request);
        let res = client.response(false);
        assert_eq!(res.status, status, "{shown}");
        assert_eq!(res.header("connection"), Some("close"), "{shown}");
        client.expect_close();
    }
}

#[test]
fn oversized_headers_are_refused() {
    let server = TestServer::start("http://127.0.0.1:0");
    let mut client = server.connect();
    let mut req = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
    req.extend(std::iter::repeat_n(b'a', 32 * 1024));
    req.extend(b"\r\n\r\n");
    // The server may close before reading everything; a failed write is fine.
    let _ = client.stream.write_all(&req);
    let res = client.response(false);
    assert_eq!(res.status, 431);
    assert_eq!(res.header("connection"), Some("close"));
}

#[test]
fn head_has_headers_but_no_body() {
    let server = TestServer::start("http://127.0.0.1:0");
    let mut client = server.connect();
    client.send(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\nGET /g HTTP/1.1\r\nHost: x\r\n\r\n");
    let head = client.response(true);
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), Some("8"));
    // Had the HEAD response carried a body, this would read it instead.
    assert_eq!(client.response(false).body, b"GET /g ");
}

#[test]
fn serves_on_every_localhost_address() {
    let server = TestServer::start("http://localhost:0");
    assert_eq!(server.addrs.len(), 2, "{:?}", server.addrs);
    for addr in &server.addrs {
        let BoundAddr::Ip(sa) = addr else { panic!() };
        let stream = TcpStream::connect(sa).unwrap();
        stream.set_read_timeout(Some(STEP)).unwrap();
        let mut client = Client {
            stream,
            buf: Vec::new(),
        };
        client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(client.response(false).status, 200, "{sa}");
    }
}

#[test]
fn serves_on_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("worker.sock");
    let server = TestServer::start(&format!("unix://{}", path.display()));
    assert_eq!(server.addrs, vec![BoundAddr::Unix(path.clone())]);
    let stream = UnixStream::connect(&path).unwrap();
    stream.set_read_timeout(Some(STEP)).unwrap();
    let mut client = Client {
        stream,
        buf: Vec::new(),
    };
    for _ in 0..2 {
        client.send(b"POST /u HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi");
        assert_eq!(client.response(false).body, b"POST /u hi");
    }
}

#[test]
fn shutdown_closes_idle_connections_and_stops_accepting() {
    let mut server = TestServer::start("http://127.0.0.1:0");
    let addr = server.tcp_addr();
    let mut client = server.connect();
    client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(client.response(false).status, 200);
    server.stop();
    client.expect_close();
    // The listener is gone with the server.
    assert!(TcpStream::connect(addr).is_err());
}

#[test]
fn a_body_larger_than_one_read_is_read_whole() {
    let server = TestServer::start("http://127.0.0.1:0");
    let mut client = server.connect();
    let body: Vec<u8> = (0..200 * 1024).map(|i| b'a' + (i % 26) as u8).collect();
    let mut req = format!(
        "PUT /big HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(&body);
    req.extend_from_slice(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n");
    client.send(&req);
    let res = client.response(false);
    assert_eq!(res.status, 200);
    assert_eq!(&res.body[..9], b"PUT /big ");
    assert!(res.body[9..] == body[..], "the body came back altered");
    assert_eq!(client.response(false).body, b"GET /next ");
}

/// Holds every request until the test releases it.
#[derive(Clone, Debug)]
struct Gate {
    entered: mpsc::Sender<()>,
    release: Arc<tokio::sync::Semaphore>,
}

impl Service<Request<RequestBody>> for Gate {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>>>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<RequestBody>) -> Self::Future {
        let gate = self.clone();
        Box::pin(async move {
            let _ = gate.entered.send(());
            gate.release.acquire().await.unwrap().forget();
            Ok(Response::new(Full::new(Bytes::from_static(b"finished"))))
        })
    }
}

#[test]
fn shutdown_lets_in_flight_requests_finish() {
    let (entered, in_flight) = mpsc::channel();
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = Gate {
        entered,
        release: release.clone(),
    };
    let mut server = TestServer::start_with("http://127.0.0.1:0", move || gate.clone());
    let mut client = server.connect();
    client.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n");
    in_flight.recv_timeout(STEP).unwrap();

    let addr = server.tcp_addr();
    server.begin_stop();
    // The drain cancels the listener's accept and closes it while the request is still in hand: new
    // connections are refused (one that raced the cancellation is closed unserved).
    let deadline = std::time::Instant::now() + STEP;
    loop {
        match TcpStream::connect(addr) {
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => break,
            other => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "still accepting after the drain began: {other:?}"
                );
                thread::sleep(Duration::from_millis(5));
            }
        }
    }
    // The server waits for the request in hand rather than dropping it.
    assert!(matches!(
        server.done.try_recv(),
        Err(mpsc::TryRecvError::Empty)
    ));
    release.add_permits(1);
    let res = client.response(false);
    assert_eq!(res.status, 200);
    assert_eq!(res.body, b"finished");
    // Whether the response says `connection: close` depends on whether the connection saw the shutdown
    // before the response was ready; either way the connection closes after it.
    client.expect_close();
    server.stop();
}

/// A body of unknown size, in pieces; `fail` makes it fail after them.
#[derive(Debug)]
struct Pieces {
    pieces: std::collections::VecDeque<Bytes>,
    fail: bool,
}

impl http_body::Body for Pieces {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        match self.pieces.pop_front() {
            Some(piece) => Poll::Ready(Some(Ok(http_body::Frame::data(piece)))),
            None if self.fail => Poll::Ready(Some(Err(std::io::Error::other("broken body")))),
            None => Poll::Ready(None),
        }
    }
}

/// Streams `/N` as N pieces of 1000 bytes with no declared length; `/fail` breaks mid-body.
fn streamer() -> impl HttpService {
    tower::service_fn(|req: Request<RequestBody>| {
        let path = req.uri().path().trim_start_matches('/');
        let fail = path == "fail";
        let n: usize = path.parse().unwrap_or(2);
        let pieces = (0..n)
            .map(|i| Bytes::from(vec![b'a' + (i % 26) as u8; 1000]))
            .collect();
        ready(Ok::<_, Infallible>(Response::new(Pieces { pieces, fail })))
    })
}

/// Decodes a chunked body from the client's buffer (reading more as needed).
fn read_chunked<T: Read + Write>(client: &mut Client<T>) -> Vec<u8> {
    let mut body = Vec::new();
    loop {
        let line_end = loop {
            if let Some(i) = client.buf.windows(2).position(|w| w == b"\r\n") {
                break i;
            }
            assert_ne!(client.fill(), 0, "eof inside a chunked body");
        };
        let size = usize::from_str_radix(std::str::from_utf8(&client.buf[..line_end]).unwrap(), 16)
            .unwrap();
        while client.buf.len() < line_end + 2 + size + 2 {
            assert_ne!(client.fill(), 0, "eof inside a chunk");
        }
        body.extend_from_slice(&client.buf[line_end + 2..line_end + 2 + size]);
        assert_eq!(
            &client.buf[line_end + 2 + size..line_end + 4 + size],
            b"\r\n"
        );
        client.buf.drain(..line_end + 4 + size);
        if size == 0 {
            return body;
        }
    }
}

/// Reads a response head only, returning the status and the headers.
fn read_head<T: Read + Write>(client: &mut Client<T>) -> (u16, Vec<(String, String)>) {
    loop {
        let mut fields = [httparse::EMPTY_HEADER; 32];
        let mut res = httparse::Response::new(&mut fields);
        if let httparse::Status::Complete(head) = res.parse(&client.buf).unwrap() {
            let status = res.code.unwrap();
            let headers = res
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_ascii_lowercase(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect();
            client.buf.drain(..head);
            return (status, headers);
        }
        assert_ne!(client.fill(), 0, "eof before a response head");
    }
}

#[test]
fn bodies_of_unknown_size_are_chunked_and_large_ones_streamed() {
    let server = TestServer::start_with("http://127.0.0.1:0", streamer);
    let mut client = server.connect();
    // 300 KB: more than one flush of the output buffer.
    client.send(b"GET /300 HTTP/1.1\r\nHost: x\r\n\r\nGET /2 HTTP/1.1\r\nHost: x\r\n\r\n");
    for n in [300, 2] {
        let (status, headers) = read_head(&mut client);
        assert_eq!(status, 200);
        assert!(
            headers.contains(&("transfer-encoding".into(), "chunked".into())),
            "{headers:?}"
        );
        let body = read_chunked(&mut client);
        assert_eq!(body.len(), n * 1000);
        assert!(
            body.chunks(1000)
                .enumerate()
                .all(|(i, c)| c.iter().all(|&b| b == b'a' + (i % 26) as u8))
        );
    }
    // An HTTP/1.0 client gets the body delimited by the connection's end.
    let mut old = server.connect();
    old.send(b"GET /3 HTTP/1.0\r\n\r\n");
    let (status, headers) = read_head(&mut old);
    assert_eq!(status, 200);
    assert!(
        headers.contains(&("connection".into(), "close".into())),
        "{headers:?}"
    );
    while old.fill() != 0 {}
    assert_eq!(old.buf.len(), 3000);
}

#[test]
fn a_failing_body_cuts_the_connection() {
    let server = TestServer::start_with("http://127.0.0.1:0", streamer);
    let mut client = server.connect();
    client.send(b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\n");
    let (status, _) = read_head(&mut client);
    assert_eq!(status, 200);
    // The chunked body never gets its last chunk: the connection ends instead.
    while client.fill() != 0 {}
    assert!(
        !client.buf.ends_with(b"0\r\n\r\n"),
        "a broken body must not look complete"
    );
}

#[test]
fn expect_100_continue_gets_an_interim_response_first() {
    let server = TestServer::start("http://127.0.0.1:0");
    let mut client = server.connect();
    client
        .send(b"POST /up HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n");
    let (status, _) = read_head(&mut client);
    assert_eq!(
        status, 100,
        "the client is told to go on before it sends the body"
    );
    client.send(b"hello");
    let res = client.response(false);
    assert_eq!(res.status, 200);
    assert_eq!(res.body, b"POST /up hello");
    // A body over the limit is refused without asking for it.
    client.send(b"POST /big HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 99999999\r\n\r\n");
    let res = client.response(false);
    assert_eq!(res.status, 413);
    client.expect_close();
}

fn short_timeouts() -> Config {
    let mut config = Config::default();
    config.limits.first_byte_timeout = Duration::from_millis(300);
    config.limits.header_timeout = Duration::from_millis(300);
    config.limits.idle_timeout = Duration::from_millis(300);
    config
}

#[test]
fn a_slow_request_head_is_cut_off_with_408() {
    let server = TestServer::start_with_config("http://127.0.0.1:0", echo, short_timeouts());
    let mut client = server.connect();
    let started = std::time::Instant::now();
    client.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ");
    let res = client.response(false);
    assert_eq!(res.status, 408);
    assert!(started.elapsed() >= Duration::from_millis(300));
    client.expect_close();
}

#[test]
fn an_idle_connection_times_out() {
    let server = TestServer::start_with_config("http://127.0.0.1:0", echo, short_timeouts());
    let mut client = server.connect();
    client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(client.response(false).status, 200);
    let idle_since = std::time::Instant::now();
    client.expect_close();
    assert!(idle_since.elapsed() >= Duration::from_millis(250));
}

#[test]
fn a_preface_trickled_byte_by_byte_is_cut_off_at_the_first_byte_timeout() {
    let server = TestServer::start_with_config("http://127.0.0.1:0", echo, short_timeouts());
    let mut client = server.connect();
    client
        .stream
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let started = std::time::Instant::now();
    // One byte of the HTTP/2 preface every 100 ms: the server cannot tell the protocol yet, and must not
    // wait more than its first-byte timeout (300 ms here) for it in all. The client's slowness is what is
    // tested: the sleep below waits for nothing.
    for byte in b"PRI * HTTP/2.0\r\n" {
        let _ = client.stream.write_all(&[*byte]);
        thread::sleep(Duration::from_millis(100));
        let mut buf = [0u8; 16];
        if let Ok(0) = client.stream.read(&mut buf) {
            break;
        }
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_millis(1000),
        "the connection stayed open {elapsed:?} while the client trickled its preface"
    );
}

/// The 17 bytes of an HTTP/2 GOAWAY frame with `PROTOCOL_ERROR` on stream 0, last stream 0.
const GOAWAY_PROTOCOL_ERROR: [u8; 17] = [0, 0, 8, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];

#[test]
fn a_broken_http2_preface_gets_goaway_not_an_http1_answer() {
    let server = TestServer::start("http://127.0.0.1:0");
    // What h2spec 3.5/2 sends, and a preface wrong after `PRI `.
    for preface in [
        &b"INVALID CONNECTION PREFACE\r\n\r\n"[..],
        b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n",
        b"PRI * HTTP/1.1\r\n\r\n",
    ] {
        let mut client = server.connect();
        client.send(preface);
        let mut got = Vec::new();
        client.stream.read_to_end(&mut got).unwrap();
        assert_eq!(
            got,
            GOAWAY_PROTOCOL_ERROR,
            "{}: {}",
            String::from_utf8_lossy(preface),
            String::from_utf8_lossy(&got)
        );
    }
    // A request that names no HTTP/1 version after a good one is an HTTP/1 client's mistake: 400.
    let mut client = server.connect();
    client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nINVALID REQUEST LINE\r\n\r\n");
    assert_eq!(client.response(false).status, 200);
    assert_eq!(client.response(false).status, 400);
    // So is an HTTP version we do not speak.
    let mut client = server.connect();
    client.send(b"GET / HTTP/1.2\r\nHost: x\r\n\r\n");
    assert_eq!(client.response(false).status, 400);
}

#[test]
fn a_silent_connection_is_closed_at_the_first_byte_timeout() {
    let mut config = Config::default();
    config.limits.first_byte_timeout = Duration::from_millis(300);
    let server = TestServer::start_with_config("http://127.0.0.1:0", echo, config);
    for first in [&b""[..], b"PRI * HTTP/2.0\r\n\r\nSM"] {
        let mut client = server.connect();
        client.send(first);
        let started = std::time::Instant::now();
        client.expect_close();
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_millis(250) && elapsed < Duration::from_secs(3),
            "{:?} closed after {elapsed:?}",
            String::from_utf8_lossy(first)
        );
    }
}

#[test]
fn the_idle_timeout_counts_from_the_last_request() {
    let mut config = Config::default();
    config.limits.idle_timeout = Duration::from_millis(1000);
    let server = TestServer::start_with_config("http://127.0.0.1:0", echo, config);
    let mut client = server.connect();
    client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(client.response(false).status, 200);
    // Part of the way into the timeout, another request: the timeout starts again from here, and
    // no later (the timer is not merely re-armed when it fires, which would close at twice that). The
    // pause is the idle time under test, not a wait for anything.
    thread::sleep(Duration::from_millis(600));
    client.send(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(client.response(false).status, 200);
    let idle_since = std::time::Instant::now();
    client.expect_close();
    let idle = idle_since.elapsed();
    assert!(
        idle >= Duration::from_millis(900) && idle < Duration::from_millis(1300),
        "closed {idle:?} after the last response"
    );
}

#[test]
fn a_stalled_body_is_answered_408() {
    let mut config = Config::default();
    config.limits.body_read_timeout = Duration::from_millis(300);
    let server = TestServer::start_with_config("http://127.0.0.1:0", echo, config);
    let mut client = server.connect();
    client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nhalf");
    let started = std::time::Instant::now();
    assert_eq!(client.response(false).status, 408);
    assert!(started.elapsed() >= Duration::from_millis(250));
    client.expect_close();
    // A body that keeps coming, but too slowly for the whole-body timeout, is cut off too.
    let mut config = Config::default();
    config.limits.body_timeout = Duration::from_millis(500);
    let server = TestServer::start_with_config("http://127.0.0.1:0", echo, config);
    let mut client = server.connect();
    client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n");
    let started = std::time::Instant::now();
    let status = loop {
        if client.stream.write_all(b"x").is_err() {
            break client.response(false).status;
        }
        // A deliberately slow body (a byte per 50 ms) is what is tested, not a wait for anything.
        thread::sleep(Duration::from_millis(50));
        let mut peek = [0u8; 1];
        client.stream.set_nonblocking(true).unwrap();
        let answered = matches!(client.stream.peek(&mut peek), Ok(n) if n > 0);
        client.stream.set_nonblocking(false).unwrap();
        if answered {
            break client.response(false).status;
        }
    };
    assert_eq!(status, 408);
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(450) && elapsed < Duration::from_secs(3),
        "{elapsed:?}"
    );
}

#[test]
fn a_request_over_the_worker_budget_is_answered_503_and_closed() {
    let config = Config {
        max_buffered_body_bytes: 256 * 1024,
        ..Config::default()
    };
    let server = TestServer::start_with_config("http://127.0.0.1:0", echo, config);
    let mut first = server.connect();
    first.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n");
    first.send(&[b'a'; 1000]);
    // The first body holds most of the budget while it lasts; a second one finds no room.
    let mut second = server.connect();
    second.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n");
    let res = second.response(false);
    assert_eq!(res.status, 503);
    assert_eq!(res.header("connection"), Some("close"));
    second.expect_close();
    // The first completes, and its budget is free again.
    first.send(&[b'a'; 199_000]);
    let res = first.response(false);
    assert_eq!(res.status, 200);
    assert_eq!(res.body.len(), "POST / ".len() + 200_000);
    // The answer to a next request on that connection comes after its buffer was given back (the
    // large response may be written before that).
    first.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(first.response(false).status, 200);
    let mut third = server.connect();
    third.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n");
    third.send(&[b'b'; 200_000]);
    assert_eq!(third.response(false).status, 200);
}
