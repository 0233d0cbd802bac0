//! What the eBPF sampler's build needs from the machine, clang and libbpf's headers, checked before
//! `cargo xtask test` and `demo` build: installed with apt-get when they are missing and this is root;
//! else named, with the command that installs them, and the build goes on with the procfs fallback
//! (an error with `PEREGRINE_REQUIRE_EBPF=1`).
//!
//! They are looked for as the build looks for them (`compile`). What to do is [`plan`], a pure
//! function of what was found ([`Probes`]) and what this machine allows ([`Host`]); [`ensure`] probes,
//! installs and reports around it.

use std::env;

use anyhow::bail;

use super::compile::{self, BuildError, MIN_CLANG};
use crate::packages;

/// Debian's package for clang (the version the VM and CI use).
const CLANG_PACKAGE: &str = "clang-19";
/// Debian's package for libbpf's headers.
const LIBBPF_PACKAGE: &str = "libbpf-dev";

/// What the eBPF build looks for, and whether it is there.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Probes {
    /// Why there is no clang >= 14 to build with (`compile::find_clang`'s reason), or `None` when
    /// there is one.
    no_clang: Option<String>,
    /// Whether `CLANG` is set: the build then runs that clang and no other, so a package cannot
    /// replace one that does not run.
    clang_var: bool,
    /// Whether libbpf's headers are there.
    libbpf: bool,
}

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

/// What to do before the build.
#[derive(Debug, PartialEq, Eq)]
enum Plan {
    /// The build has what it needs.
    Ready,
    /// Install `packages` with apt-get, after printing `line` (which ones, and why).
    Install {
        packages: Vec<&'static str>,
        line: String,
    },
    /// Build without the eBPF sampler.
    Without(Without),
}

/// A build without the eBPF sampler, as it is reported.
#[derive(Debug, PartialEq, Eq)]
enum Without {
    /// A warning; the build goes on with the procfs fallback.
    Warn(String),
    /// An error (`PEREGRINE_REQUIRE_EBPF=1`).
    Refuse(String),
}

/// Checks for clang and libbpf's headers and, when they are missing, installs them (root with
/// apt-get) or says how to; an error only with `PEREGRINE_REQUIRE_EBPF=1`.
pub(crate) fn ensure() -> anyhow::Result<()> {
    let host = Host::this();
    match plan(&Probes::now(), host) {
        Plan::Ready => Ok(()),
        Plan::Without(without) => without.report(),
        Plan::Install { packages, line } => {
            eprintln!("{line}");
            let failed = packages::apt_get_install(&packages)
                .err()
                .map(|error| format!("{error:#}"));
            after_install(failed, &Probes::now(), host.require_ebpf).map_or(Ok(()), Without::report)
        }
    }
}

/// What to do, given what is missing and what this machine allows.
fn plan(probes: &Probes, host: Host) -> Plan {
    if probes.no_clang.is_none() && probes.libbpf {
        return Plan::Ready;
    }
    let packages = probes.packages();
    let clang_var_fails = probes.no_clang.is_some() && probes.clang_var;
    if !clang_var_fails && host.root && host.apt_get {
        return Plan::Install {
            line: format!(
                "installing {} with apt-get for the eBPF sampler's build: {}",
                packages.join(" "),
                probes.missing()
            ),
            packages,
        };
    }
    let mut fixes = Vec::new();
    if clang_var_fails {
        fixes.push(format!("set CLANG to a clang >= {MIN_CLANG} (or unset it)"));
    }
    if !packages.is_empty() {
        let sudo = if host.root { "" } else { "sudo " };
        let command = format!("`{sudo}apt-get install {}`", packages.join(" "));
        fixes.push(if host.apt_get {
            format!("run {command}")
        } else {
            let what = packages
                .iter()
                .map(|&package| match package {
                    CLANG_PACKAGE => format!("clang >= {MIN_CLANG}"),
                    _ => "libbpf's headers".to_owned(),
                })
                .collect::<Vec<_>>();
            format!("install {} (Debian: {command})", what.join(" and "))
        });
    }
    Plan::Without(Without::new(
        format!("{}; to build it, {}", probes.missing(), fixes.join(" and ")),
        host.require_ebpf,
    ))
}

/// How an apt-get install went (`failed`: its error, if any), given what is there after it.
fn after_install(failed: Option<String>, probes: &Probes, require_ebpf: bool) -> Option<Without> {
    if let Some(error) = failed {
        return Some(Without::new(error, require_ebpf));
    }
    if probes.no_clang.is_none() && probes.libbpf {
        return None;
    }
    Some(Without::new(
        format!("after apt-get install, still {}", probes.missing()),
        require_ebpf,
    ))
}

// === impl Probes ===

impl Probes {
    /// Looks for clang and libbpf's headers as the build does.
    fn now() -> Self {
        Probes {
            no_clang: match compile::find_clang() {
                Ok(_) => None,
                Err(BuildError::NoClang(why)) => Some(why),
                Err(other) => Some(other.to_string()),
            },
            clang_var: env::var_os("CLANG").is_some(),
            libbpf: compile::find_libbpf().is_ok(),
        }
    }

    /// The packages that would give the build what it lacks.
    fn packages(&self) -> Vec<&'static str> {
        let mut packages = Vec::new();
        if self.no_clang.is_some() && !self.clang_var {
            packages.push(CLANG_PACKAGE);
        }
        if !self.libbpf {
            packages.push(LIBBPF_PACKAGE);
        }
        packages
    }

    /// What is missing, in words: `no clang >= 14 (none on PATH), no libbpf headers (...)`.
    fn missing(&self) -> String {
        let mut missing = Vec::new();
        if let Some(why) = &self.no_clang {
            missing.push(format!("no clang >= {MIN_CLANG} ({why})"));
        }
        if !self.libbpf {
            missing.push(format!(
                "no libbpf headers ({} in {})",
                compile::LIBBPF_HEADER,
                compile::INCLUDE_DIRS.join(" or ")
            ));
        }
        missing.join(", ")
    }
}

// === impl Host ===

impl Host {
    fn this() -> Self {
        Host {
            root: rustix::process::geteuid().is_root(),
            apt_get: packages::program_path("apt-get").is_ok(),
            require_ebpf: env::var("PEREGRINE_REQUIRE_EBPF").is_ok_and(|v| v == "1"),
        }
    }
}

// === impl Without ===

impl Without {
    /// A build without the eBPF sampler because of `why`: refused with `require_ebpf`.
    fn new(why: String, require_ebpf: bool) -> Self {
        if require_ebpf {
            Without::Refuse(format!(
                "PEREGRINE_REQUIRE_EBPF=1 and the eBPF sampler cannot be built: {why}"
            ))
        } else {
            Without::Warn(format!(
                "eBPF sampler not built (procfs fallback only): {why}"
            ))
        }
    }

    fn report(self) -> anyhow::Result<()> {
        match self {
            Without::Warn(warning) => {
                eprintln!("warning: {warning}");
                Ok(())
            }
            Without::Refuse(error) => bail!("{error}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probes(no_clang: Option<&str>, clang_var: bool, libbpf: bool) -> Probes {
        Probes {
            no_clang: no_clang.map(str::to_owned),
            clang_var,
            libbpf,
        }
    }

    fn host(root: bool, apt_get: bool, require_ebpf: bool) -> Host {
        Host {
            root,
            apt_get,
            require_ebpf,
        }
    }

    /// The message of a plan that builds without the eBPF sampler, and whether it refuses.
    fn without(plan: Plan) -> (String, bool) {
        match plan {
            Plan::Without(Without::Warn(warning)) => (warning, false),
            Plan::Without(Without::Refuse(error)) => (error, true),
            other => panic!("expected a build without the eBPF sampler, got {other:?}"),
        }
    }

    #[test]
    fn nothing_to_do_when_both_are_there() {
        for host in [host(true, true, true), host(false, false, false)] {
            assert_eq!(plan(&probes(None, false, true), host), Plan::Ready);
            assert_eq!(plan(&probes(None, true, true), host), Plan::Ready);
        }
    }

    #[test]
    fn root_with_apt_get_installs_what_is_missing() {
        let Plan::Install { packages, line } = plan(
            &probes(Some("none on PATH"), false, false),
            host(true, true, false),
        ) else {
            panic!("expected an install");
        };
        assert_eq!(packages, ["clang-19", "libbpf-dev"]);
        assert_eq!(
            line,
            "installing clang-19 libbpf-dev with apt-get for the eBPF sampler's build: no clang >= \
             14 (none on PATH), no libbpf headers (bpf/bpf_helpers.h in /usr/include or \
             /usr/local/include)"
        );
        // PEREGRINE_REQUIRE_EBPF=1 does not stop an install; an old clang is replaced; a working
        // CLANG is kept.
        for (probes, expected) in [
            (
                probes(Some("clang is version 13"), false, true),
                vec!["clang-19"],
            ),
            (probes(None, true, false), vec!["libbpf-dev"]),
        ] {
            assert!(matches!(
                plan(&probes, host(true, true, true)),
                Plan::Install { packages, .. } if packages == expected
            ));
        }
    }

    #[test]
    fn otherwise_the_build_goes_on_without_and_says_how_to_get_it() {
        let missing = probes(Some("none on PATH"), false, false);
        let (warning, refused) = without(plan(&missing, host(false, true, false)));
        assert!(!refused);
        assert!(
            warning.starts_with("eBPF sampler not built (procfs fallback only): no clang >= 14"),
            "{warning}"
        );
        assert!(
            warning.ends_with("; to build it, run `sudo apt-get install clang-19 libbpf-dev`"),
            "{warning}"
        );
        // Root on a machine without apt-get.
        let (warning, _) = without(plan(&missing, host(true, false, false)));
        assert!(
            warning.ends_with(
                "install clang >= 14 and libbpf's headers (Debian: `apt-get install clang-19 \
                 libbpf-dev`)"
            ),
            "{warning}"
        );
        let (warning, _) = without(plan(&probes(None, false, false), host(false, false, false)));
        assert!(
            warning.ends_with(
                "; to build it, install libbpf's headers (Debian: `sudo apt-get install \
                 libbpf-dev`)"
            ),
            "{warning}"
        );
    }

    #[test]
    fn a_clang_var_that_does_not_run_is_the_variables_to_fix() {
        let failing = probes(Some("CLANG=/opt/clang does not run"), true, true);
        let (warning, _) = without(plan(&failing, host(true, true, false)));
        assert!(
            warning.ends_with(
                "no clang >= 14 (CLANG=/opt/clang does not run); to build it, set CLANG to a \
                 clang >= 14 (or unset it)"
            ),
            "{warning}"
        );
        let (warning, _) = without(plan(
            &probes(Some("x"), true, false),
            host(true, true, false),
        ));
        assert!(
            warning.ends_with(
                "set CLANG to a clang >= 14 (or unset it) and run `apt-get install libbpf-dev`"
            ),
            "{warning}"
        );
    }

    #[test]
    fn peregrine_require_ebpf_makes_it_an_error() {
        let (error, refused) = without(plan(
            &probes(Some("none on PATH"), false, true),
            host(false, true, true),
        ));
        assert!(refused);
        assert_eq!(
            error,
            "PEREGRINE_REQUIRE_EBPF=1 and the eBPF sampler cannot be built: no clang >= 14 (none \
             on PATH); to build it, run `sudo apt-get install clang-19`"
        );
    }

    #[test]
    fn an_install_is_checked() {
        let ready = probes(None, false, true);
        assert_eq!(after_install(None, &ready, true), None);
        assert_eq!(
            after_install(Some("apt-get failed".into()), &ready, false),
            Some(Without::Warn(
                "eBPF sampler not built (procfs fallback only): apt-get failed".into()
            ))
        );
        assert_eq!(
            after_install(None, &probes(None, false, false), true),
            Some(Without::Refuse(
                "PEREGRINE_REQUIRE_EBPF=1 and the eBPF sampler cannot be built: after apt-get \
                 install, still no libbpf headers (bpf/bpf_helpers.h in /usr/include or \
                 /usr/local/include)"
                    .into()
            ))
        );
    }
}
