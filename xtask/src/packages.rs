//! The one list of the Debian packages the project needs ([`PACKAGES`]), and [`ensure`], which the
//! commands call first so that a fresh machine's README commands do all their own set-up.
//!
//! Each package is looked for by what the build or the tests actually use ([`Probe`]): a file
//! (`bpf/bpf_helpers.h`, which the eBPF sampler includes), a program on `PATH`, a
//! Python module. As root, [`ensure`] installs what is missing with one `apt-get install`; otherwise
//! it prints the one `apt-get install` line that would, and stops, unless all that is missing is
//! the eBPF sampler's build tools, without which the build goes on with the procfs fallback (an
//! error with `PEREGRINE_REQUIRE_EBPF=1`). What to do is `plan`, a pure function of what is
//! missing and what this machine allows.
//!
//! `.ci/run` installs, by the same probes, only build tools: a C toolchain (the xtask's own build
//! needs no more), and clang and libbpf's headers because CI builds the eBPF crate with
//! `PEREGRINE_REQUIRE_EBPF=1`; a unit test holds it to this list.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, SystemTime},
};

use anyhow::{Context, bail};

use crate::{ebpf, run_checked};

/// What a package is needed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Building the workspace.
    Build,
    /// Building the eBPF sampler; without it the build goes on with the procfs fallback.
    Ebpf,
    /// The virtualenvs the pinned Envoy, the Python app servers and the strict clients go into.
    Venv,
    /// The fleet: etcd members, hosts as network namespaces.
    Fleet,
    /// The tests' own tools.
    Test,
    /// The HTTP benchmarks' load generators.
    Bench,
    /// The fresh-machine check, on the host.
    Fresh,
    /// The Debian package (`cargo xtask package`) and its test in a fresh root.
    Package,
    /// The virtual machines of `cargo xtask vm`: a Debian image booted under QEMU.
    Vm,
}

/// How a package is found to be there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// A program on `PATH` (or in `/usr/sbin` or `/sbin`, which a user's `PATH` may lack).
    Program(&'static str),
    /// A file.
    File(&'static str),
    /// Python modules `python3` (the one on `PATH`) imports.
    Python(&'static str),
    /// A clang >= 14 as the eBPF build looks for one (`CLANG` counts as found: the build runs
    /// that one and no package can replace it; `ebpf::tools::check_clang_var` judges it).
    Clang,
    /// libbpf's headers where the eBPF build looks for them.
    Libbpf,
}

/// A Debian package, what it is for and how it is found.
#[derive(Debug, PartialEq, Eq)]
pub struct Package {
    pub name: &'static str,
    pub probe: Probe,
    pub uses: &'static [Use],
    pub why: &'static str,
}

/// Every system package the project needs.
pub const PACKAGES: &[Package] = &[
    Package {
        name: "build-essential",
        probe: Probe::Program("cc"),
        uses: &[Use::Build],
        why: "a C toolchain: rustc links with cc, and build scripts compile C",
    },
    Package {
        name: "protobuf-compiler",
        probe: Probe::Program("protoc"),
        uses: &[Use::Test],
        why: "builds the previous release (0.1.0) for the compatibility test: its etcd client's \
              build script ran protoc (no build of this version needs it)",
    },
    Package {
        name: "libprotobuf-dev",
        probe: Probe::File("/usr/include/google/protobuf/descriptor.proto"),
        uses: &[Use::Test],
        why: "protoc's own include files, which the previous release's etcd protos import",
    },
    Package {
        name: "clang-19",
        probe: Probe::Clang,
        uses: &[Use::Ebpf],
        why: "compiles the eBPF sampler",
    },
    Package {
        name: "libbpf-dev",
        probe: Probe::Libbpf,
        uses: &[Use::Ebpf],
        why: "libbpf's headers, which the eBPF sampler includes",
    },
    Package {
        name: "python3-venv",
        probe: Probe::Python("ensurepip, venv"),
        uses: &[Use::Venv],
        why: "`python3 -m venv`, for the virtualenvs of the pinned Envoy, gunicorn, uvicorn and \
              the strict Python clients",
    },
    Package {
        name: "etcd-server",
        probe: Probe::Program("etcd"),
        uses: &[Use::Fleet],
        why: "the fleet's membership store: its tests and demo start real etcd members",
    },
    Package {
        name: "iproute2",
        probe: Probe::Program("ip"),
        uses: &[Use::Fleet, Use::Package],
        why: "the fleet's hosts are network namespaces",
    },
    Package {
        name: "openssl",
        probe: Probe::Program("openssl"),
        uses: &[Use::Test],
        why: "checks the certificates `peregrine tls init` writes",
    },
    Package {
        name: "curl",
        probe: Probe::Program("curl"),
        uses: &[Use::Test, Use::Package],
        why: "an HTTP client the tests drive the worker and the TLS endpoints with",
    },
    Package {
        name: "util-linux",
        probe: Probe::Program("setpriv"),
        uses: &[Use::Test],
        why: "setpriv drops capabilities (the procfs fallback's tests), taskset pins cores",
    },
    Package {
        name: "nodejs",
        probe: Probe::Program("node"),
        uses: &[Use::Test],
        why: "a Node `http` server as a passed-socket worker",
    },
    Package {
        name: "tmux",
        probe: Probe::Program("tmux"),
        uses: &[Use::Test],
        why: "`peregrine status --watch` is tested in a terminal tmux holds",
    },
    Package {
        name: "prometheus",
        probe: Probe::Program("prometheus"),
        uses: &[Use::Test],
        why: "the metrics test scrapes the supervisor with a real Prometheus",
    },
    Package {
        name: "systemd",
        probe: Probe::Program("systemd-analyze"),
        uses: &[Use::Test],
        why: "`systemd-analyze verify` checks the systemd unit",
    },
    Package {
        name: "vagrant",
        probe: Probe::Program("vagrant"),
        uses: &[Use::Test],
        why: "`vagrant validate` checks the VM definition in vagrant/",
    },
    Package {
        name: "linux-perf",
        probe: Probe::Program("perf"),
        uses: &[Use::Test],
        why: "the benchmarks count a process's system calls with perf, and a test checks that",
    },
    Package {
        name: "wrk",
        probe: Probe::Program("wrk"),
        uses: &[Use::Bench],
        why: "HTTP/1.1 load for `cargo xtask bench http`",
    },
    Package {
        name: "nghttp2-client",
        probe: Probe::Program("h2load"),
        uses: &[Use::Bench],
        why: "HTTP/2 load (h2load) for `cargo xtask bench http`",
    },
    Package {
        name: "debootstrap",
        probe: Probe::Program("debootstrap"),
        uses: &[Use::Fresh, Use::Vm],
        why: "makes the minimal Debian root of `cargo xtask fresh` and the VM images",
    },
    Package {
        name: "qemu-system-x86",
        probe: Probe::Program("qemu-system-x86_64"),
        uses: &[Use::Vm],
        why: "boots the VM images of `cargo xtask vm` (TCG, or KVM where it boots Debian's kernels)",
    },
    Package {
        name: "qemu-utils",
        probe: Probe::Program("qemu-img"),
        uses: &[Use::Vm],
        why: "qemu-img makes the copy-on-write overlay each VM run boots from",
    },
    Package {
        name: "e2fsprogs",
        probe: Probe::Program("mkfs.ext4"),
        uses: &[Use::Vm],
        why: "mkfs.ext4 -d makes the VM's disks from folders, without a loop device",
    },
    Package {
        name: "git",
        probe: Probe::Program("git"),
        uses: &[Use::Test, Use::Fresh],
        why: "the build records HEAD's commit and a test checks it; the fresh check clones the \
              tree",
    },
    Package {
        name: "dpkg-dev",
        probe: Probe::Program("dpkg-shlibdeps"),
        uses: &[Use::Package],
        why: "dpkg-shlibdeps computes the package's library dependencies",
    },
];

/// `cargo xtask demo`: build the supervisor with the eBPF sampler, install Envoy.
pub const DEMO: &[Use] = &[Use::Build, Use::Ebpf, Use::Venv];
/// `cargo xtask demo fleet` and `bench fleet`: the demo's, and etcd and network namespaces.
pub const FLEET: &[Use] = &[Use::Build, Use::Ebpf, Use::Venv, Use::Fleet];
/// `cargo xtask test`: everything any test uses.
pub const TEST: &[Use] = &[Use::Build, Use::Ebpf, Use::Venv, Use::Fleet, Use::Test];
/// `cargo xtask envoy`: the virtualenv.
pub const VENV: &[Use] = &[Use::Venv];
/// `cargo xtask bench http`: the load generators.
pub const BENCH: &[Use] = &[Use::Bench];
/// `cargo xtask fresh`, on the host.
pub const FRESH: &[Use] = &[Use::Fresh];
/// `cargo xtask package [--test]`: the release build with the eBPF sampler, dpkg's tools, and for
/// the test a network namespace and an HTTP client (the fresh root asks for its own).
pub const PACKAGE: &[Use] = &[Use::Build, Use::Ebpf, Use::Package];
/// `cargo xtask vm`: the build with the eBPF sampler (the payload), and what makes and boots the
/// images.
pub const VM: &[Use] = &[Use::Build, Use::Ebpf, Use::Vm];

/// Package lists older than this are refreshed (`apt-get update`) before an install.
const LISTS_MAX_AGE: Duration = Duration::from_secs(24 * 3600);
/// Where apt keeps its package lists.
const LISTS_DIR: &str = "/var/lib/apt/lists";

/// What this machine allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Host {
    /// Running as root, as apt-get must.
    root: bool,
    /// `apt-get` is on PATH.
    apt_get: bool,
    /// `PEREGRINE_REQUIRE_EBPF=1`: a build without the eBPF sampler is an error.
    require_ebpf: bool,
}

/// What to do about the missing packages.
#[derive(Debug, PartialEq, Eq)]
enum Plan {
    /// Nothing is missing.
    Ready,
    /// Install these with apt-get.
    Install(Vec<&'static str>),
    /// Stop with this error, which holds the one line that installs what is missing.
    Stop(String),
    /// The eBPF sampler's tools alone are missing: warn with the line and go on (procfs fallback).
    WithoutEbpf(String),
}

/// Installs, as root, what `uses` need that is missing; else prints the one `apt-get install` line
/// that would, and stops unless only the eBPF sampler's tools are missing.
pub fn ensure(uses: &[Use]) -> anyhow::Result<()> {
    let host = Host::this();
    let missing = missing(uses);
    match plan(&missing, host) {
        Plan::Ready => Ok(()),
        Plan::Stop(error) => bail!("{error}"),
        Plan::WithoutEbpf(warning) => {
            eprintln!("warning: {warning}");
            Ok(())
        }
        Plan::Install(names) => {
            eprintln!("installing with apt-get:\n{}", reasons(&missing));
            apt_get_install(&names)?;
            let still = missing
                .into_iter()
                .filter(|package| !package.probe.found())
                .collect::<Vec<_>>();
            let required = still
                .iter()
                .filter(|package| !optional(package, host))
                .collect::<Vec<_>>();
            if !required.is_empty() || (host.require_ebpf && !still.is_empty()) {
                bail!("after apt-get install, still missing:\n{}", reasons(&still));
            }
            if !still.is_empty() {
                eprintln!(
                    "warning: eBPF sampler not built (procfs fallback only): after apt-get \
                     install, still missing:\n{}",
                    reasons(&still)
                );
            }
            Ok(())
        }
    }
}

/// The packages `uses` need whose probe finds nothing, in the list's order.
fn missing(uses: &[Use]) -> Vec<&'static Package> {
    needed(uses)
        .filter(|package| !package.probe.found())
        .collect()
}

/// The names of the packages with a use in `uses`, in the list's order.
pub fn names(uses: &[Use]) -> Vec<&'static str> {
    needed(uses).map(|package| package.name).collect()
}

/// The packages with a use in `uses`, in the list's order.
fn needed(uses: &[Use]) -> impl Iterator<Item = &'static Package> {
    PACKAGES
        .iter()
        .filter(move |package| package.uses.iter().any(|use_| uses.contains(use_)))
}

/// What to do about `missing`, given what this machine allows.
fn plan(missing: &[&'static Package], host: Host) -> Plan {
    if missing.is_empty() {
        return Plan::Ready;
    }
    let names: Vec<&'static str> = missing.iter().map(|package| package.name).collect();
    if host.root && host.apt_get {
        return Plan::Install(names);
    }
    let sudo = if host.root { "" } else { "sudo " };
    let line = format!("{sudo}apt-get install {}", names.join(" "));
    let how = if host.apt_get {
        format!("run `{line}`")
    } else {
        format!("install the same as Debian's `{line}` would")
    };
    if missing.iter().all(|package| optional(package, host)) {
        return Plan::WithoutEbpf(format!(
            "eBPF sampler not built (procfs fallback only): missing\n{}\nto build it, {how}",
            reasons(missing)
        ));
    }
    Plan::Stop(format!(
        "missing packages:\n{}\nto install them, {how}",
        reasons(missing)
    ))
}

/// Whether a command goes on without `package`: the eBPF sampler's tools, unless
/// `PEREGRINE_REQUIRE_EBPF=1`.
fn optional(package: &Package, host: Host) -> bool {
    package.uses == [Use::Ebpf] && !host.require_ebpf
}

/// One line per package: its name, what was not found, what it is for.
fn reasons(packages: &[&Package]) -> String {
    packages
        .iter()
        .map(|package| {
            format!(
                "  {}: no {} ({})",
                package.name,
                package.probe.describe(),
                package.why
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `apt-get install -y --no-install-recommends names`, non-interactive; `apt-get update` first
/// when the package lists are missing or older than a day, and again before one retry if the
/// install fails.
fn apt_get_install(names: &[&str]) -> anyhow::Result<()> {
    let apt_get = || {
        let mut command = Command::new("apt-get");
        command.env("DEBIAN_FRONTEND", "noninteractive");
        command
    };
    let update = || run_checked(apt_get().args(["-qq", "update"]));
    let install = || {
        run_checked(
            apt_get()
                .args(["install", "-y", "-q", "--no-install-recommends"])
                .args(names),
        )
    };
    let updated = if lists_need_update(newest_list(), SystemTime::now()) {
        update()?;
        true
    } else {
        false
    };
    match install() {
        Ok(()) => Ok(()),
        Err(_) if !updated => {
            // Lists a day old can name package versions the mirror no longer has.
            update()?;
            install()
        }
        Err(error) => Err(error),
    }
}

/// The modification time of the newest package list apt holds, if any.
fn newest_list() -> Option<SystemTime> {
    std::fs::read_dir(LISTS_DIR)
        .ok()?
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().contains("_Packages"))
        .filter_map(|entry| entry.metadata().ok()?.modified().ok())
        .max()
}

/// Whether apt's lists need an update: none, or the newest older than [`LISTS_MAX_AGE`].
fn lists_need_update(newest: Option<SystemTime>, now: SystemTime) -> bool {
    newest.is_none_or(|newest| {
        now.duration_since(newest)
            .is_ok_and(|age| age > LISTS_MAX_AGE)
    })
}

/// `program` found in `PATH`.
pub fn program_path(program: &str) -> anyhow::Result<PathBuf> {
    env::var_os("PATH")
        .iter()
        .flat_map(env::split_paths)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
        .with_context(|| format!("{program} is not in PATH"))
}

// === impl Probe ===

impl Probe {
    /// Whether what the probe looks for is there now.
    pub fn found(self) -> bool {
        match self {
            Probe::Program(program) => {
                program_path(program).is_ok()
                    || ["/usr/sbin", "/sbin"]
                        .iter()
                        .any(|dir| Path::new(dir).join(program).is_file())
            }
            Probe::File(path) => Path::new(path).is_file(),
            Probe::Python(modules) => Command::new("python3")
                .args(["-c", &format!("import {modules}")])
                .output()
                .is_ok_and(|output| output.status.success()),
            Probe::Clang => ebpf::tools::clang_found(),
            Probe::Libbpf => ebpf::tools::libbpf_found(),
        }
    }

    /// What the probe looks for, in words (after "no").
    pub fn describe(self) -> String {
        match self {
            Probe::Program(program) => format!("{program} in PATH"),
            Probe::File(path) => path.to_owned(),
            Probe::Python(modules) => format!("`import {modules}` in python3"),
            Probe::Clang => ebpf::tools::clang_wanted(),
            Probe::Libbpf => ebpf::tools::libbpf_wanted(),
        }
    }
}

// === impl Host ===

impl Host {
    fn this() -> Self {
        Host {
            root: rustix::process::geteuid().is_root(),
            apt_get: program_path("apt-get").is_ok(),
            require_ebpf: env::var("PEREGRINE_REQUIRE_EBPF").is_ok_and(|v| v == "1"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn package(name: &str) -> &'static Package {
        PACKAGES
            .iter()
            .find(|package| package.name == name)
            .unwrap_or_else(|| panic!("{name} is not in the list"))
    }

    fn host(root: bool, apt_get: bool, require_ebpf: bool) -> Host {
        Host {
            root,
            apt_get,
            require_ebpf,
        }
    }

    #[test]
    fn nothing_missing_is_nothing_to_do() {
        assert_eq!(plan(&[], host(false, false, true)), Plan::Ready);
    }

    #[test]
    fn root_with_apt_get_installs_everything_missing_at_once() {
        let missing = [package("etcd-server"), package("clang-19"), package("tmux")];
        assert_eq!(
            plan(&missing, host(true, true, false)),
            Plan::Install(vec!["etcd-server", "clang-19", "tmux"])
        );
    }

    #[test]
    fn otherwise_one_line_says_what_to_install_and_the_command_stops() {
        let missing = [
            package("etcd-server"),
            package("python3-venv"),
            package("libbpf-dev"),
        ];
        let Plan::Stop(error) = plan(&missing, host(false, true, false)) else {
            panic!("expected a stop");
        };
        assert_eq!(
            error,
            "missing packages:\n  \
             etcd-server: no etcd in PATH (the fleet's membership store: its tests and demo \
             start real etcd members)\n  \
             python3-venv: no `import ensurepip, venv` in python3 (`python3 -m venv`, for the \
             virtualenvs of the pinned Envoy, gunicorn, uvicorn and the strict Python clients)\n  \
             libbpf-dev: no bpf/bpf_helpers.h in /usr/include or /usr/local/include (libbpf's \
             headers, which the eBPF sampler includes)\n\
             to install them, run `sudo apt-get install etcd-server python3-venv libbpf-dev`"
        );
        assert_eq!(
            error.matches("apt-get install").count(),
            1,
            "one line to run: {error}"
        );
        // Root without apt-get: no sudo, and the line is Debian's.
        let Plan::Stop(error) = plan(&missing[..1], host(true, false, false)) else {
            panic!("expected a stop");
        };
        assert!(
            error.ends_with(
                "to install them, install the same as Debian's `apt-get install \
                 etcd-server` would"
            ),
            "{error}"
        );
    }

    #[test]
    fn without_the_ebpf_tools_alone_the_command_goes_on_unless_ebpf_is_required() {
        let missing = [package("clang-19"), package("libbpf-dev")];
        let Plan::WithoutEbpf(warning) = plan(&missing, host(false, true, false)) else {
            panic!("expected a warning");
        };
        assert!(
            warning.starts_with(
                "eBPF sampler not built (procfs fallback only): missing\n  clang-19: no clang >= 14"
            ),
            "{warning}"
        );
        assert!(
            warning.ends_with("\nto build it, run `sudo apt-get install clang-19 libbpf-dev`"),
            "{warning}"
        );
        assert!(matches!(
            plan(&missing, host(false, true, true)),
            Plan::Stop(error) if error.ends_with("run `sudo apt-get install clang-19 libbpf-dev`")
        ));
        // With PEREGRINE_REQUIRE_EBPF=1, root still installs them.
        assert_eq!(
            plan(&missing, host(true, true, true)),
            Plan::Install(vec!["clang-19", "libbpf-dev"])
        );
    }

    #[test]
    fn apt_lists_are_refreshed_when_missing_or_a_day_old() {
        let now = SystemTime::now();
        assert!(lists_need_update(None, now));
        assert!(!lists_need_update(
            Some(now - Duration::from_secs(3600)),
            now
        ));
        assert!(lists_need_update(
            Some(now - Duration::from_secs(25 * 3600)),
            now
        ));
        // A list from the future (a clock set back) is not refreshed for it.
        assert!(!lists_need_update(Some(now + Duration::from_secs(60)), now));
    }

    #[test]
    fn the_list_names_each_package_once_and_every_command_has_its_packages() {
        let names: BTreeSet<&str> = PACKAGES.iter().map(|package| package.name).collect();
        assert_eq!(names.len(), PACKAGES.len(), "a package listed twice");
        for package in PACKAGES {
            assert!(!package.uses.is_empty(), "{} is for nothing", package.name);
        }
        let names_for = |uses: &[Use]| needed(uses).map(|p| p.name).collect::<Vec<_>>();
        assert_eq!(
            names_for(DEMO),
            ["build-essential", "clang-19", "libbpf-dev", "python3-venv"]
        );
        // The tests need all the demo needs, and the fleet's.
        for package in needed(FLEET) {
            assert!(needed(TEST).any(|p| p == package), "{}", package.name);
        }
        assert_eq!(names_for(FRESH), ["debootstrap", "git"]);
    }

    /// Every program the tests start is found through the list (or comes with every Debian
    /// system), so `cargo xtask test` installs it before a test could skip for it.
    #[test]
    fn every_program_the_tests_start_is_in_the_list() {
        // Essential packages (coreutils, dash, apt) are on every Debian system, even a minbase
        // one; python3 comes with python3-venv.
        const EVERYWHERE: &[&str] = &[
            "sh", "sleep", "true", "timeout", "date", "cat", "/bin/cat", "cp", "id", "install",
            "python3",
        ];
        let root = crate::workspace_root();
        let mut files = Vec::new();
        for dir in [
            "tests/src",
            "tests/tests",
            "supervisor/src",
            "supervisor/tests",
            "ebpf/src",
            "ebpf/tests",
            "worker/src",
            "contract/src",
        ] {
            collect_rust_files(&root.join(dir), &mut files);
        }
        assert!(files.len() > 20, "found only {files:?}");
        let programs_for_tests: Vec<&str> = needed(TEST)
            .chain(needed(BENCH))
            .filter_map(|package| match package.probe {
                Probe::Program(program) => Some(program),
                _ => None,
            })
            .collect();
        // taskset is util-linux's; systemd-analyze systemd's; promtool prometheus's.
        let also_from_listed_packages = ["taskset", "systemd-analyze", "promtool"];
        let mut unlisted = BTreeSet::new();
        for file in &files {
            let text = std::fs::read_to_string(file).unwrap();
            for piece in text.split("Command::new(\"").skip(1) {
                let program = piece.split('"').next().unwrap_or_default();
                if !EVERYWHERE.contains(&program)
                    && !programs_for_tests.contains(&program)
                    && !also_from_listed_packages.contains(&program)
                {
                    unlisted.insert(format!("{program} ({})", file.display()));
                }
            }
        }
        assert!(
            unlisted.is_empty(),
            "programs not in the package list: {unlisted:?}"
        );
    }

    /// `.ci/run` installs, by the list's own probes, only build tools (the C toolchain, the eBPF
    /// build's clang and libbpf headers).
    #[test]
    fn ci_installs_only_build_tools_by_the_same_probes() {
        let script = std::fs::read_to_string(crate::workspace_root().join(".ci/run")).unwrap();
        let installed: Vec<&str> = script
            .split("need_apt+=(")
            .skip(1)
            .filter_map(|rest| rest.split(')').next())
            .collect();
        // curl only fetches rustup on a machine without cargo.
        assert_eq!(
            installed,
            ["build-essential", "clang-19", "libbpf-dev", "curl"]
        );
        for &name in &installed[..3] {
            let package = package(name);
            assert!(
                package
                    .uses
                    .iter()
                    .all(|use_| [Use::Build, Use::Ebpf].contains(use_)),
                "{name}"
            );
            let probe = match package.probe {
                Probe::Program(program) => format!("command -v {program}"),
                Probe::File(path) => path.to_owned(),
                Probe::Libbpf => "/usr/include/bpf/bpf_helpers.h".to_owned(),
                Probe::Clang => "clang-19".to_owned(),
                Probe::Python(modules) => format!("import {modules}"),
            };
            assert!(
                script.contains(&probe),
                "{name}: .ci/run does not probe {probe}"
            );
        }
    }

    /// The Vagrant VM is provisioned as CI is: the same build tools, the rest from this list by
    /// the xtask itself.
    #[test]
    fn the_vagrant_vm_installs_what_ci_installs() {
        let vagrantfile =
            std::fs::read_to_string(crate::workspace_root().join("vagrant/Vagrantfile")).unwrap();
        let line = vagrantfile
            .lines()
            .find(|line| line.contains("apt-get install"))
            .expect("an apt-get install line in the Vagrantfile");
        let installed: Vec<&str> = line
            .split_whitespace()
            .skip_while(|word| *word != "install")
            .skip(1)
            .filter(|word| !word.starts_with('-'))
            .collect();
        assert_eq!(
            installed,
            ["build-essential", "clang-19", "libbpf-dev", "curl"]
        );
    }

    fn collect_rust_files(dir: &Path, files: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                collect_rust_files(&path, files);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path);
            }
        }
    }
}
