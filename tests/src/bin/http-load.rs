//! `http-load ADDRESS HTTP1 HTTP2 STOP_FILE LIMIT_SECONDS`: the tests' load ([`Load`]) as a
//! program, for a host the tests cannot reach in process (a virtual machine): `HTTP1` HTTP/1.1 and
//! `HTTP2` HTTP/2 clients send `GET /` to `ADDRESS` one request after another until `STOP_FILE`
//! exists or `LIMIT_SECONDS` pass, then it prints what they saw as one JSON object: the requests
//! answered by a worker, by protocol and by worker pid, and every failure. Exit 0 when it ran,
//! whatever it saw: the caller judges the figures.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Context;
use peregrine_e2e::{Load, POLL_INTERVAL};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [address, http1, http2, stop, limit] = args.as_slice() else {
        anyhow::bail!("usage: http-load ADDRESS HTTP1 HTTP2 STOP_FILE LIMIT_SECONDS");
    };
    let address: SocketAddr = address.parse().context("ADDRESS")?;
    let (http1, http2): (usize, usize) = (http1.parse()?, http2.parse()?);
    let limit = Duration::from_secs(limit.parse().context("LIMIT_SECONDS")?);
    let stop = PathBuf::from(stop);
    let load = Load::start(address, http1, http2, limit);
    while !stop.exists() && load.elapsed() < limit {
        std::thread::sleep(POLL_INTERVAL);
    }
    let report = load.stop();
    let failures: Vec<serde_json::Value> = report
        .failures
        .iter()
        .map(|failure| {
            serde_json::json!({
                "protocol": format!("{:?}", failure.protocol),
                "what": failure.what,
                "after_s": failure.after.as_secs_f64(),
                "cut": failure.cut,
            })
        })
        .collect();
    let ok: serde_json::Map<String, serde_json::Value> = report
        .ok
        .iter()
        .map(|(protocol, count)| (format!("{protocol:?}"), (*count).into()))
        .collect();
    let by_pid: serde_json::Map<String, serde_json::Value> = report
        .by_pid
        .iter()
        .map(|(pid, count)| (pid.to_string(), (*count).into()))
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "served": report.served(),
            "ok": ok,
            "by_pid": by_pid,
            "failed": report.failures.len(),
            "failures": failures,
            "seconds": report.elapsed.as_secs_f64(),
        })
    );
    Ok(())
}
