//! `cargo xtask bench <name>`: benchmarks, built in release mode.
//!
//! - `restart [--kills N]`: from a worker's SIGKILL to Envoy holding its replacement endpoint, split into
//!   exit detection, restart and xDS delivery (`tests/src/bin/restart-latency.rs`).
//! - `http [--duration SECS] [--rounds N]`: the worker's HTTP server against a hyper baseline on the same
//!   core, under `wrk` and `h2load` ([`http`]).

mod http;
mod parse;

use std::process::ExitCode;

use anyhow::bail;
use peregrine_e2e::target_dir;

use crate::{cargo, envoy, run_checked};

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    match args.first().map(String::as_str) {
        Some("restart") => restart(&args[1..]),
        Some("http") => http::run(&args[1..]),
        Some(other) => bail!("unknown benchmark {other:?}: expected `restart` or `http`"),
        None => bail!(
            "name a benchmark: `cargo xtask bench restart [--kills N]` or `cargo xtask bench http [--duration SECS] [--rounds N]`"
        ),
    }
}

fn restart(args: &[String]) -> anyhow::Result<ExitCode> {
    let envoy = envoy::install()?;
    run_checked(cargo().args([
        "build",
        "--release",
        "-p",
        "peregrine-supervisor",
        "--bin",
        "peregrine",
    ]))?;
    run_checked(
        cargo()
            .args([
                "run",
                "--release",
                "-p",
                "peregrine-e2e",
                "--bin",
                "restart-latency",
                "--",
            ])
            .args(args)
            .env("ENVOY", &envoy)
            .env("PEREGRINE", target_dir().join("release/peregrine")),
    )?;
    Ok(ExitCode::SUCCESS)
}
