//! The strict HTTP clients the tests use besides curl: Python's `h11` and `h2` (the reference
//! sans-IO implementations, which reject protocol violations), pinned, in a virtualenv under the target
//! directory.

use std::{path::PathBuf, process::Command};

use peregrine_testenv::target_dir;

use crate::pip_install;

/// The pinned packages.
const PACKAGES: [&str; 2] = ["h11==0.16.0", "h2==4.4.1"];

/// Returns the virtualenv's python with the clients importable, installing them first if needed.
pub fn install() -> anyhow::Result<PathBuf> {
    let venv = target_dir().join("pyclients/venv");
    let python = venv.join("bin/python");
    let importable = |python: &PathBuf| {
        Command::new(python)
            .args(["-c", "import h11, h2"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if python.is_file() && importable(&python) {
        return Ok(python);
    }
    eprintln!("installing {} into {}", PACKAGES.join(" "), venv.display());
    let python = pip_install(&venv, &PACKAGES)?;
    anyhow::ensure!(
        importable(&python),
        "h11 and h2 are not importable after pip install"
    );
    Ok(python)
}
