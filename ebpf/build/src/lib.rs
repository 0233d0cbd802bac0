//! Compiles the kernel program with clang: shared by the crate's build script and `cargo xtask
//! build-ebpf`, so both run exactly the same build.

use std::{
    env,
    ffi::OsStr,
    fmt,
    path::{Path, PathBuf},
    process::Command,
};

/// The oldest clang whose BPF back end emits what the program needs (CO-RE relocations, BTF maps).
pub const MIN_CLANG: u32 = 14;

/// The C sources, relative to the `ebpf` crate; a change to any of them rebuilds the object.
pub const SOURCES: [&str; 2] = ["src/bpf/sampler.bpf.c", "src/bpf/sampler.h"];

/// The include directories searched for libbpf's headers, in order.
pub const INCLUDE_DIRS: [&str; 2] = ["/usr/include", "/usr/local/include"];

/// The libbpf header whose presence, under an include directory, means libbpf's headers are there.
pub const LIBBPF_HEADER: &str = "bpf/bpf_helpers.h";

/// Why the object could not be built.
#[derive(Debug)]
pub enum BuildError {
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

/// The clang to use: `CLANG` if set, else the newest `clang-N` (N >= 14) or `clang` on PATH; its
/// command (as `CLANG` or PATH names it) and major version.
pub fn find_clang() -> Result<(PathBuf, u32), BuildError> {
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

/// The first of [`INCLUDE_DIRS`] that holds libbpf's headers.
pub fn find_libbpf() -> Result<&'static Path, BuildError> {
    INCLUDE_DIRS
        .iter()
        .map(Path::new)
        .find(|dir| dir.join(LIBBPF_HEADER).exists())
        .ok_or(BuildError::NoLibbpf)
}

/// The paths whose change can change what [`build`] finds, for the build script's
/// `rerun-if-changed`: given the clang command it found (`clang`, as [`find_clang`] returns it) and
/// the include directory with libbpf's headers (`include`), or `None` for what it did not find, the
/// `CLANG` and `PATH` variables, and which paths exist.
///
/// Cargo reruns a build script when a listed path is newer than the script's last run (a directory:
/// the newest of itself and everything under it), and on every build when a listed path does not
/// exist. So only existing paths are listed: a tool that was found, itself (its file keeps its
/// package's date, so a build with clang is not rerun); a missing one, the directories it would be
/// added to, since adding a file to a directory makes the directory new: those on `PATH` (`CLANG`'s
/// own when it is a path), and each include directory's `bpf/` or, while there is none, the include
/// directory. Relative `PATH` entries and `/` itself are left out.
pub fn rerun_paths(
    clang: Option<&Path>,
    include: Option<&Path>,
    clang_var: Option<&OsStr>,
    path_var: Option<&OsStr>,
    exists: impl Fn(&Path) -> bool,
) -> Vec<PathBuf> {
    let on_path: Vec<PathBuf> = path_var
        .map(|var| {
            env::split_paths(var)
                .filter(|dir| dir.is_absolute())
                .collect()
        })
        .unwrap_or_default();
    // A command with a directory in it is run as it is; a bare name is looked up on PATH.
    let is_path = |command: &Path| command.components().count() > 1;
    let mut paths = Vec::new();
    match (clang, clang_var) {
        (Some(clang), _) if is_path(clang) => paths.push(clang.to_path_buf()),
        (Some(clang), _) => paths.extend(
            on_path
                .iter()
                .map(|dir| dir.join(clang))
                .find(|p| exists(p)),
        ),
        (None, Some(var)) if is_path(Path::new(var)) => {
            paths.extend(Path::new(var).parent().map(Path::to_path_buf));
        }
        (None, _) => paths.extend(on_path),
    }
    match include {
        Some(include) => paths.push(include.join(LIBBPF_HEADER)),
        None => {
            for dir in INCLUDE_DIRS.map(Path::new) {
                let bpf = dir.join("bpf");
                paths.push(if exists(&bpf) { bpf } else { dir.to_path_buf() });
            }
        }
    }
    let mut listed = Vec::new();
    for path in paths {
        if path.parent().is_some() && exists(&path) && !listed.contains(&path) {
            listed.push(path);
        }
    }
    listed
}

/// Builds `crate_dir/src/bpf/sampler.bpf.c` into `out`; returns the clang command line used.
pub fn build(crate_dir: &Path, out: &Path) -> Result<String, BuildError> {
    let (clang, _) = find_clang()?;
    compile(&clang, find_libbpf()?, crate_dir, out)
}

/// Builds `crate_dir/src/bpf/sampler.bpf.c` into `out` with the clang command `clang` and libbpf's
/// headers in `include`; returns the clang command line used.
pub fn compile(
    clang: &Path,
    include: &Path,
    crate_dir: &Path,
    out: &Path,
) -> Result<String, BuildError> {
    let (arch, multiarch) = match std::env::consts::ARCH {
        "x86_64" => ("x86", "x86_64-linux-gnu"),
        "aarch64" => ("arm64", "aarch64-linux-gnu"),
        "riscv64" => ("riscv", "riscv64-linux-gnu"),
        "s390x" => ("s390", "s390x-linux-gnu"),
        other => (other, other),
    };
    let mut cmd = Command::new(clang);
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

    /// [`rerun_paths`] on a machine where exactly `existing` exist.
    fn rerun_paths_with(
        clang: Option<&str>,
        include: Option<&str>,
        clang_var: Option<&str>,
        existing: &[&str],
    ) -> Vec<PathBuf> {
        rerun_paths(
            clang.map(Path::new),
            include.map(Path::new),
            clang_var.map(OsStr::new),
            Some(OsStr::new("/opt/llvm/bin:relative/bin:/usr/bin:/missing")),
            |path| existing.iter().any(|e| Path::new(e) == path),
        )
    }

    fn paths(paths: &[&str]) -> Vec<PathBuf> {
        paths.iter().map(PathBuf::from).collect()
    }

    #[test]
    fn a_build_with_its_tools_watches_them_only() {
        let existing = [
            "/opt/llvm/bin",
            "/usr/bin",
            "/usr/bin/clang-19",
            "/usr/include/bpf/bpf_helpers.h",
        ];
        assert_eq!(
            rerun_paths_with(Some("clang-19"), Some("/usr/include"), None, &existing),
            paths(&["/usr/bin/clang-19", "/usr/include/bpf/bpf_helpers.h"])
        );
        // CLANG as a path is run as it is.
        assert_eq!(
            rerun_paths_with(
                Some("/usr/bin/clang-19"),
                Some("/usr/include"),
                Some("/usr/bin/clang-19"),
                &existing
            ),
            paths(&["/usr/bin/clang-19", "/usr/include/bpf/bpf_helpers.h"])
        );
    }

    #[test]
    fn a_missing_clang_is_watched_for_where_it_would_appear() {
        let existing = ["/opt/llvm/bin", "/usr/bin", "/usr/include", "/tmp/t"];
        // Every absolute, existing directory on PATH; /usr/include while it has no bpf/, and no
        // /usr/local/include, which does not exist (a missing path would rerun every build).
        assert_eq!(
            rerun_paths_with(None, None, None, &existing),
            paths(&["/opt/llvm/bin", "/usr/bin", "/usr/include"])
        );
        // CLANG as a name is looked up on PATH; as a path, in its directory.
        assert_eq!(
            rerun_paths_with(None, None, Some("clang-18"), &existing),
            paths(&["/opt/llvm/bin", "/usr/bin", "/usr/include"])
        );
        assert_eq!(
            rerun_paths_with(None, None, Some("/tmp/t/clang"), &existing),
            paths(&["/tmp/t", "/usr/include"])
        );
        // Never the whole file system.
        assert_eq!(
            rerun_paths_with(None, None, Some("/clang"), &["/", "/usr/include"]),
            paths(&["/usr/include"])
        );
    }

    #[test]
    fn missing_headers_are_watched_for_in_bpf_once_it_exists() {
        let existing = [
            "/usr/bin/clang",
            "/usr/bin",
            "/usr/include",
            "/usr/include/bpf",
        ];
        assert_eq!(
            rerun_paths_with(Some("clang"), None, None, &existing),
            paths(&["/usr/bin/clang", "/usr/include/bpf"])
        );
    }
}
