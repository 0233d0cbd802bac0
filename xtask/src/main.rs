//! Project automation, run as `cargo xtask <command>` (an alias in `.cargo/config.toml`).
//!
//! One binary with a module per subcommand and few dependencies (rust-analyzer's xtask pattern), over
//! the library of this crate (`lib.rs`: what the benchmarks and the demo share with it). Cargo is
//! invoked through `$CARGO`, so the toolchain that runs the xtask also builds and tests.
//! `cargo xtask bench` and `cargo xtask demo` run the binaries of the `peregrine-bench` and
//! `peregrine-demo` crates, which link the end-to-end harness (`peregrine-e2e`), so that the xtask
//! itself does not.

#![forbid(unsafe_code)]

mod fresh;
mod package;
mod test;
mod vm;

use std::{os::unix::process::CommandExt as _, process::ExitCode};

use xtask::{USAGE, cargo, ebpf, envoy};

fn main() -> ExitCode {
    xtask::main_with(run)
}

fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    match args.first().map(String::as_str) {
        Some("envoy") => envoy::run(&args[1..]),
        Some("test") => test::run(&args[1..]),
        Some("demo") => run_binary("peregrine-demo", &args[1..]),
        Some("bench") => run_binary("peregrine-bench", &args[1..]),
        Some("build-ebpf") => ebpf::run(&args[1..]),
        Some("fresh") => fresh::run(&args[1..]),
        Some("package") => package::run(&args[1..]),
        Some("vm") => vm::run(&args[1..]),
        Some("help" | "-h" | "--help") => {
            print!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        Some(other) => {
            eprint!("unknown command {other:?}\n\n{USAGE}");
            Ok(ExitCode::from(2))
        }
        None => {
            eprint!("{USAGE}");
            Ok(ExitCode::from(2))
        }
    }
}

/// Becomes `$CARGO run --quiet -p PACKAGE -- ARGS` in the workspace root: the package's binary, built
/// in the profile the xtask runs in (dev) and run with `args`, its exit status the xtask's. Cargo
/// runs a binary in place of itself, so Ctrl-C reaches the binary alone, and no process of the
/// xtask waits behind it.
fn run_binary(package: &str, args: &[String]) -> anyhow::Result<ExitCode> {
    let mut command = cargo();
    command
        .args(["run", "--quiet", "-p", package, "--"])
        .args(args);
    // Returns only when the program could not be started.
    let error = command.exec();
    Err(anyhow::Error::new(error).context(format!("running {command:?}")))
}
