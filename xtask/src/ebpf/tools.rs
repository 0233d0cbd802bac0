//! What the eBPF sampler's build needs from the machine, clang and libbpf's headers, looked for as the
//! build looks for them (`compile`). They are two entries of the project's package list
//! ([`crate::packages`]), which installs them as root or says how to; this module gives the list its
//! two probes and judges the one case no package fixes: a `CLANG` that does not run (then the build
//! goes on with the procfs fallback and a warning, or fails with `PEREGRINE_REQUIRE_EBPF=1`).

use std::env;

use anyhow::bail;

use super::compile::{self, BuildError, INCLUDE_DIRS, LIBBPF_HEADER, MIN_CLANG};

/// Whether the build finds a clang >= `MIN_CLANG`, or runs the one `CLANG` names (whether that one
/// works is [`check_clang_var`]'s to say: no package replaces it).
pub fn clang_found() -> bool {
    env::var_os("CLANG").is_some() || compile::find_clang().is_ok()
}

/// Whether the build finds libbpf's headers.
pub fn libbpf_found() -> bool {
    compile::find_libbpf().is_ok()
}

/// What the clang probe looks for, in words.
pub fn clang_wanted() -> String {
    format!("clang >= {MIN_CLANG} in PATH, as clang-NN or clang")
}

/// What the libbpf probe looks for, in words.
pub fn libbpf_wanted() -> String {
    format!("{LIBBPF_HEADER} in {}", INCLUDE_DIRS.join(" or "))
}

/// With `CLANG` set, checks that it runs and is recent enough: else a warning (the build goes on
/// with the procfs fallback) or, with `PEREGRINE_REQUIRE_EBPF=1`, an error.
pub fn check_clang_var() -> anyhow::Result<()> {
    if env::var_os("CLANG").is_none() {
        return Ok(());
    }
    let why = match compile::find_clang() {
        Ok(_) => return Ok(()),
        Err(BuildError::NoClang(why)) => why,
        Err(other) => other.to_string(),
    };
    let require_ebpf = env::var("PEREGRINE_REQUIRE_EBPF").is_ok_and(|v| v == "1");
    Without::new(
        format!("{why}; to build it, set CLANG to a clang >= {MIN_CLANG} (or unset it)"),
        require_ebpf,
    )
    .report()
}

/// A build without the eBPF sampler, as it is reported.
#[derive(Debug, PartialEq, Eq)]
enum Without {
    /// A warning; the build goes on with the procfs fallback.
    Warn(String),
    /// An error (`PEREGRINE_REQUIRE_EBPF=1`).
    Refuse(String),
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

    #[test]
    fn a_clang_var_that_does_not_run_is_a_warning_or_with_require_ebpf_an_error() {
        let why =
            "CLANG=/opt/clang does not run; to build it, set CLANG to a clang >= 14 (or unset it)";
        assert_eq!(
            Without::new(why.into(), false),
            Without::Warn(format!(
                "eBPF sampler not built (procfs fallback only): {why}"
            ))
        );
        let refused = Without::new(why.into(), true);
        assert_eq!(
            refused,
            Without::Refuse(format!(
                "PEREGRINE_REQUIRE_EBPF=1 and the eBPF sampler cannot be built: {why}"
            ))
        );
        assert!(refused.report().is_err());
        assert!(Without::new(why.into(), false).report().is_ok());
    }

    #[test]
    fn the_probes_say_what_they_look_for() {
        assert_eq!(clang_wanted(), "clang >= 14 in PATH, as clang-NN or clang");
        assert_eq!(
            libbpf_wanted(),
            "bpf/bpf_helpers.h in /usr/include or /usr/local/include"
        );
    }
}
