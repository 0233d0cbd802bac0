//! `cargo xtask bench <name>`: benchmarks, built in release mode. This binary (`peregrine-bench`) is
//! what `cargo xtask bench` runs, with the arguments after `bench`; it shares the package list, Envoy's
//! install, Ctrl-C and `cargo()` with the xtask through the `xtask` library.
//!
//! - `restart [--kills N] [--user NAME]`: from a worker's SIGKILL to Envoy holding its replacement endpoint, split into
//!   exit detection, restart and xDS delivery (`bench/src/bin/restart-latency.rs`).
//! - `http [--duration SECS] [--rounds N]`: the worker's HTTP server against a hyper baseline on the same
//!   core, under `wrk` and `h2load` ([`http`]).
//! - `hashing [--keys N]`: keys moved by consistent hashing through Envoy on a worker restart and on
//!   scaling 3 -> 4 -> 3 workers, ring hash and Maglev, with and without bounded loads ([`hashing`]).
//! - `sampler [--duration SECS] [--rounds N]`: what the sampler costs a loaded worker (off, eBPF and
//!   procfs at 1 s and 100 ms), and one sample pass over 8, 64 and 512 processes ([`sampler`]).
//! - `balance [--rounds N] [--warmup SECS] [--duration SECS] [--load FRACTION] [--cpu-ms MS]`: round
//!   robin, least request and ORCA-weighted round robin through the real Envoy while one worker's core
//!   is shared with a CPU hog, or the worker gets CPU-heavy requests past Envoy; with a plot of the
//!   shares, utilizations and weights over time ([`balance`]).
//! - `attacks [--connections N] [--bodies N]`: a flood of connections to the gRPC port and of
//!   unfinished request bodies to a worker, at the size they were found at ([`attacks`]).
//! - `lifecycle [--rounds N] [--batches N,N...]`: a rolling restart of 8 workers (`restart_batch` 1 and
//!   4) and a SIGKILLed supervisor adopting its workers again, under load through the real Envoy
//!   ([`lifecycle`]).
//! - `fleet [--hosts N] [--workers N] [--changes N] [--losses N] ...`: supervisors sharing membership
//!   through a real etcd: a worker change until every Envoy of the fleet holds it, a dead host until
//!   every other Envoy drops it, and 50 supervisors of 20 workers: RSS and CPU per supervisor,
//!   etcd's writes and watch events per change, one more supervisor's sync ([`fleet`]).
//! - `orca-cost [--workers W] [--streams P,P,...] [--window SECS] [--rounds N] [--quick]`: what ORCA
//!   out-of-band streams cost one supervisor (CPU, RSS and reports per stream), `P` streams of
//!   simulated Envoys to `W` workers ([`orca_cost`]).
//! - `xds-scale [--streams N,N...] [--endpoints M,M...] [--kind sotw|delta|ads|delta-ads] [--quick]
//!   [--supervisor [LABEL=]PATH]`: N Envoy-like xDS clients of ours against one supervisor serving M
//!   endpoints of remote hosts (records in a real etcd): a change until every client ACKed it, a
//!   burst, RSS per stream and per endpoint, CPU and bytes per change, a reconnect storm
//!   ([`xds_scale`]).

#![forbid(unsafe_code)]

mod attacks;
mod balance;
mod behind_envoy;
mod config;
mod fleet;
mod hashing;
mod http;
mod idle;
mod kernel_ops;
mod lifecycle;
mod machine;
mod orca_cost;
mod parse;
mod plot;
mod sampler;
mod server;
mod table;
mod xds_scale;

use std::{path::PathBuf, process::ExitCode};

use anyhow::{Context, bail};
use peregrine_e2e::target_dir;
use xtask::{cargo, envoy, run_checked};

/// A command line from `text`, split at whitespace: the option strings the tests parse.
#[cfg(test)]
fn args(text: &str) -> Vec<String> {
    text.split_whitespace().map(str::to_owned).collect()
}

fn main() -> ExitCode {
    xtask::main_with(run)
}

fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    match args.first().map(String::as_str) {
        Some("restart") => restart(&args[1..]),
        Some("http") => http::run(&args[1..]),
        Some("sampler") => sampler::run(&args[1..]),
        Some("hashing") => hashing::run(&args[1..]),
        Some("balance") => balance::run(&args[1..]),
        Some("lifecycle") => lifecycle::run(&args[1..]),
        Some("attacks") => attacks::run(&args[1..]),
        Some("fleet") => fleet::run(&args[1..]),
        Some("xds-scale") => xds_scale::run(&args[1..]),
        Some("orca-cost") => orca_cost::run(&args[1..]),
        Some(other) => {
            bail!(
                "unknown benchmark {other:?}: expected `restart`, `http`, `sampler`, `hashing`, `balance`, `lifecycle`, `attacks`, `fleet` or `orca-cost`"
            )
        }
        None => bail!(
            "name a benchmark: `cargo xtask bench restart [--kills N] [--user NAME]` or `cargo xtask bench http [--duration SECS] [--rounds N]` or `cargo xtask bench sampler`, `hashing`, `balance`, `lifecycle` or `fleet`"
        ),
    }
}

/// `cargo xtask bench NAME ARGS...`, as the report's first line quotes it.
fn command_line(bench: &str, args: &[String]) -> String {
    std::iter::once(format!("cargo xtask bench {bench}"))
        .chain(args.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Builds the release `peregrine` (the supervisor and the built-in worker) and returns its path.
fn release_peregrine() -> anyhow::Result<PathBuf> {
    release_peregrine_and(&[])
}

/// [`release_peregrine`], with more packages and binaries in the same `cargo build` (`extra`, as
/// `-p PACKAGE --bin NAME` arguments).
fn release_peregrine_and(extra: &[&str]) -> anyhow::Result<PathBuf> {
    // The release build needs the eBPF sampler's tools; the fleet benchmarks need etcd.
    xtask::packages::ensure(xtask::packages::FLEET)?;
    run_checked(
        cargo()
            .args([
                "build",
                "--release",
                "-p",
                "peregrine",
                "--bin",
                "peregrine",
            ])
            .args(extra),
    )?;
    Ok(target_dir().join("release/peregrine"))
}

/// A benchmark's `--flag VALUE` arguments, one flag at a time:
///
/// ```ignore
/// let mut args = Flags::new(args, USAGE);
/// while let Some(flag) = args.next() {
///     match flag {
///         "--rounds" => rounds = args.value(flag)?.parse().context("--rounds N")?,
///         other => return Err(args.unknown(other)),
///     }
/// }
/// ```
struct Flags<'a> {
    args: std::slice::Iter<'a, String>,
    usage: &'static str,
}

impl<'a> Flags<'a> {
    fn new(args: &'a [String], usage: &'static str) -> Self {
        Flags {
            args: args.iter(),
            usage,
        }
    }

    /// The next flag, if any.
    fn next(&mut self) -> Option<&'a str> {
        self.args.next().map(String::as_str)
    }

    /// The value after `flag`; an error with the usage when there is none.
    fn value(&mut self, flag: &str) -> anyhow::Result<&'a str> {
        self.args
            .next()
            .map(String::as_str)
            .with_context(|| format!("{flag} needs a value\nusage: {}", self.usage))
    }

    /// The error for a flag the benchmark does not know.
    fn unknown(&self, flag: &str) -> anyhow::Error {
        anyhow::anyhow!("unknown argument {flag:?}\nusage: {}", self.usage)
    }
}

fn restart(args: &[String]) -> anyhow::Result<ExitCode> {
    let envoy = envoy::install()?;
    release_peregrine()?;
    run_checked(
        cargo()
            .args([
                "run",
                "--release",
                "-p",
                "peregrine-bench",
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
