//! `cargo xtask package`: the Debian package, `target/debian/peregrine_<version>_<arch>.deb`, built
//! with `dpkg-deb --build --root-owner-group` from a release build that has the eBPF sampler
//! (`PEREGRINE_REQUIRE_EBPF=1`: a package never falls back to procfs because the build machine
//! lacked clang; the built binary's `--version` is checked to say so).
//!
//! What goes where is [`layout`]; the control file, its dependencies and its installed size are
//! [`control`]; the machine-readable copyright file, with the crates compiled in, is [`copyright`].
//! The maintainer scripts, the control file's template and the conffiles list are files in
//! `packaging/debian/`, the unit and the config in `packaging/`. `--test` then installs the package
//! into a fresh Debian 12 root and checks it end to end ([`install_test`]).
//!
//! The binary is stripped as `dh_strip` strips it (14 MB instead of 119 MB with `debug = 1`): an
//! operator's host needs no debug info to run it, and a panic's message names its source line
//! without it. The debug info is kept beside the package, `peregrine_<version>_<arch>.debug`, named
//! by the binary's build id, for a backtrace from the field.

mod control;
mod copyright;
mod install_test;
mod layout;

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    time::Instant,
};

use anyhow::{Context, bail, ensure};
use peregrine_testenv::target_dir;
use xtask::{cargo, packages, run_checked, workspace_root};

/// The package's name, and its binary's.
const NAME: &str = "peregrine";
/// The Debian revision of every package built from a given upstream version: built from the tree
/// itself, never patched.
const REVISION: &str = "1";
/// What `peregrine --version` ends with in a build that has the eBPF sampler.
const EBPF_BUILT_IN: &str = ", eBPF sampler built in)";

/// A built package.
#[derive(Debug)]
pub(crate) struct Package {
    /// The `.deb`.
    pub(crate) deb: PathBuf,
    /// Its Debian version (`0.1.0-1`).
    pub(crate) version: String,
    /// The line `peregrine --version` printed.
    pub(crate) version_line: String,
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let test = match args {
        [] => false,
        [flag] if flag == "--test" => true,
        [other, ..] => bail!("`cargo xtask package` takes only --test, not {other:?}"),
    };
    packages::ensure(packages::PACKAGE)?;
    let started = Instant::now();
    let package = build()?;
    let built = started.elapsed();
    report(&package)?;
    println!("built in {:.1}s", built.as_secs_f64());
    if test {
        install_test::run(&package, built)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Builds the release binary with the eBPF sampler, lays the package out and builds the `.deb`.
pub(crate) fn build() -> anyhow::Result<Package> {
    build_revision(REVISION)
}

/// [`build`], with the Debian revision `revision`: e.g. a package of the same tree with a higher
/// version, to upgrade to.
pub(crate) fn build_revision(revision: &str) -> anyhow::Result<Package> {
    eprintln!("building the release binary with the eBPF sampler (PEREGRINE_REQUIRE_EBPF=1)");
    run_checked(
        cargo()
            .args(["build", "--release", "-p", "peregrine", "--bin", NAME])
            .env("PEREGRINE_REQUIRE_EBPF", "1"),
    )?;
    let binary = target_dir().join("release").join(NAME);
    let version_line = output(Command::new(&binary).arg("--version"))?;
    let upstream = env!("CARGO_PKG_VERSION");
    check_version_line(&version_line, upstream)?;
    let version = format!("{upstream}-{revision}");
    let architecture = output(Command::new("dpkg").arg("--print-architecture"))?;

    let out = target_dir().join("debian");
    // dpkg-shlibdeps wants the package's tree where debhelper puts it: debian/<package>/ beside a
    // debian/control.
    let work = out.join("build");
    if work.exists() {
        fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    }
    let tree = work.join("debian").join(NAME);
    let stem = format!("{NAME}_{version}_{architecture}");
    let commit = git(&["rev-parse", "--short", "HEAD"])?;
    let maintainer = maintainer()?;
    let year = |args: &[&str]| -> anyhow::Result<String> {
        let years = git(&[&["log", "--format=%cd", "--date=format:%Y"], args].concat())?;
        years.lines().next().map(str::to_owned).context("no commit")
    };
    let years = copyright::years(&year(&["--reverse"])?, &year(&["-1"])?);
    layout::lay_out(&layout::Sources {
        workspace: &workspace_root(),
        binary: &binary,
        tree: &tree,
        debug_info: &out.join(format!("{stem}.debug")),
        version: &version,
        commit: &commit,
        maintainer: &maintainer,
        date: &git(&["log", "-1", "--format=%cD"])?,
        years: &years,
    })?;
    let depends = control::depends(&shlibs(&work, &tree.join("usr/bin").join(NAME))?)?;
    let control = control::render(
        &read(&workspace_root().join("packaging/debian/control"))?,
        &[
            ("version", version.as_str()),
            ("architecture", &architecture),
            ("maintainer", &maintainer),
            (
                "installed-size",
                &control::installed_size(&tree)?.to_string(),
            ),
            ("depends", &depends),
        ],
    )?;
    layout::debian_dir(&workspace_root(), &tree, &control)?;

    let deb = out.join(format!("{stem}.deb"));
    run_checked(
        Command::new("dpkg-deb")
            .args(["--build", "--root-owner-group", "-Zxz"])
            .arg(&tree)
            .arg(&deb)
            // The files' times are clamped to the commit's: the same tree gives the same archive.
            .env("SOURCE_DATE_EPOCH", git(&["log", "-1", "--format=%ct"])?),
    )?;
    Ok(Package {
        deb,
        version,
        version_line,
    })
}

/// Fails unless `line` is `peregrine VERSION (COMMIT, eBPF sampler built in)`.
fn check_version_line(line: &str, version: &str) -> anyhow::Result<()> {
    ensure!(
        line.starts_with(&format!("{NAME} {version} (")),
        "the release binary says {line:?}, not `{NAME} {version} (...)`"
    );
    ensure!(
        line.ends_with(EBPF_BUILT_IN),
        "the release binary has no eBPF sampler: {line:?}; a package must never fall back to procfs"
    );
    Ok(())
}

/// The package's size and contents, and its control file.
fn report(package: &Package) -> anyhow::Result<()> {
    let size = fs::metadata(&package.deb)
        .with_context(|| format!("reading {}", package.deb.display()))?
        .len();
    let contents = output(Command::new("dpkg-deb").arg("--contents").arg(&package.deb))?;
    let info = output(Command::new("dpkg-deb").arg("--field").arg(&package.deb))?;
    println!(
        "\n{}: {size} bytes ({:.1} MiB), {}\n\n$ dpkg-deb --field {}\n{info}\n\n$ dpkg -c {}\n{contents}",
        package.deb.display(),
        size as f64 / (1024.0 * 1024.0),
        package.version_line,
        package.deb.display(),
        package.deb.display(),
    );
    Ok(())
}

/// The shared-library dependencies of `binary` in the package tree, as dpkg-shlibdeps computes them
/// (from the libraries' symbols files, so with the version floor of the newest symbol used): the
/// value of its `shlibs:Depends=` line. `work` holds a minimal `debian/control` for it.
fn shlibs(work: &Path, binary: &Path) -> anyhow::Result<String> {
    fs::write(
        work.join("debian/control"),
        format!("Source: {NAME}\n\nPackage: {NAME}\nArchitecture: any\n"),
    )
    .context("writing debian/control for dpkg-shlibdeps")?;
    let said = output(
        Command::new("dpkg-shlibdeps")
            .arg("-O")
            .arg(binary)
            .current_dir(work),
    )?;
    control::shlibs_depends(&said)
}

/// The package's maintainer: `DEBFULLNAME <DEBEMAIL>` as Debian's tools take it, else the git
/// identity of this checkout (the one who builds it).
fn maintainer() -> anyhow::Result<String> {
    let var = |name| {
        std::env::var(name)
            .ok()
            .filter(|v: &String| !v.trim().is_empty())
    };
    if let (Some(name), Some(email)) = (var("DEBFULLNAME"), var("DEBEMAIL")) {
        return Ok(format!("{} <{}>", name.trim(), email.trim()));
    }
    match (
        git(&["config", "user.name"]),
        git(&["config", "user.email"]),
    ) {
        (Ok(name), Ok(email)) => Ok(format!("{name} <{email}>")),
        _ => bail!(
            "no maintainer for the package: set DEBFULLNAME and DEBEMAIL (or git's user.name and \
             user.email)"
        ),
    }
}

/// `git ARGS` in the workspace, its output trimmed.
fn git(args: &[&str]) -> anyhow::Result<String> {
    output(Command::new("git").args(args).current_dir(workspace_root()))
}

/// Runs `command`, its stdout trimmed; an error with what it printed unless it exits 0 (stderr,
/// and stdout too where a tool writes its errors there, as debootstrap does).
pub(crate) fn output(command: &mut Command) -> anyhow::Result<String> {
    let out = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    ensure!(
        out.status.success(),
        "{command:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A file's text.
fn read(path: &Path) -> anyhow::Result<String> {
    fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::check_version_line;

    #[test]
    fn only_a_release_binary_with_the_ebpf_sampler_is_packaged() {
        check_version_line("peregrine 0.1.0 (33ee67c, eBPF sampler built in)", "0.1.0").unwrap();
        let error = check_version_line(
            "peregrine 0.1.0 (33ee67c, eBPF sampler not built in: procfs only)",
            "0.1.0",
        )
        .unwrap_err();
        assert!(error.to_string().contains("has no eBPF sampler"), "{error}");
        let error = check_version_line("peregrine-supervisor 0.1.0", "0.1.0").unwrap_err();
        assert!(
            error.to_string().contains("not `peregrine 0.1.0"),
            "{error}"
        );
        assert!(
            check_version_line("peregrine 0.2.0 (33ee67c, eBPF sampler built in)", "0.1.0")
                .is_err()
        );
    }
}
