//! Compiles the kernel program with clang: shared by the crate's build script and `cargo xtask
//! build-ebpf`, so both run exactly the same build.

use std::{
    fmt,
    path::{Path, PathBuf},
    process::Command,
};

/// The oldest clang whose BPF back end emits what the program needs (CO-RE relocations, BTF maps).
pub(crate) const MIN_CLANG: u32 = 14;

/// The C sources, relative to the `ebpf` crate; a change to any of them rebuilds the object.
pub(crate) const SOURCES: [&str; 2] = ["src/bpf/sampler.bpf.c", "src/bpf/sampler.h"];

/// Why the object could not be built.
#[derive(Debug)]
pub(crate) enum BuildError {
    /// No usable clang on PATH (or in `CLANG`).
    NoClang(String),
    /// libbpf's headers are missing.
    NoLibbpf,
    /// clang ran and failed.
    Compile(String),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::NoClang(why) => write!(
                f,
                "clang >= {MIN_CLANG} not found ({why}); install clang-19 (Debian: apt install clang-19) or set CLANG"
            ),
            BuildError::NoLibbpf => write!(
                f,
                "bpf/bpf_helpers.h not found; install libbpf-dev (Debian: apt install libbpf-dev)"
            ),
            BuildError::Compile(stderr) => {
                write!(f, "clang failed to build the eBPF program:\n{stderr}")
            }
        }
    }
}

/// The clang to use: `CLANG` if set, else the newest `clang-N` (N >= 14) or `clang` on PATH.
pub(crate) fn find_clang() -> Result<(PathBuf, u32), BuildError> {
    let mut candidates: Vec<String> = Vec::new();
    if let Some(clang) = std::env::var_os("CLANG") {
        candidates.push(clang.to_string_lossy().into_owned());
    } else {
        candidates.extend((MIN_CLANG..=30).rev().map(|v| format!("clang-{v}")));
        candidates.push("clang".into());
    }
    let mut seen = Vec::new();
    for name in candidates {
        let Ok(out) = Command::new(&name).arg("--version").output() else {
            if std::env::var_os("CLANG").is_some() {
                seen.push(format!("CLANG={name} does not run"));
            }
            continue;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        match major_version(&text) {
            Some(v) if v >= MIN_CLANG => return Ok((PathBuf::from(name), v)),
            Some(v) => seen.push(format!("{name} is version {v}")),
            None => seen.push(format!("{name} printed no version")),
        }
    }
    Err(BuildError::NoClang(if seen.is_empty() {
        "none on PATH".into()
    } else {
        seen.join(", ")
    }))
}

/// `clang version 19.1.7 (...)` -> 19.
fn major_version(text: &str) -> Option<u32> {
    let rest = &text[text.find("clang version ")? + "clang version ".len()..];
    rest.split('.').next()?.trim().parse().ok()
}

/// Builds `crate_dir/src/bpf/sampler.bpf.c` into `out`; returns the clang command line used.
pub(crate) fn build(crate_dir: &Path, out: &Path) -> Result<String, BuildError> {
    let (clang, _) = find_clang()?;
    let include = ["/usr/include", "/usr/local/include"]
        .iter()
        .map(Path::new)
        .find(|dir| dir.join("bpf/bpf_helpers.h").exists())
        .ok_or(BuildError::NoLibbpf)?;
    let (arch, multiarch) = match std::env::consts::ARCH {
        "x86_64" => ("x86", "x86_64-linux-gnu"),
        "aarch64" => ("arm64", "aarch64-linux-gnu"),
        "riscv64" => ("riscv", "riscv64-linux-gnu"),
        "s390x" => ("s390", "s390x-linux-gnu"),
        other => (other, other),
    };
    let mut cmd = Command::new(&clang);
    cmd.args([
        "-target", "bpf", "-O2", "-g", "-mcpu=v3", "-Wall", "-Werror",
    ])
    .arg(format!("-D__TARGET_ARCH_{arch}"))
    .arg("-I")
    .arg(include)
    // <linux/types.h> includes <asm/types.h>, which Debian keeps under the multiarch directory.
    .arg("-I")
    .arg(include.join(multiarch))
    .arg("-c")
    .arg(crate_dir.join(SOURCES[0]))
    .arg("-o")
    .arg(out);
    let line = format!("{cmd:?}");
    let output = cmd
        .output()
        .map_err(|e| BuildError::NoClang(format!("{}: {e}", clang.display())))?;
    if !output.status.success() {
        return Err(BuildError::Compile(
            String::from_utf8_lossy(&output.stderr).into_owned(),
        ));
    }
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_clang_major_versions() {
        assert_eq!(
            major_version("Debian clang version 19.1.7 (3+b1)\nTarget: x86_64"),
            Some(19)
        );
        assert_eq!(major_version("clang version 14.0.6"), Some(14));
        assert_eq!(major_version("gcc (Debian 12.2.0)"), None);
    }
}
