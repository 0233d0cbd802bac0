//! Smoke test of the spike: three pipelined HTTP/1.1 requests on one connection, and one h2c request.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    process::Command,
    time::Duration,
};

use peregrine_e2e::{ChildGuard, TempDir, free_port, wait_until};

/// The running server; the harness's guard kills it when dropped (also when a test panics).
struct Server {
    child: ChildGuard,
    addr: SocketAddr,
    _logs: TempDir,
}

fn start() -> Server {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let logs = TempDir::new().expect("a log directory");
    let child = ChildGuard::spawn(
        "spike-uring",
        Command::new(env!("CARGO_BIN_EXE_spike-uring")).arg(addr.to_string()),
        logs.path(),
    )
    .expect("start spike-uring");
    wait_until(Duration::from_secs(10), "spike-uring to listen", || {
        TcpStream::connect(addr).ok()
    });
    Server {
        child,
        addr,
        _logs: logs,
    }
}

fn expected_body(server: &Server) -> String {
    format!("Hello from worker {}!\n", server.child.id())
}

#[test]
fn answers_pipelined_http1_requests_in_order() {
    let server = start();
    let body = expected_body(&server);
    let response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(server.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
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

#[test]
fn answers_h2c() {
    let server = start();
    let body = expected_body(&server);
    let addr = server.addr;
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
            // One request, then one more on the same connection, then five at once.
            for _ in 0..2 {
                assert_eq!(get(&mut client, addr).await, body);
            }
            let mut concurrent = Vec::new();
            for _ in 0..5 {
                let mut client = client.clone();
                concurrent.push(tokio::spawn(async move { get(&mut client, addr).await }));
            }
            for answer in concurrent {
                assert_eq!(answer.await.unwrap(), body);
            }
        });
}

/// One GET over `client`: checks the status and content type, returns the body.
async fn get(client: &mut h2::client::SendRequest<bytes::Bytes>, addr: SocketAddr) -> String {
    let request = http::Request::get(format!("http://{addr}/"))
        .body(())
        .unwrap();
    let (response, _) = client.send_request(request, true).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("an answer in time")
        .unwrap();
    assert_eq!(response.status(), http::StatusCode::OK);
    assert_eq!(
        response.headers()["content-type"],
        "text/plain; charset=utf-8"
    );
    let mut stream = response.into_body();
    let mut got = Vec::new();
    while let Some(chunk) = stream.data().await {
        let chunk = chunk.unwrap();
        let _ = stream.flow_control().release_capacity(chunk.len());
        got.extend_from_slice(&chunk);
    }
    String::from_utf8(got).unwrap()
}
