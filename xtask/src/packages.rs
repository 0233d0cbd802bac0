//! Debian packages the project's commands need and install when they are missing (and run as root):
//! a fresh machine's README commands do all their own set-up.

use std::{env, path::PathBuf, process::Command};

use anyhow::{Context, bail};

use crate::run_checked;

/// `program` found in `PATH`.
pub(crate) fn program_path(program: &str) -> anyhow::Result<PathBuf> {
    env::var_os("PATH")
        .iter()
        .flat_map(env::split_paths)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
        .with_context(|| format!("{program} is not in PATH"))
}

/// Installs the package of every `(program, package)` whose program is not in `PATH`, with apt-get;
/// an error naming the command to run when this is not root.
pub(crate) fn ensure(needed: &[(&str, &str)]) -> anyhow::Result<()> {
    let missing = needed
        .iter()
        .filter(|(program, _)| program_path(program).is_err())
        .map(|(_, package)| *package)
        .collect::<Vec<_>>();
    if missing.is_empty() {
        return Ok(());
    }
    if !rustix::process::geteuid().is_root() {
        bail!(
            "missing: run `apt-get install -y {}` as root",
            missing.join(" ")
        );
    }
    eprintln!("installing {}", missing.join(" "));
    let install = || {
        run_checked(
            Command::new("apt-get")
                .args(["install", "-y", "--no-install-recommends"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(&missing),
        )
    };
    if install().is_err() {
        // A fresh machine may have no package lists yet.
        run_checked(Command::new("apt-get").arg("update"))?;
        install()?;
    }
    Ok(())
}

/// `apt-get update`, then `apt-get install -y --no-install-recommends` of `packages`,
/// non-interactive; apt-get's own output kept short (`-qq`).
pub(crate) fn apt_get_install(packages: &[&str]) -> anyhow::Result<()> {
    let apt_get = || {
        let mut command = Command::new("apt-get");
        command.env("DEBIAN_FRONTEND", "noninteractive").arg("-qq");
        command
    };
    run_checked(apt_get().arg("update"))?;
    run_checked(
        apt_get()
            .args(["install", "-y", "--no-install-recommends"])
            .args(packages),
    )
}

/// What building the supervisor and running the fleet's tests and demo need: `protoc` (the etcd
/// client's build script compiles etcd's protos), etcd itself (Debian's `etcd-server`, 3.4), `ip`
/// (hosts as network namespaces), and `openssl` (checks the certificates `peregrine tls init`
/// writes).
pub(crate) const FLEET: &[(&str, &str)] = &[
    ("protoc", "protobuf-compiler"),
    ("etcd", "etcd-server"),
    ("ip", "iproute2"),
    ("openssl", "openssl"),
];

/// What the tests that run third-party HTTP servers as workers need besides the Python ones
/// (`pyapps`): Node, for a plain `http` server (Debian's `nodejs`).
pub(crate) const APP_SERVERS: &[(&str, &str)] = &[("node", "nodejs")];
