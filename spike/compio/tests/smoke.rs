//! Smoke test of the spike binary: three pipelined HTTP/1.1 requests on one connection, and one h2c
//! request with the `h2` client.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    process::Command,
    time::Duration,
};

use peregrine_e2e::{ChildGuard, TempDir, free_port, wait_until};

/// The spike's process; the harness's guard kills it when the test ends, also on a panic.
struct Server {
    child: ChildGuard,
    addr: SocketAddr,
    _logs: TempDir,
}

impl Server {
    fn start() -> Server {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let logs = TempDir::new().expect("a log directory");
        let child = ChildGuard::spawn(
            "spike-compio",
            Command::new(env!("CARGO_BIN_EXE_spike-compio")).arg(addr.to_string()),
            logs.path(),
        )
        .expect("spawning spike-compio");
        wait_until(Duration::from_secs(10), "spike-compio to listen", || {
            TcpStream::connect(addr).ok()
        });
        Server {
            child,
            addr,
            _logs: logs,
        }
    }

    fn body(&self) -> String {
        format!("Hello from worker {}!\n", self.child.id())
    }
}

#[test]
fn http1_pipelined_and_h2c() {
    let server = Server::start();
    let body = server.body();

    let expected = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(server.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(
            b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n\
              POST /2 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello\
              GET /3 HTTP/1.1\r\nHost: x\r\n\r\n",
        )
        .unwrap();
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    while received.len() < 3 * expected.len() {
        let n = stream.read(&mut chunk).expect("reading the responses");
        assert!(n > 0, "connection closed after {received:?}");
        received.extend_from_slice(&chunk[..n]);
    }
    assert_eq!(String::from_utf8(received).unwrap(), expected.repeat(3));

    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
            let (mut client, connection) = h2::client::handshake(tcp).await.unwrap();
            tokio::spawn(connection);
            let request = http::Request::get(format!("http://{}/h2", server.addr))
                .body(())
                .unwrap();
            let (response, _) = client.send_request(request, true).unwrap();
            let response = tokio::time::timeout(Duration::from_secs(10), response)
                .await
                .expect("h2 response in time")
                .unwrap();
            assert_eq!(response.status(), 200);
            assert_eq!(
                response.headers()["content-length"],
                body.len().to_string().as_str()
            );
            let mut recv = response.into_body();
            let mut got = Vec::new();
            while let Some(data) = recv.data().await {
                let data = data.unwrap();
                let _ = recv.flow_control().release_capacity(data.len());
                got.extend_from_slice(&data);
            }
            assert_eq!(String::from_utf8(got).unwrap(), body);
        });
}
