//! A tiny blocking HTTP/1.1 client (enough for Envoy's admin API and the hello worker) and the parser of
//! the hello worker's answer.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{Context, bail};

/// Connect, read and write timeout of [`http_get`].
const TIMEOUT: Duration = Duration::from_secs(5);

/// `GET path` on `addr` with `Connection: close`; returns the status code and the body (decoded from
/// `Content-Length`, chunked encoding, or read to the end).
pub fn http_get(addr: impl Into<SocketAddr>, path: &str) -> anyhow::Result<(u16, String)> {
    http_get_with(addr, path, &[])
}

/// [`http_get`] with extra request headers.
pub fn http_get_with(
    addr: impl Into<SocketAddr>,
    path: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, String)> {
    request(addr.into(), "GET", path, headers, "")
}

/// `POST path` on `addr` with a JSON `body` (etcd's JSON gateway); returns the status code and the
/// body, as [`http_get`] does.
pub fn http_post_json(
    addr: impl Into<SocketAddr>,
    path: &str,
    body: &str,
) -> anyhow::Result<(u16, String)> {
    let length = body.len().to_string();
    let headers = [
        ("Content-Type", "application/json"),
        ("Content-Length", length.as_str()),
    ];
    request(addr.into(), "POST", path, &headers, body)
}

/// `METHOD path` on `addr` with `Connection: close`, `headers` and `body`.
fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> anyhow::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    // One write, so the request leaves in one segment (`write!` on a socket writes piece by piece).
    let extra: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: peregrine-e2e\r\n{extra}Connection: close\r\n\r\n{body}"
    );
    stream
        .write_all(request.as_bytes())
        .with_context(|| format!("sending to {addr}"))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .with_context(|| format!("reading from {addr}"))?;
    parse_response(&response).with_context(|| format!("{method} http://{addr}{path}"))
}

fn parse_response(response: &[u8]) -> anyhow::Result<(u16, String)> {
    let Some(head_end) = response.windows(4).position(|w| w == b"\r\n\r\n") else {
        bail!("incomplete response head ({} bytes)", response.len());
    };
    let head = std::str::from_utf8(&response[..head_end]).context("response head is not utf-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse::<u16>().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let mut content_length = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            content_length = Some(value.parse::<usize>().context("bad content-length")?);
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            && value.eq_ignore_ascii_case("chunked")
        {
            chunked = true;
        }
    }
    let rest = &response[head_end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(length) = content_length {
        if rest.len() < length {
            bail!(
                "body has {} bytes, content-length says {length}",
                rest.len()
            );
        }
        rest[..length].to_vec()
    } else {
        rest.to_vec()
    };
    Ok((
        status,
        String::from_utf8(body).context("body is not utf-8")?,
    ))
}

fn dechunk(mut data: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("truncated chunk size")?;
        let size_line = std::str::from_utf8(&data[..line_end])?;
        let size_hex = size_line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16)
            .with_context(|| format!("bad chunk size {size_hex:?}"))?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        if data.len() < size + 2 {
            bail!("truncated chunk");
        }
        body.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

/// The pid in the hello worker's answer `Hello from worker <pid>!`.
pub fn worker_pid(body: &str) -> Option<u32> {
    body.trim()
        .strip_prefix("Hello from worker ")?
        .strip_suffix('!')?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_worker_pids() {
        assert_eq!(worker_pid("Hello from worker 1234!\n"), Some(1234));
        assert_eq!(worker_pid("Hello from worker 1!"), Some(1));
        assert_eq!(worker_pid("Hello from worker !\n"), None);
        assert_eq!(worker_pid("Hello from worker 12x!\n"), None);
        assert_eq!(worker_pid("no healthy upstream"), None);
    }

    #[test]
    fn parses_content_length_responses() {
        let response = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx: y\r\n\r\nhello";
        assert_eq!(parse_response(response).unwrap(), (200, "hello".to_owned()));
    }

    #[test]
    fn parses_chunked_responses() {
        let response = b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(response).unwrap(), (503, "abcde".to_owned()));
    }

    #[test]
    fn parses_bodies_read_to_the_end() {
        assert_eq!(
            parse_response(b"HTTP/1.1 404 Not Found\r\n\r\nnope").unwrap(),
            (404, "nope".to_owned())
        );
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nshort").is_err());
    }

    #[test]
    fn gets_from_a_real_socket() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = [0; 1024];
            let n = stream.read(&mut request).unwrap();
            assert!(request[..n].starts_with(b"GET /hi HTTP/1.1\r\n"));
            stream
                .write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 24\r\n\r\nHello from worker 4242!\n",
                )
                .unwrap();
        });
        let (status, body) = http_get(addr, "/hi").unwrap();
        server.join().unwrap();
        assert_eq!(status, 200);
        assert_eq!(worker_pid(&body), Some(4242));
    }
}
