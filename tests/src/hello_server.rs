//! A server binary that answers like the worker's hello app, started on a free loopback port, and the
//! checks every such server must pass: the smoke tests of the `spike/` measurement servers.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    process::Command,
    time::Duration,
};

use crate::{ChildGuard, TempDir, free_port, wait_until};

/// How long a server may take to listen, and to answer.
const DEADLINE: Duration = Duration::from_secs(10);

/// A running server (`BINARY ADDR`); the harness's guard kills it when dropped, also on a panic.
#[derive(Debug)]
pub struct HelloServer {
    child: ChildGuard,
    addr: SocketAddr,
    _logs: TempDir,
}

impl HelloServer {
    /// Starts `binary` with a free loopback address as its argument and waits until it listens.
    ///
    /// # Panics
    ///
    /// When it cannot start or does not listen in time.
    pub fn start(name: &str, binary: &Path) -> HelloServer {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let logs = TempDir::new().expect("a log directory");
        let child = ChildGuard::spawn(
            name,
            Command::new(binary).arg(addr.to_string()),
            logs.path(),
        )
        .unwrap_or_else(|error| panic!("starting {name}: {error}"));
        wait_until(DEADLINE, &format!("{name} to listen"), || {
            TcpStream::connect(addr).ok()
        });
        HelloServer {
            child,
            addr,
            _logs: logs,
        }
    }

    /// The body every answer carries: the hello app's, with this server's pid.
    pub fn body(&self) -> String {
        format!("Hello from worker {}!\n", self.child.id())
    }

    /// Three pipelined HTTP/1.1 requests on one connection (one with a body) get the hello app's
    /// exact bytes, three times, in order.
    ///
    /// # Panics
    ///
    /// When they do not.
    pub fn check_pipelined_http1(&self) {
        let body = self.body();
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut stream = TcpStream::connect(self.addr).unwrap();
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        stream
            .write_all(
                b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n\
                  POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello\
                  GET /c HTTP/1.1\r\nHost: x\r\n\r\n",
            )
            .unwrap();
        let want = response.repeat(3);
        let mut got = vec![0; want.len()];
        stream.read_exact(&mut got).unwrap();
        assert_eq!(String::from_utf8_lossy(&got), want);
    }

    /// h2c with prior knowledge: one request, one more on the same connection, then five at once,
    /// each answered `200` with the hello app's headers and body.
    ///
    /// # Panics
    ///
    /// When they are not.
    pub fn check_h2c(&self) {
        let body = self.body();
        let addr = self.addr;
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let io = tokio::net::TcpStream::connect(addr).await.unwrap();
                let (mut client, connection) = h2::client::handshake(io).await.unwrap();
                tokio::spawn(async move {
                    let _ = connection.await;
                });
                for _ in 0..2 {
                    assert_eq!(h2c_get(&mut client, addr).await, body);
                }
                let mut concurrent = Vec::new();
                for _ in 0..5 {
                    let mut client = client.clone();
                    concurrent.push(tokio::spawn(
                        async move { h2c_get(&mut client, addr).await },
                    ));
                }
                for answer in concurrent {
                    assert_eq!(answer.await.unwrap(), body);
                }
            });
    }
}

/// One GET over `client`: checks the status and the headers, returns the body.
async fn h2c_get(client: &mut h2::client::SendRequest<bytes::Bytes>, addr: SocketAddr) -> String {
    let request = http::Request::get(format!("http://{addr}/"))
        .body(())
        .unwrap();
    let (response, _) = client.send_request(request, true).unwrap();
    let response = tokio::time::timeout(DEADLINE, response)
        .await
        .expect("an answer in time")
        .unwrap();
    assert_eq!(response.status(), http::StatusCode::OK);
    assert_eq!(
        response.headers()["content-type"],
        "text/plain; charset=utf-8"
    );
    let length: usize = response.headers()["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let mut stream = response.into_body();
    let mut got = Vec::new();
    while let Some(chunk) = stream.data().await {
        let chunk = chunk.unwrap();
        let _ = stream.flow_control().release_capacity(chunk.len());
        got.extend_from_slice(&chunk);
    }
    assert_eq!(got.len(), length, "the body is as long as announced");
    String::from_utf8(got).unwrap()
}
