//! Smoke test of the spike: pipelined HTTP/1.1 and h2c, answered with the hello app's exact bytes.

use std::path::Path;

use peregrine_e2e::HelloServer;

fn start() -> HelloServer {
    HelloServer::start(
        "spike-compio",
        Path::new(env!("CARGO_BIN_EXE_spike-compio")),
    )
}

#[test]
fn answers_pipelined_http1_requests_in_order() {
    start().check_pipelined_http1();
}

#[test]
fn answers_h2c() {
    start().check_h2c();
}
